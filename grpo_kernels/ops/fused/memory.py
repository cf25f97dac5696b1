"""What each schedule of fused_linear_grpo_loss holds in memory, from the same planners the code runs.

`schedule_memory` lists the buffers that scale with V (the vocabulary) or with a chunk of tokens times
H or V, for the Triton backend's schedules, and their peak "extra" (beyond the inputs and the
gradients). Buffers of O(N) bytes (per-token statistics, the loss head's vectors: a few dozen bytes
per token) are summed into one line. Validation (the functional layer's checks, before any of these
buffers exists) is its own phase: `validation_bytes`, O(N) per-row minima / maxima of the hidden
states and O(1) for the weight; the peak is the larger of the two phases. tests/test_fused_memory.py checks the model against the bytes a
run actually allocates (a counting profiler, interpreter tier) and prints the table at the target
shape; the op README gives it. No GPU is needed: every size here is a planning decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import function
from .function import (
    LOW_MEMORY_DZ_ROWS,
    ONE_PASS_LOGITS_BYTES,
    ONE_PASS_VARIANTS,
    one_pass_capacity,
    stored_logits_bytes,
    vocab_slab_columns,
)

GIB = 2**30
# The extra-memory goal of the fused loss (beyond inputs and gradients) that "auto" plans with (dispatch.py)
# unless the call passes max_extra_memory=.
EXTRA_MEMORY_GOAL = 3 * GIB // 2
# per valid token, the O(N) vectors the fused path keeps alive at once (fp32 / int64 per-token values:
# logprobs, entropy, leaves, g_lp, g_ent, row indices, statistics, loss-head inputs): an upper bound
PER_TOKEN_BYTES = 160


@dataclass(frozen=True)
class ScheduleMemory:
    schedule: str
    buffers: dict[str, int]  # name -> bytes, all alive at the peak
    peak_extra: int  # bytes beyond inputs and gradients at the peak: max(sum of buffers, validation)
    validation: int = 0  # bytes the input checks hold at once (before the schedule's buffers exist)

    def table(self) -> str:
        lines = [f"{self.schedule}: peak extra {self.peak_extra / GIB:.2f} GiB"]
        lines += [f"  {name:<50} {nbytes / 2**20:10,.1f} MiB" for name, nbytes in self.buffers.items()]
        lines.append(f"  {'(before them) validation, per-row min / max':<50} {self.validation / 2**20:10,.1f} MiB")
        return "\n".join(lines)


def validation_bytes(n_tokens: int, element_size: int = 2) -> int:
    """What the functional layer's finite checks hold at once (grpo_kernels/_checks.py check_finite): the
    hidden states' per-row minimum and maximum ([N] each, input dtype) and three [N] bools (finite minimum,
    finite maximum, their combination); the weight and bias by whole-tensor minimum / maximum (O(1));
    per-token vectors elementwise ([N] bools). Measured equal by tests/test_fused_memory.py."""
    return n_tokens * (2 * element_size + 3)


def _build(schedule: str, buffers: dict[str, int], n_tokens: int, element_size: int) -> ScheduleMemory:
    validation = validation_bytes(n_tokens, element_size)
    return ScheduleMemory(schedule, buffers, max(sum(buffers.values()), validation), validation)


def schedule_memory(schedule: str, n_valid: int, hidden: int, vocab: int, element_size: int = 2, *,
                    bias: bool = False, logits_bytes: int = ONE_PASS_LOGITS_BYTES,
                    workspace_bytes: int | None = None, block_m: int = 128, masked: bool = True,
                    n_tokens: int | None = None, chunk_rows: int | None = None) -> ScheduleMemory:  # fmt: skip
    """The peak of the Triton backend's fused forward (which computes every gradient) for `n_valid`
    valid tokens (`n_tokens` in the batch, default n_valid: what validation reads). One-pass family:
    the fp32 grad_weight accumulator (none in the in-place variants: the gradient buffer itself is
    summed into), the chunk's stored logits (as many tokens as `logits_bytes` holds: fp32, or for kernel A
    with 16-bit inputs fp16 differences and offsets, function.stored_logits_bytes), and per chunk the dz slab (input
    dtype; none for the dz schedules) and the chunk's fp32 grad_hidden and gathered hidden rows. two_pass:
    the accumulator, the gathered hidden rows of the whole batch, and per backward chunk the dz slab and
    its fp32 grad_hidden. The cast of the accumulator to the weight's dtype (the gradient) happens after
    the logits buffer is released. low_memory: no V x H fp32 buffer; grad_hidden in fp32, and per
    vocabulary slab the dz rows and the slab's fp32 grad_weight block. `masked`: some tokens are masked,
    so the two-pass schedules gather the valid hidden rows (a copy) first. `chunk_rows`: the valid tokens of
    the largest one-pass chunk the call runs, where known (function.balanced_chunk_tokens for a token-local
    objective); default the most a chunk may hold, an upper bound for every objective."""
    from ..lm_head.triton import DEFAULT_NUM_SMS, DEFAULT_WORKSPACE_BYTES, STREAM_TILES, plan_backward, plan_forward

    n_tokens = n_valid if n_tokens is None else n_tokens
    workspace_bytes = workspace_bytes or DEFAULT_WORKSPACE_BYTES
    if schedule == "low_memory":
        columns = vocab_slab_columns(n_valid, hidden, element_size, vocab)
        budget = LOW_MEMORY_DZ_ROWS * ((columns + 64) * element_size + 4 * hidden)
        plan = plan_backward(n_valid, columns, hidden, element_size, block_m, budget, store_dlogits=True,
                             need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
        buffers = {
            "grad_hidden accumulator, fp32 [N, H]": 4 * n_valid * hidden,
            "valid hidden rows [N, H] (when tokens are masked)": element_size * n_valid * hidden if masked else 0,
            f"slab grad_weight block, fp32 [{columns}, H]": 4 * columns * hidden,
            "slab dz rows [rows, slab] + fp32 grad_hidden rows": plan.workspace_bytes,
            "per-token vectors (O(N) bound)": PER_TOKEN_BYTES * n_valid,
        }
        return _build(schedule, buffers, n_tokens, element_size)
    if schedule not in ONE_PASS_VARIANTS and schedule != "two_pass":
        raise ValueError(f"schedule must be one of {('two_pass', 'low_memory', *ONE_PASS_VARIANTS)}, got {schedule!r}")
    forward_gemm, in_place, dz_in_gemm = ONE_PASS_VARIANTS.get(schedule, ("kernel_a", False, False))
    buffers: dict[str, int] = {}
    if not in_place:
        buffers["grad_weight accumulator, fp32 [V, H]"] = 4 * vocab * hidden
    if bias:
        buffers["grad_bias accumulator, fp32 [V]"] = 4 * vocab
    if schedule in ONE_PASS_VARIANTS:
        rows = min(n_valid, max(1, one_pass_capacity(vocab, logits_bytes, schedule, element_size)))
        rows = rows if chunk_rows is None else min(rows, chunk_rows)
        buffers["chunk logits [chunk, V] (fp32; kernel A, 16-bit: fp16 + offsets)"] = stored_logits_bytes(
            schedule, rows, vocab, element_size)  # fmt: skip
        buffers["chunk hidden rows + chunk grad_hidden [chunk, H]"] = 2 * element_size * rows * hidden
        if forward_gemm == "cublas":  # the streaming statistics kernel's split partials (more splits than A)
            tile = STREAM_TILES["gpu"]
            fwd = plan_forward(rows, vocab, tile.block_m, tile.block_n, DEFAULT_NUM_SMS, tile.group_m)
            buffers["statistics split partials, fp32 [3, splits, chunk]"] = fwd.partial_bytes(rows)
        plan = plan_backward(rows, vocab, hidden, element_size, block_m, workspace_bytes,
                             store_dlogits=not dz_in_gemm, need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
    else:
        buffers["valid hidden rows [N, H] (when tokens are masked)"] = element_size * n_valid * hidden if masked else 0
        plan = plan_backward(n_valid, vocab, hidden, element_size, block_m, workspace_bytes, store_dlogits=True,
                             need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
    buffers["dz slab [rows, V_pad] + fp32 grad_hidden rows"] = plan.workspace_bytes
    buffers["per-token vectors (O(N) bound)"] = PER_TOKEN_BYTES * n_valid
    return _build(schedule, buffers, n_tokens, element_size)


def inplace_chunk_rows(n_valid: int, hidden: int, vocab: int, element_size: int, goal: int, *, bias: bool = False,
                       schedule: str = "one_pass_inplace") -> int:  # fmt: skip
    """Valid tokens per chunk of an in-place schedule: the most (whole 64-token tiles, at most
    function.ONE_PASS_CHUNK_TOKENS) whose modelled peak fits `goal`; 0 where not even 64 do. Bigger chunks mean
    fewer roundings of grad_weight (accuracy.py) and fewer re-reads of W and the gradient buffer."""
    def fits(rows: int) -> bool:
        m = schedule_memory(schedule, max(n_valid, rows), hidden, vocab, element_size, bias=bias,
                            logits_bytes=stored_logits_bytes(schedule, rows, vocab, element_size))  # fmt: skip
        return m.peak_extra <= goal

    cap = function.ONE_PASS_CHUNK_TOKENS  # read at call time (tests set tiny chunks)
    if cap < 64:
        return cap if fits(cap) else 0
    lo, hi = 0, cap // 64  # in tiles; fits() is monotone in the rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(64 * mid) else (lo, mid - 1)
    return 64 * lo
