"""gmpo: the geometric mean of the sign-aware clipped token ratios of each sequence times its mean advantage,
averaged over sequences (GMPO, arXiv 2507.20673; verl compute_policy_loss_geo_mean). A sequence-level objective:
its Triton pieces are the kernel's pass A sums, the sequence term between the passes and the pass B gradient."""

from __future__ import annotations

import torch

from ._base import LossVariant, Objective, require, tl, triton_piece  # noqa: F401  (tl: bound later)


def check(cfg):
    require(
        cfg.top_entropy_quantile == 1.0 and cfg.old_prob_threshold is None,
        "gmpo averages log-ratios over whole sequences; token selection (top_entropy_quantile, "
        "old_prob_threshold) is not defined for it",
    )
    if "length-pow" in (cfg.loss_agg_mode, cfg.entropy_agg_mode, cfg.kl_agg_mode):
        require(False, "gmpo averages over sequences; length-pow does not apply")


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


@triton_piece
def block_log_ratio(lr, adv, mf, clip_low, clip_high):
    """Pass A: this block's share of the sum of sign-aware clipped log-ratios."""
    sgn = tl.where(adv > 0, 1.0, tl.where(adv < 0, -1.0, 0.0))
    clipped = tl.minimum(tl.maximum(lr, -clip_low), clip_high)
    lr_min = sgn * tl.minimum(sgn * lr, sgn * clipped)
    return tl.sum(lr_min * mf)


@triton_piece
def block_log_is(isw_ptr, idx, inb, m, mf):
    """Pass A: this block's share of the summed log IS weights (their geometric mean per sequence, verl)."""
    w_is = tl.where(m, tl.load(isw_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
    return tl.sum(tl.log(w_is + 1e-10) * mf)


@triton_piece
def sequence_term(sum_gmpo, sum_adv, sum_log_isw, length, len1, offpol_seq_ok, any_nonneg, norms_ptr, dp_size,
                  HAS_ISW: tl.constexpr, OFFPOL: tl.constexpr):  # fmt: skip
    """Between the passes: (the sequence's loss term, d loss / d lr_min_t for each of its valid tokens)."""
    seq_ratio = tl.exp(sum_gmpo / len1)
    seq_adv = sum_adv / len1
    is_geo = 1.0
    if HAS_ISW:
        is_geo = tl.exp(sum_log_isw / len1)
    keep = tl.where(length > 0, 1.0, 0.0)
    if OFFPOL:
        keep = keep * tl.maximum(offpol_seq_ok, any_nonneg)
    gmpo_scale = is_geo * keep * dp_size / tl.load(norms_ptr + 1)
    loss_pg = -seq_adv * seq_ratio * gmpo_scale
    # d loss / d lr_min_t = -Abar * ratio / |o| * gmpo_scale for every valid token
    gmpo_coef = -seq_adv * seq_ratio / len1 * gmpo_scale
    return loss_pg, gmpo_coef


@triton_piece
def token_gradient(lr, adv, m, mf, clip_low, clip_high, gmpo_coef, acc_gmpo_hi, acc_gmpo_lo):
    """Pass B: dL/dlp through the sign-aware clipped log-ratio of each token, and the clip counts."""
    sgn = tl.where(adv > 0, 1.0, tl.where(adv < 0, -1.0, 0.0))
    inside = (lr >= -clip_low) & (lr <= clip_high)
    passes = tl.where(inside, 1.0, tl.where(sgn * lr < sgn * tl.minimum(tl.maximum(lr, -clip_low), clip_high), 1.0,
                                            0.0))  # fmt: skip
    g_lp = gmpo_coef * sgn * sgn * passes * mf
    was_clipped = tl.where(m & ~inside, 1.0, 0.0)
    acc_gmpo_hi += was_clipped * tl.where(adv > 0, 1.0, 0.0)
    acc_gmpo_lo += was_clipped * tl.where(adv < 0, 1.0, 0.0)
    return g_lp, acc_gmpo_hi, acc_gmpo_lo


def finalize(partials):
    partials.metrics["clip_ratio/high_mean"] = partials.token_mean("gmpo_high")
    partials.metrics["clip_ratio/low_mean"] = partials.token_mean("gmpo_low")


VARIANT = LossVariant("gmpo", 9, "geometric mean of token ratios per sequence (GMPO)",
    objective=objective, sequence_loss=sequence_loss, check=check, finalize=finalize,
    metrics=lambda cfg: {"clip_ratio/low_mean", "clip_ratio/high_mean"}, token_local=False,
    ratio_levels=("token",),
    presets={"gmpo": dict(loss_type="gmpo", clip_low=0.4, clip_high=0.4, kl_coef=0.0)},
    compile_cases={"gmpo_offpolicy": (dict(preset="gmpo", off_policy_mask_threshold=0.5),
                                      ("old", "rollout", "is_weights"))},
    peer_names={"verl": "geo_mean"},
)  # fmt: skip
