"""sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg (Soft Adaptive Policy
Optimisation, arXiv 2511.20347)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, require, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    tau_pos: float = 1.0  # gate temperature for A > 0
    tau_neg: float = 1.05  # gate temperature for A <= 0

    def __post_init__(self):
        require(self.tau_pos > 0 and self.tau_neg > 0, "sapo temperatures must be > 0")


def objective(ctx) -> Objective:
    p, adv = ctx.params, ctx.adv
    tau = torch.where(adv > 0, p.tau_pos, p.tau_neg)
    gate = torch.sigmoid(tau * (ctx.ratio - 1.0)) * 4.0 / tau
    return Objective(-gate * adv)


@triton_piece
def token_objective(ratio, adv, tau_pos, tau_neg):
    """(l, dl/dr)."""
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    s = tl.sigmoid(tau * (ratio - 1.0))
    return -s * 4.0 / tau * adv, -adv * 4.0 * s * (1.0 - s)


VARIANT = LossVariant("sapo", 3, "-gate(r) A, gate = sigmoid(tau (r - 1)) 4 / tau (soft adaptive policy optimisation)",
    objective=objective, params=Params, config_fields={"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"},
    presets={"sapo": dict(loss_type="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_coef=0.0,
                          loss_agg_mode="seq-mean-token-mean")},
    compile_cases={"sapo": (dict(preset="sapo"), ("old",))},
    peer_names={"TRL": "sapo", "verl": "sapo", "SkyRL": "sapo"},
)  # fmt: skip
