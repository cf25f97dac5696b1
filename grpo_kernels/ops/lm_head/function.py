"""Autograd Function for the LM-head statistics: forward is kernel A, backward is kernel C (recompute).

Inputs are already validated and compacted to the valid rows by the functional layer
(grpo_kernels.functional.fused_linear_logprobs). `impl` is a module with lm_head_forward /
lm_head_backward (chunked.py for PyTorch, triton.py for the Triton kernels).
"""

from __future__ import annotations

import torch


class LMHeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, impl, compute_entropy: bool):
        # hidden [N, H], weight [V, H], bias [V] | None, targets [N] int64. Autocast off: the tiles
        # accumulate in fp32 by construction, an active autocast would round them to half precision.
        with torch.autocast(hidden.device.type, enabled=False):
            # an impl may have entry points of its own for this function (triton.py: its logits GEMM choice)
            stats = getattr(impl, "logprobs_forward", impl.lm_head_forward)(hidden, weight, bias, targets, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, stats.lse, stats.expected_logit)
        ctx.temperature = temperature
        ctx.impl = impl
        # An output nobody differentiates arrives as None in backward (e.g. entropy only logged).
        ctx.set_materialize_grads(False)
        entropy = stats.entropy if compute_entropy else None
        if entropy is None:
            return stats.logprobs, None
        return stats.logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, expected_logit = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            backward = getattr(ctx.impl, "logprobs_backward", ctx.impl.lm_head_backward)
            grad_hidden, grad_weight, grad_bias = backward(
                hidden, weight, bias, targets, ctx.temperature, lse, expected_logit, grad_logprobs, grad_entropy,
                need_grad_hidden=need_h, need_grad_weight=need_w, need_grad_bias=need_b,
            )  # fmt: skip
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # fp32 accumulator, cast once
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
