"""ppo_clip: -min(r_u A, clip(r, 1 - clip_low, 1 + clip_high) A), r_u = min(r, delta), optional dual clip
(GRPO, DAPO clip-higher, Dr. GRPO, BNPO, GSPO and TIC-GRPO by ratio level, TRL's two-sided clip, verl's dual clip).
Derivation: ../README.md "Objectives and their gradients"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, clip_masks, min_weight, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    dual_clip: float | None = None  # c > 1: for A < 0 the loss is at most -c A (verl clip_ratio_c)
    delta: float | None = None  # TRL / INTELLECT-2 two-sided clip: the unclipped ratio is capped at delta


def dual_clip_reference(ctx, objective, dual_clip):
    """verl's dual clip: for A < 0 the loss is at most -c A (ppo_clip and dcpo)."""
    adv = ctx.adv
    dual_bound = -dual_clip * adv
    ctx.metrics["clip_ratio/dual_mean"] = ctx.level_mean(((objective > dual_bound) & (adv < 0)).float())
    return torch.where(adv < 0, torch.minimum(objective, dual_bound), objective)


def objective(ctx) -> Objective:
    p, ratio, adv = ctx.params, ctx.ratio, ctx.adv
    clipped = ratio.clamp(ctx.lower, ctx.upper)
    unclipped = ratio if p.delta is None else ratio.clamp(max=p.delta)  # TRL two-sided clip
    value = -torch.minimum(unclipped * adv, clipped * adv)
    if p.dual_clip is not None:
        value = dual_clip_reference(ctx, value, p.dual_clip)
    low, high = clip_masks(ratio, unclipped, ctx.lower, ctx.upper, adv)
    return Objective(value, low, high)


def finalize(partials):
    if partials.cfg.dual_clip is not None:
        partials.metrics["clip_ratio/dual_mean"] = partials.level_mean("dual")


def metrics(cfg):
    return {"clip_ratio/dual_mean"} if cfg.dual_clip is not None else set()


@triton_piece
def token_objective(ratio, adv, lp, lower, upper, delta, USE_DELTA: tl.constexpr):
    """(l, dl/dr, the ratio TRL's upper clip statistic reads); USE_DELTA False: Clip-Cov's plain clip."""
    clipped = tl.minimum(tl.maximum(ratio, lower), upper)
    d_clipped = tl.where((ratio >= lower) & (ratio <= upper), 1.0, 0.0)
    unclipped = ratio
    d_unclipped = 1.0 + 0.0 * lp
    metric_ratio = ratio
    if USE_DELTA:
        unclipped = tl.minimum(ratio, delta)
        d_unclipped = tl.where(ratio <= delta, 1.0, 0.0)
        metric_ratio = unclipped
    w_u = min_weight(unclipped * adv, clipped * adv)
    objective = -tl.minimum(unclipped * adv, clipped * adv)
    g_r = -adv * (w_u * d_unclipped + (1.0 - w_u) * d_clipped)
    return objective, g_r, metric_ratio


@triton_piece
def dual_clip(objective, g_r, adv, m, dual_c, acc_dual):
    """For A < 0 the loss is at most -c A; c = inf (off) stays finite: no inf * 0."""
    dual_bound = -tl.minimum(dual_c, 3.0e38) * adv
    neg = adv < 0
    acc_dual += tl.where(m & neg & (objective > dual_bound), 1.0, 0.0)
    g_r = tl.where(neg, g_r * min_weight(objective, dual_bound), g_r)
    objective = tl.where(neg, tl.minimum(objective, dual_bound), objective)
    return objective, g_r, acc_dual



VARIANT = LossVariant("ppo_clip", 0, "-min(r A, clip(r, 1-clip_low, 1+clip_high) A), optional dual clip / delta",
    objective=objective, params=Params, config_fields={"dual_clip": "dual_clip", "delta": "delta"},
    metrics=metrics, finalize=finalize, clip_metrics=True, rollout_anchor=True,
    presets={
        "grpo": dict(loss_type="ppo_clip", clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_estimator="k3",
                     loss_agg_mode="seq-mean-token-mean"),
        "dapo": dict(loss_type="ppo_clip", clip_low=0.2, clip_high=0.28, kl_coef=0.0, loss_agg_mode="token-mean"),
        "dr_grpo": dict(loss_type="ppo_clip", clip_low=0.2, clip_high=0.2, kl_coef=0.0,
                        loss_agg_mode="seq-mean-token-sum-norm", max_completion_length=1024),
        "bnpo": dict(loss_type="ppo_clip", clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg_mode="token-mean"),
        "gspo": dict(loss_type="ppo_clip", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, kl_coef=0.0,
                     loss_agg_mode="seq-mean-token-mean"),
        "olmo3": dict(loss_type="ppo_clip", clip_low=0.2, clip_high=0.272, kl_coef=0.0, loss_agg_mode="token-mean",
                      is_level="token", is_mode="truncate", is_max=2.0),
        "tic_grpo": dict(loss_type="ppo_clip", ratio_level="sequence_sum", clip_low=0.2, clip_high=0.2,
                         kl_coef=0.0, loss_agg_mode="seq-mean-token-mean"),
    },
    compile_cases={
        "dual_clip_delta": (dict(dual_clip=3.0, delta=2.0, loss_agg_mode="token-sum"), ("old",)),
    },
    peer_names={"TRL": "grpo / dapo / bnpo / dr_grpo / luspo", "verl": "vanilla / gspo", "SkyRL": "regular / "
                "dual_clip / gspo", "OpenRLHF": "ppo / gspo"},
)  # fmt: skip
