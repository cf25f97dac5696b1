"""dppo: -r A k_t, PPO's clip replaced by a binary trust region k_t on the probability change p_t - mu_t (DPPO,
arXiv 2602.04879; SkyRL `dppo`, prime-rl's default loss). Bounds: clip_low (A < 0), clip_high (A > 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, binary_kl, binary_kl_piece, require, tl, triton_piece  # noqa: F401

DIVERGENCES = (
    "binary_tv",  # p - mu (probabilities): the total variation of the binary {token, rest} distributions
    "binary_kl",  # KL(Bernoulli(mu) || Bernoulli(p)), with the sign of p - mu
)


@dataclass(frozen=True)
class Params:
    divergence: str = "binary_tv"  # one of DIVERGENCES

    def __post_init__(self):
        require(self.divergence in DIVERGENCES, f"unknown dppo_divergence {self.divergence!r}; known: {DIVERGENCES}")


def check(cfg):
    require(
        cfg.ratio_level == "token",
        "loss_type='dppo' masks tokens by their own probability change; ratio_level must be 'token'",
    )


def out_of_region(cfg, divergence, lp, anchor, adv):
    """DPPO's trust region (SkyRL dppo_policy_loss, prime-rl default_loss_fn): with p = e^lp, mu = e^anchor,
    a token with A > 0 leaves it when p rose too far, one with A < 0 when p fell too far:
      binary_tv: p - mu > clip_high (A > 0);  mu - p > clip_low (A < 0)
      binary_kl: p > mu and KL_b(mu || p) > clip_high (A > 0);  p < mu and KL_b(mu || p) > clip_low (A < 0).
    Returns the bool masks (dropped with A < 0, dropped with A > 0); no gradient flows through them."""
    with torch.no_grad():
        diff = lp.exp() - anchor.exp()
        if divergence == "binary_tv":
            out_high, out_low = diff > cfg.clip_high, -diff > cfg.clip_low
        else:
            kl = binary_kl(anchor, lp)
            out_high = (diff > 0) & (kl > cfg.clip_high)
            out_low = (diff < 0) & (kl > cfg.clip_low)
        return (adv < 0) & out_low, (adv > 0) & out_high


def objective(ctx) -> Objective:
    low, high = out_of_region(ctx.cfg, ctx.params.divergence, ctx.lp.detach(), ctx.anchor, ctx.adv)
    value = -ctx.ratio * ctx.adv * (1.0 - (low | high).float())
    return Objective(value, low.float(), high.float())  # the tokens the trust region drops, by the sign of A


@triton_piece
def token_objective(lp, base, adv, ratio, m, clip_low, clip_high, acc_low, acc_high, acc_region,
                    DPPO_KL: tl.constexpr):  # fmt: skip
    """(l, dl/dr, and the dropped counts: with A < 0, with A > 0, either)."""
    diff = tl.exp(lp) - tl.exp(base)
    if DPPO_KL:
        div = binary_kl_piece(base, lp)
        out_high = (diff > 0) & (div > clip_high)
        out_low = (diff < 0) & (div > clip_low)
    else:
        out_high = diff > clip_high
        out_low = -diff > clip_low
    drop_low = m & (adv < 0) & out_low
    drop_high = m & (adv > 0) & out_high
    keep = tl.where(drop_low | drop_high, 0.0, 1.0)
    objective = -ratio * adv * keep
    g_r = -adv * keep
    acc_low += tl.where(drop_low, 1.0, 0.0)
    acc_high += tl.where(drop_high, 1.0, 0.0)
    acc_region += tl.where(drop_low | drop_high, 1.0, 0.0)
    return objective, g_r, acc_low, acc_high, acc_region


VARIANT = LossVariant("dppo", 11, "-r A k: PPO's clip replaced by a binary trust-region mask k on the probability change (DPPO)",
    objective=objective, params=Params, config_fields={"divergence": "dppo_divergence"}, clip_metrics=True,
    check=check, ratio_levels=("token",), rollout_anchor=True,
    presets={"dppo": dict(loss_type="dppo", dppo_divergence="binary_tv", clip_low=0.2, clip_high=0.2, kl_coef=0.0,
                          loss_agg_mode="token-mean")},
    compile_cases={
        "dppo_rollout_ratio_kl": (dict(preset="dppo", ratio_anchor="rollout", ratio_kl_coef=2e-3), ("rollout",)),
        "dppo_binary_kl": (dict(preset="dppo", dppo_divergence="binary_kl", clip_low=0.05, clip_high=0.05), ("old",)),
    },
    peer_names={"SkyRL": "dppo", "prime-rl": "default loss (dppo_mask_low / dppo_mask_high)"},
)  # fmt: skip
