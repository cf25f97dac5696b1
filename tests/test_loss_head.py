"""Tier 1: properties of the loss head (grpo_loss on the PyTorch backend = the fp32 reference).

Parity with TRL's and verl's own code is in test_parity_*.py; here: the invariants every variant must
satisfy, the aggregation and normalizer algebra, and bad input.
"""

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from grpo_kernels.testing import assert_close

B, T = 5, 9  # odd sizes; masks below make sequences ragged (one of length 1)


def batch(per_token_adv=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 1, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    lp = -torch.rand(B, T, generator=g) * 3 - 0.05
    old = lp + torch.randn(B, T, generator=g) * 0.3  # ratios straddle both clip bounds
    ref = lp + torch.randn(B, T, generator=g) * 0.2
    rollout = old + torch.randn(B, T, generator=g) * 0.2
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    ent = torch.rand(B, T, generator=g) * 2
    return dict(lp=lp, old=old, ref=ref, rollout=rollout, adv=adv, ent=ent, mask=mask)


# One configuration per code path of the reference; ids say which.
CONFIGS = {
    "grpo": C.grpo(),
    "dapo": C.dapo(),
    "dr_grpo": C.dr_grpo(max_completion_length=T),
    "bnpo": C.bnpo(),
    "gspo": C.gspo(),
    "gspo_token": C.gspo(ratio_level="sequence_token"),
    "tic_grpo_seq_sum": C(ratio_level="sequence_sum", clip_low=0.2, clip_high=0.2),
    "dual_clip": C(dual_clip=3.0),
    "delta": C(delta=1.5),
    "delta_inside_clip": C(delta=1.1),  # below 1 + clip_high: caps ratios the clip lets through (TRL allows it)
    "cispo_relative": C.cispo(),
    "cispo_absolute": C.cispo(cispo_form="absolute", cispo_cap=1.2),
    "gpg": C.gpg(),
    "gmpo": C.gmpo(),
    "sapo": C.sapo(),
    "vespo": C(loss_type="vespo"),
    "vespo_sequence_kl": C(loss_type="vespo", ratio_level="sequence", kl_coef=0.1, kl_ratio_correction=True),
    "clip_cov": C(loss_type="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=1.0),
    "kl_cov": C(loss_type="kl_cov", kl_cov_ratio=0.2),
    "kl_k1_ratio_corrected": C(kl_coef=0.1, kl_estimator="k1", kl_ratio_correction=True),
    "kl_k2": C(kl_coef=0.1, kl_estimator="k2"),
    "kl_low_var_straight_through": C(kl_coef=0.1, kl_estimator="low_var_kl", kl_straight_through=True),
    "kl_abs": C(kl_coef=0.1, kl_estimator="abs"),
    "kl_own_aggregation": C(kl_coef=0.1, kl_agg_mode="seq-mean-token-mean", loss_agg_mode="token-mean"),
    "entropy_bonus": C(entropy_coef=0.01),
    "entropy_penalty": C(entropy_coef=-0.02),
    "entropy_bonus_trl": C(entropy_coef=0.01, entropy_agg_mode="token-mean-local", loss_agg_mode="seq-mean-token-sum"),
    "top_entropy": C(top_entropy_quantile=0.5, entropy_coef=0.02),
    "off_policy_mask": C(off_policy_mask_threshold=0.05),
    "tis_token": C(is_level="token", is_mode="truncate", is_max=1.1),
    "mis_sequence": C(is_level="sequence", is_mode="mask", is_min=0.5, is_max=2.0),
    "olmo3": C.olmo3(),
    "lopti_low": C(old_prob_threshold=0.3, old_prob_side="low"),
    "token_sum": C(loss_agg_mode="token-sum"),
    "length_pow": C(loss_agg_mode="length-pow", length_power=0.5),
    "pspo": C.pspo(),
    "dcpo": C.dcpo(),
    "prefix_trace": C(ratio_level="prefix", prefix_decay=0.8),
    "tic_grpo": C.tic_grpo(),
    "group_dpo": C(loss_type="group_dpo", group_size=5, dpo_beta=0.5),
    "seq_mean_token_sum": C(loss_agg_mode="seq-mean-token-sum"),
    # the trust region, the rollout anchor, the squared log-ratio penalty, geometric IS and the gates
    "dppo_binary_tv": C.dppo(clip_low=0.1, clip_high=0.1),
    "dppo_binary_kl": C.dppo(dppo_divergence="binary_kl", clip_low=0.01, clip_high=0.01),
    "dppo_rollout_ratio_kl": C.dppo(ratio_anchor="rollout", ratio_kl_coef=0.5, clip_low=0.05, clip_high=0.05),  # prime-rl
    "rollout_is": C(loss_type="cispo", cispo_form="mask", ratio_anchor="rollout"),  # SkyRL rollout_is
    "cispo_rollout_anchor": C.cispo(ratio_anchor="rollout", clip_low=0.2, clip_high=0.2),
    "gspo_rollout_ratio_kl": C.gspo(ratio_anchor="rollout", ratio_kl_coef=0.3, clip_low=0.05, clip_high=0.05),
    "is_sequence_geometric_truncate": C(is_level="sequence_geometric", is_min=0.95, is_max=1.02),
    "is_sequence_geometric_mask": C(is_level="sequence_geometric", is_mode="mask", is_min=0.95, is_max=1.05),
    "seq_mask_tis": C(is_level="token", is_max=None, is_gate="ratio", is_gate_level="sequence", is_gate_min=0.95,
                      is_gate_max=1.05),  # NeMo-RL seq-mask-tis  # fmt: skip
    "gate_binary_kl_token": C(is_gate="binary_kl", is_gate_max=0.005),
    "gate_tv_sequence_tis": C(is_level="token", is_gate="tv", is_gate_level="sequence", is_gate_max=0.03),
}


def call(cfg, d, *, lp=None, old="default", layout="padded", **kw):
    """grpo_loss with the inputs this config uses; lp is a leaf so gradients can be read."""
    lp = (d["lp"] if lp is None else lp).clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    old_lp = d["old"] if isinstance(old, str) else old
    args = dict(
        old_logprobs=old_lp,
        ref_logprobs=d["ref"] if cfg.needs_reference else None,
        rollout_logprobs=d["rollout"] if cfg.uses_rollout_logprobs else None,
        entropy=ent,
        config=cfg,
        backend="torch",
    )
    args.update(kw)
    out = gk.grpo_loss(lp, d["adv"], d["mask"], **args)
    grads = torch.autograd.grad(out.loss, [lp, ent], allow_unused=True)
    zero = torch.zeros_like(lp)
    return out, (zero if grads[0] is None else grads[0]), (zero if grads[1] is None else grads[1])


def agg_weights(cfg, mask):
    """d loss / d (per-token objective) for each loss_agg_mode with local normalizers."""
    m = mask.float()
    lengths = m.sum(-1, keepdim=True)
    n_seq = (lengths > 0).float().sum()
    return {
        "token-mean": m / m.sum(),
        "token-sum": m,
        "seq-mean-token-sum": m / n_seq,
        "seq-mean-token-sum-norm": m / n_seq / (cfg.max_completion_length or 1),
        "seq-mean-token-mean": m / lengths.clamp(min=1) / n_seq,
        "length-pow": m * lengths.clamp(min=1) ** -cfg.length_power
        / (lengths.clamp(min=1) ** (1 - cfg.length_power) * (lengths > 0)).sum(),
    }[cfg.loss_agg_mode]


ON_POLICY_VALUE_IS_MINUS_A = {"grpo", "dapo", "dr_grpo", "bnpo", "gspo", "gspo_token", "tic_grpo_seq_sum",
                              "dual_clip", "delta", "kl_cov", "token_sum", "seq_mean_token_sum", "length_pow",
                              "pspo", "dcpo", "prefix_trace", "tic_grpo", "dppo_binary_tv", "dppo_binary_kl"}  # fmt: skip
# measured against the sampler's log-probs or weighted by their mismatch: no ratio-1 limit with old = None
SAMPLER_DEPENDENT = {name for name, cfg in CONFIGS.items() if cfg.uses_rollout_logprobs}


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - {"clip_cov", "top_entropy", "group_dpo", "lopti_low"}
                                        - SAMPLER_DEPENDENT))  # fmt: skip
def test_on_policy_gradient_is_minus_advantage(name):
    """old = None (ratio 1): every objective's gradient w.r.t. log p_t is -A_t times its aggregation
    weight; for the ratio objectives the loss itself is the aggregated -A."""
    cfg = CONFIGS[name].replace(kl_coef=0.0, entropy_coef=0.0)
    d = batch(per_token_adv=False)
    out, g_lp, _ = call(cfg, d, old=None)
    a = d["adv"][:, None].expand(B, T)
    w = w_loss = agg_weights(cfg, d["mask"]) if cfg.loss_type != "gmpo" else agg_weights(C.grpo(), d["mask"])
    if cfg.ratio_level in ("sequence", "sequence_sum"):
        # one ratio per sequence, r_i = exp(sum_t lr_t / |o_i|) or exp(sum_t lr_t): each token's log p
        # moves r_i by 1/|o_i| (or 1), and r_i multiplies the weights of all tokens of the sequence
        per_seq = w.sum(-1, keepdim=True)
        if cfg.ratio_level == "sequence":
            per_seq = per_seq / d["mask"].sum(-1, keepdim=True).clamp(min=1)
        w = per_seq * d["mask"]
    if cfg.ratio_level == "prefix":
        # r_t = exp(sum_{k<=t} decay^(t-k) lr_k): log p_k moves every later r_t by decay^(t-k)
        later = torch.zeros_like(w)
        for t in reversed(range(T)):
            later[:, t] = w[:, t] + (cfg.prefix_decay * later[:, t + 1] if t + 1 < T else 0.0)
        w = later * d["mask"]
    if cfg.loss_type == "pspo":
        w = w * (1.0 - cfg.pspo_alpha)  # r~ = (1 - a) r + a
    assert_close(f"{name}: dL/dlogp", g_lp, -a * w, atol=1e-7, rtol=1e-5)
    if name in ON_POLICY_VALUE_IS_MINUS_A:
        assert_close(f"{name}: loss", out.loss, (-a * w_loss).sum(), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_masked_tokens_contribute_exactly_zero(name):
    """Whatever masked positions hold (huge values here), loss, metrics and gradients are unchanged,
    and the gradient at masked positions is exactly 0."""
    cfg = CONFIGS[name]
    d = batch(per_token_adv=True)
    out, g_lp, g_ent = call(cfg, d)
    junk = {k: v.clone() for k, v in d.items()}
    off = ~d["mask"]
    for k in ("lp", "old", "ref", "rollout", "adv", "ent"):
        junk[k][off] = 1e4 * torch.randn(int(off.sum()))
    torch.manual_seed(0)  # clip_cov draws a random subset
    out2, g_lp2, g_ent2 = call(cfg, junk)
    assert_close(f"{name}: loss", out2.loss, out.loss, atol=0, rtol=0)
    assert_close(f"{name}: dL/dlogp", g_lp2, g_lp, atol=0, rtol=0)
    assert_close(f"{name}: dL/dH", g_ent2, g_ent, atol=0, rtol=0)
    assert bool((g_lp2[off] == 0).all()) and bool((g_ent2[off] == 0).all())
    for key, value in out.metrics.items():
        assert_close(f"{name}: metric {key}", out2.metrics[key], value, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_all_masked_batch_gives_zero_loss(name):
    cfg = CONFIGS[name]
    d = batch()
    d["mask"] = torch.zeros(B, T, dtype=torch.bool)
    out, g_lp, g_ent = call(cfg, d)
    assert out.loss.item() == 0.0
    assert bool((g_lp == 0).all()) and bool((g_ent == 0).all())


@pytest.mark.parametrize("name", ["dapo", "grpo", "gpg", "cispo_relative", "sapo", "gspo", "dppo_binary_tv"])
def test_gradient_sign_follows_advantage(name):
    """Descending the loss raises log p of tokens with A > 0 and lowers it for A < 0 (on-policy)."""
    d = batch(per_token_adv=False)  # a sequence-level ratio (gspo) mixes the advantages of one sequence
    _, g_lp, _ = call(CONFIGS[name].replace(kl_coef=0.0), d, old=None)
    m = d["mask"]
    adv = d["adv"][:, None].expand(B, T)
    assert bool((torch.sign(-g_lp[m]) == torch.sign(adv[m])).all())


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - {"clip_cov"}))
def test_packed_layout_equals_padded(name):
    cfg = CONFIGS[name]
    d = batch(per_token_adv=False)
    out, g_lp, g_ent = call(cfg, d)
    m = d["mask"]
    lengths = m.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed = {k: (v[m] if v.shape == (B, T) else v) for k, v in d.items()}
    packed["mask"] = torch.ones(int(lengths.sum()), dtype=torch.bool)
    out_p, g_lp_p, g_ent_p = call(cfg, packed, cu_seqlens=cu)
    assert_close("loss", out_p.loss, out.loss, atol=1e-7, rtol=1e-6)
    assert_close("dL/dlogp", g_lp_p, g_lp[m], atol=1e-8, rtol=1e-6)
    assert_close("dL/dH", g_ent_p, g_ent[m], atol=1e-8, rtol=1e-6)
    for key in out.metrics:
        assert_close(f"metric {key}", out_p.metrics[key], out.metrics[key], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "seq-mean-token-mean"])  # fmt: skip
@pytest.mark.parametrize("dp_size", [1, 2])
def test_global_normalizers_make_micro_batches_add_up(mode, dp_size):
    """Gradient accumulation and data parallelism: the two halves of a batch, each normalised by the
    counts of the whole batch, sum (ranks: average) to the loss of the whole batch."""
    cfg = C(loss_agg_mode=mode, max_completion_length=T if mode.endswith("norm") else None, kl_coef=0.05)
    d = batch(per_token_adv=True)
    full, _, _ = call(cfg, d)
    n_tok = float(d["mask"].sum())
    n_seq = float((d["mask"].sum(-1) > 0).sum())
    parts = []
    for rows in (slice(0, 2), slice(2, B)):
        part = {k: v[rows] for k, v in d.items()}
        out, _, _ = call(cfg, part, num_tokens=n_tok, num_sequences=n_seq, dp_size=dp_size)
        parts.append(out.loss)
    assert_close(f"{mode}", sum(parts) / dp_size, full.loss, atol=1e-7, rtol=1e-6)


def test_grad_accum_steps_divides_local_means():
    d = batch()
    full, _, _ = call(C.bnpo(), d)
    ga, _, _ = call(C.bnpo(), d, grad_accum_steps=4)
    assert_close("loss / GA", ga.loss, full.loss / 4, atol=1e-8, rtol=1e-6)


def test_aggregation_modes_by_hand():
    # gpg on-policy: per-token objective = -A * logp; with A = 1 it is -logp
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.ones(2)
    expected = {
        "token-mean": (1 + 2 + 3 + 4) / 4,
        "token-sum": 10.0,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-sum-norm": (6 + 4) / 2 / 5,
        "seq-mean-token-mean": (2 + 4) / 2,
    }
    for mode, value in expected.items():
        cfg = C(loss_type="gpg", loss_agg_mode=mode, max_completion_length=5 if mode.endswith("norm") else None)
        out = gk.grpo_loss(lp, adv, mask, config=cfg, backend="torch")
        assert math.isclose(out.loss.item(), value, rel_tol=1e-6), (mode, out.loss.item(), value)


def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    x = ref - lp.detach()
    forms = {
        "k1": -x,
        "k2": 0.5 * x**2,
        "k3": torch.exp(x) - x - 1,
        "low_var_kl": torch.exp(x) - x - 1,  # inside the clamps
        "abs": x.abs(),
    }
    for name, per_token in forms.items():
        cfg = C(loss_type="gpg", kl_coef=1.0, kl_estimator=name)
        out = gk.grpo_loss(lp, torch.zeros(1), mask, ref_logprobs=ref, config=cfg, backend="torch")
        assert_close(f"kl {name}", out.loss, per_token.mean(), atol=1e-7, rtol=1e-6)
        assert_close(f"kl metric {name}", out.metrics["kl"], per_token.mean(), atol=1e-7, rtol=1e-6)
    # straight-through: the value of k3, the gradient of k2 (d/dlp 0.5 (ref - lp)^2 = lp - ref)
    cfg = C(loss_type="gpg", kl_coef=1.0, kl_estimator="k3", kl_straight_through=True)
    out = gk.grpo_loss(lp, torch.zeros(1), mask, ref_logprobs=ref, config=cfg, backend="torch")
    (g,) = torch.autograd.grad(out.loss, lp)
    assert_close("k3+ value", out.loss, forms["k3"].mean(), atol=1e-7, rtol=1e-6)
    assert_close("k3+ grad", g, (lp.detach() - ref) / 2, atol=1e-7, rtol=1e-6)


def test_truncated_and_masked_importance_weights_by_hand():
    lp = torch.zeros(1, 3)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.0, 1.0]])  # old / rollout = 1, e, 1/e
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1)
    tis = C(loss_type="gpg", is_level="token", is_mode="truncate", is_max=2.0)
    out = gk.grpo_loss(lp, adv, mask, old, rollout_logprobs=rollout, config=tis, backend="torch")
    assert_close("TIS weights", torch.stack([out.metrics["is_weight/min"], out.metrics["is_weight/max"]]),
                 torch.tensor([math.exp(-1), 2.0]), atol=1e-6, rtol=1e-6)  # fmt: skip
    mis = C(loss_type="gpg", is_level="token", is_mode="mask", is_min=0.5, is_max=2.0)
    out = gk.grpo_loss(lp, adv, mask, old, rollout_logprobs=rollout, config=mis, backend="torch")
    assert_close("MIS masked fraction", out.metrics["is_weight/masked_frac"], torch.tensor(2 / 3), atol=1e-6, rtol=0)
    seq = C(loss_type="gpg", is_level="sequence", is_mode="truncate", is_max=2.0)
    out = gk.grpo_loss(lp, adv, mask, old, rollout_logprobs=rollout, config=seq, backend="torch")
    assert_close("sequence IS (sum of log-diffs = 0)", out.metrics["is_weight/mean"], torch.tensor(1.0), atol=1e-6, rtol=0)


UNSCORED_CASES = ["tis_token", "mis_sequence", "off_policy_mask", "is_sequence_geometric_mask", "seq_mask_tis",
                  "gate_binary_kl_token", "gate_tv_sequence_tis"]  # fmt: skip


@pytest.mark.parametrize("name", UNSCORED_CASES)
def test_unscored_rollout_tokens_are_neutral(name):
    """NaN sampler log-probs (tokens vLLM could not score, TRL's convention) carry no evidence: the
    IS weight of such a token is that of rollout = old, its off-policy divergence that of rollout = logp."""
    cfg = CONFIGS[name]
    d = batch(per_token_adv=True)
    nan_at = (0, 2)
    with_nan = {k: v.clone() for k, v in d.items()}
    with_nan["rollout"][nan_at] = float("nan")
    neutral = {k: v.clone() for k, v in d.items()}
    neutral["rollout"][nan_at] = d["lp"][nan_at] if name == "off_policy_mask" else d["old"][nan_at]
    out_nan, g_nan, _ = call(cfg, with_nan)
    out_ref, g_ref, _ = call(cfg, neutral)
    assert_close("loss", out_nan.loss, out_ref.loss, atol=0, rtol=1e-7)
    assert_close("dL/dlogp", g_nan, g_ref, atol=0, rtol=1e-7)
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite"):
        inf = {k: v.clone() for k, v in d.items()}
        inf["rollout"][nan_at] = float("inf")
        call(cfg, inf)


def test_dual_clip_caps_negative_advantage_loss():
    # A < 0 and ratio e^2 ~ 7.4: PPO gives -A r = 7.4 |A|; the dual clip caps it at c |A| = 3 |A|
    lp = torch.tensor([[2.0]])
    out = gk.grpo_loss(lp, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1),
                       config=C(dual_clip=3.0), backend="torch")  # fmt: skip
    assert math.isclose(out.loss.item(), 3.0, rel_tol=1e-6)
    assert out.metrics["clip_ratio/dual_mean"].item() == 1.0


def test_dcpo_bounds_depend_on_the_old_probability():
    # q = 0.9: bounds [0.5 + 0.5 sqrt(1 - 4 * 0.16 / 0.9), 0.5 + 0.5 sqrt(1 + 4 * 0.2 / 0.9)] = [0.768, 1.186]
    # q = 0.01: lower bound 0.5 (sqrt of a negative clamps to 0), upper 0.5 + 0.5 sqrt(81) = 5
    cfg = C.dcpo()
    q = torch.tensor([[0.9, 0.01]])
    old = q.log()
    for ratio, adv, expected in [(1.5, 1.0, 1.186), (0.5, -1.0, 0.768), (7.0, 1.0, 5.0), (0.3, -1.0, 0.5)]:
        token = 0 if expected in (1.186, 0.768) else 1
        lp = old.clone()
        lp[0, token] += math.log(ratio)
        m = torch.zeros(1, 2, dtype=torch.bool)
        m[0, token] = True
        out = gk.grpo_loss(lp, torch.tensor([adv]), m, old, config=cfg.replace(dual_clip=None), backend="torch")
        # the clipped branch is active: loss = -A clip(r) (token-sum over one sequence of one token)
        assert math.isclose(out.loss.item(), -adv * expected, rel_tol=2e-3), (ratio, adv, out.loss.item())


def test_group_dpo_by_hand():
    # one group of 3: advantages pick sequence 1 (best) over sequence 2 (worst)
    lp = torch.tensor([[-1.0, -1.0], [-0.5, -0.7], [-2.0, -1.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([0.1, 1.0, -1.1])
    cfg = C(loss_type="group_dpo", group_size=3, dpo_beta=0.5)
    out = gk.grpo_loss(lp, adv, mask, ref_logprobs=ref, config=cfg, backend="torch")
    margin = ((-0.5 - 0.7) - (-2.0)) - ((-2.0 - 1.5) - (-2.0))  # (S_w - S_ref_w) - (S_l - S_ref_l) = 2.3
    expected = -torch.nn.functional.logsigmoid(torch.tensor(0.5 * margin))
    assert math.isclose(out.loss.item(), expected.item(), rel_tol=1e-6)
    assert out.metrics["dpo/accuracy"].item() == 1.0
    (g,) = torch.autograd.grad(out.loss, lp)
    assert bool((g[0] == 0).all()) and bool((g[1] < 0).all()) and bool((g[2] > 0).all())
    # a group whose advantages are all equal has no preference: loss 0
    out = gk.grpo_loss(lp, torch.zeros(3), mask, ref_logprobs=ref, config=cfg, backend="torch")
    assert out.loss.item() == 0.0 and out.metrics["dpo/pairs"].item() == 0


def test_length_pow_interpolates_token_and_sequence_means():
    d = batch(per_token_adv=True)
    for power, mode in [(0.0, "token-mean"), (1.0, "seq-mean-token-mean")]:
        a, _, _ = call(C(loss_agg_mode="length-pow", length_power=power), d)
        b, _, _ = call(C(loss_agg_mode=mode), d)
        assert_close(f"length-pow p={power} vs {mode}", a.loss, b.loss, atol=1e-7, rtol=1e-6)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_type="ppo"), "unknown loss_type 'ppo'"),
        (dict(loss_agg_mode="mean"), "unknown loss_agg_mode"),
        (dict(kl_estimator="k4"), "unknown kl_estimator"),
        (dict(clip_low=-0.1), "clip_low and clip_high must be >= 0"),
        (dict(kl_coef=-1.0), "kl_coef must be >= 0"),
        (dict(entropy_coef=float("inf")), "entropy_coef must be a finite number"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "needs max_completion_length"),
        (dict(max_completion_length=128), "only used by 'seq-mean-token-sum-norm'"),
        (dict(dual_clip=0.5), "dual_clip must be > 1"),
        (dict(delta=0.0), "delta caps a ratio"),
        (dict(loss_type="cispo", delta=1.5), "delta applies to loss_type='ppo_clip' only"),
        (dict(loss_type="vespo", ratio_level="sequence_sum"), "vespo' takes ratio_level 'token' or 'sequence'"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(clip_high=float("nan")), "clip_high must be a finite number"),
        (dict(loss_type="cispo", cispo_form="absolute"), "needs cispo_cap"),
        (dict(cispo_cap=5.0), "cispo_cap is only used"),
        (dict(loss_type="gpg", ratio_level="sequence"), "defines its own ratio"),
        (dict(top_entropy_quantile=0.0), "top_entropy_quantile must be in"),
        (dict(is_min=3.0, is_max=2.0), "need 0 <= is_min < is_max"),
        (dict(loss_type="gmpo", top_entropy_quantile=0.2), "token selection"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C(**kwargs)


def test_presets_and_frozen():
    for name in C.PRESETS:
        cfg = C.from_preset(name)
        assert isinstance(cfg, C) and cfg.__doc__
    with pytest.raises(ValueError, match="unknown preset"):
        C.from_preset("ppo")
    with pytest.raises(Exception):
        C.grpo().kl_coef = 0.0  # frozen
    assert C.dapo(clip_high=0.3).clip_high == 0.3


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(adv=torch.randn(4)), r"advantages must be per sequence \(5,\) or per token \(5, 9\)"),
        (dict(mask=torch.ones(5, 8, dtype=torch.bool)), "mask must have the shape of logprobs"),
        (dict(lp=torch.zeros(5, 9, dtype=torch.int64)), "logprobs must have dtype"),
        (dict(lp=torch.zeros(45)), "token tensors must be \\[B, T\\]"),
        (dict(lp=torch.zeros(0, 9), mask=torch.zeros(0, 9, dtype=torch.bool), adv=torch.zeros(0)), "empty batch"),
        (dict(lp=torch.full((5, 9), float("nan"))), "logprobs has .* non-finite"),
        (dict(adv=torch.tensor([1.0, float("inf"), 0, 0, 0])), "advantages has .* non-finite"),
    ],
)
def test_grpo_loss_bad_input(change, match):
    d = batch()
    d.update(change)
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], config=C.dapo(), backend="torch")


def test_inputs_a_config_would_drop_are_refused():
    d = batch()
    with pytest.raises(ValueError, match="kl_coef=0.04 needs ref_logprobs"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], config=C.grpo(), backend="torch")
    with pytest.raises(ValueError, match="rollout_logprobs were given but nothing uses them"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], rollout_logprobs=d["rollout"], config=C.dapo(), backend="torch")
    with pytest.raises(ValueError, match="is_level='token' needs rollout_logprobs"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], config=C.olmo3(), backend="torch")
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], config=C(entropy_coef=0.1), backend="torch")
    with pytest.raises(ValueError, match="config must be a grpo_kernels.PolicyLossConfig"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], config={"loss_type": "dapo"}, backend="torch")
    with pytest.raises(ValueError, match=r"dp_size must be a whole number >= 1 \(data-parallel ranks\), got 1.5"):
        gk.grpo_loss(d["lp"], d["adv"], d["mask"], dp_size=1.5, backend="torch")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at the token count 45"):
        gk.grpo_loss(d["lp"].reshape(-1), d["adv"], d["mask"].reshape(-1), cu_seqlens=torch.tensor([0, 9, 40]),
                     backend="torch")  # fmt: skip


def test_garbage_at_masked_positions_passes_the_finite_check():
    d = batch()
    d["lp"][~d["mask"]] = float("nan")
    out = gk.grpo_loss(d["lp"], d["adv"], d["mask"], config=C.dapo(), backend="torch")
    assert torch.isfinite(out.loss)


def test_kernel_covers_every_config_value():
    """Every value a config field may take has a code path in the Triton kernel."""
    from grpo_kernels import config
    from grpo_kernels.ops.loss_head import triton as kernel

    assert set(kernel.LOSS_IDS) == set(config.LOSS_TYPES)
    assert set(kernel.LEVEL_IDS) | set(config.TORCH_ONLY_RATIO_LEVELS) == set(config.RATIO_LEVELS)
    assert not set(kernel.LEVEL_IDS) & set(config.TORCH_ONLY_RATIO_LEVELS)
    assert set(kernel.KL_IDS) == set(config.KL_ESTIMATORS)
    assert set(kernel.AGG_IDS) == set(config.LOSS_AGG_MODES) | {"token-mean-local"}
    assert set(config.ENTROPY_AGG_MODES) - {None} <= set(kernel.AGG_IDS)


def test_every_loss_variant_has_a_test_row():
    """A loss variant is one file (grpo_kernels/ops/loss_head/variants/<loss_type>.py) plus one row of CONFIGS
    above: every registered variant has a row here (so every property, packed-layout, fused and interpreter test
    runs on it), its named constant in the kernel, an AOT compile case, and frozen params that the flat keywords
    of PolicyLossConfig reach."""
    import dataclasses

    from grpo_kernels.ops.loss_head import triton as kernel
    from grpo_kernels.ops.loss_head.variants import VARIANTS, LossId
    from grpo_kernels.testing import loss_head_compile

    tested = {cfg.loss_type for cfg in CONFIGS.values()}
    compiled = {cfg.loss_type for cfg, _ in loss_head_compile.CASES.values()}
    for name, variant in VARIANTS.items():
        assert name in tested, f"loss variant {name!r} has no row in tests/test_loss_head.py CONFIGS"
        assert name in compiled, f"loss variant {name!r} has no AOT compile case (its file's compile_cases)"
        assert getattr(kernel, f"LOSS_{name.upper()}") == int(LossId[name.upper()]) == kernel.LOSS_IDS[name]
        assert dataclasses.is_dataclass(variant.params) and variant.params.__dataclass_params__.frozen, name
        assert set(variant.config_fields.values()) <= {f.name for f in dataclasses.fields(C)}, name
        for preset, keywords in variant.presets.items():
            assert C.from_preset(preset).loss_type == keywords["loss_type"] == name, preset
    assert C.dppo(dppo_divergence="binary_kl").params.divergence == "binary_kl"
    assert C.sapo(sapo_tau_neg=1.5).params.tau_neg == 1.5


def test_variant_params_are_validated_and_refused_where_keywords_exist():
    from grpo_kernels.ops.loss_head.variants import dppo, sapo

    with pytest.raises(ValueError, match="sapo temperatures must be > 0"):
        sapo.Params(tau_pos=-1.0)
    with pytest.raises(ValueError, match="takes its params as the keywords dppo_divergence"):
        C(loss_type="dppo", variant_params=dppo.Params("binary_kl"))
