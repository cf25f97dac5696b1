"""Run by tests/test_edges.py with TRITON_INTERPRET=1: numbers at the edges on both backends, against
float64. Prints one JSON line.

  softcap   log-probs and entropy for soft caps 1 ... 1e36 (and logit scales 1e-3 ... 1e3), each backend's
            worst |error| against the float64 reference, with the largest |z| of the batch (the scale of
            the tolerance), fp32 inputs
  forbidden a row whose every token is forbidden (bias -inf everywhere, check_finite=False): the values and
            gradients of both backends
  fp16_dz   fp16 inputs whose dL/dz entries lie below fp16's smallest subnormal (a tiny upstream gradient):
            grad_hidden / grad_weight of both backends against float64 (worst error / largest element,
            and the share of entries that came back exactly 0 where float64's is not)
"""

import json
import math

import torch

import grpo_kernels as gk
from grpo_kernels.ops.lm_head.reference import lm_head_stats_reference

CAPS = [1.0, 10.0, 1e2, 1e3, 1e4, 1e6, 1e8, 1e10, 1e15, 1e20, 1e25, 1e30, 1e35]
SCALES = [1e-3, 1.0, 1e3]
FP16_UPSTREAM = [1.0, 1e-3, 1e-5]  # upstream gradient scales: dz entries near, below fp16's subnormals


def batch(n=16, h=32, v=203, seed=0, dtype=torch.float32, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * spread / h**0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


def softcap_sweep():
    hidden, weight, bias, targets = batch()
    out = {}
    for scale in SCALES:
        for cap in CAPS:
            temperature = 0.8
            ref = lm_head_stats_reference(hidden, weight, targets, bias, temperature, softcap=cap, logit_scale=scale)
            x = (hidden @ weight.T + bias) * scale
            z_max = float((cap * torch.tanh(x / cap) / temperature).abs().max())
            row = {"z_max": z_max}
            for backend in ("torch", "triton"):
                try:
                    got = gk.fused_linear_logprobs(hidden.float(), weight.float(), targets, bias.float(), temperature,
                                                   softcap=cap, logit_scale=scale, backend=backend)  # fmt: skip
                except ValueError as error:  # a limit (the test checks that only the limits refuse)
                    row[backend] = str(error)
                    continue
                row[backend] = [float((got.logprobs.double() - ref.logprobs).abs().max()),
                                float((got.entropy.double() - ref.entropy).abs().max())]  # fmt: skip
            out[f"scale={scale:g},cap={cap:g}"] = row
    return out


def forbidden_row():
    hidden, weight, _, targets = batch(n=9, v=203)
    bias = torch.full((203,), float("-inf"))
    res = {}
    for backend in ("torch", "triton"):
        x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        got = gk.fused_linear_logprobs(x, w, targets, bias, 1.0, check_finite=False, backend=backend)
        (got.logprobs.sum() + 0.5 * got.entropy.sum()).backward()
        res[backend] = {"logprobs": got.logprobs.tolist(), "entropy": got.entropy.tolist(),
                        "grad_hidden": x.grad.reshape(-1).tolist(), "grad_weight": w.grad.reshape(-1).tolist()}  # fmt: skip
    res["log_v"] = math.log(203)
    return res


def fp16_dz(grad_scale):
    """dz = grad_scale x (softmax terms): with grad_scale 1e-9 most entries are below fp16's 6e-8."""
    hidden, weight, bias, targets = batch(n=24, h=32, v=203, seed=1)
    upstream = torch.randn(24, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * grad_scale
    h64, w64 = hidden.half().double().requires_grad_(), weight.half().double().requires_grad_()
    ref = lm_head_stats_reference(h64, w64, targets, None, 1.0)
    (ref.logprobs * upstream).sum().backward()
    res = {}
    for backend in ("torch", "triton"):
        x, w = hidden.half().requires_grad_(), weight.half().requires_grad_()
        got = gk.fused_linear_logprobs(x, w, targets, None, 1.0, compute_entropy=False, backend=backend)
        (got.logprobs * upstream.float()).sum().backward()
        row = {}
        for name, a, e in (("grad_hidden", x.grad, h64.grad), ("grad_weight", w.grad, w64.grad)):
            a = a.double()
            scale = float(e.abs().max())
            representable = e.abs() >= 2.0**-24  # fp16's smallest subnormal: the output dtype can hold it
            row[name] = {"worst_over_largest": float((a - e).abs().max()) / scale,
                         "zeroed": float(((a == 0) & representable).double().sum() / representable.double().sum()),
                         "largest": scale}  # fmt: skip
        res[backend] = row
    return res


def main():
    print(json.dumps({"softcap": softcap_sweep(), "forbidden": forbidden_row(),
                      "fp16_dz": {f"{g:g}": fp16_dz(g) for g in FP16_UPSTREAM}}))  # fmt: skip


if __name__ == "__main__":
    main()
