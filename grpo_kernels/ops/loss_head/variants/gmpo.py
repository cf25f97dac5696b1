"""gmpo: the geometric mean of the sign-aware clipped token ratios of each sequence times its mean advantage,
averaged over sequences (GMPO, arXiv 2507.20673; verl compute_policy_loss_geo_mean). A sequence-level objective:
its Triton part is the kernel's pass A sum and pass B gradient under LOSS == LOSS_GMPO."""

from __future__ import annotations

import torch

from ._base import LossVariant, Objective


def objective(ctx) -> Objective:
    return Objective(None)  # sequence-level: sequence_loss below


def sequence_loss(ctx, selection, weights, normalizers):
    """sign-aware clip of the token log-ratio to [-clip_low, clip_high], geometric mean over the sequence, times
    the sequence-mean advantage:
      l_i = -Abar_i exp( sum_t sgn(A_t) min(sgn(A_t) lr_t, sgn(A_t) clip(lr_t)) m_t / |o_i| ),
    averaged over sequences (ignores loss_agg_mode, as the paper and verl). Token IS weights enter as
    their geometric mean per sequence (verl)."""
    cfg, log_ratio, adv, m, seq_sum, seq_len = ctx.cfg, ctx.log_ratio, ctx.adv, ctx.m, ctx.seq_sum, ctx.seq_len
    sgn = torch.sign(adv)
    clipped = log_ratio.clamp(-cfg.clip_low, cfg.clip_high)
    lr_min = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)
    length = seq_len.clamp(min=1.0)
    seq_ratio = torch.exp(seq_sum(lr_min * m) / length)
    seq_adv = seq_sum(adv * m) / length
    seq_objective = -seq_adv * seq_ratio
    is_geo = torch.exp(seq_sum(torch.log(weights + 1e-10) * m) / length)  # 1 when no IS weights
    seq_keep = (seq_sum(selection) > 0).float()  # off-policy masking drops whole sequences
    was_clipped = (log_ratio != clipped).float()
    ctx.metrics["clip_ratio/high_mean"] = (was_clipped * (adv > 0) * m).sum() / m.sum().clamp(min=1.0)
    ctx.metrics["clip_ratio/low_mean"] = (was_clipped * (adv < 0) * m).sum() / m.sum().clamp(min=1.0)
    total = (seq_objective * is_geo * seq_keep * (seq_len > 0)).sum()
    return total / normalizers.sequence_count() * normalizers.dp_size


VARIANT = LossVariant(
    name="gmpo",
    id=9,
    doc="geometric mean of token ratios per sequence (GMPO)",
    objective=objective,
    sequence_loss=sequence_loss,
    metrics=lambda cfg: {"clip_ratio/low_mean", "clip_ratio/high_mean"},
    token_local=False,
    ratio_levels=("token",),
    presets={"gmpo": dict(loss_type="gmpo", clip_low=0.4, clip_high=0.4, kl_coef=0.0)},
    compile_cases={"gmpo_offpolicy": (dict(preset="gmpo", off_policy_mask_threshold=0.5),
                                      ("old", "rollout", "is_weights"))},  # fmt: skip
    peer_names={"verl": "geo_mean"},
)
