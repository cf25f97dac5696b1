"""Parity with verl 0.9.1: its own policy losses, KL penalties and actor loss, called on our inputs.

What is called (verl's code, not a copy):
  * `core_algos.get_policy_loss_fn(mode)(old_log_prob=, log_prob=, advantages=, response_mask=,
    loss_agg_mode=, config=ActorConfig(...), rollout_is_weights=)` for every policy loss mode verl and
    we both have, every loss_agg_mode, local normalisation (`global_batch_info = {}`) and global
    normalisation (`{dp_size, batch_num_tokens, global_batch_size, loss_scale_factor}`);
  * `verl.workers.utils.losses.ppo_loss(config, model_output, data)`, the actor loss the engine
    workers use (losses.py:57-144): pg_loss - entropy_coeff * agg_loss(entropy)
    + kl_loss_coef * agg_loss(kl_penalty(log_prob, ref, kl_loss_type)), on packed (no-padding)
    log-probs exactly as the engine hands them over, for every kl_loss_type.
Compared: the loss, every metric verl returns (VERL_METRICS says which of ours it equals) and the
gradient w.r.t. the log-probs (and the entropy). Ours runs on the padded [B, T] layout and, for the
policy losses, also on the packed [N] + cu_seqlens layout.

How verl's configuration maps to ours (`our_config`):
  vanilla  -> ppo_clip, dual_clip = clip_ratio_c (always on in verl), log-ratio clamp +-20
  gspo     -> ppo_clip, ratio_level="sequence_token"
  gpg      -> gpg
  clip_cov -> clip_cov (clip_cov_ratio / lb / ub), no log-ratio clamp (verl has none)
  kl_cov   -> kl_cov, kl_cov_coef = policy_loss.ppo_kl_coef, no log-ratio clamp
  geo_mean -> gmpo (clip_ratio_low / high are bounds on the log-ratio), no log-ratio clamp
  cispo    -> cispo, cispo_form="relative" (two-sided; TRL's absolute cap: test_parity_trl.py)
  sapo     -> sapo (tau_pos / tau_neg); verl forces seq-mean-token-mean on the policy term only
  kl_loss_type: kl, k1 -> k1; abs -> abs; mse, k2 -> k2; low_var_kl, k3 -> low_var_kl (verl's
  "k3" is the clamped estimator); "<name>+" -> kl_straight_through=True ("k2+"/"mse+" are k2).
  global_batch_info -> num_tokens = batch_num_tokens, num_sequences = global_batch_size,
  dp_size = dp_size, max_completion_length = loss_scale_factor (local: the padded length T, verl's
  default horizon loss_mask.shape[-1]).

Where verl counts differently (documented, and handled by the mapping):
  * geo_mean averages the policy term with torch.mean over the B local rows, all-masked rows
    included, whatever loss_agg_mode and global_batch_info say: ours gets num_sequences = B * dp_size
    (gmpo divides by num_sequences / dp_size).
  * seq-mean-* modes skip all-masked rows in the local count (as ours does); token-mean without
    global counts divides by the raw mask sum (NaN for an all-masked batch; ours gives 0, so that
    batch is not compared).

Semantic gaps (verl behaviour our config cannot express; not tested, listed in the report):
  * sapo: verl aggregates the policy term with seq-mean-token-mean but the KL term with the
    configured loss_agg_mode; we have one loss_agg_mode for the policy and KL terms (entropy has
    its own entropy_agg_mode). Expressible only for loss_agg_mode="seq-mean-token-mean".
  * geo_mean: the policy term is divided by the local row count B while the KL / entropy terms use
    agg_loss; with seq-mean-* modes they need a different sequence count (nonempty rows, or
    global_batch_size), but num_sequences is one number for all terms.
  * gspo clamps the log-ratio on one side only (<= 10); log_ratio_clamp is symmetric. Equal as long
    as sequence-mean log-ratios stay above -10 (the inputs here do; see test_extreme_log_ratios).
"""

from __future__ import annotations

import pytest
import torch
from parity_helpers import (
    EMPTY_ROW,
    LENGTHS,
    SEED,
    assert_close,
    grad_scale,
    leaf,
    make_token_inputs,
    require_peer,
)

require_peer("verl", "verl")

from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.workers.config.actor import ActorConfig
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import grpo_kernels as gk

pytestmark = pytest.mark.parity

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
MODES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo")
SEQ_MODES = tuple(m for m in AGG_MODES if m.startswith("seq"))

# verl hyperparameters per mode, chosen so that each mode's regimes are visited on these inputs
# (test_inputs_visit_every_regime checks it): asymmetric clip bounds, dual clip at 3, selections of
# a few tokens for the covariance modes.
HPARAMS = {
    "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "gspo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "gpg": dict(),
    "clip_cov": dict(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=2.0
    ),
    "kl_cov": dict(kl_cov_ratio=0.15, ppo_kl_coef=0.7),
    "geo_mean": dict(clip_ratio_low=0.3, clip_ratio_high=0.4),
    "cispo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
}
POLICY_LOSS_FIELDS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")

# Every metric verl's policy loss returns, and what it equals on our side: the name of one of our
# metrics, or a constant verl reports "for compatibility".
VERL_METRICS = {
    "vanilla": {
        "actor/pg_clipfrac": "clip_ratio/region_mean",  # -A clip(r) > -A r  <=>  low or high clipped
        "actor/ppo_kl": "ppo_kl",  # mean of -(clamped) log-ratio
        "actor/pg_clipfrac_lower": "clip_ratio/dual_mean",  # A < 0 and the dual bound -c A is active
    },
    "gspo": {
        "actor/pg_clipfrac": "clip_ratio/region_mean",
        "actor/ppo_kl": "ppo_kl",
        "actor/pg_clipfrac_lower": 0.0,
    },
    "gpg": {},
    "clip_cov": {"actor/pg_clipfrac": "selection/cov_frac", "actor/ppo_kl": "ppo_kl"},
    "kl_cov": {"actor/ppo_kl": "ppo_kl_abs"},  # verl logs the mean |log-ratio| under this name for kl_cov
    "geo_mean": {
        "actor/pg_clipfrac": "clip_ratio/high_mean",  # log-ratio clipped and A > 0
        "actor/ppo_kl": "ppo_kl",
        "actor/pg_clipfrac_lower": "clip_ratio/low_mean",  # log-ratio clipped and A < 0
    },
    "cispo": {
        "actor/pg_clipfrac": "clip_ratio/any_mean",
        "actor/ppo_kl": "ppo_kl",
        "actor/pg_clipfrac_lower": 0.0,
    },
    "sapo": {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": "ppo_kl", "actor/pg_clipfrac_lower": 0.0},
}
# ppo_loss's own metrics -> ours.
ACTOR_METRICS = {"actor/pg_loss": "policy_loss", "actor/entropy_loss": "entropy_loss", "kl_loss": "kl_loss"}

# kl_loss_type -> (our kl_estimator, kl_straight_through)
VERL_KL = {
    "kl": ("k1", False),
    "k1": ("k1", False),
    "abs": ("abs", False),
    "mse": ("k2", False),
    "k2": ("k2", False),
    "low_var_kl": ("low_var_kl", False),
    "k3": ("low_var_kl", False),
    "kl+": ("k1", True),
    "k1+": ("k1", True),
    "abs+": ("abs", True),
    "mse+": ("k2", False),
    "k2+": ("k2", False),
    "low_var_kl+": ("low_var_kl", True),
    "k3+": ("low_var_kl", True),
}

B, T = len(LENGTHS), 9
# Global normalisation: the micro-batch is one of several on 2 ranks. The counts are deliberately
# not multiples of the local ones, so a wrong normalizer cannot pass by proportionality.
GLOBAL_INFO = dict(dp_size=2, batch_num_tokens=77, global_batch_size=13, loss_scale_factor=12)
SCOPES = ("local", "global")


def verl_info(scope: str) -> dict:
    return dict(GLOBAL_INFO) if scope == "global" else {}


def actor_config(mode: str, agg: str, scope: str, hp: dict | None = None, **actor_fields) -> ActorConfig:
    hp = HPARAMS[mode] if hp is None else hp
    policy_loss = VerlPolicyLossConfig(
        loss_mode=mode, **{k: v for k, v in hp.items() if k in POLICY_LOSS_FIELDS}
    )
    fields = {k: v for k, v in hp.items() if k not in POLICY_LOSS_FIELDS}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=agg,
        policy_loss=policy_loss,
        global_batch_info=verl_info(scope),
        **fields,
        **actor_fields,
    )


def our_config(mode: str, agg: str, scope: str, hp: dict | None = None, **extra) -> gk.PolicyLossConfig:
    """PolicyLossConfig equal to verl's (mode, loss_agg_mode, scope); extra: KL / entropy fields."""
    hp = HPARAMS[mode] if hp is None else hp
    clip = dict(clip_low=hp.get("clip_ratio_low", 0.2), clip_high=hp.get("clip_ratio_high", 0.2))
    fields = {
        "vanilla": dict(loss_type="ppo_clip", dual_clip=hp.get("clip_ratio_c"), log_ratio_clamp=20.0, **clip),
        "gspo": dict(loss_type="ppo_clip", ratio_level="sequence_token", log_ratio_clamp=None, **clip),
        "gpg": dict(loss_type="gpg"),
        "clip_cov": dict(
            loss_type="clip_cov",
            log_ratio_clamp=None,
            clip_cov_ratio=hp.get("clip_cov_ratio"),
            clip_cov_lb=hp.get("clip_cov_lb"),
            clip_cov_ub=hp.get("clip_cov_ub"),
            **clip,
        ),
        "kl_cov": dict(
            loss_type="kl_cov",
            log_ratio_clamp=None,
            kl_cov_ratio=hp.get("kl_cov_ratio"),
            kl_cov_coef=hp.get("ppo_kl_coef"),
        ),
        "geo_mean": dict(loss_type="gmpo", log_ratio_clamp=None, **clip),
        "cispo": dict(loss_type="cispo", cispo_form="relative", log_ratio_clamp=20.0, **clip),
        "sapo": dict(
            loss_type="sapo",
            sapo_tau_pos=hp.get("tau_pos"),
            sapo_tau_neg=hp.get("tau_neg"),
            log_ratio_clamp=20.0,
        ),
    }[mode]
    fields["loss_agg_mode"] = agg
    if mode == "sapo":  # verl forces seq-mean-token-mean on the policy term; entropy keeps the mode
        fields["loss_agg_mode"] = "seq-mean-token-mean"
        if extra.get("entropy_coef", 0.0) > 0:
            fields["entropy_agg_mode"] = agg
    fields.update(extra)
    if "seq-mean-token-sum-norm" in (fields["loss_agg_mode"], fields.get("entropy_agg_mode")):
        fields["max_completion_length"] = GLOBAL_INFO["loss_scale_factor"] if scope == "global" else T
    return gk.PolicyLossConfig(**fields)


def our_normalizers(mode: str, scope: str) -> dict:
    if scope == "local":
        # geo_mean: verl's torch.mean over the B rows (all-masked rows included)
        return dict(num_sequences=B) if mode == "geo_mean" else {}
    info = GLOBAL_INFO
    num_sequences = B * info["dp_size"] if mode == "geo_mean" else info["global_batch_size"]
    return dict(num_tokens=info["batch_num_tokens"], num_sequences=num_sequences, dp_size=info["dp_size"])


def advantages(x: dict, kind: str) -> torch.Tensor:
    return x["adv_seq"][:, None].expand(B, T).contiguous() if kind == "seq" else x["adv_tok"]


def run_verl_policy(mode, agg, scope, x, adv, use_is, hp=None):
    cfg = actor_config(mode, agg, scope, hp)
    lp = leaf(x["logp"])
    loss, metrics = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=x["old"].double(),
        log_prob=lp,
        advantages=adv.double(),
        response_mask=x["mask"],
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=x["is_weights"].double() if use_is else None,
    )
    loss.backward()
    return loss.detach(), metrics, lp.grad


def run_ours(cfg, x, adv, normalizers, *, use_is=False, ref=False, entropy=False):
    lp = leaf(x["logp"], torch.float32)
    ent = leaf(x["entropy"], torch.float32) if entropy else None
    out = gk.grpo_loss(
        lp,
        adv,
        x["mask"],
        old_logprobs=x["old"],
        ref_logprobs=x["ref"] if ref else None,
        entropy=ent,
        config=cfg,
        is_weights=x["is_weights"] if use_is else None,
        backend="torch",
        **normalizers,
    )
    out.loss.backward()
    return out, lp.grad, None if ent is None else ent.grad


def check_metrics(mapping: dict, theirs: dict, ours: dict, context: str) -> None:
    assert set(theirs) == set(mapping), (
        f"{context}: verl returned metrics {sorted(theirs)}, mapping has {sorted(mapping)}"
    )
    for name, our_name in mapping.items():
        value = theirs[name]
        value = value.aggregate() if hasattr(value, "aggregate") else value
        expected = our_name if isinstance(our_name, float) else ours[our_name]
        assert_close(f"{context} metric {name} vs ours {our_name!r}", expected, value, equal_nan=True)


@pytest.fixture(scope="module")
def inputs():
    return make_token_inputs(SEED)


def test_inputs_visit_every_regime(inputs):
    """The grid is only meaningful if clipping happens on both sides and the selections pick tokens."""
    x, m = inputs, inputs["mask"]
    r = (x["logp"] - x["old"]).exp()[m]
    a = x["adv_seq"][:, None].expand(B, T)[m]
    assert ((r < 0.8) & (a < 0)).any() and ((r > 1.28) & (a > 0)).any(), "no low / high clipping"
    assert ((r > 3.0) & (a < 0)).any(), "dual clip never active"
    assert ((r > 0.8) & (r < 1.28)).any(), "no token inside the clip range"
    seq_r = ((x["logp"] - x["old"]) * m).sum(1).div(m.sum(1).clamp(min=1)).exp()  # gspo's sequence ratio
    assert ((seq_r < 0.8) & (x["adv_seq"] < 0)).any() and ((seq_r > 1.28) & (x["adv_seq"] > 0)).any()
    assert ((seq_r > 0.8) & (seq_r < 1.28) & m.any(1)).any()
    assert not m[EMPTY_ROW].any() and (x["adv_seq"] > 0).any() and (x["adv_seq"] < 0).any()
    torch.manual_seed(0)
    out, _, _ = run_ours(our_config("clip_cov", "token-mean", "local"), x, x["adv_seq"], {})
    assert 0 < out.metrics["selection/cov_frac"] < 0.5
    out, _, _ = run_ours(our_config("kl_cov", "token-mean", "local"), x, x["adv_seq"], {})
    assert 0 < out.metrics["selection/cov_frac"] < 0.5


@pytest.mark.parametrize("use_is", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_matches_verl(mode, agg, scope, use_is, inputs):
    x = inputs
    adv = advantages(x, "seq")
    torch.manual_seed(1234)  # clip_cov draws torch.randperm from the default generator
    loss_v, metrics_v, grad_v = run_verl_policy(mode, agg, scope, x, adv, use_is)
    torch.manual_seed(1234)
    out, grad_o, _ = run_ours(
        our_config(mode, agg, scope), x, adv, our_normalizers(mode, scope), use_is=use_is
    )
    ctx = f"verl {mode} {agg} {scope}"
    assert_close(f"{ctx} loss", out.loss, loss_v)
    assert_close(f"{ctx} dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    check_metrics(VERL_METRICS[mode], metrics_v, out.metrics, ctx)


def run_ours_packed(cfg, x, adv_seq, normalizers, *, use_is):
    """Ours on the packed layout: row b contributes its first LENGTHS[b] positions (the hole stays a
    masked token, the empty row an empty segment), per-sequence advantages [S], cu_seqlens [S + 1]."""
    keep = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]  # [B, T] positions that are packed
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    lp = leaf(x["logp"][keep], torch.float32)
    out = gk.grpo_loss(
        lp,
        adv_seq,
        x["mask"][keep],
        old_logprobs=x["old"][keep],
        config=cfg,
        cu_seqlens=cu_seqlens,
        is_weights=x["is_weights"][keep] if use_is else None,
        backend="torch",
        **normalizers,
    )
    out.loss.backward()
    grad = torch.zeros(B, T, dtype=lp.grad.dtype).masked_scatter(keep, lp.grad)  # back to [B, T]
    return out, grad


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_packed_layout_matches_verl(mode, agg, scope, inputs):
    """The same batch packed ([N] + cu_seqlens, as the engines' no-padding layout) gives verl's
    padded result: the layout changes nothing but the storage."""
    x = inputs
    torch.manual_seed(4321)
    loss_v, metrics_v, grad_v = run_verl_policy(mode, agg, scope, x, advantages(x, "seq"), use_is=True)
    torch.manual_seed(4321)
    cfg = our_config(mode, agg, scope)
    out, grad_o = run_ours_packed(cfg, x, x["adv_seq"], our_normalizers(mode, scope), use_is=True)
    ctx = f"verl {mode} {agg} {scope} packed"
    assert_close(f"{ctx} loss", out.loss, loss_v)
    assert_close(f"{ctx} dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    check_metrics(VERL_METRICS[mode], metrics_v, out.metrics, ctx)


@pytest.mark.parametrize("mode", MODES)
def test_per_token_advantages_match_verl(mode, inputs):
    """Advantages that vary within a sequence (verl takes [B, T]); geo_mean averages them per sequence."""
    x = inputs
    adv = advantages(x, "token")
    torch.manual_seed(99)
    loss_v, metrics_v, grad_v = run_verl_policy(mode, "token-mean", "local", x, adv, use_is=False)
    torch.manual_seed(99)
    out, grad_o, _ = run_ours(our_config(mode, "token-mean", "local"), x, adv, our_normalizers(mode, "local"))
    assert_close(f"verl {mode} per-token A loss", out.loss, loss_v)
    assert_close(f"verl {mode} per-token A dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    check_metrics(VERL_METRICS[mode], metrics_v, out.metrics, f"verl {mode} per-token A")


@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo", "clip_cov", "kl_cov", "geo_mean"])
def test_extreme_log_ratios(mode, inputs):
    """Log-ratios of +-25 hit verl's +-20 clamp (vanilla, cispo, sapo) or its absence (clip_cov, kl_cov,
    geo_mean): our log_ratio_clamp must follow."""
    x = dict(inputs)
    old = x["old"].clone()
    old[0, 1] = x["logp"][0, 1] - 25.0  # r = e^25 on a positive-advantage row
    old[1, 0] = x["logp"][1, 0] - 25.0  # r = e^25 on a negative-advantage row: dual clip
    old[4, 3] = x["logp"][4, 3] + 25.0  # r = e^-25
    x["old"] = old
    adv = advantages(x, "seq")
    torch.manual_seed(7)
    loss_v, metrics_v, grad_v = run_verl_policy(mode, "token-mean", "local", x, adv, use_is=False)
    torch.manual_seed(7)
    out, grad_o, _ = run_ours(our_config(mode, "token-mean", "local"), x, adv, our_normalizers(mode, "local"))
    assert_close(f"verl {mode} extreme loss", out.loss, loss_v, scale=max(1.0, abs(float(loss_v))))
    assert_close(f"verl {mode} extreme dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    check_metrics(VERL_METRICS[mode], metrics_v, out.metrics, f"verl {mode} extreme")


# ---------------------------------------------------------------------------------------------------
# The actor loss: verl's ppo_loss on packed log-probs
# ---------------------------------------------------------------------------------------------------
PROMPT_LEN = 2


def _pack(x: torch.Tensor) -> torch.Tensor:
    """[B, T] response values -> the engine's packed [sum(prompt + response)] layout, shifted left by
    one token (padding.py:no_padding_2_padding reads response t of row b at offset - len - 1 + t)."""
    pieces = []
    for b, length in enumerate(LENGTHS):
        pieces += [x.new_zeros(PROMPT_LEN - 1), x[b, :length], x.new_zeros(1)]
    return torch.cat(pieces)


def run_verl_actor(mode, agg, scope, x, adv, *, kl_type=None, kl_coef=0.0, entropy_coeff=0.0, use_is=False):
    cfg = actor_config(
        mode,
        agg,
        "local",
        use_kl_loss=kl_type is not None,
        kl_loss_type=kl_type or "low_var_kl",
        kl_loss_coef=kl_coef,
        entropy_coeff=entropy_coeff,
        loss_scale_factor=GLOBAL_INFO["loss_scale_factor"] if scope == "global" else None,
    )
    lp, ent = leaf(x["logp"]), leaf(x["entropy"])
    response_len = torch.tensor(LENGTHS)
    attention = torch.cat(
        [torch.ones(B, PROMPT_LEN, dtype=torch.long), (torch.arange(T)[None] < response_len[:, None]).long()],
        dim=1,
    )
    tensors = dict(
        prompts=torch.ones(B, PROMPT_LEN, dtype=torch.long),
        responses=torch.ones(B, T, dtype=torch.long),
        attention_mask=attention,
        response_mask=x["mask"],
        old_log_probs=x["old"].double(),
        advantages=adv.double(),
    )
    if kl_type is not None:
        tensors["ref_log_prob"] = x["ref"].double()
    if use_is:
        tensors["rollout_is_weights"] = x["is_weights"].double()
    info = verl_info(scope)
    data = tu.get_tensordict(
        tensors,
        non_tensor_dict=dict(
            dp_size=info.get("dp_size", 1),
            batch_num_tokens=info.get("batch_num_tokens"),
            global_batch_size=info.get("global_batch_size"),
        ),
    )
    loss, metrics = ppo_loss(cfg, dict(log_probs=_pack(lp), entropy=_pack(ent)), data)
    loss.backward()
    return loss.detach(), metrics, lp.grad, ent.grad


def check_actor(mode, agg, scope, x, adv, *, kl_type, kl_coef, entropy_coeff, use_is, seed=5):
    torch.manual_seed(seed)
    loss_v, metrics_v, grad_v, grad_ent_v = run_verl_actor(
        mode, agg, scope, x, adv, kl_type=kl_type, kl_coef=kl_coef, entropy_coeff=entropy_coeff, use_is=use_is
    )
    extra = dict(entropy_coef=entropy_coeff)
    if kl_type is not None:
        estimator, straight_through = VERL_KL[kl_type]
        extra.update(kl_coef=kl_coef, kl_estimator=estimator, kl_straight_through=straight_through)
    torch.manual_seed(seed)
    out, grad_o, grad_ent_o = run_ours(
        our_config(mode, agg, scope, **extra),
        x,
        adv,
        our_normalizers(mode, scope),
        use_is=use_is,
        ref=kl_type is not None,
        entropy=True,
    )
    ctx = f"verl ppo_loss {mode} {agg} {scope} kl={kl_type}"
    scale = max(1.0, abs(float(loss_v)))
    assert_close(f"{ctx} loss", out.loss, loss_v, scale=scale)
    assert_close(f"{ctx} dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    assert_close(f"{ctx} dloss/dentropy", grad_ent_o, grad_ent_v, scale=grad_scale(grad_ent_v))
    mapping = dict(VERL_METRICS[mode])
    mapping.update({k: v for k, v in ACTOR_METRICS.items() if k != "kl_loss" or kl_type is not None})
    theirs = {k: v for k, v in metrics_v.items() if k != "kl_coef"}
    check_metrics(mapping, theirs, out.metrics, ctx)
    if kl_type is not None:
        assert metrics_v["kl_coef"] == kl_coef


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", list(VERL_KL))
def test_kl_penalty_matches_verl_ppo_loss(kl_type, agg, scope, inputs):
    """Every kl_loss_type through verl's actor loss (vanilla policy, entropy bonus on). The reference
    log-probs include two points outside low_var_kl's clamps (|ref - logp| > 10 and > 20)."""
    x = dict(inputs)
    ref = x["ref"].clone()
    ref[0, 0] = x["logp"][0, 0] - 12.0  # k3 = e^-12 + 11 > 10: clamped to 10 by low_var_kl
    ref[2, 1] = x["logp"][2, 1] + 23.0  # x = 23: clamped to 20 first
    x["ref"] = ref
    check_actor(
        "vanilla",
        agg,
        scope,
        x,
        advantages(x, "seq"),
        kl_type=kl_type,
        kl_coef=0.05,
        entropy_coeff=0.01,
        use_is=False,
    )


def _actor_cases():
    for mode in MODES:
        for agg in AGG_MODES:
            if mode == "geo_mean" and agg in SEQ_MODES:
                continue  # gap: one sequence count for policy (B) and KL / entropy (see module doc)
            kl = not (mode == "sapo" and agg != "seq-mean-token-mean")  # gap: sapo's KL aggregation
            for scope in SCOPES:
                yield pytest.param(mode, agg, scope, kl, id=f"{mode}-{agg}-{scope}-{'kl' if kl else 'nokl'}")


@pytest.mark.parametrize(("mode", "agg", "scope", "kl"), list(_actor_cases()))
def test_actor_loss_matches_verl_ppo_loss(mode, agg, scope, kl, inputs):
    """Every policy mode composed with the entropy bonus and (where expressible) the KL loss, with
    rollout IS weights, through verl's ppo_loss."""
    x = inputs
    check_actor(
        mode,
        agg,
        scope,
        x,
        advantages(x, "seq"),
        kl_type="low_var_kl" if kl else None,
        kl_coef=0.1,
        entropy_coeff=0.02,
        use_is=True,
    )


def test_dual_clip_bound_is_verl_clip_ratio_c(inputs):
    """Another clip_ratio_c (1.5, active on more tokens) moves the bound on both sides alike."""
    x = inputs
    adv = advantages(x, "seq")
    hp = dict(HPARAMS["vanilla"], clip_ratio_c=1.5)
    loss_v, metrics_v, grad_v = run_verl_policy("vanilla", "token-mean", "local", x, adv, use_is=False, hp=hp)
    out, grad_o, _ = run_ours(our_config("vanilla", "token-mean", "local", hp), x, adv, {})
    assert out.metrics["clip_ratio/dual_mean"] > 0
    assert_close("verl dual clip 1.5 loss", out.loss, loss_v)
    assert_close("verl dual clip 1.5 dloss/dlogp", grad_o, grad_v, scale=grad_scale(grad_v))
    check_metrics(VERL_METRICS["vanilla"], metrics_v, out.metrics, "verl dual clip 1.5")
