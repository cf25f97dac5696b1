"""Tier 1: the other trainers' loss variants against float64 formulas written here from
grpo_kernels/ops/loss_head/README.md (not from reference.py): DPPO's binary TV and binary KL trust
regions, CISPO's hard-zero form with the rollout anchor (SkyRL's rollout_is), the squared log-ratio
penalty, the geometric-mean sequence IS weight and the sampler gates. Loss, dL/dlogp by float64 autograd,
and the metrics each variant adds; their limits and edges by hand.

The loss head computes in float32 and these formulas in float64, so the comparison measures float32
rounding (parity_helpers' bounds: 1e-6 relative, 1e-6 of the term scale absolute). Masks are step
functions of the inputs: every test asserts that no statistic lies within 1e-4 (relative) of a bound it is
compared with, so float32 and float64 take the same side of every bound (a draw that came closer would
fail that check, not the comparison). The Triton loss head is held to the reference on the same variants
by test_loss_head_triton_interpreter.py (test_loss_head.CONFIGS) and the fused paths by test_fused*.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from parity_helpers import assert_close, grad_scale, leaf, make_token_inputs

MARGIN = 1e-4


def inputs(seed=5, spread=1.0):
    """parity_helpers' draw (ratios over ~[0.14, 7.4], both advantage signs, a hole, an empty row), with
    the sampler's log-probs at `spread` x N(0, 0.3) from old, and old and rollout log-probs of
    probabilities (<= 0: the probability differences and binary KLs read them as such)."""
    d = make_token_inputs(seed)
    d["rollout"] = (d["old"] + spread * (d["rollout"] - d["old"])).clamp(max=-0.01)
    d["old"] = d["old"].clamp(max=-0.01)
    return d


def ours(cfg, d, *, adv="adv_tok", old=True, rollout=None, token_weights=None, **kw):
    """grpo_loss (PyTorch backend, float32) on the draw, with the sampler's log-probs when the config reads
    them (rollout=None) or as told; returns (loss, dL/dlogp, metrics)."""
    lp = d["logp"].clone().requires_grad_()
    rollout = cfg.uses_rollout_logprobs if rollout is None else rollout
    out = gk.grpo_loss(lp, d[adv], d["mask"], d["old"] if old else None,
                       rollout_logprobs=d["rollout"] if rollout else None, config=cfg,
                       token_weights=token_weights, backend="torch", **kw)  # fmt: skip
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g, out.metrics


def token_mean(per_token, mask):
    m = mask.double()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def check_margin(name, stat, bound, where):
    """No statistic within MARGIN (relative) of its bound where it is compared."""
    if bound is None or not bool(where.any()):
        return
    gap = ((stat - bound).abs() / max(abs(bound), 1e-3))[where]
    assert float(gap.min()) > MARGIN, f"{name}: a statistic lies {float(gap.min()):.1e} from the bound {bound}"


def compare(name, loss64, lp64, loss32, g32):
    (g64,) = torch.autograd.grad(loss64, lp64)
    assert_close(f"{name}: loss", loss32, loss64, scale=max(1.0, abs(float(loss64.detach()))))
    assert_close(f"{name}: dL/dlogp", g32, g64, scale=grad_scale(g64))
    return g64


def binary_kl64(mu_lp, lp):
    mu, p = mu_lp.exp(), lp.exp()
    return mu * (mu_lp - lp) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - p + 1e-8))


# ---- DPPO ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence,delta_low,delta_high", [("binary_tv", 0.1, 0.15), ("binary_kl", 0.02, 0.03)])
@pytest.mark.parametrize("anchor", ["old", "rollout"])
def test_dppo_against_float64(divergence, delta_low, delta_high, anchor):
    """l_t = -r_t A_t k_t with the trust region k_t of the probability change p - mu; dL/dlp_t = -A k r / N."""
    d = inputs(spread=3.0)  # the sampler far enough from old that the rollout anchor drops tokens too
    cfg = C.dppo(dppo_divergence=divergence, clip_low=delta_low, clip_high=delta_high, ratio_anchor=anchor)
    lp = leaf(d["logp"])
    a = (d["old"] if anchor == "old" else d["rollout"]).double()
    adv, mask = d["adv_tok"].double(), d["mask"]
    diff = lp.detach().exp() - a.exp()
    if divergence == "binary_tv":
        up, down = diff > delta_high, -diff > delta_low
        check_margin("p - mu", diff, delta_high, mask & (adv > 0) & (diff > 0))
        check_margin("mu - p", -diff, delta_low, mask & (adv < 0) & (diff < 0))
    else:
        div = binary_kl64(a, lp.detach())
        up, down = (diff > 0) & (div > delta_high), (diff < 0) & (div > delta_low)
        check_margin("KL_b up", div, delta_high, mask & (adv > 0) & (diff > 0))
        check_margin("KL_b down", div, delta_low, mask & (adv < 0) & (diff < 0))
    dropped_high, dropped_low = mask & (adv > 0) & up, mask & (adv < 0) & down
    assert int(dropped_high.sum()) > 0 and int(dropped_low.sum()) > 0, "the draw must leave the region both ways"
    keep = (~(dropped_high | dropped_low)).double()
    ratio = torch.exp(lp - a)
    loss64 = token_mean(-ratio * adv * keep, mask)
    loss32, g32, metrics = ours(cfg, d)
    g64 = compare(f"dppo {divergence} {anchor}", loss64, lp, loss32, g32)
    assert bool((g64[dropped_high | dropped_low] == 0).all()) and bool((g32[dropped_high | dropped_low] == 0).all())
    n = mask.sum()
    assert_close("clip_ratio/high_mean", metrics["clip_ratio/high_mean"], dropped_high.sum() / n)
    assert_close("clip_ratio/low_mean", metrics["clip_ratio/low_mean"], dropped_low.sum() / n)
    assert_close("clip_ratio/region_mean", metrics["clip_ratio/region_mean"], (1 - keep)[mask].sum() / n)


def test_dppo_by_hand():
    """One token per case, mu = 0.5: A > 0 and p 0.5 -> 0.75 leaves a TV region of 0.2 (dropped: loss 0,
    no gradient); A < 0 and p 0.5 -> 0.4 stays inside (loss -r A = 0.8, gradient -A r = 0.8). Binary KL
    of (0.5 || 0.75) = 0.5 log(0.5 / 0.75) + 0.5 log(0.5 / 0.25) = 0.1438."""
    mu = torch.tensor([[math.log(0.5)]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    for p, adv, divergence, delta, expected_loss, expected_grad in [
        (0.75, 1.0, "binary_tv", 0.2, 0.0, 0.0),
        (0.4, -1.0, "binary_tv", 0.2, 0.8, 0.8),
        (0.75, 1.0, "binary_kl", 0.15, -1.5, -1.5),  # KL_b 0.1438 < 0.15: kept, -r A = -1.5
        (0.75, 1.0, "binary_kl", 0.14, 0.0, 0.0),  # > 0.14: dropped
        (0.75, -1.0, "binary_tv", 0.2, 1.5, 1.5),  # p rose but A < 0: the region's other side, kept
    ]:
        lp = torch.tensor([[math.log(p)]], requires_grad=True)
        cfg = C.dppo(dppo_divergence=divergence, clip_low=delta, clip_high=delta)
        out = gk.grpo_loss(lp, torch.tensor([adv]), mask, mu, config=cfg, backend="torch")
        (g,) = torch.autograd.grad(out.loss, lp)
        assert math.isclose(out.loss.item(), expected_loss, abs_tol=1e-6), (p, adv, divergence, out.loss.item())
        assert math.isclose(g.item(), expected_grad, abs_tol=1e-6), (p, adv, divergence, g.item())
    assert math.isclose(binary_kl64(mu.double(), torch.tensor([[math.log(0.75)]]).double()).item(),
                        0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), rel_tol=1e-6)  # fmt: skip


def test_dppo_limits():
    """Bounds wider than any probability change (1: |p - mu| < 1; KL_b of these draws < 10): nothing is
    dropped and DPPO is the unclipped surrogate -r A (ppo_clip with a clip range no ratio reaches)."""
    d = inputs()
    wide = C(clip_low=0.99, clip_high=1e3)  # lower bound 0.01 < every ratio of the draw (>= 0.14)
    for cfg in (C.dppo(clip_low=1.0, clip_high=1.0), C.dppo(dppo_divergence="binary_kl", clip_low=10.0, clip_high=10.0)):
        loss, g, metrics = ours(cfg, d)
        loss_ppo, g_ppo, _ = ours(wide, d)
        assert_close("dppo with an empty mask vs the unclipped surrogate", loss, loss_ppo, atol=1e-7, rtol=1e-6)
        assert_close("its gradient", g, g_ppo, scale=grad_scale(g_ppo))
        assert metrics["clip_ratio/region_mean"].item() == 0.0


# ---- CISPO's hard zero and the rollout anchor ----------------------------------------------------------


@pytest.mark.parametrize("form", ["mask", "relative"])
def test_cispo_rollout_anchor_against_float64(form):
    """SkyRL rollout_is (mask) and cispo_anchor="rollout" (relative): l = -sg(c(r)) A lp with
    r = pi / pi_rollout, c(r) = r inside (1 - eps_low, 1 + eps_high) and 0 outside, or the clamp."""
    d = inputs()
    cfg = C(loss_type="cispo", cispo_form=form, ratio_anchor="rollout", clip_low=0.2, clip_high=0.28)
    lp = leaf(d["logp"])
    adv, mask = d["adv_tok"].double(), d["mask"]
    r = torch.exp(lp.detach() - d["rollout"].double())
    check_margin("r vs 1 - eps_low", r, 0.8, mask)
    check_margin("r vs 1 + eps_high", r, 1.28, mask)
    inside = (r > 0.8) & (r < 1.28)
    assert int((inside & mask).sum()) > 0 and int((~inside & mask).sum()) > 0
    weight = torch.where(inside, r, torch.zeros_like(r)) if form == "mask" else r.clamp(0.8, 1.28)
    loss64 = token_mean(-weight * adv * lp, mask)
    loss32, g32, metrics = ours(cfg, d)
    g64 = compare(f"cispo {form} rollout", loss64, lp, loss32, g32)
    if form == "mask":
        assert bool((g64[mask & ~inside] == 0).all()) and bool((g32[mask & ~inside] == 0).all())
    assert_close("clip_ratio/any_mean", metrics["clip_ratio/any_mean"], (mask & ~inside).sum() / mask.sum())


def test_rollout_anchor_ratio_one_limit():
    """rollout = logp (the sampler is the current policy): r = 1, so rollout_is is -A lp (weight 1, inside
    the range), DPPO keeps every token, and the squared log-ratio penalty and its gradient are 0."""
    d = inputs()
    d["rollout"] = d["logp"].clone()
    gpg, g_gpg, _ = ours(C.gpg(), d, old=False, rollout=False)
    for cfg in (C(loss_type="cispo", cispo_form="mask", ratio_anchor="rollout"),
                C.dppo(ratio_anchor="rollout", ratio_kl_coef=1.0)):  # fmt: skip
        loss, g, metrics = ours(cfg, d)
        if cfg.loss_type == "cispo":
            assert_close("rollout_is at r = 1 vs -A lp", loss, gpg, atol=1e-7, rtol=1e-6)
        assert_close(f"{cfg.loss_type} at r = 1: dL/dlp = -A / N", g, g_gpg, scale=grad_scale(g_gpg))
        if cfg.ratio_kl_coef:
            assert metrics["ratio_kl"].item() == 0.0 and metrics["ratio_kl_loss"].item() == 0.0


def test_rollout_anchor_refusals():
    d = inputs()
    with pytest.raises(ValueError, match="ratio_anchor='rollout' needs rollout_logprobs"):
        ours(C.dppo(ratio_anchor="rollout"), d, rollout=False)
    d["rollout"][0, 1] = float("nan")  # unscored by the sampler: no ratio can be measured against it
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite"):
        ours(C.dppo(ratio_anchor="rollout"), d)
    with pytest.raises(ValueError, match="ratio_anchor='rollout' is defined for loss_type"):
        C(loss_type="sapo", ratio_anchor="rollout")


# ---- the squared log-ratio penalty ---------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ratio_kl_against_float64(agg):
    """P = coef AGG(lr^2 / 2 u) on the token log-ratio against the anchor, beside GSPO's sequence ratio
    (whose own value and gradient are unchanged), with per-token weights u; dP/dlp = coef c u lr."""
    d = inputs()
    coef = 0.3
    u = 0.5 + torch.rand(d["mask"].shape, generator=torch.Generator().manual_seed(3))
    cfg = C.gspo(ratio_anchor="rollout", ratio_kl_coef=coef, loss_agg_mode=agg)
    base = cfg.replace(ratio_kl_coef=0.0)
    lp = leaf(d["logp"])
    mask = d["mask"]
    m = mask.double()
    lr = (lp - d["rollout"].double()) * m
    per_token = 0.5 * lr * lr * u.double()
    if agg == "token-mean":
        penalty = per_token.sum() / m.sum()
    else:
        lengths = m.sum(-1)
        penalty = (per_token.sum(-1)[lengths > 0] / lengths[lengths > 0]).mean()
    loss_base, g_base, _ = ours(base, d, token_weights=u)
    loss32, g32, metrics = ours(cfg, d, token_weights=u)
    (g_pen,) = torch.autograd.grad(coef * penalty, lp)
    assert_close("loss - gspo's", loss32 - loss_base, coef * penalty.detach(), scale=1.0)
    assert_close("dL/dlp - gspo's", g32 - g_base, g_pen, scale=grad_scale(g_pen))
    assert_close("ratio_kl_loss", metrics["ratio_kl_loss"], penalty.detach())
    assert_close("ratio_kl", metrics["ratio_kl"], (0.5 * lr.detach() ** 2 * m).sum() / m.sum())


def test_ratio_kl_by_hand():
    # lp = (-1, -2), anchor (-1.5, -1): lr = (0.5, -1), lr^2 / 2 = (0.125, 0.5), token mean 0.3125;
    # d/dlp of coef * mean = coef * lr / 2 = (0.25, -0.5) * coef
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])
    cfg = C(loss_type="gpg", ratio_kl_coef=2.0)  # gpg's own term is -A lp = 0 with A = 0
    out = gk.grpo_loss(lp, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), old, config=cfg, backend="torch")
    (g,) = torch.autograd.grad(out.loss, lp)
    assert math.isclose(out.loss.item(), 2.0 * 0.3125, rel_tol=1e-6)
    assert torch.allclose(g, torch.tensor([[0.5, -1.0]]), atol=1e-6)


# ---- the geometric-mean sequence IS weight ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_geometric_is_against_float64(mode):
    """rho_i = exp(sum_t (old_t - rollout_t) / |o_i|), truncated to or masked outside [0.9, 1.1], times
    the PPO clipped surrogate (detached: it scales each sequence's gradient)."""
    d = inputs()
    cfg = C(is_level="sequence_geometric", is_mode=mode, is_min=0.9, is_max=1.1)
    lp = leaf(d["logp"])
    adv, mask = d["adv_tok"].double(), d["mask"]
    m = mask.double()
    lengths = m.sum(-1, keepdim=True)
    rho = torch.exp(((d["old"].double() - d["rollout"].double()) * m).sum(-1, keepdim=True) / lengths.clamp(min=1))
    nonempty = lengths[:, 0] > 0
    check_margin("rho vs 0.9", rho[:, 0], 0.9, nonempty)
    check_margin("rho vs 1.1", rho[:, 0], 1.1, nonempty)
    outside = ((rho < 0.9) | (rho > 1.1))[:, 0] & nonempty
    assert 0 < int(outside.sum()) < int(nonempty.sum()), "the draw must put sequences on both sides of a bound"
    w = rho.clamp(0.9, 1.1) if mode == "truncate" else torch.where((rho >= 0.9) & (rho <= 1.1), rho, 0 * rho)
    ratio = torch.exp(lp - d["old"].double())
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss64 = token_mean(surrogate * w, mask)
    loss32, g32, metrics = ours(cfg, d)
    compare(f"sequence_geometric {mode}", loss64, lp, loss32, g32)
    assert_close("is_weight/mean", metrics["is_weight/mean"], token_mean(w.expand_as(m), mask))


def test_sequence_geometric_relates_to_the_product():
    """One-token sequences: the geometric mean is the product. Longer ones: rho_geo^|o| = rho_prod."""
    d = inputs()
    lengths = d["mask"].sum(-1)
    one = torch.zeros_like(d["mask"])
    one[:, 0] = lengths > 0
    d1 = dict(d, mask=one)
    unbounded = dict(is_mode="truncate", is_max=1e6)
    geo, g_geo, _ = ours(C(is_level="sequence_geometric", **unbounded), d1)
    prod, g_prod, _ = ours(C(is_level="sequence", **unbounded), d1)
    assert_close("one-token sequences: loss", geo, prod, atol=1e-7, rtol=1e-6)
    assert_close("one-token sequences: dL/dlp", g_geo, g_prod, scale=grad_scale(g_prod))
    _, _, m_geo = ours(C(is_level="sequence_geometric", **unbounded), d, adv="adv_seq")
    _, _, m_prod = ours(C(is_level="sequence", **unbounded), d, adv="adv_seq")
    # per-sequence weights: the min / max over tokens are those of the sequences; rho_geo^|o| = rho_prod
    # holds per sequence, checked here on the sequence with the largest product weight
    d_seq = ((d["old"] - d["rollout"]) * d["mask"]).sum(-1)
    i = int(torch.where(lengths > 0, d_seq, torch.full_like(d_seq, -1e9)).argmax())
    assert_close("max product weight = geometric weight ^ |o|", m_prod["is_weight/max"],
                 torch.exp(d_seq[i]), rtol=1e-5)  # fmt: skip
    geo_i = torch.exp(d_seq[i] / lengths[i])
    assert float(m_geo["is_weight/min"]) <= float(geo_i) <= float(m_geo["is_weight/max"])


def test_sequence_geometric_is_one_when_the_sampler_agrees():
    d = inputs()
    d["rollout"] = d["old"].clone()
    plain, g_plain, _ = ours(C(), d, rollout=False)
    for cfg in (C(is_level="sequence_geometric", is_mode="mask", is_min=0.99, is_max=1.01),
                C(is_gate="ratio", is_gate_level="sequence", is_gate_min=0.99, is_gate_max=1.01),
                C(is_gate="binary_kl", is_gate_max=0.0), C(is_gate="tv", is_gate_level="sequence", is_gate_max=0.0)):  # fmt: skip
        loss, g, metrics = ours(cfg, d)
        assert_close(f"{cfg.is_level} / {cfg.is_gate}: loss with rollout = old", loss, plain, atol=0, rtol=1e-7)
        assert_close("dL/dlp", g, g_plain, atol=0, rtol=1e-7)
        assert metrics["is_weight/min"].item() == 1.0 and metrics["is_weight/max"].item() == 1.0


# ---- the sampler gates ---------------------------------------------------------------------------------------


def gate64(kind, level, lo, hi, d):
    """The gate's keep mask [B, T] from the README's table (float64) and the statistic it compared."""
    mask = d["mask"]
    m = mask.double()
    old, rollout = d["old"].double(), d["rollout"].double()
    if kind == "ratio":
        s = (old - rollout) * m
    elif kind == "binary_kl":
        s = binary_kl64(rollout, old) * m
    else:
        s = (rollout.exp() - old.exp()).abs() * m
    if level == "sequence":
        s = (s.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(m)
    if kind == "ratio":
        s = s.exp()
    keep = torch.ones_like(m, dtype=torch.bool)
    if lo is not None:
        keep &= s >= lo
        check_margin(f"{kind} {level} vs min", s, lo, mask)
    if hi is not None:
        keep &= s <= hi
        check_margin(f"{kind} {level} vs max", s, hi, mask)
    return keep & mask


@pytest.mark.parametrize(
    "kind,level,lo,hi",
    [("ratio", "sequence", 0.95, 1.05), ("ratio", "token", 0.8, 1.25), ("binary_kl", "token", None, 0.01),
     ("binary_kl", "sequence", None, 0.01), ("tv", "token", None, 0.05), ("tv", "sequence", None, 0.05)],
)  # fmt: skip
def test_sampler_gate_against_float64(kind, level, lo, hi):
    """Raw token IS weights rho_t = exp(old - rollout) (is_max=None) times the gate g (OpenRLHF's masked
    gating, NeMo-RL's seq-mask-tis for the ratio at the sequence level), with the PPO surrogate."""
    d = inputs()
    cfg = C(is_level="token", is_max=None, is_gate=kind, is_gate_level=level, is_gate_min=lo, is_gate_max=hi)
    lp = leaf(d["logp"])
    adv, mask = d["adv_tok"].double(), d["mask"]
    keep = gate64(kind, level, lo, hi, d)
    assert 0 < int(keep.sum()) < int(mask.sum()), "the draw must put units on both sides of the gate"
    rho = torch.exp(d["old"].double() - d["rollout"].double()) * keep
    ratio = torch.exp(lp - d["old"].double())
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss64 = token_mean(surrogate * rho, mask)
    loss32, g32, metrics = ours(cfg, d)
    compare(f"gate {kind} {level}", loss64, lp, loss32, g32)
    assert_close("is_weight/gated_frac", metrics["is_weight/gated_frac"], (mask & ~keep).sum() / mask.sum())
    assert_close("is_weight/mean", metrics["is_weight/mean"], token_mean(rho, mask))


def test_gate_alone_and_with_truncation():
    """Without is_level the gate's weight is 1 where it keeps (SkyRL's sequence mask without TIS); with a
    truncated token weight it multiplies the truncated weight (SkyRL's TIS plus geometric mask)."""
    d = inputs()
    keep = gate64("ratio", "sequence", 0.95, 1.05, d).double()
    base, _, _ = ours(C(), d, rollout=False, token_weights=keep.float())
    gated, _, _ = ours(C(is_gate="ratio", is_gate_level="sequence", is_gate_min=0.95, is_gate_max=1.05), d)
    assert_close("gate alone = the keep mask as token weights", gated, base, atol=1e-7, rtol=1e-6)
    rho = torch.exp(d["old"] - d["rollout"]).clamp(max=1.5) * keep
    weighted, _, _ = ours(C(), d, rollout=False, token_weights=rho.float())
    both, _, _ = ours(C(is_level="token", is_max=1.5, is_gate="ratio", is_gate_level="sequence", is_gate_min=0.95,
                        is_gate_max=1.05), d)  # fmt: skip
    assert_close("TIS x gate", both, weighted, atol=1e-7, rtol=1e-6)


def test_unscored_sampler_tokens_are_neutral_in_the_new_weights():
    """A NaN sampler log-prob (TRL's "could not score") counts as rollout = old in the geometric weight and
    in every gate, as in the token and product weights."""
    d = inputs()
    nan_at = (0, 2)
    neutral = {k: v.clone() for k, v in d.items()}
    neutral["rollout"][nan_at] = d["old"][nan_at]
    with_nan = {k: v.clone() for k, v in d.items()}
    with_nan["rollout"][nan_at] = float("nan")
    for cfg in (C(is_level="sequence_geometric", is_mode="truncate", is_min=0.9, is_max=1.1),
                C(is_level="token", is_max=None, is_gate="binary_kl", is_gate_level="sequence", is_gate_max=0.01),
                C(is_gate="tv", is_gate_max=0.05), C(is_gate="ratio", is_gate_min=0.8, is_gate_max=1.25)):  # fmt: skip
        a, ga, _ = ours(cfg, with_nan)
        b, gb, _ = ours(cfg, neutral)
        assert_close(f"{cfg.is_level} / {cfg.is_gate}: loss", a, b, atol=0, rtol=1e-7)
        assert_close("dL/dlp", ga, gb, atol=0, rtol=1e-7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(is_gate="tv"), "needs is_gate_max"),
        (dict(is_gate="binary_kl", is_gate_min=0.0, is_gate_max=0.1), "bounded above only"),
        (dict(is_gate="ratio"), "needs is_gate_min or is_gate_max"),
        (dict(is_gate="ratio", is_gate_min=1.2, is_gate_max=1.1), "need is_gate_min < is_gate_max"),
        (dict(is_gate_max=0.1), "only used with is_gate set"),
        (dict(is_gate_level="sequence"), "only used with is_gate set"),
        (dict(is_gate="l1", is_gate_max=0.1), "unknown is_gate"),
        (dict(loss_type="vespo", is_gate="tv", is_gate_max=0.1), "vespo folds"),
        (dict(loss_type="group_dpo", group_size=2, is_gate="tv", is_gate_max=0.1), "group_dpo is a sequence-pair"),
        (dict(is_level="token", is_mode="mask", is_max=None), "would mask nothing"),
        (dict(is_min=-0.5), "is_min must be >= 0"),
        (dict(dppo_divergence="binary_kl"), "only used by loss_type='dppo'"),
        (dict(loss_type="dppo", dppo_divergence="kl"), "unknown dppo_divergence"),
        (dict(loss_type="dppo", ratio_level="sequence"), "ratio_level must be 'token'"),
        (dict(loss_type="dppo", dual_clip=3.0), "dual_clip applies to"),
        (dict(ratio_anchor="sampler"), "unknown ratio_anchor"),
        (dict(ratio_kl_coef=-1.0), "ratio_kl_coef must be >= 0"),
        (dict(loss_type="gmpo", ratio_kl_coef=0.1), "sequence-level objective"),
        (dict(cispo_form="clamp"), "unknown cispo_form"),
    ],
)
def test_config_refuses_bad_variant_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C(**kwargs)


def test_inputs_the_new_fields_need():
    d = inputs()
    with pytest.raises(ValueError, match="is_gate='tv' needs rollout_logprobs"):
        ours(C(is_gate="tv", is_gate_max=0.1), d, rollout=False)
    # rollout_logprobs used by nothing but the anchor: accepted (not "nothing uses them")
    ours(C.dppo(ratio_anchor="rollout"), d)


def test_the_trainer_passes_and_requires_the_sampler_for_these_variants():
    """`grpo-kernels train --loss-option ...`: a variant that reads the sampler's log-probs needs the vLLM
    sampler (transformers' generate samples with the training weights: nothing to measure against)."""
    from grpo_kernels.trainer import TrainConfig

    for options in ({"ratio_anchor": "rollout"}, {"is_gate": "tv", "is_gate_max": 0.1},
                    {"is_level": "sequence_geometric"}):  # fmt: skip
        with pytest.raises(ValueError, match=r"need the sampler's log-probs \(--rollout-engine vllm\)"):
            TrainConfig(loss="dppo", loss_options=options)
    assert TrainConfig(loss="dppo", loss_options={"ratio_kl_coef": 0.002}).loss_config(8).ratio_kl_coef == 0.002
