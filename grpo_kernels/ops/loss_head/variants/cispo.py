"""cispo: -sg(c(r)) A logp, c(r) the clipped ratio: "relative" clip(r, 1 - clip_low, 1 + clip_high) (verl, the
MiniMax-M1 paper, arXiv 2506.13585), "absolute" min(r, cap) (TRL), or "mask" r inside the open range and 0
outside (SkyRL's rollout_is)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, clip_masks, require, tl, triton_piece  # noqa: F401  (tl: bound later)

FORMS = (
    "relative",  # clip(r, 1 - clip_low, 1 + clip_high) (verl, the MiniMax-M1 paper)
    "absolute",  # min(r, cispo_cap) (TRL)
    "mask",  # r inside (1 - clip_low, 1 + clip_high), else 0: a hard zero outside (SkyRL's rollout_is)
)


@dataclass(frozen=True)
class Params:
    form: str = "relative"  # one of FORMS
    cap: float | None = None  # "absolute": min(r, cap) (TRL's epsilon_high, e.g. 5.0)

    def __post_init__(self):
        require(self.form in FORMS, f"unknown cispo_form {self.form!r}; known: {FORMS}")


def check(cfg):
    if cfg.params.form == "absolute":
        cap = cfg.params.cap
        require(cap is not None and cap > 0, "cispo_form='absolute' needs cispo_cap > 0 (TRL's epsilon_high, e.g. 5.0)")


def objective(ctx) -> Objective:
    p, ratio, adv = ctx.params, ctx.ratio, ctx.adv
    lower, upper = ctx.lower, ctx.upper
    if p.form == "relative":  # verl, MiniMax-M1 paper: two-sided, relative to 1
        weight = ratio.clamp(lower, upper)
        outside = (ratio < lower) | (ratio > upper)
    elif p.form == "mask":  # SkyRL rollout_is: the ratio inside the open range, a hard zero outside
        inside = (ratio > lower) & (ratio < upper)
        weight = torch.where(inside, ratio, torch.zeros_like(ratio))
        outside = ~inside
    else:  # TRL: one-sided absolute cap
        weight = ratio.clamp(max=p.cap)
        lower, upper = float("-inf"), p.cap
        outside = ratio > upper
    value = -weight.detach() * adv * ctx.lp
    ctx.metrics["clip_ratio/any_mean"] = ctx.level_mean(outside.float())
    low, high = clip_masks(ratio, ratio, lower, upper, adv)
    return Objective(value, low, high)


def finalize(partials):
    partials.metrics["clip_ratio/any_mean"] = partials.level_mean("any")


@triton_piece
def token_objective(ratio, adv, lp, m, lower, upper, low_bound, high_bound, cispo_cap, acc_any,
                    CISPO_ABS: tl.constexpr, CISPO_MASK: tl.constexpr):  # fmt: skip
    """(l, dl/dlp, the clip statistics' bounds, the count outside them)."""
    if CISPO_ABS:
        weight = tl.minimum(ratio, cispo_cap)
        low_bound = float("-inf") + 0.0 * lp
        high_bound = cispo_cap + 0.0 * lp
        acc_any += tl.where(m & (ratio > high_bound), 1.0, 0.0)
    elif CISPO_MASK:  # a hard zero outside the open range (SkyRL rollout_is)
        inside = (ratio > lower) & (ratio < upper)
        weight = tl.where(inside, ratio, 0.0)
        acc_any += tl.where(m & ~inside, 1.0, 0.0)
    else:
        weight = tl.minimum(tl.maximum(ratio, lower), upper)
        acc_any += tl.where(m & ((ratio < low_bound) | (ratio > high_bound)), 1.0, 0.0)
    return -weight * adv * lp, -weight * adv, low_bound, high_bound, acc_any



VARIANT = LossVariant("cispo", 1, "-sg(clip(r)) A logp (MiniMax-M1), 'relative' (verl), 'absolute' (TRL) or 'mask' (SkyRL rollout_is)",
    objective=objective, params=Params, config_fields={"form": "cispo_form", "cap": "cispo_cap"},
    metrics=lambda cfg: {"clip_ratio/any_mean"}, finalize=finalize, clip_metrics=True, check=check,
    rollout_anchor=True,
    presets={"cispo": dict(loss_type="cispo", cispo_form="relative", clip_low=1.0, clip_high=4.0, kl_coef=0.0,
                           loss_agg_mode="token-mean")},
    compile_cases={
        "cispo_relative": (dict(preset="cispo"), ("old",)),
        "cispo_absolute": (dict(preset="cispo", cispo_form="absolute", cispo_cap=5.0, clip_low=0.2, clip_high=0.2),
                           ("old",)),
        "rollout_is": (dict(loss_type="cispo", cispo_form="mask", ratio_anchor="rollout"), ("old", "rollout")),
    },
    peer_names={"TRL": "cispo", "verl": "cispo", "SkyRL": "cispo / rollout_is"},
)  # fmt: skip
