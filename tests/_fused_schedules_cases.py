"""Run by tests/test_fused_schedules_interpreter.py in a subprocess with TRITON_INTERPRET=1.

The schedules of issue 23 on the Triton backend: "one_pass_cublas" (forward GEMM by torch.addmm into the
chunk's fp32 logits, statistics by lm_head_fwd_kernel_stats_from_logits), "one_pass_inplace" (grad_weight
accumulated in the weight's dtype in the gradient buffer, once per chunk), "one_pass_cublas_inplace" and
"one_pass_dz_inplace" (dz formed inside the backward GEMMs, grad_weight in place), in fp32, fp16 and bf16
(packed layout, chunks of at most 7 valid tokens: 4 chunks; the gradient buffers start NaN-filled), against the PyTorch
backend run in fp32 on the same (rounded) inputs. Every configuration of test_loss_head.CONFIGS runs once,
its (dtype, schedule) pair taken in turn from the 3 x 4 grid (so each dtype and each schedule meets about
14 configurations; the interpreter needs ~5 s per run); GRID_CONFIGS run the whole grid.

For each run the report carries, per gradient, the worst |got - expected| and the element-wise bound the
test checks it against, computed here from the float32 dL/dlogit of the reference (dz, by autograd through
explicit logits and the loss head): |dz| |X| summed over the tokens (grad_weight), |dz| |W| over the
vocabulary (grad_hidden), |dz| over the tokens (grad_bias). Prints one JSON line.
"""

import json
import os
import sys

import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused

sys.path.insert(0, os.path.dirname(__file__))
from interpreter_runner import nan_fill_uninitialized  # noqa: E402
from test_loss_head import CONFIGS  # noqa: E402

fused.ONE_PASS_CHUNK_TOKENS = 7  # 22 valid tokens below: 4 chunks (sequences cut for token-local objectives)
nan_fill_uninitialized()  # a schedule that read a grad_weight accumulator before writing it fails every check below
SCHEDULES = ("one_pass_cublas", "one_pass_inplace", "one_pass_cublas_inplace", "one_pass_dz_inplace")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TEMPERATURE = 0.8
GRID_CONFIGS = ("entropy_bonus", "grpo")  # every dtype x every schedule (entropy_bonus: the g_H term of dz)


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, v = 24, 203
    lengths = torch.tensor([7, 3, 5, 1, 6])
    n = int(lengths.sum())
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    bias = (torch.randn(v, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    with torch.no_grad():
        lp = gk.fused_linear_logprobs(hidden.float(), weight.float(), targets, bias.float(), backend="torch").logprobs
    old = lp + torch.randn(n, generator=g) * 0.3
    ref = lp + torch.randn(n, generator=g) * 0.2
    rollout = old + torch.randn(n, generator=g) * 0.2
    adv = torch.randn(len(lengths), generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, cu=cu, old=old, ref=ref, rollout=rollout,
                adv=adv, mask=torch.ones(n, dtype=torch.bool))  # fmt: skip


def per_token(cfg, d):
    return dict(ref=d["ref"] if cfg.needs_reference else None,
                rollout=d["rollout"] if cfg.uses_rollout_logprobs else None)  # fmt: skip


def run(cfg, d, backend, schedule, dtype):
    leaves = [d[k].to(dtype).clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    extra = per_token(cfg, d)
    torch.manual_seed(3)  # clip_cov draws a random subset
    out = gk.fused_linear_grpo_loss(
        leaves[0], leaves[1], d["targets"], d["adv"], d["mask"], d["old"], extra["ref"], extra["rollout"],
        bias=leaves[2], config=cfg.replace(temperature=TEMPERATURE), backend=backend, schedule=schedule,
        cu_seqlens=d["cu"],
    )  # fmt: skip
    out.loss.backward()
    return out, [x.grad.float() for x in leaves]


def dz_bounds(cfg, d):
    """|dz| |X| (grad_weight), |dz| |W| (grad_hidden), sum |dz| (grad_bias) from the fp32 reference dz."""
    h, w, b = d["hidden"].float(), d["weight"].float(), d["bias"].float()
    x = (h @ w.T + b).requires_grad_()  # [n, V], pre-temperature logits
    z = x / TEMPERATURE
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(1, d["targets"][:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    extra = per_token(cfg, d)
    torch.manual_seed(3)
    loss = gk.grpo_loss(logp, d["adv"], d["mask"], d["old"], extra["ref"], extra["rollout"], ent,
                        config=cfg.replace(temperature=TEMPERATURE), cu_seqlens=d["cu"], backend="torch").loss  # fmt: skip
    (dz,) = torch.autograd.grad(loss, x)
    a = dz.abs()
    return a.T @ h.abs(), a @ w.abs(), a.sum(0)


def worst(got, expected, bound):
    """The element with the largest |got - expected| / bound: [got, expected, index, bound there, max bound]."""
    diff = (got - expected).abs()
    ratio = diff / bound.clamp(min=1e-30)
    i = int(ratio.reshape(-1).argmax())
    return [got.reshape(-1)[i].item(), expected.reshape(-1)[i].item(), i, bound.reshape(-1)[i].item(),
            bound.max().item()]  # fmt: skip


def bf16_store_rounds_toward_zero() -> bool:
    """Whether this interpreter stores an fp32 value to a bf16 tensor by truncation (round toward zero, an
    error up to one ulp, 2 u) instead of rounding to nearest as a GPU does (triton 3.6's does: numpy has no
    bf16 and the interpreter drops the low 16 bits). The dz slab of the bf16 runs is such a store."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_bf16(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))

    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    y = torch.empty(256, dtype=torch.bfloat16)
    store_bf16[(1,)](x, y, BLOCK=256)
    return bool((y != x.bfloat16()).any()) and bool((y.float().abs() <= x.abs()).all())


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import grpo_kernels.ops.lm_head.triton as lm_triton

    launched, launch = [], lm_triton._launch
    lm_triton._launch = lambda kernel, *args: (launched.append(kernel.__name__), launch(kernel, *args))[1]
    report = {}
    data = {dname: inputs(dtype) for dname, dtype in DTYPES.items()}
    pairs = [(dname, schedule) for schedule in SCHEDULES[::-1] for dname in DTYPES]  # dz_inplace first
    runs = {}  # config -> [(dtype name, schedule)]
    for i, name in enumerate(sorted(CONFIGS)):
        runs[name] = pairs if name in GRID_CONFIGS else [pairs[i % len(pairs)]]
    for name, todo in runs.items():
        cfg = CONFIGS[name]
        for dname in DTYPES:
            schedules = [schedule for dn, schedule in todo if dn == dname]
            if not schedules:
                continue
            d = data[dname]
            rounded = {k: (v.float() if v.is_floating_point() else v) for k, v in d.items()}  # the same values
            ref, g_ref = run(cfg, rounded, "torch", "two_pass", torch.float32)
            bounds = dz_bounds(cfg, rounded) if not cfg.needs_global_statistics else None
            for schedule in schedules:
                case = f"{name}-{dname}-{schedule}"
                launched.clear()
                try:
                    out, g = run(cfg, d, "triton", schedule, DTYPES[dname])
                except ValueError as exc:
                    report[case] = {"refused": str(exc)}
                    continue
                report[case] = {
                    "loss": [out.loss.item(), ref.loss.item()],
                    "logprobs": [float((out.logprobs - ref.logprobs).abs().max()), float(ref.logprobs.abs().max())],
                    "grads": {k: worst(a, b, bd) for k, a, b, bd in zip(("weight", "hidden", "bias"),
                                                                      (g[1], g[0], g[2]), (g_ref[1], g_ref[0], g_ref[2]),
                                                                      bounds)},  # fmt: skip
                    "metrics": {k: [out.metrics[k].item() if k in out.metrics else None, v.item()]
                                for k, v in ref.metrics.items()},
                    "kernels": sorted({k for k in launched if k.startswith("lm_head_fwd")}),
                    "backward_kernels": sorted({k for k in launched if k.startswith("lm_head_bwd")}),
                }
    lm_triton._launch = launch
    # not a case: how this interpreter rounds a bf16 store (the test's bound for the dz slab)
    report["_interpreter"] = {"bf16_store_rounds_toward_zero": bf16_store_rounds_toward_zero()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
