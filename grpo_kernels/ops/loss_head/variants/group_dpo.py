"""group_dpo: DPO between the best and the worst completion of each group of group_size consecutive
completions, on summed log-probs against the reference (Rafailov et al. 2023). The kernel returns each
sequence's summed log-probs (`block_sums` in its pass A); the pairing runs in torch (`finalize`, `group_dpo_loss`)
and its gradient is broadcast to the tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, require, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    beta: float = 0.1  # DPO inverse temperature
    group_size: int | None = None  # completions per prompt, laid out consecutively

    def __post_init__(self):
        require(self.beta > 0, f"dpo_beta must be > 0, got {self.beta}")


def check(cfg):
    g = cfg.params.group_size
    require(
        isinstance(g, int) and not isinstance(g, bool) and g >= 2,
        f"group_dpo needs group_size >= 2 (completions per prompt, consecutive), got {g!r}",
    )
    require(cfg.ratio_level == "token", "group_dpo compares summed log-probs; ratio_level must be 'token'")
    require(
        cfg.top_entropy_quantile == 1.0 and cfg.old_prob_threshold is None and cfg.is_level is None
        and cfg.off_policy_mask_threshold is None and cfg.is_gate is None,
        "group_dpo is a sequence-pair objective: token selection and IS corrections are not defined for it",
    )  # fmt: skip


def group_dpo_loss(cfg, seq_logprob_sum, seq_ref_sum, seq_adv, seq_len, grad_accum_steps, dp_size, metrics):
    """In each group of group_size consecutive completions, the one with the largest advantage is preferred
    over the one with the smallest:
      l_g = -log sigmoid( beta [ (S_w - S^ref_w) - (S_l - S^ref_l) ] ),  S = sum_t log pi(o_t),
    averaged over groups that have a preference (max A > min A); ties contribute nothing."""
    g = cfg.group_size
    n_groups = seq_len.shape[0] // g
    seq_adv = seq_adv.reshape(n_groups, g)
    nonempty = (seq_len > 0).reshape(n_groups, g)
    policy_minus_ref = (seq_logprob_sum - seq_ref_sum).reshape(n_groups, g)
    inf = torch.tensor(float("inf"), device=seq_len.device)
    best = torch.where(nonempty, seq_adv, -inf).argmax(-1, keepdim=True)
    worst = torch.where(nonempty, seq_adv, inf).argmin(-1, keepdim=True)
    has_pair = (seq_adv.gather(-1, best) > seq_adv.gather(-1, worst)).squeeze(-1) & (nonempty.sum(-1) >= 2)
    margin = (policy_minus_ref.gather(-1, best) - policy_minus_ref.gather(-1, worst)).squeeze(-1)
    pair = has_pair.float()
    n_pairs = pair.sum().clamp(min=1.0)
    metrics["dpo/pairs"] = pair.sum()
    metrics["dpo/reward_margin"] = (cfg.dpo_beta * margin * pair).detach().sum() / n_pairs
    metrics["dpo/accuracy"] = ((margin > 0).float() * pair).sum() / n_pairs
    losses = -torch.nn.functional.logsigmoid(cfg.dpo_beta * margin) * pair
    return losses.sum() / (n_pairs * grad_accum_steps) * dp_size


@triton_piece
def block_sums(lp, m, mf, ref_ptr, idx, inb, sum_lp, sum_ref):
    """Pass A: the sequence's summed log-probs and reference log-probs, this block added."""
    ref = tl.where(m, tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
    sum_lp += tl.sum(lp * mf)
    sum_ref += tl.sum(ref * mf)
    return sum_lp, sum_ref


def finalize(partials):
    """The pairing over the kernel's per-sequence sums, and the gradient of each sequence's summed log-probs."""
    lengths = partials.seq_len.clamp(min=1.0)
    seq_sum_lp = partials.column("sum_lp").clone().requires_grad_(partials.need_grad)
    seq_adv = partials.column("sum_adv") / lengths
    with torch.enable_grad():
        dpo = group_dpo_loss(partials.cfg, seq_sum_lp, partials.column("sum_ref"), seq_adv, partials.seq_len,
                             partials.grad_accum_steps, partials.dp_size, partials.metrics)  # fmt: skip
    extra_grad = None
    if partials.need_grad:
        (extra_grad,) = torch.autograd.grad(dpo, seq_sum_lp)
    return dpo.detach(), extra_grad


def objective(ctx) -> Objective:
    return Objective(None)  # sequence-level: sequence_loss below


def sequence_loss(ctx, selection, weights, normalizers):
    ref = ctx.ref
    if ref is None:
        raise ValueError("group_dpo needs ref_logprobs")
    seq_sum, m, seq_len = ctx.seq_sum, ctx.m, ctx.seq_len
    seq_adv = seq_sum(ctx.adv * m) / seq_len.clamp(min=1.0)
    return group_dpo_loss(ctx.cfg, seq_sum(ctx.lp * m), seq_sum(ref * m), seq_adv, seq_len,
                          normalizers.grad_accum_steps, normalizers.dp_size, ctx.metrics)  # fmt: skip


VARIANT = LossVariant("group_dpo", 10, "DPO loss between the best and the worst completion of each group (summed log-probs)",
    objective=objective, params=Params, config_fields={"beta": "dpo_beta", "group_size": "group_size"},
    sequence_loss=sequence_loss, check=check, finalize=finalize,
    metrics=lambda cfg: {"dpo/pairs", "dpo/reward_margin", "dpo/accuracy"}, token_local=False,
    global_statistics=True, ratio_levels=("token",),
    compile_cases={"group_dpo": (dict(loss_type="group_dpo", group_size=2), ("old", "ref"))}, peer_names={},
)  # fmt: skip
