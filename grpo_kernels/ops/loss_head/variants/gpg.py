"""gpg: -A logp, no ratio (Group Policy Gradient, arXiv 2504.02546)."""

from __future__ import annotations

from ._base import LossVariant, Objective, tl, triton_piece  # noqa: F401  (tl: bound later)


def objective(ctx) -> Objective:
    return Objective(-ctx.adv * ctx.lp)


@triton_piece
def token_objective(adv, lp):
    """(l, dl/dlp)."""
    return -adv * lp, -adv


VARIANT = LossVariant("gpg", 2, "-A logp, no ratio (Group Policy Gradient)",
    objective=objective, ratio_levels=("token",),
    presets={"gpg": dict(loss_type="gpg", kl_coef=0.0, loss_agg_mode="token-mean")},
    compile_cases={"gpg": (dict(preset="gpg"), ())}, peer_names={"verl": "gpg"},
)  # fmt: skip
