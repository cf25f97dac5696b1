"""Autograd Function for the Triton loss head: the kernel computes the loss and its gradients
w.r.t. log-probs and entropy in the forward; backward scales them by grad_output."""

from __future__ import annotations

import torch


class LossHeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, entropy, run, metrics_out: dict):
        # run(need_grad_logprobs, need_grad_entropy) -> (loss, metrics, grad_logprobs, grad_entropy, partials)
        need_lp = ctx.needs_input_grad[0]
        need_ent = entropy is not None and ctx.needs_input_grad[1]
        loss, metrics, g_lp, g_ent, _ = run(need_lp, need_ent)
        metrics_out.update(metrics)
        ctx.save_for_backward(g_lp, g_ent)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        g_lp, g_ent = ctx.saved_tensors
        scale = grad_output.float()
        return (
            None if g_lp is None else g_lp * scale,
            None if g_ent is None else g_ent * scale,
            None,
            None,
        )
