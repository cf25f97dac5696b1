"""Run by tests/test_softcap.py with TRITON_INTERPRET=1: the Triton backend with a logit scale and a soft
cap against the PyTorch backend (checked against the float64 reference in test_softcap.py):
fused_linear_logprobs forward and every gradient, and fused_linear_grpo_loss in every schedule.
fp32 inputs. Prints one JSON line: check -> [got, expected, flat index, scale of expected]."""

import json

import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused
from grpo_kernels import PolicyLossConfig as C

fused.ONE_PASS_CHUNK_TOKENS = 7
fused.LOW_MEMORY_SLAB_BYTES = 1


def worst(a, b):
    diff = (a.double() - b.double()).abs().reshape(-1)
    i = int(diff.argmax())
    return [a.reshape(-1)[i].item(), b.reshape(-1)[i].item(), i, b.abs().max().item()]


def main():
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 4, 7, 24, 203
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 4
    bias = torch.randn(v, generator=g) * 0.5
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = torch.arange(t)[None, :] < torch.tensor([7, 3, 5, 6])[:, None]
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g) * 4
    report = {}
    for cap, scale in ((3.0, 1.0), (2.0, 0.5)):
        key = f"cap{cap}-scale{scale}"
        res = {}
        for backend in ("torch", "triton"):
            x, w, bb = (z.clone().requires_grad_() for z in (hidden, weight, bias))
            out = gk.fused_linear_logprobs(x, w, targets, bb, 0.8, mask=mask, softcap=cap, logit_scale=scale,
                                           backend=backend)  # fmt: skip
            (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
            res[backend] = (out.logprobs, out.entropy, x.grad, w.grad, bb.grad)
        for name, a, e in zip(("logprobs", "entropy", "grad_hidden", "grad_weight", "grad_bias"), res["triton"], res["torch"]):
            report[f"{key}/logprobs_fn/{name}"] = worst(a, e)
        # one_pass_cublas: the streaming statistics kernel applies the soft-cap to the cuBLAS output and writes z back
        for schedule in ("one_pass", "two_pass", "low_memory", "one_pass_cublas"):
            runs = {}
            for backend, sched in (("torch", "two_pass"), ("triton", schedule)):
                x, w, bb = (z.clone().requires_grad_() for z in (hidden, weight, bias))
                out = gk.fused_linear_grpo_loss(x, w, targets, adv, mask, old, bias=bb,
                                                config=C.dapo(entropy_coef=0.01, temperature=0.7), softcap=cap,
                                                logit_scale=scale, backend=backend, schedule=sched)  # fmt: skip
                out.loss.backward()
                runs[backend] = (out.loss, out.logprobs, x.grad, w.grad, bb.grad)
            for name, a, e in zip(("loss", "logprobs", "grad_hidden", "grad_weight", "grad_bias"), runs["triton"], runs["torch"]):
                report[f"{key}/{schedule}/{name}"] = worst(a, e)
    # the TMA kernel A with the soft-cap: log-probs and the one-pass schedule (logits stored by TMA)
    import grpo_kernels.ops.lm_head.triton as lm_triton

    launched, launch = [], lm_triton._launch
    lm_triton._launch = lambda kernel, *args: (launched.append(kernel.__name__), launch(kernel, *args))[1]
    cap, scale = 3.0, 0.5
    with lm_triton.use_forward_kernel("tma"):
        for fn in ("logprobs_fn", "one_pass"):
            runs = {}
            for backend in ("torch", "triton"):
                x, w, bb = (z.clone().requires_grad_() for z in (hidden, weight, bias))
                if fn == "logprobs_fn":
                    out = gk.fused_linear_logprobs(x, w, targets, bb, 0.8, mask=mask, softcap=cap, logit_scale=scale,
                                                   backend=backend)  # fmt: skip
                    (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
                    runs[backend] = (out.logprobs, out.entropy, x.grad, w.grad, bb.grad)
                else:
                    out = gk.fused_linear_grpo_loss(x, w, targets, adv, mask, old, bias=bb,
                                                    config=C.dapo(entropy_coef=0.01, temperature=0.7), softcap=cap,
                                                    logit_scale=scale, backend=backend,
                                                    schedule="two_pass" if backend == "torch" else "one_pass")  # fmt: skip
                    out.loss.backward()
                    runs[backend] = (out.loss, out.logprobs, x.grad, w.grad, bb.grad)
            names = ("logprobs", "entropy") if fn == "logprobs_fn" else ("loss", "logprobs")
            for name, a, e in zip(names + ("grad_hidden", "grad_weight", "grad_bias"), runs["triton"], runs["torch"]):
                report[f"tma-cap{cap}-scale{scale}/{fn}/{name}"] = worst(a, e)
    lm_triton._launch = launch
    report["forward_kernels"] = sorted({n for n in launched if n.startswith("lm_head_fwd_kernel_partial")})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
