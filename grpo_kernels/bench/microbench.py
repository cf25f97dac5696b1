"""Per-kernel microbenchmarks of the GPU session: where the time of the fused loss goes, kernel by kernel.

Each case times one call (CUDA events, median) at the target head (Qwen3-8B: H = 4096, V = 151936,
N = 16384 tokens; the stored-logits cases at one one-pass chunk of `one_pass_capacity(V)` tokens, as
the schedule runs them) and reports achieved TFLOP/s over the GEMM FLOPs the call must do and GB/s over
the fewest bytes it must move (each operand read once, each output written once), each also as a
share of the device's peaks: the datasheet's (DEVICE_PEAKS, by the device's name) and the ceilings
measured first in the same run (a device-to-device copy, an 8192^3 bf16 GEMM). On CUDA the call is
also run once under torch.profiler: per kernel its device time (a composite call, e.g. the backward,
is split into the dlogits kernel and the cuBLAS GEMMs that way).

Core cases (call 1): the two ceilings; cuBLAS at the same shapes (logits GEMM with bf16 and fp32
output, the two backward GEMMs with fp32 output); kernel A (cp.async) with and without the stored
logits (fp32, and the fp16 differences the fused schedules store for bf16); the backward with recomputed
logits (the dlogits kernel's GEMM + epilogue, then cuBLAS) and from stored logits (both formats); the loss
head over 1M tokens. Opt-in cases (after every core row): kernel A
by TMA, and the two dz-in-GEMM kernels of schedule="one_pass_dz".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Datasheet peaks (dense bf16 tensor-core TFLOP/s, HBM TB/s) by a substring of torch's device name,
# first match wins; "measured" are the ceilings seen on this workplace's machines
# (/work/.library/device/KINDS.md: an 8192^3 bf16 GEMM on random data, a device-to-device copy).
DEVICE_PEAKS = (
    ("H200", {"bf16_tflops": 989.0, "hbm_tbps": 4.8, "measured_tflops": 788.0, "measured_copy_tbps": 4.3,
              "part": "H200 SXM 141 GB"}),
    ("H100 PCIe", {"bf16_tflops": 756.0, "hbm_tbps": 2.0, "part": "H100 PCIe 80 GB"}),
    ("H100 NVL", {"bf16_tflops": 835.0, "hbm_tbps": 3.9, "part": "H100 NVL 94 GB"}),
    ("H100", {"bf16_tflops": 989.0, "hbm_tbps": 3.35, "measured_tflops": 798.0, "measured_copy_tbps": 3.0,
              "part": "H100 SXM 80 GB"}),
)  # fmt: skip


def device_peaks(name: str) -> dict | None:
    for key, peaks in DEVICE_PEAKS:
        if key.lower() in name.lower():
            return {"matched": key, **peaks}
    return None


@dataclass(frozen=True)
class Head:
    tokens: int  # N
    hidden: int  # H
    vocab: int  # V
    chunk: int  # rows of one one-pass chunk (the stored-logits cases)
    loss_tokens: int  # tokens of the loss-head case
    gemm: int  # side of the square ceiling GEMM
    copy_bytes: int  # bytes of the ceiling copy (read + written: twice this)


TARGET = Head(16384, 4096, 151936, 0, 1 << 20, 8192, 2 << 30)
TINY = Head(256, 128, 1000, 64, 4096, 256, 8 << 20)  # the rehearsal's (CPU: the flow, not the numbers)


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    needs_cuda: str | None  # why it cannot run off CUDA (None: it can)
    opt_in: bool
    # (head, device, dtype) -> (call, flops, bytes, kernels): kernels maps a substring of a kernel's name
    # to its own (flops, bytes), for the profiler's per-kernel split
    setup: Callable


def _rand(*shape, device, dtype, std=1.0):
    return (torch.randn(shape, device=device) * std).to(dtype)


class Tensors:
    """The operands every case shares, built once per process at the given head."""

    def __init__(self, head: Head, device: torch.device, dtype: torch.dtype):
        from ..ops.fused.function import one_pass_capacity

        n, h, v = head.tokens, head.hidden, head.vocab
        self.head, self.device, self.dtype = head, device, dtype
        self.chunk = head.chunk or one_pass_capacity(v)
        g = torch.Generator(device=device).manual_seed(0)
        self.hidden = (torch.randn(n, h, generator=g, device=device)).to(dtype)  # [N, H]
        self.weight = (torch.randn(v, h, generator=g, device=device) * (4.0 / h**0.5)).to(dtype)  # [V, H]
        self.targets = torch.randint(0, v, (n,), generator=g, device=device)
        self.grad_logprobs = torch.randn(n, generator=g, device=device) / n  # fp32 [N]
        self._stats = None

    def stats(self):
        if self._stats is None:  # lse and E_p[z] for the backward cases, from the PyTorch backend
            from ..ops.lm_head.chunked import lm_head_forward

            self._stats = lm_head_forward(self.hidden.float(), self.weight.float(), None, self.targets, 1.0)
        return self._stats


def _b(*tensors_or_counts) -> int:
    return sum(
        x.numel() * x.element_size() if isinstance(x, torch.Tensor) else int(x) for x in tensors_or_counts
    )


# -- cases ---------------------------------------------------------------------------------------------


def _ceiling_copy(t: Tensors):
    src = torch.empty(t.head.copy_bytes, dtype=torch.uint8, device=t.device).random_(0, 255)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 0, 2 * src.numel(), {}


def _ceiling_gemm(t: Tensors):
    s = t.head.gemm
    a, b = _rand(s, s, device=t.device, dtype=t.dtype), _rand(s, s, device=t.device, dtype=t.dtype)
    return (lambda: a @ b), 2 * s**3, _b(a, b, a), {}


def _cublas_logits(t: Tensors):
    x, w = t.hidden, t.weight
    out = torch.empty(x.shape[0], w.shape[0], dtype=t.dtype, device=t.device)
    return (lambda: torch.mm(x, w.t(), out=out)), 2 * x.shape[0] * x.shape[1] * w.shape[0], _b(x, w, out), {}


def _cublas_logits_fp32(t: Tensors):
    x, w = t.hidden[: t.chunk], t.weight
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    return (
        (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)),
        flops,
        _b(x, w, 4 * x.shape[0] * w.shape[0]),
        {},
    )


def _dz(t: Tensors, rows: int):
    return _rand(rows, t.weight.shape[0], device=t.device, dtype=t.dtype, std=1e-4)  # [rows, V]


def _cublas_grad_hidden(t: Tensors):
    dz, w = _dz(t, t.chunk), t.weight
    flops = 2 * dz.shape[0] * dz.shape[1] * w.shape[1]
    return (
        (lambda: torch.mm(dz, w, out_dtype=torch.float32)),
        flops,
        _b(dz, w, 4 * dz.shape[0] * w.shape[1]),
        {},
    )


def _cublas_grad_weight(t: Tensors):
    dz, x = _dz(t, t.chunk), t.hidden[: t.chunk]
    acc = torch.zeros(t.weight.shape, dtype=torch.float32, device=t.device)  # [V, H] fp32
    flops = 2 * dz.shape[0] * dz.shape[1] * x.shape[1]
    return (
        (lambda: torch.addmm(acc, dz.t(), x, out_dtype=torch.float32, out=acc)),
        flops,
        _b(dz, x, acc, acc),
        {},
    )


def _logits_store(stored, rows: int, vocab: int, device):
    """(the buffer kernel A stores one chunk's logits in, its bytes): fp32 [rows, V] (stored True), the fp16
    differences + fp32 offsets of 16-bit inputs (stored "half", what the fused schedules run), or none."""
    from ..ops.lm_head import triton as tri

    if stored == "half":
        return tri.HalfLogits.empty(rows, vocab, device), tri.HalfLogits.nbytes(rows, vocab)
    if stored:
        return torch.empty(rows, vocab, dtype=torch.float32, device=device), 4 * rows * vocab
    return None, 0


def _kernel_a(stored, kernel: str):
    def setup(t: Tensors):
        from ..ops.lm_head import triton as tri

        rows = t.chunk if stored else t.head.tokens
        x, w, y = t.hidden[:rows], t.weight, t.targets[:rows]
        logits, logits_bytes = _logits_store(stored, rows, w.shape[0], t.device)

        def call():
            with tri.use_forward_kernel(kernel):
                return tri.lm_head_forward(x, w, None, y, 1.0, logits_out=logits)

        flops = 2 * rows * x.shape[1] * w.shape[0]
        moved = _b(x, w, 16 * rows) + logits_bytes
        return call, flops, moved, {"lm_head_fwd_kernel_partial": (flops, moved)}

    return setup


def _backward(stored, dz_in_gemm: str | None = None):
    """The LM-head backward for log-prob cotangents: recomputed (dlogits kernel with its GEMM, then
    two cuBLAS GEMMs) or from one chunk's stored logits (fp32, or "half": fp16 differences + offsets);
    dz_in_gemm: only that dz kernel."""

    def setup(t: Tensors):
        from ..ops.lm_head import triton as tri

        stats = t.stats()
        rows = t.chunk if stored else t.head.tokens
        x, w, y = t.hidden[:rows], t.weight, t.targets[:rows]
        n, h, v = rows, x.shape[1], w.shape[0]
        logits, z_bytes = _logits_store(stored, rows, v, t.device)
        if stored:
            tri.lm_head_forward(x, w, None, y, 1.0, logits_out=logits)
        acc = torch.zeros(w.shape, dtype=torch.float32, device=t.device)
        lse, mean_z, g = stats.lse[:rows], stats.expected_logit[:rows], t.grad_logprobs[:rows]
        want_h = dz_in_gemm in (None, "grad_hidden")
        want_w = dz_in_gemm in (None, "grad_weight")

        def call():
            return tri.lm_head_backward(x, w, None, y, 1.0, lse, mean_z, g, None, need_grad_hidden=want_h,
                                        need_grad_weight=want_w, need_grad_bias=False, grad_weight_acc=acc,
                                        stored_logits=logits, dz_in_gemm=dz_in_gemm is not None)  # fmt: skip

        gemm = 2 * n * h * v
        dz_bytes = 2 * n * v  # the bf16 dz slab, written once
        kernels = {
            "lm_head_bwd_kernel_dlogits": (0 if stored else gemm, z_bytes + dz_bytes + (0 if stored else _b(x, w))),
            "lm_head_bwd_kernel_grad_hidden_dz": (gemm, z_bytes + _b(w) + 4 * n * h),
            "lm_head_bwd_kernel_grad_weight_dz": (gemm, z_bytes + _b(x) + 8 * v * h),
        }  # fmt: skip
        if dz_in_gemm is not None:
            name = f"lm_head_bwd_kernel_{dz_in_gemm}_dz"
            return call, gemm, kernels[name][1], {name: kernels[name]}
        units = 2 if stored else 3
        moved = z_bytes + _b(x, w) + dz_bytes + 8 * v * h + 4 * n * h
        return call, units * gemm, moved, kernels

    return setup


def _loss_head(t: Tensors):
    import grpo_kernels as gk

    from .ops import BENCH_LOSS_CONFIG, compulsory_bytes
    from .shapes import BenchShape

    n = t.head.loss_tokens
    seq = min(1024, n)
    b = n // seq
    g = torch.Generator(device=t.device).manual_seed(1)
    logprobs = (-torch.rand(b, seq, generator=g, device=t.device) * 4).requires_grad_(True)
    old = logprobs.detach() + 0.1 * torch.randn(b, seq, generator=g, device=t.device)
    ref = logprobs.detach() + 0.1 * torch.randn(b, seq, generator=g, device=t.device)
    adv = torch.randn(b, generator=g, device=t.device)
    mask = torch.ones(b, seq, dtype=torch.bool, device=t.device)

    def call():
        logprobs.grad = None
        gk.grpo_loss(logprobs, adv, mask, old, ref, config=BENCH_LOSS_CONFIG).loss.backward()

    return call, 0, compulsory_bytes(BenchShape("loss", 1, 1, n, seq)), {}


TRITON = "a Triton kernel (CUDA)"
OUT_DTYPE = "torch.mm(out_dtype=float32) exists for CUDA only"
CASES: tuple[Case, ...] = (
    Case("ceiling-copy", "device-to-device copy (bytes read + written): the bandwidth ceiling", None, False,
         _ceiling_copy),
    Case("ceiling-gemm", "square bf16 GEMM (8192^3 on a GPU) by cuBLAS: the matrix-rate ceiling", None, False,
         _ceiling_gemm),
    Case("cublas-logits", "cuBLAS [N, H] x [H, V] -> bf16 [N, V] (the forward GEMM, the floor's first unit)",
         None, False, _cublas_logits),
    Case("cublas-logits-fp32out", "cuBLAS one chunk's [n, H] x [H, V] -> fp32 (what kernel A stores)", OUT_DTYPE,
         False, _cublas_logits_fp32),
    Case("cublas-grad-hidden", "cuBLAS dz [n, V] x W [V, H] -> fp32 (one chunk)", OUT_DTYPE, False, _cublas_grad_hidden),
    Case("cublas-grad-weight", "cuBLAS dz^T [V, n] x X [n, H] added into fp32 [V, H] (one chunk)", OUT_DTYPE, False,
         _cublas_grad_weight),
    Case("kernel-a-cp.async", "kernel A (cp.async): statistics of [N, V] logits, nothing stored", TRITON, False,
         _kernel_a(False, "cp.async")),
    Case("kernel-a-cp.async-stored", "kernel A (cp.async) on one chunk, fp32 logits stored", TRITON, False,
         _kernel_a(True, "cp.async")),
    Case("kernel-a-cp.async-stored-half", "kernel A (cp.async) on one chunk, fp16 logits - row max stored (what "
         "the fused schedules run for bf16)", TRITON, False, _kernel_a("half", "cp.async")),
    Case("backward-recompute", "backward, logits recomputed: dlogits kernel (GEMM + dz) + 2 cuBLAS GEMMs", TRITON,
         False, _backward(False)),
    Case("backward-stored", "backward of one chunk from stored logits: dlogits kernel (stream) + 2 cuBLAS GEMMs",
         TRITON, False, _backward(True)),
    Case("backward-stored-half", "backward of one chunk from stored fp16 logits - row max: dlogits kernel "
         "(stream) + 2 cuBLAS GEMMs", TRITON, False, _backward("half")),
    Case("loss-head", "loss head (Triton) fwd + bwd over 1M tokens: compulsory bytes", TRITON, False, _loss_head),
    Case("kernel-a-tma", "kernel A by TMA (opt-in): statistics only", TRITON, True, _kernel_a(False, "tma")),
    Case("kernel-a-tma-stored", "kernel A by TMA (opt-in) on one chunk, fp32 logits stored", TRITON, True,
         _kernel_a(True, "tma")),
    Case("kernel-a-tma-stored-half", "kernel A by TMA (opt-in) on one chunk, fp16 logits - row max stored", TRITON,
         True, _kernel_a("half", "tma")),
    Case("dz-grad-hidden", "one_pass_dz's grad_hidden kernel (dz formed in the operand load from the fp16 "
         "stored logits), one chunk", TRITON, True, _backward("half", "grad_hidden")),
    Case("dz-grad-weight", "one_pass_dz's grad_weight kernel (dz formed in the operand load from the fp16 "
         "stored logits), one chunk", TRITON, True, _backward("half", "grad_weight")),
)  # fmt: skip


def cases(opt_in: bool) -> list[Case]:
    return [c for c in CASES if c.opt_in == opt_in]


def rates(seconds: float, flops: int, moved: int, peaks: dict | None, ceilings: dict) -> dict:
    """TFLOP/s and GB/s of one timing, and their shares of the datasheet and measured ceilings."""
    out: dict = {
        "tflops": flops / seconds / 1e12 if flops else None,
        "gbps": moved / seconds / 1e9 if moved else None,
    }
    if peaks and out["tflops"] is not None:
        out["pct_datasheet_tflops"] = 100 * out["tflops"] / peaks["bf16_tflops"]
    if peaks and out["gbps"] is not None:
        out["pct_datasheet_gbps"] = 100 * out["gbps"] / (1e3 * peaks["hbm_tbps"])
    if ceilings.get("tflops") and out["tflops"] is not None:
        out["pct_measured_tflops"] = 100 * out["tflops"] / ceilings["tflops"]
    if ceilings.get("gbps") and out["gbps"] is not None:
        out["pct_measured_gbps"] = 100 * out["gbps"] / ceilings["gbps"]
    return out


def kernel_split(call, kernels: dict, device: torch.device, peaks: dict | None, ceilings: dict) -> list[dict]:
    """One profiled call: device time per kernel (torch.profiler), with rates where `kernels` counts
    that kernel's work. CUDA only (empty elsewhere)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0)
        if not us:
            continue
        row = {"kernel": event.key[:160], "calls": event.count, "device_ms": us / 1e3}
        for name, (flops, moved) in kernels.items():
            if name in event.key:
                row.update(rates(us / 1e6, flops, moved, peaks, ceilings))
        rows.append(row)
    rows.sort(key=lambda r: -r["device_ms"])
    return rows[:8]
