"""Run by tests/test_bad_inputs.py (with TRITON_INTERPRET=1 for the Triton backend): forbidden tokens
(-inf bias) and an all-masked batch, on the backend named in argv[1]. Prints one JSON line."""

import json
import sys

import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C


def main(backend):
    g = torch.Generator().manual_seed(0)
    n, h, v = 12, 16, 97
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 4
    bias = torch.randn(v, generator=g) * 0.3
    forbidden = torch.tensor([3, 40, 41, 96])
    allowed = torch.ones(v, dtype=torch.bool)
    allowed[forbidden] = False
    bias_inf = bias.clone()
    bias_inf[forbidden] = float("-inf")
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.isin(targets, forbidden)] = 5  # the sampled tokens are allowed ones
    out = {}
    # log-probs / entropy with forbidden tokens = the same head without those rows
    x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias_inf))
    lp = gk.fused_linear_logprobs(x, w, targets, b, backend=backend)
    (lp.logprobs.sum() + 0.5 * lp.entropy.sum()).backward()
    x2, w2, b2 = (t.clone().requires_grad_() for t in (hidden, weight[allowed], bias[allowed]))
    remap = torch.cumsum(allowed.long(), 0) - 1
    ref = gk.fused_linear_logprobs(x2, w2, remap[targets], b2, backend="torch")
    (ref.logprobs.sum() + 0.5 * ref.entropy.sum()).backward()
    diff = lambda a, c: float((a - c).abs().max())  # noqa: E731
    out["logprobs"] = diff(lp.logprobs, ref.logprobs)
    out["entropy"] = diff(lp.entropy, ref.entropy)
    out["grad_hidden"] = diff(x.grad, x2.grad)
    out["grad_weight_allowed"] = diff(w.grad[allowed], w2.grad)
    out["grad_weight_forbidden"] = float(w.grad[forbidden].abs().max())
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in (lp.logprobs, lp.entropy, x.grad, w.grad))
    # fused loss with an entropy bonus
    x, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias_inf))
    adv = torch.randn(3, generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    loss = gk.fused_linear_grpo_loss(x.view(3, 4, h), w, targets.view(3, 4), adv, mask, bias=b,
                                     config=C.dapo(entropy_coef=0.01), backend=backend)  # fmt: skip
    loss.loss.backward()
    out["loss_finite"] = bool(torch.isfinite(loss.loss)) and all(
        bool(torch.isfinite(t).all()) for t in (x.grad, w.grad)
    )
    # an all-masked batch: loss 0, zero gradients, every metric defined
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    empty = gk.fused_linear_grpo_loss(x.view(3, 4, h), w, targets.view(3, 4), adv, torch.zeros(3, 4, dtype=torch.bool),
                                      torch.zeros(3, 4), config=C.dapo(), backend=backend)  # fmt: skip
    empty.loss.backward()
    out["empty_loss"] = float(empty.loss)
    out["empty_metrics"] = {k: float(v) for k, v in empty.metrics.items()}
    out["empty_grads_zero"] = bool((x.grad == 0).all() and (w.grad == 0).all())
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
