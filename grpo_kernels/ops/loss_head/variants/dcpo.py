"""dcpo: PPO's clip with bounds that depend on the old probability q = e^old (DCPO, arXiv 2509.02333; lime-RL/DCPO
get_clip_low_high), optional dual clip."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ppo_clip
from ._base import LossVariant, Objective, clip_masks, max_weight, min_weight, require, tl, triton_piece  # noqa: F401


@dataclass(frozen=True)
class Params:
    max_ratio: float = 10.0  # cap of the probability-dependent upper bound
    dual_clip: float | None = None  # as ppo_clip's

    def __post_init__(self):
        require(self.max_ratio > 1.0, f"dcpo_max_ratio must be > 1, got {self.max_ratio}")


def objective(ctx) -> Objective:
    p, cfg, ratio, adv = ctx.params, ctx.cfg, ctx.ratio, ctx.adv
    q = ctx.old.exp()
    lower = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * cfg.clip_low / q, min=0.0))
    upper = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * cfg.clip_high / q), max=p.max_ratio)
    value = torch.maximum(-adv * ratio, -adv * torch.minimum(torch.maximum(ratio, lower), upper))
    if p.dual_clip is not None:
        value = ppo_clip.dual_clip_reference(ctx, value, p.dual_clip)
    low, high = clip_masks(ratio, ratio, lower, upper, adv)
    return Objective(value, low, high)


@triton_piece
def token_objective(ratio, adv, old, clip_low, clip_high, dcpo_max):
    """(l, dl/dr, the per-token bounds)."""
    q = tl.exp(old)
    low_bound = 0.5 + 0.5 * tl.sqrt(tl.maximum(1.0 - 4.0 * clip_low / q, 0.0))
    high_bound = tl.minimum(0.5 + 0.5 * tl.sqrt(1.0 + 4.0 * clip_high / q), dcpo_max)
    inner = tl.maximum(ratio, low_bound)
    clipped = tl.minimum(inner, high_bound)
    d_clipped = max_weight(ratio, low_bound) * min_weight(inner, high_bound)
    a = -adv * ratio
    b = -adv * clipped
    w_a = max_weight(a, b)
    objective = tl.maximum(a, b)
    g_r = w_a * (-adv) + (1.0 - w_a) * (-adv * d_clipped)
    return objective, g_r, low_bound, high_bound


VARIANT = LossVariant("dcpo", 5, "PPO clip with probability-dependent bounds (dynamic clipping)",
    objective=objective, params=Params,
    config_fields={"max_ratio": "dcpo_max_ratio", "dual_clip": "dual_clip"},
    metrics=lambda cfg: {"clip_ratio/dual_mean"} if cfg.dual_clip is not None else set(),
    finalize=ppo_clip.finalize, clip_metrics=True,
    presets={"dcpo": dict(loss_type="dcpo", clip_low=0.16, clip_high=0.2, dcpo_max_ratio=10.0, dual_clip=10.0,
                          kl_coef=0.0, loss_agg_mode="seq-mean-token-sum")},
    compile_cases={"dcpo": (dict(preset="dcpo"), ("old",))}, peer_names={"lime-RL/DCPO": "dcpo"},
)  # fmt: skip
