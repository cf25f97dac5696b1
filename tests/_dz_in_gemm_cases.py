"""Run by tests/test_dz_in_gemm_interpreter.py in a subprocess with TRITON_INTERPRET=1.

lm_head_backward with the forward's stored logits, two ways: the dz slab (lm_head_bwd_kernel_dlogits
writes dz in the operand dtype, the GEMMs read it) and dz_in_gemm (two Triton GEMMs form dz in their
operand loads). For each case and gradient, the largest ratio |slab - fused| / bound over the elements,
where the bound is derived from the two computations (see the test's docstring). Prints one JSON line.
"""

import json
import os

import torch
from interpreter_runner import wanted

from grpo_kernels.ops.lm_head import cutlass
from grpo_kernels.ops.lm_head import triton as tri

UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def dz_magnitude(z, lse, mean_z, c_lp, c_h, targets, softcap):
    """An upper bound of |dz| per element in float64: p (|c_H| |E[z] - z| + |c_lp|) + |c_lp| 1[j = y],
    times cap_in cap_out with a soft-cap (|1 - tanh^2| <= 1)."""
    z = z.double()
    p = torch.exp(z - lse.double()[:, None])
    mag = p * (c_h.double().abs()[:, None] * (mean_z.double()[:, None] - z).abs() + c_lp.double().abs()[:, None])
    mag[torch.arange(z.shape[0]), targets] += c_lp.double().abs()
    if softcap is not None:
        mag = mag * softcap[0] * softcap[1]
    return mag


def stored_case(seed, dtype, n, h, v, temperature, *, bias, cap):
    """Operands, kernel A's fp16 store (HalfLogits) and its statistics, and upstream gradients of one case:
    (args of lm_head_backward, the store, stats)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    half = tri.HalfLogits.empty(n, v, "cpu")
    stats = tri.lm_head_forward(x, w, b, y, temperature, logits_out=half, softcap=cap)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return (x, w, b, y, temperature, stats.lse, stats.expected_logit, g_lp, g_h), half, stats


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    report, index = {}, -1
    n, h, v, temperature = 37, 48, 131, 0.7  # odd sizes: every tile edge of the 32 x 64 x 32 interpreter tiles
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bias_on in (False, True):
            for grads in ("both", "logprobs", "entropy"):
                for capped in (False, True):
                    index += 1  # the case's seed: its place in the grid, whichever cases run
                    name = f"{str(dtype).removeprefix('torch.')}-{'bias' if bias_on else 'nobias'}-{grads}" + (
                        "-softcap" if capped else "")  # fmt: skip
                    if not wanted(name):
                        continue
                    g = torch.Generator().manual_seed(index)
                    x = torch.randn(n, h, generator=g).to(dtype)
                    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
                    b = torch.randn(v, generator=g).to(dtype) if bias_on else None
                    y = torch.randint(0, v, (n,), generator=g)
                    cap = (1.0 / 30.0, 30.0 / temperature) if capped else None
                    logits = torch.empty(n, v + 5)[:, :v]  # a row stride that is not V
                    stats = tri.lm_head_forward(x, w, b, y, temperature, logits_out=logits, softcap=cap)
                    g_lp = torch.randn(n, generator=g) if grads in ("both", "logprobs") else None
                    g_h = torch.randn(n, generator=g) if grads in ("both", "entropy") else None
                    for upstream in (g_lp, g_h):
                        if upstream is not None:
                            upstream[3] = 0.0  # a row whose upstream gradient is 0: dz exactly 0 there
                    args = (x, w, b, y, temperature, stats.lse, stats.expected_logit, g_lp, g_h)
                    slab = tri.lm_head_backward(*args, stored_logits=logits, softcap=cap)
                    fused = tri.lm_head_backward(*args, stored_logits=logits, softcap=cap, dz_in_gemm=True)
                    zeros = torch.zeros(n)
                    inv_t = 1.0 / temperature if cap is None else 1.0
                    mag = dz_magnitude(logits, stats.lse, stats.expected_logit,
                                       (g_lp if g_lp is not None else zeros) * inv_t,
                                       (g_h if g_h is not None else zeros) * inv_t, y, cap)  # fmt: skip
                    u_op, u32 = UNIT[dtype], UNIT[torch.float32]
                    entry = {}
                    # grad_hidden = dz W: both round dz to the operand dtype (at most u_op |dz| apart), sum
                    # V products in fp32 in different orders (2 V u32 of the absolute sum), and round the
                    # result to the hidden dtype (one unit of each)
                    absolute = mag @ w.double().abs()
                    bound = (u_op + 2 * v * u32) * absolute + 2 * u_op * torch.maximum(
                        slab[0].double().abs(), fused[0].double().abs())  # fmt: skip
                    diff = (slab[0].double() - fused[0].double()).abs()
                    entry["grad_hidden"] = (diff / bound.clamp(min=1e-300)).max().item()
                    # grad_weight += dz^T X in fp32 (no final rounding): n products per element
                    absolute = mag.T @ x.double().abs()
                    bound = (u_op + 2 * n * u32) * absolute
                    diff = (slab[1].double() - fused[1].double()).abs()
                    entry["grad_weight"] = (diff / bound.clamp(min=1e-300)).max().item()
                    if bias_on:  # the same kernel sums the bias gradient in both: identical
                        entry["grad_bias_equal"] = bool(torch.equal(slab[2], fused[2]))
                    entry["zero_row_hidden"] = float(fused[0][3].abs().max()) if grads == "both" else 0.0
                    report[name] = entry
    # csrc's kernel C contract: triton.lm_head_backward(dz_in_gemm=True) with `dz_gemms` = the torch spec of
    # csrc's kernels (cutlass.dz_gemms_reference, what the csrc launcher is handed) against the Triton dz
    # kernels, on kernel A's fp16 store, both adding into fp32 accumulators (grad_hidden_acc, grad_weight_acc)
    for dtype in (torch.float16, torch.bfloat16):
        for capped in (False, True):
            index += 1
            name = f"csrc-{str(dtype).removeprefix('torch.')}-bias-both" + ("-softcap" if capped else "")
            if not wanted(name):
                continue
            cap = (1.0 / 30.0, 30.0 / temperature) if capped else None
            args, half, stats = stored_case(index, dtype, n, h, v, temperature, bias=True, cap=cap)
            x, w, _, y, _, _, _, g_lp, g_h = args
            g_lp[3] = g_h[3] = 0.0  # a token without upstream gradient (the tensors args holds)
            runs = []
            for hook in (None, cutlass.dz_gemms_reference):
                acc_h, acc_w = torch.full((n, h), 0.5), torch.full((v, h), -0.25)
                runs.append(tri.lm_head_backward(*args, stored_logits=half, softcap=cap, dz_in_gemm=True,
                                                 grad_hidden_acc=acc_h, grad_weight_acc=acc_w, dz_gemms=hook))
            triton_run, spec_run = runs
            inv_t = 1.0 / temperature if cap is None else 1.0
            mag = dz_magnitude(half.reconstruct(), stats.lse, stats.expected_logit, g_lp * inv_t, g_h * inv_t, y, cap)
            # the interpreter casts fp32 to bf16 by truncation (checked: every element of a random draw equals
            # the truncated value), the spec (torch) and the GPU round to nearest: the same dz may then be one bf16
            # ulp (2 u) apart; fp16's cast rounds to nearest in both
            u_op = 2 * UNIT[dtype] if dtype == torch.bfloat16 else UNIT[dtype]
            u32 = UNIT[torch.float32]
            entry = {}
            # the same dz rounded to the operand (u_op apart at most), fp32 sums of K products in two orders,
            # each result added to the same fp32 accumulator (one rounding each)
            for i, (grad, operand, k) in enumerate((("grad_hidden", w, v), ("grad_weight", x, n))):
                absolute = (mag @ operand.double().abs()) if i == 0 else (mag.T @ operand.double().abs())
                a, c = triton_run[i].double(), spec_run[i].double()
                bound = (u_op + 2 * k * u32) * absolute + 2 * u32 * torch.maximum(a.abs(), c.abs())
                entry[grad] = ((a - c).abs() / bound.clamp(min=1e-300)).max().item()
            entry["grad_bias_equal"] = bool(torch.equal(triton_run[2], spec_run[2]))
            entry["zero_row_hidden"] = float((spec_run[0][3] - 0.5).abs().max())
            report[name] = entry
    # grad_weight summed in place (schedule="one_pass_dz_inplace"): the accumulator is the gradient buffer in the
    # operands' dtype. Both the Triton kernel and the spec must equal their own fp32-accumulator run with that
    # fp32 result rounded once: to nearest (torch, a GPU), or for the interpreter's bf16 stores toward zero
    for dtype in (torch.float16, torch.bfloat16):
        index += 1
        name = f"inplace-{str(dtype).removeprefix('torch.')}"
        if not wanted(name):
            continue
        args, half, _ = stored_case(index, dtype, n, h, v, temperature, bias=False, cap=None)
        # a gradient buffer already holding earlier chunks' sums, of the size of one chunk's contribution
        start = (torch.randn(v, h, generator=torch.Generator().manual_seed(index + 1000)) * 0.05).to(dtype)
        entry = {}
        for who, hook in (("triton", None), ("spec", cutlass.dz_gemms_reference)):
            wide, narrow = start.float(), start.clone()
            for acc in (wide, narrow):
                tri.lm_head_backward(*args, stored_logits=half, dz_in_gemm=True, need_grad_hidden=False,
                                     grad_weight_acc=acc, dz_gemms=hook)  # fmt: skip
            nearest = wide.to(dtype)
            toward_zero = (wide.view(torch.int32) & -65536).view(torch.float32).to(dtype) \
                if dtype == torch.bfloat16 and who == "triton" else nearest  # fmt: skip
            mismatch = (narrow != nearest) & (narrow != toward_zero)
            entry[f"{who}_mismatches"] = int(mismatch.sum())
            entry[f"{who}_changed"] = float((narrow != start).float().mean())
            if mismatch.any():
                i = int(mismatch.reshape(-1).nonzero()[0])
                entry[f"{who}_first_mismatch"] = [i, float(narrow.reshape(-1)[i]), float(wide.reshape(-1)[i])]
        report[name] = entry
    # the first chunk's call (accumulate_grad_weight=False): grad_weight_acc's content is neither read nor kept,
    # so a NaN-filled buffer ends exactly where the same call adding into zeros ends (0 + s = s in fp32, and
    # rounded once to the same 16-bit value in place); through the dz GEMMs (Triton, and csrc's spec for
    # 16-bit operands) and through the dz slab's cuBLAS GEMM (beta = 0); with no upstream gradient, zeros
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        index += 1
        args, half, _ = stored_case(index, dtype, n, h, v, temperature, bias=False, cap=None)
        store = half if dtype != torch.float32 else None
        if store is None:  # fp32 inputs: kernel A keeps fp32 logits
            store = torch.empty(n, v)
            tri.lm_head_forward(*args[:5], logits_out=store)
        runs = [("dz-triton", dict(dz_in_gemm=True)), ("slab", {})]
        if dtype != torch.float32:
            runs.append(("dz-spec", dict(dz_in_gemm=True, dz_gemms=cutlass.dz_gemms_reference)))
        for acc_dtype in {torch.float32, dtype}:
            for path, kwargs in runs:
                name = "-".join(("overwrite", str(dtype).removeprefix("torch."), path, "acc",
                                 str(acc_dtype).removeprefix("torch.")))  # fmt: skip
                if not wanted(name):
                    continue
                fresh = torch.full((v, h), float("nan"), dtype=acc_dtype)
                added = torch.zeros((v, h), dtype=acc_dtype)
                for acc, accumulate in ((fresh, False), (added, True)):
                    tri.lm_head_backward(*args, stored_logits=store, need_grad_hidden=False, grad_weight_acc=acc,
                                         accumulate_grad_weight=accumulate, **kwargs)  # fmt: skip
                silent = torch.full((v, h), float("nan"), dtype=acc_dtype)
                tri.lm_head_backward(*args[:7], None, None, stored_logits=store, need_grad_hidden=False,
                                     grad_weight_acc=silent, accumulate_grad_weight=False, **kwargs)  # fmt: skip
                report[name] = dict(nan=int(fresh.isnan().sum()), mismatches=int((fresh != added).sum()),
                                    nonzero=float((added != 0).float().mean()),
                                    no_upstream_nonzero=int((silent != 0).sum()))  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
