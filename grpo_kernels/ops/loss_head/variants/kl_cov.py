"""kl_cov: -r A plus k |log r| on the top-covariance tokens, no clipping (KL-Cov, arXiv 2505.22617; verl
compute_policy_loss_kl_cov). The tokens are ranked on the host, before the kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    ratio: float = 2e-4  # fraction of top-covariance tokens penalised (verl)
    coef: float = 1.0  # verl ppo_kl_coef


def selected(params, adv, lp, valid):
    """verl compute_policy_loss_kl_cov: the top max(1, int(n_valid * ratio)) tokens by centred
    covariance (A - mean A)(logp - mean logp) over the valid tokens get the |log r| penalty."""
    out = torch.zeros(adv.shape, dtype=torch.float32, device=adv.device)
    idx = torch.nonzero(valid).squeeze(-1)
    if idx.numel() == 0:
        return out
    with torch.no_grad():
        a, l = adv[idx].detach(), lp[idx].detach()
        cov = (a - a.mean()) * (l - l.mean())
        k = max(1, int(idx.numel() * params.ratio))
        out[idx[torch.topk(cov, k, largest=True).indices]] = 1.0
    return out


def objective(ctx) -> Objective:
    m, log_ratio = ctx.m, ctx.log_ratio
    penalised = selected(ctx.params, ctx.adv, ctx.lp, ctx.valid)
    ctx.metrics["selection/cov_frac"] = (penalised * m).sum() / m.sum().clamp(min=1.0)
    # the mean |log r| the penalty acts on (verl logs it as actor/ppo_kl for kl_cov)
    ctx.metrics["ppo_kl_abs"] = (log_ratio.abs() * m).sum() / m.sum().clamp(min=1.0)
    return Objective(-ctx.adv * ctx.ratio + penalised * ctx.params.coef * log_ratio.abs())


def host_selection(cfg, params, logprobs, advantages, old_logprobs, valid):
    """The kernel's per-token penalised (1) input."""
    lp_c = torch.where(valid, logprobs.float(), 0.0)
    adv_c = torch.where(valid, advantages.float(), 0.0)
    return selected(params, adv_c, lp_c, valid)


def finalize(partials):
    partials.metrics["selection/cov_frac"] = partials.token_mean("cov")
    partials.metrics["ppo_kl_abs"] = partials.token_mean("abs_lr")


@triton_piece
def token_objective(ratio, adv, lp, lr, mf, cov_ptr, idx, inb, kl_cov_coef, acc_cov, acc_abs_lr):
    """(l, dl/dr, dl/dlp, the penalised count, the summed |log r|)."""
    pen = tl.load(cov_ptr + idx, mask=inb, other=0.0).to(tl.float32) * mf
    objective = -adv * ratio + pen * kl_cov_coef * tl.abs(lr)
    g_r = -adv + 0.0 * lp
    g_direct = pen * kl_cov_coef * tl.where(lr > 0, 1.0, tl.where(lr < 0, -1.0, 0.0))
    acc_cov += pen
    acc_abs_lr += tl.abs(lr)
    return objective, g_r, g_direct, acc_cov, acc_abs_lr


VARIANT = LossVariant("kl_cov", 8, "-r A plus |log r| penalty on the top covariance tokens (KL-Cov)",
    objective=objective, params=Params, config_fields={"ratio": "kl_cov_ratio", "coef": "kl_cov_coef"},
    metrics=lambda cfg: {"selection/cov_frac", "ppo_kl_abs"}, finalize=finalize, token_local=False,
    global_statistics=True, ratio_levels=("token",),
    compile_cases={"kl_cov": (dict(loss_type="kl_cov"), ("old",))},
    peer_names={"verl": "kl_cov", "SkyRL": "kl_cov"},
)  # fmt: skip
