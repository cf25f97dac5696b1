"""pspo: -((1 - a) r + a) A, the ratio smoothed toward the old policy instead of clipped (arXiv 2509.21282)."""

from __future__ import annotations

from dataclasses import dataclass

from ._base import LossVariant, Objective, require, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    alpha: float = 0.1  # smoothing weight toward the old policy

    def __post_init__(self):
        require(0.0 <= self.alpha <= 1.0, f"pspo_alpha must be in [0, 1], got {self.alpha}")


def objective(ctx) -> Objective:
    a = ctx.params.alpha
    return Objective(-((1.0 - a) * ctx.ratio + a) * ctx.adv)


@triton_piece
def token_objective(ratio, adv, pspo_alpha):
    """(l, dl/dr)."""
    return -((1.0 - pspo_alpha) * ratio + pspo_alpha) * adv, -(1.0 - pspo_alpha) * adv


VARIANT = LossVariant("pspo", 4, "PPO objective on a ratio smoothed toward the old policy (probability smoothing)",
    objective=objective, params=Params, config_fields={"alpha": "pspo_alpha"},
    presets={"pspo": dict(loss_type="pspo", pspo_alpha=0.1, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean")},
    compile_cases={"pspo": (dict(preset="pspo"), ("old",))}, peer_names={"TRL": "pspo (PR)"},
)  # fmt: skip
