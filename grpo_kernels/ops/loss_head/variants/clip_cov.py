"""clip_cov: PPO's clip without delta / dual clip, with a random subset of the high-covariance tokens detached
(Clip-Cov, arXiv 2505.22617; verl compute_policy_loss_clip_cov). The subset is chosen on the host, before the
kernel, exactly as verl (torch.randperm on the default generator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, clip_masks, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    ratio: float = 2e-4  # fraction of tokens detached (verl clip_cov_ratio)
    lb: float = 1.0  # lower covariance bound of the candidates
    ub: float = 5.0  # upper covariance bound of the candidates


def keep(params, adv, lp, m, valid, clipped_by_ppo):
    """verl compute_policy_loss_clip_cov: among tokens not already clipped by PPO, those whose
    centred covariance (A - mean A)(logp - mean logp) lies in (lb, ub) are candidates; a random
    subset of max(1, int(ratio * n_valid)) of them is detached (keep = 0). torch.randperm on the
    default generator, exactly as verl, so seeded runs select the same tokens."""
    n_valid = m.sum()
    with torch.no_grad():
        mean_adv = (adv * m).sum() / (n_valid + 1e-8)
        mean_lp = (lp.detach() * m).sum() / (n_valid + 1e-8)
        cov = (adv - mean_adv) * (lp.detach() - mean_lp)
        cov = torch.where(valid & ~clipped_by_ppo, cov, torch.full_like(cov, float("-inf")))
        n_clip = max(int(params.ratio * n_valid.item()), 1)
        candidates = torch.nonzero((cov < params.ub) & (cov > params.lb) & valid).squeeze(-1)
        kept = torch.ones_like(m)
        if candidates.numel() > 0:
            chosen = candidates[torch.randperm(candidates.numel())[: min(n_clip, candidates.numel())]]
            kept[chosen] = 0.0
    return kept


def objective(ctx) -> Objective:
    ratio, adv, m = ctx.ratio, ctx.adv, ctx.m
    clipped = ratio.clamp(ctx.lower, ctx.upper)
    loss_unclipped, loss_clipped = -adv * ratio, -adv * clipped
    kept = keep(ctx.params, adv, ctx.lp, m, ctx.valid, loss_clipped > loss_unclipped)
    ctx.metrics["selection/cov_frac"] = ((1.0 - kept) * m).sum() / m.sum().clamp(min=1.0)
    low, high = clip_masks(ratio, ratio, ctx.lower, ctx.upper, adv)
    return Objective(torch.maximum(loss_unclipped, loss_clipped) * kept, low, high)


def host_selection(cfg, params, logprobs, advantages, old_logprobs, valid):
    """The kernel's per-token keep (1) / detach (0) input, chosen as `objective` does."""
    m = valid.float()
    lp_c = torch.where(valid, logprobs.float(), 0.0)
    adv_c = torch.where(valid, advantages.float(), 0.0)
    old_c = torch.where(valid, old_logprobs.float(), 0.0) if old_logprobs is not None else lp_c
    lr = (lp_c - old_c) * m
    c = cfg.log_ratio_clamp
    ratio = torch.exp(lr if c is None else lr.clamp(-c, c)) * m
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return keep(params, adv_c, lp_c, m, valid, -adv_c * clipped > -adv_c * ratio)


def finalize(partials):
    partials.metrics["selection/cov_frac"] = partials.token_mean("cov")


@triton_piece
def apply_keep(objective, g_r, cov_ptr, idx, inb, mf, acc_cov):
    """Detach the host-chosen tokens: (l, dl/dr, the detached count)."""
    kept = tl.load(cov_ptr + idx, mask=inb, other=1.0).to(tl.float32)
    objective = objective * kept
    g_r = g_r * kept
    acc_cov += (1.0 - kept) * mf
    return objective, g_r, acc_cov


VARIANT = LossVariant("clip_cov", 7, "PPO clip with a random subset of high-covariance tokens detached (Clip-Cov)",
    objective=objective, params=Params,
    config_fields={"ratio": "clip_cov_ratio", "lb": "clip_cov_lb", "ub": "clip_cov_ub"},
    metrics=lambda cfg: {"selection/cov_frac"}, finalize=finalize, clip_metrics=True, token_local=False,
    global_statistics=True, ratio_levels=("token",),
    compile_cases={"clip_cov": (dict(loss_type="clip_cov"), ("old",))},
    peer_names={"verl": "clip_cov", "SkyRL": "clip_cov"},
)  # fmt: skip
