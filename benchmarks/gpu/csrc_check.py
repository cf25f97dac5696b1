"""On a Hopper GPU: check the csrc kernel A (csrc/bin/libgrpo_kernels_sm90a.so) against the fp32 reference, then
time it against one cuBLAS GEMM of the same shape, interleaved. Writes one JSON file; claims nothing itself.

    python benchmarks/gpu/csrc_check.py --out $OUT/csrc.json [--n 16384] [--repeats 20]
    python benchmarks/gpu/csrc_check.py --gate --out gate.json   # the GPU session's gate only (seconds)

--gate (run by the GPU session beside its test tier, killed at its limit): every kernel entry point the
  headline's csrc rows call, on the small heads and one wide head, against float64 (kernel A, a derived bound) and
  the spec (kernel C), nothing compiled by Triton; gate_ok in the JSON, each phase saved as it ends.

Checks (each a row of "checks", ok true / false, with the worst element):
  * small heads (N = 300, H = 512, V = 5003: a ragged last tile and M tile) in bf16 and fp16, every transform
    (plain T = 0.7, bias with one -inf entry, soft cap 30 with bias) and both variants, against
    lm_head_stats_reference in fp32 on the same operands; tolerance: the Triton kernel's error on the same call
    (triton.lm_head_forward) times 4 plus 1e-5 (|lse|+1): csrc must be as accurate as today's path;
  * the target head (N = 1024, H = 4096, V = 151936, bf16), the same comparison (the reference in chunks);
  * the training forward (store_checks): the epilogue's fp16 store of the logits (HalfLogits) on the small heads
    and at the target head (256 tokens), against Triton kernel A's fp32 logits of the same call.
Timing (only if every check passed): N = --n (16384), H = 4096, V = 151936, bf16; per repeat, in a shuffled order,
  csrc cooperative and ping-pong each at tile-scheduler swizzle 1 / 4 / 8, Triton kernel A (triton.lm_head_forward),
  torch.mm (cuBLAS, bf16 out [N, V]), and the training forward storing fp16 logits (csrc cooperative, Triton
  kernel A), each timed with CUDA events after a warm-up; median / p20 / p80 ms and
  TF/s (2 N H V flops); summary: the best csrc row and its ratio to the cuBLAS GEMM (the target: <= 1.0).
Kernel C (the backward's dz GEMMs, ABI 6: both in one launch; judged apart from kernel A): backward_checks, csrc
  against its torch spec (cutlass.dz_gemms_reference) on the device on the same fp16 store, small heads and the
  target head (N = 512), per element within a derived bound, and the in-place grad_weight (16-bit buffer) exactly
  the fp32 sum rounded once; then backward_timings at one chunk (--backward-n 2432 tokens, the one-pass chunk at
  the target head): csrc's two dz GEMMs against the two cuBLAS GEMMs of the same shapes (the floor, dz given in
  bf16), each alone (two launches, against one: csrc_two_launches_to_one beside the count of
  cutlass.dz_gemms_makespan), and the in-place grad_weight GEMM against cuBLAS's addmm into the bf16 buffer,
  interleaved the same way (the whole fused loss is the headline's grpo_kernels-csrc-one-pass-dz-inplace and
  grpo_kernels-csrc-one-pass-dz).
Expected duration on an H100 / H200: ~1-2 min (build-free: the library is loaded, no compile).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpo_kernels.ops.lm_head import chunked, cutlass, triton as triton_impl  # noqa: E402
from grpo_kernels.ops.lm_head.reference import lm_head_stats_reference  # noqa: E402
from grpo_kernels.ops.lm_head.transform import gradient_factor  # noqa: E402

FIELDS = ("logprobs", "entropy", "lse", "expected_logit")


def _reference(hidden, weight, bias, targets, temperature, softcap, chunk=256):
    outs = []
    for i in range(0, hidden.shape[0], chunk):
        s = lm_head_stats_reference(hidden[i:i + chunk], weight, targets[i:i + chunk], bias, temperature, softcap)
        outs.append(torch.stack(list(s)))
    return torch.cat(outs, 1)  # [4, N]


def _compare(name, got, tri, ref):
    got, tri = torch.stack(list(got)), torch.stack(list(tri))
    row = {"case": name, "ok": True}
    for k, f in enumerate(FIELDS):
        err = (got[k] - ref[k]).abs()
        err_tri = (tri[k] - ref[k]).abs()
        tol = 4 * err_tri.max() + 1e-5 * (ref[2].abs() + 1)
        bad = ~(err <= tol)
        i = int(torch.where(bad.any(), bad.float().argmax(), (err / tol).argmax()))
        row[f] = {"max_err": err.max().item(), "triton_max_err": err_tri.max().item(), "worst_row": i,
                  "got": got[k, i].item(), "want": ref[k, i].item(), "tol": tol[i].item()}  # fmt: skip
        row["ok"] &= not bool(bad.any())
    return row


def small_heads(device, g):
    """The small-head cases (N = 300, H = 512, V = 5003), bf16 and fp16, each transform: (name, hidden, weight,
    bias, targets, temperature, cap) with cap the model's soft cap or None."""
    for dtype in (torch.bfloat16, torch.float16):
        n, h, v = 300, 512, 5003
        hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).to(dtype)
        weight = (torch.randn(v, h, device=device, generator=g) * 0.2).to(dtype)
        bias = torch.randn(v, device=device, generator=g).to(dtype)
        bias[17] = float("-inf")
        targets = torch.randint(0, v, (n,), device=device, generator=g)
        for label, b, temp, cap in (("plain", None, 0.7, None), ("bias", bias, 1.3, None), ("softcap", bias, 0.8, 30.0)):
            yield f"{dtype}-{label}", hidden, weight, b, targets, temp, cap


def checks(lib, device):
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, hidden, weight, b, targets, temp, cap in small_heads(device, g):
        sc = None if cap is None else (1.0 / cap, cap / temp)
        ref_bias = None if b is None else b.float()
        if ref_bias is not None and cap is None:  # the kernels' forbidden token: z = NEG_BIG, p (z - m) = 0
            ref_bias = ref_bias.clamp(min=-(2.0**102) * temp)  # (the reference's -inf gives 0 * -inf = NaN)
        ref = _reference(hidden.float(), weight.float(), ref_bias, targets, temp, cap)
        tri = triton_impl.lm_head_forward(hidden, weight, b, targets, temp, softcap=sc)
        for variant in cutlass.VARIANTS:
            got = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, variant=variant)
            torch.cuda.synchronize()
            rows.append(_compare(f"{name}-{variant}", got, tri, ref))
    n, h, v = 1024, 4096, 151936
    hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.02).bfloat16()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    ref = _reference(hidden.float(), weight.float(), None, targets, 1.0, None, chunk=64)
    tri = triton_impl.lm_head_forward(hidden, weight, None, targets, 1.0)
    for variant in cutlass.VARIANTS:
        got = cutlass.forward_stats(lib, hidden, weight, None, targets, 1.0, None, variant=variant)
        rows.append(_compare(f"target-head-N{n}-{variant}", got, tri, ref))
    return rows


def store_checks(lib, device):
    """The training forward (ABI 2): the csrc epilogue's fp16 store (HalfLogits) on a small head in bf16 and fp16
    (every transform) and at the target head, against Triton kernel A's fp32 logits of the same call. Per case:
    the statistics equal to the statistics-only call's (the store must not touch them), and every
    reconstructed logit m + d within the format's bound 2^-11 (lse - z) + 2^-23 (|z| + |m|) plus the two
    GEMMs' summation-order difference, 2^-23 H (|x| |w|^T) (fp32 sums of exact products)."""
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    cases = [(name, hidden, weight, b, targets, temp, None if cap is None else (1.0 / cap, cap / temp))
             for name, hidden, weight, b, targets, temp, cap in small_heads(device, g)]
    n, h, v = 256, 4096, 151936
    hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.02).bfloat16()
    cases.append((f"target-head-N{n}", hidden, weight, None, torch.randint(0, v, (n,), device=device, generator=g),
                  1.0, None))  # fmt: skip
    for name, hidden, weight, b, targets, temp, sc in cases:
        n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
        z = torch.empty(n, v, device=device)
        tri = triton_impl.lm_head_forward(hidden, weight, b, targets, temp, softcap=sc, logits_out=z)
        spread = (hidden.float().abs() @ weight.float().abs().T) * gradient_factor(1.0 / temp, sc)
        for variant in cutlass.VARIANTS:
            store = triton_impl.HalfLogits.empty(n, v, device)
            plain = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, variant=variant)
            got = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, variant=variant, logits_out=store)
            torch.cuda.synchronize()
            m = store.offset.repeat_interleave(triton_impl.STORED_GROUP, dim=1)[:, :v]
            z16 = store.reconstruct()
            live = z > -1e30  # a forbidden token is clamped: p = 0 either way
            bound = 2.0**-11 * (tri.lse[:, None] - z).clamp(min=0) + 2.0**-23 * (z.abs() + m.abs()) + 2.0**-23 * h * spread
            ratio = torch.where(live, (z16 - z).abs() / bound, torch.zeros_like(z))
            worst = int(ratio.argmax())
            row = {"case": f"store-{name}-{variant}", "stats_equal": all(torch.equal(a, c) for a, c in zip(plain, got)),
                   "worst_ratio": ratio.max().item(), "worst": [worst // v, worst % v],
                   "forbidden_below": bool((~live).sum() == 0 or (z16[~live] - tri.lse[:, None].expand_as(z)[~live]).max() < -60000)}  # fmt: skip
            row["ok"] = row["stats_equal"] and row["worst_ratio"] <= 1.0 and row["forbidden_below"]
            rows.append(row)
    return rows


def _interleaved(fns: dict, repeats: int, flops: dict) -> dict:
    """Each callable once to warm up (autotuning, first-call setup), then `repeats` rounds, each in a shuffled
    order, every call timed with CUDA events: per name median / p20 / p80 ms and TF/s at its `flops`."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        order = list(fns)
        random.shuffle(order)
        for k in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    out = {}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        med = statistics.median(ts)
        out[k] = {"median_ms": med, "p20_ms": q[1], "p80_ms": q[7], "tflops": flops[k] / med / 1e9, "n": len(ts)}
    return out


def _dz_args(hidden, weight, targets, stats, store, g_lp, g_h, temp, sc):
    """triton.lm_head_backward's prepared operands for the dz GEMMs (cutlass.DZ_GEMMS_ARGS), fresh outputs."""
    scale = None
    if hidden.dtype == torch.float16:  # the fp16 operand's power-of-two scale, as lm_head_backward sets it
        scale = triton_impl.dz_scale(stats.lse, stats.expected_logit, g_lp, g_h, gradient_factor(1.0 / temp, sc))
    return dict(stored_logits=store, hidden=hidden, weight=weight, targets=targets, lse=stats.lse,
                expected_logit=stats.expected_logit, grad_logprobs=g_lp, grad_entropy=g_h,
                inv_temperature=1.0 / temp if sc is None else 1.0, softcap=sc, dz_scale=scale,
                grad_hidden_out=torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device),
                accumulate_hidden=False,
                grad_weight_acc=torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device))  # fmt: skip


def backward_checks(lib, device, cases=None):
    """Kernel C (ABI 7): csrc's dz GEMMs against their torch spec (cutlass.dz_gemms_reference) on the device, on the
    same fp16 store, small heads (bf16 / fp16, every transform) and the target head (N = 512). Both form the same
    fp32 dz and round it to the operand dtype (at most u_op |dz| apart where fused multiply-adds differ), then sum
    K products in fp32 in different orders: per element |csrc - spec| <= (u_op + 2 K u32) (|dz| @ |operand|) + 2 u32
    |result|, |dz| bounded in float64 from the store (the interpreter test's bound). Also: a token without
    upstream gradient gets exactly 0 in grad_hidden; grad_hidden added into (accumulate) gives twice the sum; the
    in-place grad_weight (a 16-bit gradient buffer) is exactly the fp32 run's sum added to it and rounded once; a
    grad_weight overwritten (accumulate_weight=False) from NaN is exactly the sum (fp32; in place rounded once)."""
    rows = []
    g = torch.Generator(device=device).manual_seed(2)
    if cases is None:  # the small heads and the target head (the gate passes its own)
        cases = [(name, hidden, weight, b, targets, temp, None if cap is None else (1.0 / cap, cap / temp))
                 for name, hidden, weight, b, targets, temp, cap in small_heads(device, g)]
        n, h, v = 512, 4096, 151936
        hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).bfloat16()
        weight = (torch.randn(v, h, device=device, generator=g) * 0.02).bfloat16()
        cases.append((f"target-head-N{n}", hidden, weight, None,
                      torch.randint(0, v, (n,), device=device, generator=g), 1.0, None))  # fmt: skip
    units = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
    for name, hidden, weight, b, targets, temp, sc in cases:
        n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
        store = triton_impl.HalfLogits.empty(n, v, device)
        stats = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, logits_out=store)
        g_lp = torch.randn(n, device=device, generator=g)
        g_h = torch.randn(n, device=device, generator=g)
        g_lp[3] = g_h[3] = 0.0
        got = _dz_args(hidden, weight, targets, stats, store, g_lp, g_h, temp, sc)
        want = _dz_args(hidden, weight, targets, stats, store, g_lp, g_h, temp, sc)
        cutlass.dz_gemms_csrc(lib, **got)
        cutlass.dz_gemms_reference(**want)
        torch.cuda.synchronize()
        coef, target = cutlass.token_coefficients(stats.lse.double(), stats.expected_logit.double(), g_lp.double(),
                                                  g_h.double(), targets, want["inv_temperature"],
                                                  softcap=sc)  # fmt: skip
        mag = cutlass.dz_magnitude(store.reconstruct().double(), coef, target)  # the cap's constant is in coef
        row = {"case": f"backward-{name}", "ok": True}
        u_op, u32 = units[hidden.dtype], 2.0**-24
        for grad, key, operand, k in (("grad_hidden", "grad_hidden_out", weight, v),
                                      ("grad_weight", "grad_weight_acc", hidden, n)):  # fmt: skip
            a, c = got[key].double(), want[key].double()
            absolute = (mag @ operand.double().abs()) if grad == "grad_hidden" else (mag.T @ operand.double().abs())
            bound = (u_op + 2 * k * u32) * absolute + 2 * u32 * torch.maximum(a.abs(), c.abs())
            ratio = ((a - c).abs() / bound.clamp(min=1e-300))
            worst = int(ratio.argmax())
            row[grad] = {"worst_ratio": ratio.max().item(), "worst": [worst // h, worst % h],
                         "got": a.flatten()[worst].item(), "want": c.flatten()[worst].item()}  # fmt: skip
            row["ok"] &= ratio.max().item() <= 1.0
        row["zero_row_exact"] = bool((got["grad_hidden_out"][3] == 0).all())
        again = dict(got, grad_weight_acc=None, accumulate_hidden=True)
        first = got["grad_hidden_out"].clone()
        cutlass.dz_gemms_csrc(lib, **again)
        torch.cuda.synchronize()
        row["accumulate_doubles"] = bool(torch.allclose(got["grad_hidden_out"], 2 * first, rtol=2.0**-22, atol=0))
        # grad_weight in place (ABI 4, schedule="one_pass_dz_inplace"): the gradient buffer in the operands' dtype
        # gets old + the same fp32 sum rounded once. The in-place kernel's main loop is the fp32 one's (same tiles,
        # same order), and the fp32 run added into zeros: exactly (start + fp32 result) rounded to nearest
        start = (torch.randn(weight.shape, device=device, generator=g) * 1e-3).to(weight.dtype)
        narrow = dict(got, grad_hidden_out=None, grad_weight_acc=start.clone())
        cutlass.dz_gemms_csrc(lib, **narrow)
        torch.cuda.synchronize()
        expect = (start.float() + got["grad_weight_acc"]).to(weight.dtype)
        differ = narrow["grad_weight_acc"] != expect
        row["in_place_rounds_once"] = {"mismatches": int(differ.sum()),
                                       "changed": float((narrow["grad_weight_acc"] != start).float().mean())}  # fmt: skip
        # the first chunk's call (ABI 5, accumulate_weight=False): a NaN-filled buffer, fp32 or in place, ends
        # exactly as the fp32 run that added into zeros (rounded once in place): nothing read it
        overwrite_mismatches = 0
        for dtype in (torch.float32, weight.dtype):
            fresh = dict(got, grad_hidden_out=None, accumulate_weight=False,
                         grad_weight_acc=torch.full(weight.shape, float("nan"), dtype=dtype, device=device))  # fmt: skip
            cutlass.dz_gemms_csrc(lib, **fresh)
            torch.cuda.synchronize()
            overwrite_mismatches += int((fresh["grad_weight_acc"] != got["grad_weight_acc"].to(dtype)).sum())
        row["overwrite_mismatches"] = overwrite_mismatches
        row["ok"] &= row["zero_row_exact"] and row["accumulate_doubles"] and not bool(differ.any())
        row["ok"] &= overwrite_mismatches == 0
        rows.append(row)
        del mag
    return rows


def backward_timings(lib, device, n, repeats):
    """One chunk of the fused loss's backward at the target head (n tokens, the one-pass chunk size), bf16: csrc's
    two dz GEMMs (and each alone) against the cuBLAS GEMMs of the same shapes (bf16 [n, V] dz given: the floor).
    No Triton row (its JIT would cost the part ~10-20 s): today's default against kernel C is the headline's
    `grpo_kernels` against `grpo_kernels-csrc-one-pass-dz` (the whole fused loss)."""
    h, v = 4096, 151936
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    hidden = (torch.randn(n, h, device=device) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=device) * 0.02).bfloat16()
    targets = torch.randint(0, v, (n,), device=device)
    store = triton_impl.HalfLogits.empty(n, v, device)
    stats = cutlass.forward_stats(lib, hidden, weight, None, targets, 1.0, None, logits_out=store)
    g_lp, g_h = torch.randn(n, device=device) * 1e-3, torch.randn(n, device=device) * 1e-3
    args = _dz_args(hidden, weight, targets, stats, store, g_lp, g_h, 1.0, None)
    dz = torch.randn(n, v, device=device).bfloat16()
    out_h = torch.empty(n, h, device=device, dtype=torch.bfloat16)
    out_w = torch.empty(v, h, device=device, dtype=torch.bfloat16)
    buffer_w = torch.zeros(v, h, device=device, dtype=torch.bfloat16)  # one_pass_dz_inplace's gradient buffer
    fns = {
        "csrc_dz_both": lambda: cutlass.dz_gemms_csrc(lib, **args),
        "csrc_dz_grad_hidden": lambda: cutlass.dz_gemms_csrc(lib, **dict(args, grad_weight_acc=None)),
        "csrc_dz_grad_weight": lambda: cutlass.dz_gemms_csrc(lib, **dict(args, grad_hidden_out=None)),
        # the first chunk's epilogue (written over, nothing read): against the row above, the cost of adding into the
        # fp32 accumulator (its loads batched: csrc/README.md, "Adding into the output")
        "csrc_dz_grad_weight_overwrite": lambda: cutlass.dz_gemms_csrc(lib, **dict(args, grad_hidden_out=None,
                                                                                   accumulate_weight=False)),
        "cublas_grad_hidden": lambda: torch.mm(dz, weight, out=out_h),
        "cublas_grad_weight": lambda: torch.mm(dz.t(), hidden, out=out_w),
        # in place: csrc's 16-bit epilogue against cuBLAS's beta = 1 addmm into the bf16 buffer (one_pass_inplace's)
        "csrc_dz_grad_weight_in_place": lambda: cutlass.dz_gemms_csrc(lib, **dict(args, grad_hidden_out=None,
                                                                                  grad_weight_acc=buffer_w)),
        "cublas_grad_weight_in_place": lambda: out_w.addmm_(dz.t(), hidden),
    }  # fmt: skip
    out = _interleaved(fns, repeats, {k: (4 if "both" in k else 2) * n * h * v for k in fns})
    floor = out["cublas_grad_hidden"]["median_ms"] + out["cublas_grad_weight"]["median_ms"]
    summary = {"csrc_dz_to_cublas_pair": out["csrc_dz_both"]["median_ms"] / floor,
               "csrc_grad_hidden_to_cublas": out["csrc_dz_grad_hidden"]["median_ms"] / out["cublas_grad_hidden"]["median_ms"],
               "csrc_grad_weight_to_cublas": out["csrc_dz_grad_weight"]["median_ms"] / out["cublas_grad_weight"]["median_ms"],
               "csrc_grad_weight_in_place_to_cublas": out["csrc_dz_grad_weight_in_place"]["median_ms"]
               / out["cublas_grad_weight_in_place"]["median_ms"],
               # what adding into the fp32 accumulator costs over writing it (every chunk after a call's first)
               "csrc_grad_weight_add_to_overwrite": out["csrc_dz_grad_weight"]["median_ms"]
               / out["csrc_dz_grad_weight_overwrite"]["median_ms"],
               # ABI 6 runs both GEMMs in one launch: the two alone (two launches) over both, against the count of
               # cutlass.dz_gemms_makespan on this GPU's SMs (the tail of grad_hidden's last wave filled)
               "csrc_two_launches_to_one": (out["csrc_dz_grad_hidden"]["median_ms"]
                                            + out["csrc_dz_grad_weight"]["median_ms"]) / out["csrc_dz_both"]["median_ms"],
               "counted_two_launches_to_one": cutlass.dz_gemms_makespan(n, v, h, sms, one_launch=False)
               / cutlass.dz_gemms_makespan(n, v, h, sms)}  # fmt: skip
    return {"shape": {"N": n, "H": h, "V": v, "dtype": "bf16"}, "rows": out, "summary": summary}


def timings(lib, device, n, repeats):
    h, v = 4096, 151936
    hidden = (torch.randn(n, h, device=device) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=device) * 0.02).bfloat16()
    targets = torch.randint(0, v, (n,), device=device)
    logits = torch.empty(n, v, device=device, dtype=torch.bfloat16)
    def csrc(variant, swizzle):  # the tile scheduler's swizzle (1, 4, 8 tiles) is a run-time argument
        return lambda: cutlass.forward_stats(lib, hidden, weight, None, targets, 1.0, variant=variant, swizzle=swizzle)

    fns = {f"csrc_{v}_swizzle{w}": csrc(v, w) for v in cutlass.VARIANTS for w in (1, 4, 8)}
    fns["triton_kernel_a"] = lambda: triton_impl.lm_head_forward(hidden, weight, None, targets, 1.0)
    fns["cublas_gemm_bf16_out"] = lambda: torch.mm(hidden, weight.t(), out=logits)
    # the training forward: the logits stored as fp16 z - m (HalfLogits), csrc's epilogue against Triton's kernel A
    store = triton_impl.HalfLogits.empty(n, v, device)
    fns["csrc_cooperative_store_half"] = lambda: cutlass.forward_stats(lib, hidden, weight, None, targets, 1.0,
                                                                       logits_out=store)  # fmt: skip
    fns["triton_kernel_a_store_half"] = lambda: triton_impl.lm_head_forward(hidden, weight, None, targets, 1.0,
                                                                            logits_out=store)  # fmt: skip
    out = _interleaved(fns, repeats, {k: 2 * n * h * v for k in fns})
    best = min((k for k in out if k.startswith("csrc_") and "store" not in k), key=lambda k: out[k]["median_ms"])
    floor = out["cublas_gemm_bf16_out"]["median_ms"]
    summary = {"best_csrc": best, "best_csrc_to_cublas": out[best]["median_ms"] / floor,
               "triton_to_cublas": out["triton_kernel_a"]["median_ms"] / floor,
               "csrc_store_half_to_cublas": out["csrc_cooperative_store_half"]["median_ms"] / floor,
               "triton_store_half_to_cublas": out["triton_kernel_a_store_half"]["median_ms"] / floor}  # fmt: skip
    return {"shape": {"N": n, "H": h, "V": v, "dtype": "bf16"}, "rows": out, "summary": summary}


# ------------------------------------------------------------------------------------------------
# --gate: the GPU session's first look at the library (run beside the GPU test tier, to a time limit)
# ------------------------------------------------------------------------------------------------
WIDE_HEAD = (640, 512, 151936)  # kernel A: 5 x 594 tiles, ~23 per CTA of the persistent grid on 132 SMs; kernel C:
# grad_hidden over 2,374 K tiles (the stage ring wraps ~600 times), grad_weight 2,374 tiles of 10 K tiles


def gate_cases(device):
    """The small heads (every transform, bf16 and fp16) and the wide head: (name, hidden, weight, bias, targets,
    temperature, softcap as the kernels take it), as backward_checks takes its cases."""
    g = torch.Generator(device=device).manual_seed(3)
    cases = [(name, hidden, weight, b, targets, temp, None if cap is None else (1.0 / cap, cap / temp))
             for name, hidden, weight, b, targets, temp, cap in small_heads(device, g)]
    n, h, v = WIDE_HEAD
    hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.2).bfloat16()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    cases.append((f"wide-N{n}-H{h}-V{v}-bf16", hidden, weight, None, targets, 1.0, None))
    return cases


def gate_forward_checks(lib, cases):
    """Kernel A (both variants, statistics only and with the fp16 store) against float64 statistics, without
    Triton (nothing to compile beside the tier). Per row and statistic the bound is derived, not fitted:
    cutlass.stats_error_bound (the epilogue's fp32 arithmetic on fp32-rounded z) plus, to first order, what the
    GEMM's fp32 sums move each logit by, e_v = K u sum_h |x_h w_vh| F (F = 1 / T, or cap_in cap_out with a soft
    cap, whose tanh by ex2.approx and div.approx adds a few ulp of cap_out: 8 u cap_out), carried into each
    statistic by its own sensitivity (weighted by p). With the store: the statistics bitwise those of the
    statistics-only call, and m + d within the HalfLogits bound."""
    u = 2.0**-24
    rows = []
    for name, hidden, weight, b, targets, temp, sc in cases:
        k = hidden.shape[1]
        z = hidden.double() @ weight.double().T
        chunked._transform_(z, b, 1.0 / temp, sc)  # the epilogue's transform, here in float64 (NEG_BIG included)
        lse = torch.logsumexp(z, 1)
        logp = z - lse[:, None]
        p = logp.exp()
        expected = (p * z).sum(1)
        want = torch.stack([logp.gather(1, targets[:, None]).squeeze(1), lse - expected, lse, expected])
        magnitude = hidden.float().abs() @ weight.float().abs().T  # [N, V] sum_h |x_h w_vh|
        factor = gradient_factor(1.0 / temp, sc)
        # per logit, what the GEMM's fp32 sums (and a soft cap's approximations) can move z by; first order in it,
        # lse moves by a = E_p[e], log p_y by e_y + a, E_p[z] by a + c with c = E_p[|z - E_p[z]| (e + a)], the
        # entropy by 2 a + c
        e = k * u * magnitude.double() * factor + (8 * u * sc[1] if sc is not None else 0.0)  # [N, V]
        a = (p * e).sum(1)
        c = (p * (z - expected[:, None]).abs() * (e + a[:, None])).sum(1)
        e_y = e.gather(1, targets[:, None]).squeeze(1)
        live = z > -1e30  # a forbidden token (p = 0 exactly) moves nothing: the bound is over the others
        z_live = torch.where(live, z, z.masked_fill(~live, float("inf")).amin(1, keepdim=True))
        bound = cutlass.stats_error_bound(z_live, 256) + torch.stack([e_y + a, 2 * a + c, a, a + c])  # [4, N]
        for variant in cutlass.VARIANTS:
            store = triton_impl.HalfLogits.empty(hidden.shape[0], weight.shape[0], hidden.device)
            plain = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, variant=variant)
            stored = cutlass.forward_stats(lib, hidden, weight, b, targets, temp, sc, variant=variant, logits_out=store)
            torch.cuda.synchronize()
            got = torch.stack(list(plain)).double()
            ratio = ((got - want).abs() / bound).nan_to_num(nan=float("inf"))  # a NaN statistic fails
            field, row = divmod(int(ratio.argmax()), ratio.shape[1])
            z16 = store.reconstruct().double()
            m = store.offset.repeat_interleave(triton_impl.STORED_GROUP, dim=1)[:, :z.shape[1]].double()
            store_bound = (2.0**-11 * (lse[:, None] - z).clamp(min=0) + 2.0**-23 * (z.abs() + m.abs())
                           + 2.0**-23 * k * magnitude.double() * factor)  # fmt: skip
            store_ratio = torch.where(live, (z16 - z).abs() / store_bound, torch.zeros_like(z))
            store_ratio = store_ratio.nan_to_num(nan=float("inf"))  # a NaN logit fails
            rows.append({"case": f"A-{name}-{variant}", "worst_ratio": ratio.max().item(),
                         "worst": {"field": FIELDS[field], "row": row, "got": got[field, row].item(),
                                   "want": want[field, row].item(), "bound": bound[field, row].item()},
                         "store_stats_equal": all(torch.equal(a, c) for a, c in zip(plain, stored)),
                         "store_worst_ratio": store_ratio.max().item()})  # fmt: skip
            rows[-1]["ok"] = (rows[-1]["worst_ratio"] <= 1.0 and rows[-1]["store_stats_equal"]
                              and rows[-1]["store_worst_ratio"] <= 1.0)  # fmt: skip
            del z16, m, store_ratio, store
        del z, p, logp, magnitude, e
    return rows


def gate(lib, save, result, device=None):
    """What the GPU session runs beside its test tier before any csrc provider is timed: every kernel entry
    point the headline calls (kernel A's two variants with and without the store, kernel C into an fp32
    accumulator, added into, overwritten, and in place) on the small heads and one wide head, each phase saved
    as it ends, so that a hang names the phase it was in (the session kills this process at its limit)."""
    device = device or torch.device("cuda")  # the CPU test passes "cpu", with the spec in the library's place
    cases = gate_cases(device)
    result["gate"] = gate_forward_checks(lib, cases)
    save("kernel A checked")
    result["gate"] += backward_checks(lib, device, cases)
    save("kernel C checked")
    result["gate_ok"] = all(r["ok"] for r in result["gate"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backward-n", type=int, default=2432, help="tokens of one backward chunk (one_pass_dz's)")
    ap.add_argument("--gate", action="store_true", help="only the GPU session's gate (small and wide heads, no "
                    "Triton, no timing): gate_ok in the JSON")  # fmt: skip
    args = ap.parse_args()
    t0 = time.time()
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(device), "capability": torch.cuda.get_device_capability(device),
              "torch": torch.__version__, "library": str(cutlass.library_path())}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(phase):  # after every phase: a hang or a crash later keeps what was measured
        result["phase"], result["seconds"] = phase, time.time() - t0
        out.write_text(json.dumps(result, indent=1))

    lib = cutlass.load()
    result["loaded"] = lib is not None
    result["why_not"] = cutlass.why_not()
    save("loaded")
    if lib is not None and args.gate:
        gate(lib, save, result)  # an exception exits non-zero: the session reads it as a crash, with its tail
    elif lib is not None:
        try:
            result["checks"] = checks(lib, device) + store_checks(lib, device)
            result["all_checks_ok"] = all(r["ok"] for r in result["checks"])
            save("checked")
            if result["all_checks_ok"]:
                result["timing"] = timings(lib, device, args.n, args.repeats)
                save("timed")
            # kernel C (the backward) is judged on its own: a failure of its checks leaves kernel A's rows standing
            result["backward_checks"] = backward_checks(lib, device)
            result["backward_checks_ok"] = all(r["ok"] for r in result["backward_checks"])
            save("backward checked")
            if result["backward_checks_ok"]:
                result["backward_timing"] = backward_timings(lib, device, args.backward_n, args.repeats)
        except Exception as exc:  # noqa: BLE001 - the session records the failure and goes on
            result["error"] = f"{type(exc).__name__}: {exc}"
    save("done")
    print(json.dumps({k: result.get(k) for k in ("loaded", "why_not", "gate_ok", "all_checks_ok", "backward_checks_ok",
                                                 "error", "seconds") if k in result}))  # fmt: skip
    for r in result.get("gate", []):
        if not r["ok"]:
            print("gate: wrong:", json.dumps(r))
    for part in ("timing", "backward_timing"):
        if part in result:
            print(json.dumps(result[part]["summary"], indent=1))
            for k, r in result[part]["rows"].items():
                print(f"{k:32s} {r['median_ms']:8.3f} ms (p20 {r['p20_ms']:.3f}, p80 {r['p80_ms']:.3f})  {r['tflops']:6.1f} TF/s")


if __name__ == "__main__":
    main()
