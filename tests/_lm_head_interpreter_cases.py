"""Cases of the Triton-interpreter tier for the LM-head kernels, run in a subprocess.

tests/test_lm_head_triton_interpreter.py runs `python tests/_lm_head_interpreter_cases.py` with
TRITON_INTERPRET=1 in the environment (it must be set before triton is first imported, which a pytest
process that already imported triton cannot undo) and asserts on the JSON this prints. Importing this
module is cheap: torch and triton are imported inside main().

Grid rationale (interpreter tiles are 32 x 64 x 32): V = 1001 and 3000 end in a ragged vocabulary tile;
N = 37 and 70 end in a ragged token tile; H = 48 leaves a ragged K slice (EVEN_K False), H = 64 does not;
N = 1 / V = 50 is smaller than one tile in both directions. Splits are forced with num_sms (64 SMs ->
many vocabulary splits, 1 SM -> one split) and token chunking with workspace_rows. Every other knob
(bias, temperature, which upstream gradients exist, which input gradients are needed, strided /
transposed / misaligned inputs, int32 targets, prefilled fp32 accumulators, zero-gradient rows and a
whole zero-gradient token tile, peaked logits) is switched on in at least one case.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

CASES = [
    dict(
        id="fp32-N37-H48-V1001-bias-T0.7-zero_rows",
        dtype="float32",
        N=37,
        H=48,
        V=1001,
        bias=True,
        T=0.7,
        zero_rows=(3, 9),
    ),
    dict(
        id="fp32-N37-H64-V3000-T1-splits-chunks-acc",
        dtype="float32",
        N=37,
        H=64,
        V=3000,
        bias=False,
        T=1.0,
        num_sms=64,
        workspace_rows=32,
        prefill_acc=True,
    ),
    dict(
        id="fp32-N37-H48-V1001-bias-T0.7-entropy_only-transposed_w-int32",
        dtype="float32",
        N=37,
        H=48,
        V=1001,
        bias=True,
        T=0.7,
        grads="entropy",
        layout="transposed",
        targets_dtype="int32",
    ),
    dict(id="fp32-N1-H64-V50-bias-T2", dtype="float32", N=1, H=64, V=50, bias=True, T=2.0),
    dict(
        id="fp32-N70-H64-V3000-grad_weight_only-zero_tile",
        dtype="float32",
        N=70,
        H=64,
        V=3000,
        bias=True,
        T=0.9,
        zero_rows=(32, 64),
        needs=(False, True, False),
        num_sms=1,
    ),
    # a whole zero-gradient token tile whose fake logits (acc = 0, so z = bias / T) sit 110 above the rows'
    # lse: exp overflows unless dead rows are excluded before the exponential
    dict(
        id="fp32-N70-H64-V1001-dead_tile_overflow",
        dtype="float32",
        N=70,
        H=64,
        V=1001,
        bias=True,
        T=0.5,
        zero_rows=(32, 64),
        dead_tile_overflow=True,
    ),
    dict(
        id="fp32-N37-H48-V1001-bias-grad_bias_only",
        dtype="float32",
        N=37,
        H=48,
        V=1001,
        bias=True,
        T=1.1,
        needs=(False, False, True),
        prefill_acc=True,
    ),
    dict(
        id="fp32-N37-H64-V1001-peaked-T0.7",
        dtype="float32",
        N=37,
        H=64,
        V=1001,
        bias=True,
        T=0.7,
        peaked=True,
    ),
    dict(id="fp16-N37-H64-V3000-bias-T0.7", dtype="float16", N=37, H=64, V=3000, bias=True, T=0.7),
    dict(
        id="fp16-N37-H48-V1001-T1.3-logprobs_only-strided",
        dtype="float16",
        N=37,
        H=48,
        V=1001,
        bias=False,
        T=1.3,
        grads="logprobs",
        layout="strided",
        workspace_rows=32,
    ),
    dict(
        id="fp16-N37-H64-V3000-no_upstream_grad",
        dtype="float16",
        N=37,
        H=64,
        V=3000,
        bias=True,
        T=1.0,
        grads="none",
    ),
    dict(id="bf16-N37-H64-V1001-bias-T0.7", dtype="bfloat16", N=37, H=64, V=1001, bias=True, T=0.7),
    # through grpo_kernels.ops.lm_head.function.LMHeadFunction (get_impl("triton")) and torch.autograd
    dict(
        id="autograd-fp32-N37-H48-V1001-bias-T0.7",
        dtype="float32",
        N=37,
        H=48,
        V=1001,
        bias=True,
        T=0.7,
        autograd=True,
    ),
]

# The same checks with the TMA kernel A (use_forward_kernel("tma"): descriptors bound the ragged token,
# vocabulary and K edges instead of clamped indices and a peeled K tail): ragged K with bias, many
# vocabulary splits, one token, peaked logits, fp16 and bf16, and the strided case, whose misaligned
# weight must fall back to the cp.async kernel with a TMAFallbackWarning.
TMA_CASE_IDS = (
    "fp32-N37-H48-V1001-bias-T0.7-zero_rows",
    "fp32-N37-H64-V3000-T1-splits-chunks-acc",
    "fp32-N1-H64-V50-bias-T2",
    "fp32-N37-H64-V1001-peaked-T0.7",
    "fp16-N37-H64-V3000-bias-T0.7",
    "fp16-N37-H48-V1001-T1.3-logprobs_only-strided",
    "bf16-N37-H64-V1001-bias-T0.7",
)
CASES += [dict(c, id=f"{c['id']}-tma", forward_kernel="tma") for c in CASES if c["id"] in TMA_CASE_IDS]

# fused_linear_logprobs' cuBLAS logits GEMM (use_logits_gemm("cublas")) through LMHeadFunction: chunks of
# `chunk_rows` tokens (16 and 32 rows: several chunks and a ragged last one at N = 37 and 70) in the forward
# and in the backward's recompute, without a bias in fp32 and bf16. With a bias, or in fp16, both directions
# keep the Triton path (triton.py, _cublas_logits): the test checks kernel A ran.
CASES += [
    dict(id="autograd-cublas-fp32-N37-H48-V1001-T0.7", dtype="float32", N=37, H=48, V=1001, bias=False, T=0.7,
         autograd=True, logits_gemm="cublas", chunk_rows=16),
    dict(id="autograd-cublas-bf16-N70-H64-V3000-T1", dtype="bfloat16", N=70, H=64, V=3000, bias=False, T=1.0,
         autograd=True, logits_gemm="cublas", chunk_rows=32),
    dict(id="autograd-cublas-fp32-N37-H48-V1001-bias-T0.7", dtype="float32", N=37, H=48, V=1001, bias=True,
         T=0.7, autograd=True, logits_gemm="cublas", chunk_rows=16),
    dict(id="autograd-cublas-fp16-N37-H64-V1001-T1.3", dtype="float16", N=37, H=64, V=1001, bias=False, T=1.3,
         autograd=True, logits_gemm="cublas", chunk_rows=16),
]  # fmt: skip

FORWARD_FIELDS = ("logprobs", "entropy", "lse", "expected_logit")
AUTOGRAD_FIELDS = ("logprobs", "entropy")


def _make_inputs(case, torch):
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    n, h, v = case["N"], case["H"], case["V"]
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * (1.0 if case.get("peaked") else 0.3)
    b = torch.randn(v, generator=gen) if case["bias"] else None
    y = torch.randint(0, v, (n,), generator=gen)
    if case.get(
        "peaked"
    ):  # logits with std ~8 / T, |z| up to ~40; half the targets are the argmax (logp -> 0-)
        z = (x @ w.T + (b if b is not None else 0)) / case["T"]
        y[::2] = z.argmax(-1)[::2]
    if case.get("dead_tile_overflow"):  # rows 32..63: z_5 = (x . w_5 + b_5) / T = (-128 + 60) / 0.5
        x[32:64] = 1.0
        w[5] = -2.0
        b[5] = 60.0
    x, w = x.to(dtype), w.to(dtype)
    b = b.to(dtype) if b is not None else None
    layout = case.get("layout", "contiguous")
    if layout == "strided":  # row strides H + 16 / H + 5, and a weight base that is not 16-byte aligned
        xb = torch.zeros(n, h + 16, dtype=dtype)
        xb[:, :h] = x
        x = xb[:, :h]
        wb = torch.zeros(v, h + 5, dtype=dtype)
        wb[:, 3 : 3 + h] = w
        w = wb[:, 3 : 3 + h]
    elif layout == "transposed":  # weight stored as [H, V]: unit stride is along V, the launcher copies
        w = w.T.contiguous().T
    if case.get("targets_dtype") == "int32":
        y = y.to(torch.int32)
    g_lp = torch.randn(n, generator=gen)
    g_h = torch.randn(n, generator=gen)
    if "zero_rows" in case:
        lo, hi = case["zero_rows"]
        g_lp[lo:hi] = 0
        g_h[lo:hi] = 0
    grads = case.get("grads", "both")
    if grads in ("entropy", "none"):
        g_lp = None
    if grads in ("logprobs", "none"):
        g_h = None
    return x, w, b, y, g_lp, g_h


def _stats_and_grads(x, w, b, y, T, g_lp, g_h, torch, compute_dtype=None):
    """Autograd through softmax statistics of z = (x @ w.T + b) / T.

    Logits come from a GEMM in x's dtype; the statistics are then taken in compute_dtype (default: x's dtype).
    """
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True) if b is not None else None
    logits = torch.nn.functional.linear(x, w, b)
    z = logits.to(compute_dtype or x.dtype) / T
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    lse = torch.logsumexp(z, dim=-1)
    ez = (p * z).sum(-1)
    entropy = -(p * log_p).sum(-1)
    logprobs = log_p.gather(-1, y.long()[:, None]).squeeze(-1)
    loss = 0
    if g_lp is not None:
        loss = loss + (logprobs * g_lp.to(logprobs.dtype)).sum()
    if g_h is not None:
        loss = loss + (entropy * g_h.to(entropy.dtype)).sum()
    grads = (None, None, None)
    if torch.is_tensor(loss):
        inputs = (x, w) + ((b,) if b is not None else ())
        got = torch.autograd.grad(loss, inputs)
        grads = (got[0], got[1], got[2] if b is not None else None)
    stats = dict(logprobs=logprobs, entropy=entropy, lse=lse, expected_logit=ez)
    return {k: t.detach() for k, t in stats.items()}, grads


def _compare(tri, gt, base, torch):
    """Max error of tri and of the baseline against the float64 ground truth, and the worst element."""
    gt = gt.double()
    err = (tri.double() - gt).abs()
    flat = int(err.flatten().argmax())
    idx = list(torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else []
    idx = [int(i) for i in idx]
    base_err = (base.double() - gt).abs().max().item() if base is not None else None
    return dict(
        max_err=err.max().item(),
        base_err=base_err,
        scale=gt.abs().max().item(),
        worst_index=idx,
        expected=gt.flatten()[flat].item(),
        got=tri.double().flatten()[flat].item(),
        nonfinite=int((~torch.isfinite(tri)).sum()),
    )


def run_case(case):
    import warnings

    import torch

    from grpo_kernels.ops.lm_head import triton as tri

    x, w, b, y, g_lp, g_h = _make_inputs(case, torch)
    T = case["T"]
    out = {}

    if case.get("autograd"):
        return _run_autograd_case(case, x, w, b, y, g_lp, g_h, torch)
    launched, launch = [], tri._launch
    tri._launch = lambda kernel, *args: (launched.append(kernel.__name__), launch(kernel, *args))[1]
    try:
        with tri.use_forward_kernel(case.get("forward_kernel", "cp.async")), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", tri.TMAFallbackWarning)
            stats = tri.lm_head_forward(x, w, b, y, T, num_sms=case.get("num_sms", 8))
    finally:
        tri._launch = launch
    out["forward_kernels"] = launched
    out["tma_fallback_warnings"] = [str(m.message) for m in said if issubclass(m.category, tri.TMAFallbackWarning)]
    gt_stats, gt_grads = _stats_and_grads(
        x.double(),
        w.double(),
        b.double() if b is not None else None,
        y,
        T,
        g_lp.double() if g_lp is not None else None,
        g_h.double() if g_h is not None else None,
        torch,
    )
    # forward baseline: the fp32 computation on the same (exactly upcast) inputs, which is what the kernel
    # claims to do whatever the input dtype
    ref_stats, _ = _stats_and_grads(
        x.float(), w.float(), b.float() if b is not None else None, y, T, None, None, torch
    )
    for name in FORWARD_FIELDS:
        out[name] = _compare(getattr(stats, name), gt_stats[name], ref_stats[name], torch)
    out["invariants"] = dict(max_logprob=stats.logprobs.max().item(), min_entropy=stats.entropy.min().item())

    # gradient baseline: plain PyTorch autograd in the input dtype: logits from a GEMM in that dtype,
    # softmax statistics in fp32 (for fp32 inputs this is the fp32 reference)
    _, base_grads = _stats_and_grads(x, w, b, y, T, g_lp, g_h, torch, compute_dtype=torch.float32)

    need_h, need_w, need_b = case.get("needs", (True, True, True))
    acc_w = acc_b = None
    if case.get("prefill_acc"):
        gen = torch.Generator().manual_seed(7)
        acc_w = torch.randn(w.shape, generator=gen)
        acc_b = torch.randn(w.shape[0], generator=gen) if b is not None else None
    acc_w0 = acc_w.clone() if acc_w is not None else None
    acc_b0 = acc_b.clone() if acc_b is not None else None
    workspace_bytes = tri.DEFAULT_WORKSPACE_BYTES
    if "workspace_rows" in case:
        row_stride = -(-w.shape[0] // tri.WORKSPACE_ROW_ALIGN) * tri.WORKSPACE_ROW_ALIGN
        workspace_bytes = case["workspace_rows"] * row_stride * x.element_size()
    g_hidden, g_weight, g_bias = tri.lm_head_backward(
        x,
        w,
        b,
        y,
        T,
        stats.lse,
        stats.expected_logit,
        g_lp,
        g_h,
        need_grad_hidden=need_h,
        need_grad_weight=need_w,
        need_grad_bias=need_b,
        grad_weight_acc=acc_w,
        grad_bias_acc=acc_b,
        workspace_bytes=workspace_bytes,
    )
    out["returned"] = dict(
        grad_hidden=g_hidden is not None,
        grad_weight=g_weight is not None,
        grad_bias=g_bias is not None,
        grad_hidden_dtype=str(g_hidden.dtype) if g_hidden is not None else None,
        grad_weight_dtype=str(g_weight.dtype) if g_weight is not None else None,
        acc_in_place=(g_weight is acc_w) if acc_w is not None and g_weight is not None else None,
    )
    expected_returned = dict(grad_hidden=need_h, grad_weight=need_w, grad_bias=need_b and b is not None)
    out["expected_returned"] = expected_returned
    zero = lambda t: torch.zeros_like(t)  # noqa: E731
    gt_gx, gt_gw, gt_gb = (g if g is not None else None for g in gt_grads)
    if gt_gx is None:  # no upstream gradient at all: every returned gradient is exactly zero
        gt_gx, gt_gw = zero(x.double()), zero(w.double())
        gt_gb = zero(b.double()) if b is not None else None
        base_grads = (zero(x), zero(w), zero(b) if b is not None else None)
    if g_hidden is not None:
        out["grad_hidden"] = _compare(g_hidden, gt_gx, base_grads[0], torch)
        if "zero_rows" in case:
            lo, hi = case["zero_rows"]
            out["zero_rows_grad_hidden_max_abs"] = g_hidden[lo:hi].abs().max().item()
    if g_weight is not None:
        got = g_weight - acc_w0 if acc_w0 is not None else g_weight
        out["grad_weight"] = _compare(got, gt_gw, base_grads[1], torch)
    if g_bias is not None:
        got = g_bias - acc_b0 if acc_b0 is not None else g_bias
        out["grad_bias"] = _compare(got, gt_gb, base_grads[2], torch)
    return out


def _run_autograd_case(case, x, w, b, y, g_lp, g_h, torch):
    from grpo_kernels.ops.lm_head import get_impl
    from grpo_kernels.ops.lm_head.function import LMHeadFunction

    from grpo_kernels.ops.lm_head import triton as tri

    T = case["T"]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) if t is not None]
    impl = get_impl("triton")
    launched, launch = [], tri._launch
    patched = dict(_launch=lambda kernel, *args: (launched.append(kernel.__name__), launch(kernel, *args))[1])
    if "chunk_rows" in case:  # the cuBLAS path's chunks (forward and backward): logits + dz slab + grad_hidden
        element = x.element_size()
        slab = -(-case["V"] // tri.WORKSPACE_ROW_ALIGN) * tri.WORKSPACE_ROW_ALIGN * element
        per_row = 4 * case["V"] + slab + (4 * case["H"] if element < 4 else 0)
        patched.update(DEFAULT_WORKSPACE_BYTES=case["chunk_rows"] * per_row)
    saved = {name: getattr(tri, name) for name in patched}
    for name, value in patched.items():
        setattr(tri, name, value)
    try:
        with tri.use_logits_gemm(case.get("logits_gemm", "triton")):
            logprobs, entropy = LMHeadFunction.apply(*leaves[:2], leaves[2] if b is not None else None, y, T,
                                                     impl, True)  # fmt: skip
            loss = (logprobs * g_lp).sum() + (entropy * g_h).sum()
            grads = torch.autograd.grad(loss, leaves)
    finally:
        for name, value in saved.items():
            setattr(tri, name, value)
    grads = tuple(grads) + ((None,) if b is None else ())
    gt_stats, gt_grads = _stats_and_grads(
        x.double(), w.double(), b.double() if b is not None else None, y, T, g_lp.double(), g_h.double(), torch
    )
    ref_stats, ref_grads = _stats_and_grads(x, w, b, y, T, g_lp, g_h, torch, compute_dtype=torch.float32)
    out = {
        "logprobs": _compare(logprobs.detach(), gt_stats["logprobs"], ref_stats["logprobs"], torch),
        "entropy": _compare(entropy.detach(), gt_stats["entropy"], ref_stats["entropy"], torch),
        "invariants": dict(max_logprob=logprobs.max().item(), min_entropy=entropy.min().item()),
        "returned": dict(
            grad_hidden=True,
            grad_weight=True,
            grad_bias=b is not None,
            acc_in_place=None,
            grad_hidden_dtype=str(grads[0].dtype),
            grad_weight_dtype="torch.float32",
        ),
        "expected_returned": dict(grad_hidden=True, grad_weight=True, grad_bias=b is not None),
        "autograd_dtypes": [str(g.dtype) for g in grads if g is not None],
        "kernels": sorted(set(launched)),
    }
    for name, got, gt, ref in zip(
        ("grad_hidden", "grad_weight", "grad_bias"), grads, gt_grads, ref_grads, strict=True
    ):
        if got is not None:
            out[name] = _compare(got, gt, ref, torch)
    return out


def main(argv):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 in the environment")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import warnings

    import numpy as np

    warnings.simplefilter("ignore")  # numpy warnings from masked-out lanes the interpreter evaluates
    np.seterr(all="ignore")
    from interpreter_runner import nan_fill_uninitialized, wanted

    nan_fill_uninitialized()  # lm_head_backward's own accumulator and the cuBLAS-logits backward's

    named = set(argv)  # case ids on the command line, else the selected tests' (GRPO_KERNELS_CASES), else all
    results = {}
    for case in CASES:
        if case["id"] in named if named else wanted(case["id"]):
            try:
                results[case["id"]] = run_case(case)
            except Exception as exc:  # reported per case, so one failure does not hide the others
                import traceback

                results[case["id"]] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
