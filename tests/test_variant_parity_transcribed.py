"""Parity (tier 1): prime-rl's default loss and NeMo-RL's truncated importance sampling modes, transcribed
here as oracles, because neither peer imports on this project's Python: prime-rl is not on PyPI (GitHub
only, Python ~=3.12, its loss module imports its pydantic configs and a flash-attn extra from GitHub URLs);
NeMo-RL is not on PyPI either (a 0.0.0 placeholder; the GitHub code needs Python >= 3.13.14 and
torch==2.11.0). Each transcription restates, operation by operation in this project's words, the source
named in its docstring (the snapshot read: prime-rl 559b4477, 2026-08-21; NeMo-RL 7ea279ab, 2026-08-22),
keeping its stop-gradients, masks, clamps and normalisers, and runs in float64; ours runs in float32
(parity_helpers' tolerances). Every mask decision has a margin of 1e-4 from its bound.
"""

from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from parity_helpers import assert_close, grad_scale, make_token_inputs

pytestmark = pytest.mark.parity
MARGIN = 1e-4


def inputs(seed=5, spread=1.0):
    d = make_token_inputs(seed)
    d["rollout"] = (d["old"] + spread * (d["rollout"] - d["old"])).clamp(max=-0.01)
    d["old"] = d["old"].clamp(max=-0.01)
    return d


def margin(name, stat, bound, where):
    gap = ((stat - bound).abs() / max(abs(bound), 1e-3))[where]
    assert gap.numel() == 0 or float(gap.min()) > MARGIN, f"{name}: within {float(gap.min()):.1e} of {bound}"


# ---- prime-rl ------------------------------------------------------------------------------------------------


def prime_rl_sample_loss(trainer_lp, inference_lp, adv, loss_mask, mask_low, mask_high, adv_tau, kl_tau, weights):
    """prime-rl src/prime_rl/trainer/rl/loss.py::default_loss_fn on one sample (1-D tensors): the ratio to
    the inference log-probs, unclamped and differentiable; tokens whose probability moved past the
    trust region in the advantage's direction leave the policy term (a boolean mask: no gradient); the
    squared log-ratio on every loss-mask token, times kl_tau; optional per-token weights on the whole
    per-token loss; the sample's sum."""
    log_ratio = trainer_lp - inference_lp
    ratio = torch.exp(log_ratio)
    moved = torch.exp(trainer_lp) - torch.exp(inference_lp)
    out_of_region = torch.where(adv > 0, moved > mask_high, moved < -mask_low)
    keep = loss_mask & ~out_of_region
    per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * (loss_mask * log_ratio**2)
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum()


@pytest.mark.parametrize("with_weights", [False, True])
def test_prime_rl_default_loss(with_weights):
    """compute_loss sums the samples' losses and divides by rl_scale, the global count of rl tokens. Here
    on the packed layout (prime-rl packs samples): 5 samples of 9, 6 (with a hole), 3, 0 and 7 tokens.
    Mapping: dppo binary_tv, clip_low / clip_high = dppo_mask_low / high, ratio_anchor="rollout" (the
    inference log-probs), ratio_kl_coef = 2 kl_tau, advantages times adv_tau, token-mean with
    num_tokens = rl_scale, token_weights = the rl weights."""
    d = inputs(spread=2.0)
    mask_low, mask_high, adv_tau, kl_tau = 0.05, 0.08, 0.7, 0.01
    mask = d["mask"]
    lengths = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = {k: d[k][mask] for k in ("logp", "rollout", "adv_tok")}
    n = int(lengths.sum())
    weights = (0.5 + torch.rand(n, generator=torch.Generator().manual_seed(7))) if with_weights else None
    moved = flat["logp"].double().exp() - flat["rollout"].double().exp()
    margin("p - p_inf", moved, mask_high, flat["adv_tok"] > 0)
    margin("p_inf - p", -moved, mask_low, flat["adv_tok"] <= 0)
    rl_scale = float(n) + 3.0  # the global count also holds other micro-batches' tokens

    lp64 = flat["logp"].double().requires_grad_()
    total = 0.0
    for i in range(len(lengths)):
        s, e = int(cu[i]), int(cu[i + 1])
        total = total + prime_rl_sample_loss(
            lp64[s:e], flat["rollout"][s:e].double(), flat["adv_tok"][s:e].double(),
            torch.ones(e - s, dtype=torch.bool), mask_low, mask_high, adv_tau, kl_tau,
            None if weights is None else weights[s:e].double(),
        )  # fmt: skip
    loss_peer = total / rl_scale
    (g_peer,) = torch.autograd.grad(loss_peer, lp64)

    cfg = C.dppo(clip_low=mask_low, clip_high=mask_high, ratio_anchor="rollout", ratio_kl_coef=2 * kl_tau)
    lp = flat["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, adv_tau * flat["adv_tok"], torch.ones(n, dtype=torch.bool), None,
                       rollout_logprobs=flat["rollout"], config=cfg, cu_seqlens=cu, num_tokens=rl_scale,
                       token_weights=weights, backend="torch")  # fmt: skip
    (g,) = torch.autograd.grad(out.loss, lp)
    assert 0 < out.metrics["clip_ratio/region_mean"].item() < 1, "the draw must leave the trust region somewhere"
    assert_close("loss", out.loss, loss_peer, scale=max(1.0, abs(float(loss_peer.detach()))))
    assert_close("dL/dlogp", g, g_peer, scale=grad_scale(g_peer))


# ---- NeMo-RL -----------------------------------------------------------------------------------------------------


def nemo_rl_actor_loss(curr, prev, gen, adv, mask, kind, ratio_max, ratio_min, eps_low, eps_high):
    """NeMo-RL nemo_rl/algorithms/loss/loss_functions.py::ClippedPGLossFn, token-level loss, token-level
    importance ratios: the PPO clipped objective max(-A r, -A clip(r)) with r = exp(curr - prev); the
    actor's importance weight exp(prev - gen) (non-finite -> 0), then per `kind`: "tis" clamps it to
    [ratio_min or 0, ratio_max], "icepop" zeroes it outside [ratio_min, ratio_max], "seq-mask-tis" keeps
    it raw and zeroes whole sequences whose geometric-mean weight exp(masked mean of prev - gen) leaves
    [ratio_min, ratio_max]; the weighted objective's masked sum over (valid tokens + 1e-8)."""
    m = mask.double()
    ratio = torch.exp(curr - prev)
    objective = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    weight = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if kind == "tis":
        weight = weight.clamp(min=0.0 if ratio_min is None else ratio_min, max=ratio_max)
    elif kind == "icepop":
        weight = torch.where((weight >= ratio_min) & (weight <= ratio_max), weight, torch.zeros_like(weight))
    else:
        log_w = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp((log_w * m).sum(-1) / (m.sum(-1) + 1e-8))
        kept = ((geo >= ratio_min) & (geo <= ratio_max)).double()
        weight = weight * kept[:, None]
    return (weight * objective * m).sum() / (m.sum() + 1e-8)


@pytest.mark.parametrize(
    "kind,ratio_min,ratio_max,cfg",
    [
        ("tis", None, 1.1, C(is_level="token", is_mode="truncate", is_max=1.1)),
        ("tis", 0.8, 1.2, C(is_level="token", is_mode="truncate", is_min=0.8, is_max=1.2)),
        ("icepop", 0.8, 1.25, C(is_level="token", is_mode="mask", is_min=0.8, is_max=1.25)),
        ("seq-mask-tis", 0.97, 1.03, C(is_level="token", is_max=None, is_gate="ratio", is_gate_level="sequence",
                                       is_gate_min=0.97, is_gate_max=1.03)),
    ],
)  # fmt: skip
def test_nemo_rl_truncated_importance_sampling(kind, ratio_min, ratio_max, cfg):
    d = inputs(spread=0.5)
    mask = d["mask"]
    m = mask.double()
    w = (d["old"].double() - d["rollout"].double()).exp()
    if kind == "seq-mask-tis":
        geo = ((d["old"].double() - d["rollout"].double()) * m).sum(-1) / m.sum(-1).clamp(min=1)
        stat, where = geo.exp(), m.sum(-1) > 0
    else:
        stat, where = w, mask
    for bound in (b for b in (ratio_min, ratio_max) if b is not None):
        margin(kind, stat, bound, where)
    outside = where & ((stat > ratio_max) | ((stat < ratio_min) if ratio_min is not None else False))
    assert 0 < int(outside.sum()) < int(where.sum()), "the draw must put units on both sides of a bound"
    lp64 = d["logp"].double().requires_grad_()
    loss_peer = nemo_rl_actor_loss(lp64, d["old"].double(), d["rollout"].double(), d["adv_tok"].double(), mask,
                                   kind, ratio_max, ratio_min, 0.2, 0.28)  # fmt: skip
    (g_peer,) = torch.autograd.grad(loss_peer, lp64)
    lp = d["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, d["adv_tok"], mask, d["old"], rollout_logprobs=d["rollout"],
                       config=cfg.replace(clip_low=0.2, clip_high=0.28), backend="torch")  # fmt: skip
    (g,) = torch.autograd.grad(out.loss, lp)
    assert_close("loss", out.loss, loss_peer, scale=max(1.0, abs(float(loss_peer.detach()))))
    assert_close("dL/dlogp", g, g_peer, scale=grad_scale(g_peer))
