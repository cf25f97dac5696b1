"""fused_linear_grpo_loss: gradients computed inside the forward, backward only scales them.

Schedule (DESIGN.md §1), on the compacted valid rows [Nv, H]:
  A  LM-head statistics of every valid token (log-prob, entropy, lse, E_p[z]; no logits kept)
  B  the loss head on the per-token values -> loss, metrics, g_lp = dL/dlogp, g_H = dL/dH
  C  LM-head gradients from (g_lp, g_H), logits recomputed tile by tile; grad_weight in fp32
This is the two-pass form (4 GEMM units); it is exact for every variant, including those that need
batch-global statistics. The chunked one-pass form (3 units) is chosen by the Triton backend when
valid and gives the same result.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("grpo_kernels")


class _Saved:
    """What the forward leaves for the backward: the gradients, already computed."""

    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_rows, weight, bias, loss, saved: _Saved):
        # the loss was computed by fused_grpo_forward; this node only carries its gradients
        ctx.saved = saved
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_output):
        s = ctx.saved

        def scale(g):
            if g is None:
                return None
            if torch.equal(grad_output, torch.ones_like(grad_output)):
                return g
            return (g.float() * grad_output.float()).to(g.dtype)

        return scale(s.grad_hidden), scale(s.grad_weight), scale(s.grad_bias), None, None


def fused_grpo_forward(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl, loss_head):
    """Returns (loss, metrics, logprobs [N], entropy [N]); loss is differentiable w.r.t. hidden,
    weight and bias when they require grad and grad mode is on."""
    valid = batch.valid
    n_tokens = valid.shape[0]
    all_valid = bool(valid.all())
    rows = None if all_valid else valid.nonzero().squeeze(-1)
    hidden_rows = flat_hidden if all_valid else flat_hidden.index_select(0, rows)  # [Nv, H]
    targets_rows = (flat_targets if all_valid else flat_targets.index_select(0, rows)).long()
    temperature = float(cfg.temperature)

    # A: statistics of the valid rows
    stats = lm_impl.lm_head_forward(hidden_rows.detach(), weight.detach(),
                                    None if bias is None else bias.detach(), targets_rows, temperature)  # fmt: skip

    def to_tokens(x):  # [Nv] -> [N], 0 on masked tokens
        if all_valid:
            return x
        return torch.zeros(n_tokens, dtype=x.dtype, device=x.device).index_put((rows,), x)

    logprobs = to_tokens(stats.logprobs)
    entropy = to_tokens(stats.entropy)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (flat_hidden, weight, bias)
    )
    # B: the loss head on leaves, so autograd gives dL/dlogp and dL/dH per token
    lp_leaf = logprobs.clone().requires_grad_(needs_grad)
    ent_leaf = entropy.clone().requires_grad_(needs_grad and cfg.entropy_coef > 0)
    with torch.enable_grad():
        out = loss_head(lp_leaf, ent_leaf)
    logger.debug(
        "fused_linear_grpo_loss: two-pass schedule (LM head: %s, %d of %d tokens valid)",
        lm_impl.__name__, hidden_rows.shape[0], n_tokens,
    )
    if not needs_grad:
        return out.loss.detach(), out.metrics, logprobs, entropy

    leaves = [lp_leaf] + ([ent_leaf] if ent_leaf.requires_grad else [])
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    g_lp = grads[0]
    g_ent = grads[1] if len(grads) > 1 else None

    def to_rows(g):
        if g is None:
            return None
        return g if all_valid else g.index_select(0, rows)

    # C: LM-head gradients, logits recomputed
    saved = _Saved()
    grad_hidden, grad_weight, grad_bias = lm_impl.lm_head_backward(
        hidden_rows.detach(), weight.detach(), None if bias is None else bias.detach(), targets_rows, temperature,
        stats.lse, stats.expected_logit, to_rows(g_lp), to_rows(g_ent),
        need_grad_hidden=flat_hidden.requires_grad, need_grad_weight=weight.requires_grad,
        need_grad_bias=bias is not None and bias.requires_grad,
    )  # fmt: skip
    saved.grad_hidden = grad_hidden
    saved.grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    saved.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
    loss = FusedLinearGRPOLossFunction.apply(hidden_rows, weight, bias, out.loss.detach(), saved)
    return loss, out.metrics, logprobs, entropy
