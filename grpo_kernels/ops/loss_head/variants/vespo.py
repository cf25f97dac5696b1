"""vespo: detached sequence-level Gamma weight phi(W) times -A logp (VESPO, arXiv 2602.10693; TRL 1.16
get_gamma_weights). ratio_level ("token" or "sequence", TRL's importance_sampling_level) sets only the ratio of
the KL correction."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._base import LossVariant, Objective, require, tl, triton_piece  # noqa: F401  (tl: bound later)


@dataclass(frozen=True)
class Params:
    k_pos: float = 2.0  # Gamma weight phi(W): shape k for A >= 0
    lambda_pos: float = 3.0  # rate lambda for A >= 0
    k_neg: float = 3.0  # shape k for A < 0
    lambda_neg: float = 2.0  # rate lambda for A < 0


def check(cfg):
    # its weight comes from the summed log-ratio; ratio_level sets only the ratio of the KL correction (TRL's
    # importance_sampling_level does the same)
    require(
        cfg.ratio_level in ("token", "sequence"),
        f"loss_type='vespo' takes ratio_level 'token' or 'sequence' (the KL correction's ratio), got "
        f"{cfg.ratio_level!r}",
    )
    if cfg.is_level is not None:
        require(cfg.is_level == "token", "vespo folds token-level IS weights only (is_level='token')")
    require(cfg.is_gate is None, "vespo folds token-level IS weights into its own weight; is_gate is not defined for it")


def phi(ctx):
    """TRL 1.16 GRPOTrainer.get_gamma_weights: phi(w) = exp(lambda + k log w - lambda w), with
    log w = clamp(sum_t clamp(lr_t, +-20) [+ sum_t clamp(log IS_t, log 1e-8, 20)], log 1e-8, 20),
    k, lambda chosen by the sign of A (A >= 0: pos). Detached: it only scales A grad log pi."""
    p, cfg, m, seq_sum = ctx.params, ctx.cfg, ctx.m, ctx.seq_sum
    lower = math.log(1e-8)
    with torch.no_grad():
        seq_log_ratio = seq_sum(ctx.log_ratio.detach().clamp(-20.0, 20.0) * m)
        if cfg.is_level is not None:
            if cfg.is_level != "token":
                raise ValueError("vespo folds token-level IS weights only (is_level='token')")
            is_w = ctx.sampler_is_weights()
            # masked tokens carry weight 1 in TRL (their log-diff is 0), i.e. log 1 = 0
            log_is = torch.where(m > 0, torch.log(is_w).clamp(lower, 20.0), torch.zeros_like(is_w))
            seq_log_ratio = seq_log_ratio + seq_sum(log_is)
        log_w = seq_log_ratio.clamp(lower, 20.0)[ctx.seq_index]
        nonneg = ctx.adv >= 0
        k = torch.where(nonneg, p.k_pos, p.k_neg)
        lam = torch.where(nonneg, p.lambda_pos, p.lambda_neg).clamp(min=1e-4)
        value = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return value * m


def objective(ctx) -> Objective:
    weight = phi(ctx)
    per_seq_phi = ctx.seq_sum(weight) / ctx.seq_len.clamp(min=1.0)
    nonempty = ctx.seq_nonempty
    ctx.metrics["vespo/phi_seq_mean"] = (per_seq_phi * nonempty).sum() / nonempty.sum().clamp(min=1.0)
    return Objective(-weight * ctx.adv * ctx.lp)


def finalize(partials):
    """The mean over non-empty sequences of the sequence's phi."""
    lengths = partials.seq_len.clamp(min=1.0)
    nonempty = partials.seq_len > 0
    per_seq = partials.column("phi") / lengths
    partials.metrics["vespo/phi_seq_mean"] = (per_seq * nonempty).sum() / nonempty.float().sum().clamp(min=1.0)


@triton_piece
def block_log_ratio(lr, mf):
    """Pass A: this block's share of the sequence log-ratio, with TRL's +-20 token clamp."""
    return tl.sum(tl.minimum(tl.maximum(lr, -20.0), 20.0) * mf)


@triton_piece
def block_log_is(old, rollout, scored, m, mf, log_clamp, is_min, is_max, IS_MASK: tl.constexpr,
                 LOG_1E8: tl.constexpr):  # fmt: skip
    """Pass A: this block's share of the summed log token-IS weights VESPO folds into W (TRL)."""
    d = tl.minimum(tl.maximum(tl.where(scored, (old - rollout) * mf, 0.0), -log_clamp), log_clamp)
    rho = tl.exp(d)
    lo = is_min
    if IS_MASK:
        rho = tl.where((rho >= lo) & (rho <= is_max), rho, 0.0)
    else:
        rho = tl.minimum(tl.maximum(rho, lo), is_max)
    log_is = tl.minimum(tl.maximum(tl.log(rho * mf), LOG_1E8), 20.0)
    return tl.sum(tl.where(m, log_is, 0.0))


@triton_piece
def token_objective(adv, lp, mf, log_w_vespo, vk_pos, vl_pos, vk_neg, vl_neg, acc_phi):
    """(l, dl/dlp, phi summed for the metric), given the sequence's clamped log W from pass A."""
    nonneg = adv >= 0
    k = tl.where(nonneg, vk_pos, vk_neg)
    lam = tl.maximum(tl.where(nonneg, vl_pos, vl_neg), 1e-4)
    phi = tl.exp(lam + k * log_w_vespo - lam * tl.exp(log_w_vespo))
    phi = tl.where(phi == phi, phi, 0.0)  # nan -> 0
    phi = tl.where((phi < float("inf")) & (phi > float("-inf")), phi, 0.0) * mf
    objective = -phi * adv * lp
    g_direct = -phi * adv
    acc_phi += phi
    return objective, g_direct, acc_phi


VARIANT = LossVariant("vespo", 6, "detached sequence-level Gamma weight times -A logp (TRL's VESPO)",
    objective=objective, params=Params,
    config_fields={"k_pos": "vespo_k_pos", "lambda_pos": "vespo_lambda_pos", "k_neg": "vespo_k_neg",
                   "lambda_neg": "vespo_lambda_neg"},
    metrics=lambda cfg: {"vespo/phi_seq_mean"}, finalize=finalize, check=check, token_local=False,
    ratio_levels=("token", "sequence"),
    presets={"vespo": dict(loss_type="vespo", kl_coef=0.0, loss_agg_mode="token-mean")},
    compile_cases={"vespo_tis": (dict(preset="vespo", is_level="token"), ("old", "rollout"))},
    peer_names={"TRL": "vespo"},
)  # fmt: skip
