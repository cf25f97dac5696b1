"""A time model of the fused schedules: GEMM FLOPs at a device's matmul rate plus bytes at its bandwidth.

    time = cuBLAS FLOPs / R + Triton-GEMM FLOPs / (R / TRITON_GEMM_SLOWDOWN) + bytes moved / B

summed without overlap (an upper-bound style estimate: each schedule's GEMMs are each near the roof, so
what separates schedules is work, not overlap). FLOPs: each GEMM unit is 2 N H V; kernel A and the
recomputing dlogits kernel are Triton GEMMs, the backward's grad_hidden / grad_weight GEMMs and the
cuBLAS-forward schedules' forward are cuBLAS. Bytes: the traffic that scales with V x H per chunk or slab
(W re-read, the grad_weight accumulator's read-modify-write) and with N x V (stored logits, dz slab);
O(N x H) traffic is left out (it is the same order in every schedule). The numbers are the ones of the
op README's table ("Memory and bytes moved per schedule"); R, B and the Triton slowdown are assumptions
printed with every estimate (`ScheduleTime.table`), to be replaced by what the GPU session measures
(its per-kernel microbenchmarks time kernel A against the cuBLAS GEMM of the same shape).

"auto" (dispatch.py) ranks the candidate schedules that fit the memory goal and the error bound by this
model; it needs no GPU, so the choice is the same on every machine for the same shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..lm_head.half_logits_format import STORED_GROUP
from .function import DZ_IN_GEMM_SCHEDULES

# H100 SXM, bf16 dense: cuBLAS reaches ~790 TFLOP/s on large GEMMs (989 peak); HBM3 ~3.0 TB/s achieved
# (3.35 peak). Kernel A and the dlogits kernel (Triton, no warp specialisation) are estimated at ~1.4x the
# cuBLAS time of the same GEMM (issue 23's estimate from the compile reports; not measured).
MATMUL_FLOPS = 790e12
BANDWIDTH = 3.0e12
TRITON_GEMM_SLOWDOWN = 1.4


@dataclass(frozen=True)
class ScheduleTime:
    schedule: str
    cublas_flops: float
    triton_flops: float
    bytes_moved: float

    @property
    def seconds(self) -> float:
        return (self.cublas_flops / MATMUL_FLOPS + self.triton_flops * TRITON_GEMM_SLOWDOWN / MATMUL_FLOPS
                + self.bytes_moved / BANDWIDTH)  # fmt: skip

    def table(self) -> str:
        return (f"{self.schedule}: {self.seconds * 1e3:.1f} ms = cuBLAS {self.cublas_flops / 1e12:.1f} TFLOP + "
                f"Triton {self.triton_flops / 1e12:.1f} TFLOP (x{TRITON_GEMM_SLOWDOWN}) at "
                f"{MATMUL_FLOPS / 1e12:.0f} TFLOP/s + {self.bytes_moved / 1e9:.1f} GB at {BANDWIDTH / 1e12:.1f} TB/s")  # fmt: skip


# kernel A's stored logits for 16-bit inputs (ops/lm_head/triton.py HalfLogits): an fp16 difference per logit and
# an fp32 offset per 64 of them, written once and read by each pass over the logits
HALF_LOGIT_BYTES = {"": 2.0, f" (fp32 row max per {STORED_GROUP} logits)": 4.0 / STORED_GROUP}


def logit_bytes(schedule: str, element_size: int = 2, *, transform_writes: bool = False) -> dict[str, float]:
    """The bytes each pass over the `[tokens, V]` logits moves per logit (per valid token and vocabulary entry),
    by pass: what schedule_time charges as N x V traffic. bf16 at the target head, `one_pass_cublas_inplace`
    (what auto runs there): 18 = 4 (cuBLAS writes the fp32 logits) + 4 (the statistics kernel reads them) + 4
    (C's dz pass reads them) + 2 (it writes the dz slab) + 2 + 2 (the grad_hidden and grad_weight GEMMs read
    it). Kernel A's one-pass schedules skip the statistics pass and, for 16-bit inputs, store the logits as
    fp16 differences from the running row max with an fp32 offset per 64 (2 + 1/16 bytes per pass): 10.125
    (was 14 with fp32 logits), the dz schedules (one_pass_dz, one_pass_dz_inplace) 6.1875 (was 12); the
    recomputing schedules store no logits."""

    e = element_size
    dz_slab = {"dz slab written": e, "dz slab read by grad_hidden GEMM": e, "dz slab read by grad_weight GEMM": e}
    if schedule in ("two_pass", "low_memory"):  # the logits are recomputed inside the dz kernel: never stored
        return dz_slab

    def stored(what: str) -> dict[str, float]:  # kernel A's store, fp16 + offsets for 16-bit inputs
        if e == 2:
            return {f"{what}{part}": nbytes for part, nbytes in HALF_LOGIT_BYTES.items()}
        return {what: 4}

    if schedule in DZ_IN_GEMM_SCHEDULES:  # dz formed inside the two GEMMs' operand loads from the stored logits
        return {**stored("logits written (kernel A)"), **stored("logits read by grad_hidden GEMM"),
                **stored("logits read by grad_weight GEMM")}  # fmt: skip
    if schedule in ("one_pass", "one_pass_inplace"):
        return {**stored("logits written (kernel A)"), **stored("logits read by dz pass"), **dz_slab}
    if schedule in ("one_pass_cublas", "one_pass_cublas_inplace"):
        out = {"logits written (cuBLAS)": 4, "logits read by statistics pass": 4}
        if transform_writes:  # a bias or soft-cap: the statistics kernel writes z back for C
            out["logits written back by statistics pass"] = 4
        return {**out, "logits read by dz pass": 4, **dz_slab}
    raise ValueError(f"no byte count for schedule {schedule!r}")


def schedule_time(schedule: str, n_valid: int, hidden: int, vocab: int, element_size: int = 2, *,
                  chunk_rows: int, slab_columns: int = 8192, transform_writes: bool = False) -> ScheduleTime:  # fmt: skip
    """The modelled time of `schedule` for `n_valid` valid tokens with one-pass chunks of `chunk_rows`
    (low_memory: vocabulary slabs of `slab_columns`). transform_writes: the cuBLAS-forward statistics
    kernel writes z back (a bias or a soft-cap)."""
    unit = 2.0 * n_valid * hidden * vocab
    vh, nv, e = float(vocab * hidden), float(n_valid * vocab), element_size
    if schedule == "low_memory":
        slabs = math.ceil(vocab / max(slab_columns, 1))
        # A (kernel A) and the slab recompute (dlogits kernel) are Triton, the two backward GEMMs cuBLAS;
        # W read three times, each grad_weight block written once; dz written and read twice; the fp32
        # grad_hidden read and written per slab
        traffic = 3 * vh * e + vh * e + nv * sum(logit_bytes(schedule, e).values()) + slabs * 8.0 * n_valid * hidden
        return ScheduleTime(schedule, 2 * unit, 2 * unit, traffic)
    if schedule == "two_pass":
        from ..lm_head.triton import DEFAULT_WORKSPACE_BYTES, plan_backward

        chunks = plan_backward(n_valid, vocab, hidden, e, 128, DEFAULT_WORKSPACE_BYTES, store_dlogits=True,
                               need_bias_grad=False, need_hidden_grad=True).num_chunks  # fmt: skip
        # A reads W once; per backward chunk the recompute and the grad_hidden GEMM read W and the fp32
        # accumulator is read and written (the first chunk's GEMM only writes it: no zero-fill, no read); dz
        # written and read twice
        traffic = vh * e + chunks * (2 * vh * e + 8 * vh) - 4 * vh + nv * sum(logit_bytes(schedule, e).values())
        return ScheduleTime(schedule, 2 * unit, 2 * unit, traffic)
    cublas_forward = schedule.startswith("one_pass_cublas")
    in_place = schedule.endswith("_inplace")
    if schedule not in ("one_pass", "one_pass_inplace", "one_pass_cublas", "one_pass_cublas_inplace"):
        raise ValueError(f"no time model for schedule {schedule!r}")
    chunks = math.ceil(n_valid / max(chunk_rows, 1))
    # per chunk: W read by A and by the grad_hidden GEMM, the accumulator read and written (fp32: 8 bytes per
    # element; in place: the gradient buffer in the weight's dtype); the first chunk's GEMM only writes it (beta
    # = 0 into an unfilled buffer: neither a zero-fill nor its read)
    per_chunk = 2 * vh * e + vh * (2 * e if in_place else 8)
    first_read = vh * (e if in_place else 4)
    # logits stored and read back (fp32, or fp16 + offsets), dz slab written and read twice; the streaming
    # statistics kernel reads the logits once more (and writes z back when a bias or soft-cap changes it):
    # logit_bytes
    logits = nv * sum(logit_bytes(schedule, e, transform_writes=transform_writes).values())
    traffic = chunks * per_chunk - first_read + logits
    cublas = 3 * unit if cublas_forward else 2 * unit
    return ScheduleTime(schedule, cublas, 0.0 if cublas_forward else unit, traffic)
