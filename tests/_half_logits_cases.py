"""Run by tests/test_half_logits_interpreter.py in a subprocess with TRITON_INTERPRET=1.

Kernel A's stored logits as fp16 differences from the running row max (HalfLogits) against the fp32 store
they replace, both against float64 autograd of the same formula on the same (dtype-rounded) inputs, and
against PyTorch's own half-precision path (logits in the input dtype from one GEMM, log-softmax and entropy
in fp32, autograd back through the GEMM). Per case and gradient: the error as max |g - g64| / max |g64|
(normwise, the scale the optimizer sees), for the fp32 store, the half store (slab and dz-in-GEMM) and
PyTorch; plus, for the half store, the largest error of the reconstructed logits as a ratio to its derived
bound, and whether a forbidden token's reconstructed logit lies far enough below the row's lse for p = 0.
Prints one JSON line.
"""

import dataclasses
import json
import os

import torch
from interpreter_runner import wanted

from grpo_kernels.ops.lm_head import triton as tri

# Scaled down from the benchmark's head (Qwen3-8B: H = 4096, V = 151936, logits spread over ~30 nats with a
# peaked target on many rows): H = 64 and V = 4099 (a ragged last tile and group), logits of standard
# deviation ~3 and a third of the rows with their target raised ~12 above the rest.
N, H, V = 48, 64, 4099
CASES = [
    ("bfloat16", False, 1.0, None),
    ("bfloat16", True, 0.7, None),
    ("bfloat16", False, 1.0, (1.0 / 30.0, 30.0)),
    ("float16", False, 1.0, None),
    ("float16", True, 0.7, None),
]


def case_name(dtype, bias, temperature, cap):
    return f"{dtype}-{'bias' if bias else 'nobias'}-T{temperature}" + ("-softcap" if cap else "")


def finite_bias(b):
    """A -inf bias (a forbidden token) as -1e4: p = 0 all the same, and autograd's p log p stays 0, not NaN."""
    return None if b is None else b.clamp(min=-1e4)


def float64_truth(x, w, b, y, temperature, cap, g_lp, g_h):
    """float64 autograd of sum(g_lp logp_y + g_H H) on the inputs as given (already rounded to their dtype)."""
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    z = x64 @ w64.T + (0.0 if b is None else finite_bias(b).double())
    z = cap[1] * torch.tanh(cap[0] * z) / temperature if cap else z / temperature
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = (g_lp.double() * logp.gather(1, y[:, None]).squeeze(1) + g_h.double() * entropy).sum()
    return torch.autograd.grad(loss, (x64, w64))


def torch_half_path(x, w, b, y, temperature, cap, g_lp, g_h):
    """What a model in the input dtype does: the logits GEMM in that dtype, statistics in fp32."""
    xh = x.clone().requires_grad_(True)
    wh = w.clone().requires_grad_(True)
    z = (xh @ wh.T + (0.0 if b is None else finite_bias(b))).float()
    z = cap[1] * torch.tanh(cap[0] * z) / temperature if cap else z / temperature
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = (g_lp * logp.gather(1, y[:, None]).squeeze(1) + g_h * entropy).sum()
    return torch.autograd.grad(loss, (xh, wh))


def normwise(got, truth):
    return ((got.double() - truth).abs().max() / truth.abs().max()).item()


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    report = {}
    for index, (dtype_name, bias_on, temperature, cap) in enumerate(CASES):
        name = case_name(dtype_name, bias_on, temperature, cap)
        if not wanted(name):
            continue
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(index)
        x = torch.randn(N, H, generator=g)
        w = torch.randn(V, H, generator=g) * (3.0 / H**0.5)  # logits of standard deviation ~3
        y = torch.randint(0, V, (N,), generator=g)
        peaked = torch.arange(N) % 3 == 0
        w[y[peaked]] += 12.0 * x[peaked] / x[peaked].pow(2).sum(-1, keepdim=True)  # z_y raised by ~12
        x, w = x.to(dtype), w.to(dtype)
        b = None
        if bias_on:
            b = torch.randn(V, generator=g).to(dtype)
            b[7] = float("-inf")  # a forbidden token: p = 0 in both stores
        g_lp = torch.randn(N, generator=g)
        g_h = torch.randn(N, generator=g)
        g_lp[5] = g_h[5] = 0.0  # a row without upstream gradient: exactly 0
        softcap = None if cap is None else (cap[0], cap[1] / temperature)
        fp32_store = torch.empty(N, V)
        half_store = tri.HalfLogits.empty(N, V, "cpu")
        stats32 = tri.lm_head_forward(x, w, b, y, temperature, logits_out=fp32_store, softcap=softcap)
        stats16 = tri.lm_head_forward(x, w, b, y, temperature, logits_out=half_store, softcap=softcap)
        entry = {"stats_equal": all(torch.equal(a, c) for a, c in zip(stats32, stats16))}
        # the reconstruction z = m + d against the fp32 z, as a ratio to its bound: fp16's rounding of d, at
        # most 2^-11 |d| <= 2^-11 (lse - z) (m is a running max, <= lse), plus fp32's of z - m and of m + d
        m = half_store.offset.repeat_interleave(tri.STORED_GROUP, dim=1)[:, :V]
        z16 = half_store.reconstruct()
        live = fp32_store > -1e30  # not a forbidden token (NEG_BIG): those are clamped, checked below
        bound = 2.0**-11 * (stats32.lse[:, None] - fp32_store) + 2.0**-23 * (fp32_store.abs() + m.abs())
        entry["reconstruction"] = ((z16 - fp32_store).abs() / bound)[live].max().item()
        entry["forbidden_below"] = bool(b is None or (z16[:, 7] - stats32.lse).max().item() < -60000.0)
        args = (x, w, b, y, temperature, stats32.lse, stats32.expected_logit, g_lp, g_h)
        truth = float64_truth(x, w, b, y, temperature, cap, g_lp, g_h)
        runs = {
            "fp32_store": tri.lm_head_backward(*args, stored_logits=fp32_store, softcap=softcap, need_grad_bias=False),
            "half_store": tri.lm_head_backward(*args, stored_logits=half_store, softcap=softcap, need_grad_bias=False),
            "half_store_dz_in_gemm": tri.lm_head_backward(*args, stored_logits=half_store, softcap=softcap,
                                                          need_grad_bias=False, dz_in_gemm=True),  # fmt: skip
            "torch": torch_half_path(x, w, b, y, temperature, cap, g_lp, g_h),
        }
        # the backward's tiles wider than one offset group (128 columns, as on a GPU; the interpreter's are
        # 32 / 64 wide, one group each): the [rows, C / 64] offset load broadcast over each group's columns
        wide = dataclasses.replace(tri.pick_config(x.device, dtype, True), name="wide-backward",
                                   backward=tri.TileConfig(128, 128, 128, 2, num_warps=4, num_stages=1))  # fmt: skip
        for dz_in_gemm in (False, True):
            runs[f"half_store_wide_tiles{'_dz_in_gemm' if dz_in_gemm else ''}"] = tri.lm_head_backward(
                *args, stored_logits=half_store, softcap=softcap, need_grad_bias=False, config=wide,
                dz_in_gemm=dz_in_gemm)  # fmt: skip
        for run, grads in runs.items():
            entry[run] = {"grad_hidden": normwise(grads[0], truth[0]), "grad_weight": normwise(grads[1], truth[1])}
            if run.startswith("half"):
                entry[run]["zero_row"] = float(grads[0][5].abs().max())
        report[name] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
