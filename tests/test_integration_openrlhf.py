"""The OpenRLHF adapter (grpo_kernels.integrations.openrlhf) against OpenRLHF 0.11.2's own code.

* `PolicyLoss` (both policy loss types, dual clip, both aggregations with local and global normalizers, the
  train/rollout corrections it maps) against OpenRLHF's `PolicyLoss` on the same inputs: loss, gradient,
  and the four metrics it returns; the options it refuses, by name; OpenRLHF's own refusals unchanged.
* `kl_config`: the KL term grpo_kernels computes with it equals OpenRLHF's `compute_approx_kl` aggregated as
  `training_step` does, clamps binding included.
* `actor_forward` (the "logprobs" part) against OpenRLHF's `Actor.forward` on tiny Llama / Qwen2 / Gemma 2 /
  Granite models built here: log-probs, entropy, the loss on top, and the gradients of the hidden states
  entering the LM head, of its weight and of every parameter; packed samples; the no-grad and
  logits-returning calls; DeepSpeed ZeRO-3 (a subprocess, one process on DeepSpeed's CPU accelerator).
* The seam in place: OpenRLHF's real `ActorPPOTrainer` (its `__init__` building `PolicyLoss` from the module
  global, its `training_step`), stock and with `install()`, on one micro-batch: every logged value and every
  gradient.
* `install` through the import hook in a fresh interpreter, and Ray's worker setup hook in real Ray workers
  (`launch` as `python -m grpo_kernels.integrations.openrlhf` runs it).

OpenRLHF runs on CPU here with two test-only stand-ins (tests/_openrlhf_support.py): flash_attn (imported by
`openrlhf.models`) and vllm (imported by the PPO actor's package); OpenRLHF's torch.compile'd entropy of the
full logits runs eagerly (as in its own CPU test: compiling it costs minutes per process on a CPU). The module
skips, saying which environment runs it, when OpenRLHF 0.11.2 is not installed.

Tolerances. OpenRLHF's PolicyLoss is plain PyTorch: it runs on float64 copies of the inputs (the exact value
of its formula) and ours in float32, compared with parity_helpers.assert_close (1e-6 relative, 1e-6 of the
terms' scale). Log-prob paths: both sides fp32 from the same hidden states (OpenRLHF's full logits and chunked
logsumexp; grpo_kernels' tiled online logsumexp): values to 1e-5 absolute (log-probs of magnitude <= ~10, fp32
sums over V = 97 logits of magnitude ~10), gradients to 1e-5 of the largest element (TRL adapter's measured
first-step bound; here measured worst ~7e-7 relative).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkout import CHECKOUT, PYTHON_PREAMBLE
from parity_helpers import assert_close, grad_scale, leaf, make_token_inputs

import _openrlhf_support  # noqa: E402

_openrlhf_support.require_openrlhf()

import transformers  # noqa: E402

with _openrlhf_support.stubs():  # flash_attn and vllm stand-ins while OpenRLHF's modules import, then gone
    import openrlhf.models.utils as openrlhf_utils
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor, aggregate_loss
    from openrlhf.models.loss import PolicyLoss as StockPolicyLoss
    from openrlhf.trainer.ppo_utils.experience import Experience
_openrlhf_support.eager_compute_entropy()

import grpo_kernels as gk  # noqa: E402
import grpo_kernels.integrations.openrlhf as gk_openrlhf  # noqa: E402

pytestmark = pytest.mark.parity

assert Path(gk_openrlhf.__file__).resolve().parent == CHECKOUT / "integrations", gk_openrlhf.__file__

VALUE_ATOL = 1e-5
GRAD_TOL = 1e-5


def test_stand_ins_left_with_the_import():
    """The flash_attn / vllm stand-ins served OpenRLHF's imports only: later tests in this process that look
    for the real packages do not find them."""
    modules = list(sys.modules.items())
    left = [name for name, m in modules if getattr(m, "__dict__", {}).get("__grpo_kernels_test_stub__")]
    assert left == [], left


@pytest.fixture(autouse=True)
def _stock_openrlhf():
    """Every test starts and ends with OpenRLHF unpatched in this process."""
    gk_openrlhf.uninstall()
    yield
    gk_openrlhf.uninstall()


# ---------------------------------------------------------------------------------------------------
# PolicyLoss
# ---------------------------------------------------------------------------------------------------
CORRECTIONS = {
    "off": {},
    "token-mask": dict(
        is_correction_level="token", is_correction_mode="mask", is_correction_threshold=[0.5, 5.0]
    ),
    "token-mask-narrow": dict(
        is_correction_level="token", is_correction_mode="mask", is_correction_threshold=[0.8, 1.25]
    ),
    "token-mask-no-low": dict(
        is_correction_level="token", is_correction_mode="mask", is_correction_threshold=[0, 1.3]
    ),
    "token-clip": dict(
        is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.8, 1.25]
    ),
    # seq-mask-TIS: a sequence is kept on the geometric mean of its ratios
    "seq-mask-ratio": dict(
        is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=[0.8, 1.25]
    ),
    "seq-mask-ratio-no-low": dict(
        is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=[0, 1.1]
    ),
    # the trust regions on the sampled token's probability (the launcher turns a single HIGH into [0, HIGH])
    "token-binary-kl": dict(
        is_correction_level="token", is_correction_gating="binary_kl", is_correction_threshold=[0, 0.01]
    ),
    "seq-binary-kl": dict(
        is_correction_level="seq", is_correction_gating="binary_kl", is_correction_threshold=[0, 0.06]
    ),
    "token-tv": dict(
        is_correction_level="token", is_correction_gating="tv", is_correction_threshold=[0, 0.05]
    ),
    "seq-tv": dict(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=[-1.0, 0.1]),
}
GLOBAL = dict(dp_size=2, batch_num_tokens=torch.tensor(61.0), global_batch_size=torch.tensor(9.0))
# GSPO with the correction on: its ratio is taken against the rollout log-probs, no weight (any level, gating)
GSPO_CORRECTIONS = ("off", "token-mask", "seq-binary-kl")


def _loss_cases():
    for loss_type in ("ppo", "gspo"):
        for dual_clip in (None, 3.0):
            for token_level in (True, False):
                for normalizers in ("local", "global"):
                    for correction in CORRECTIONS:
                        if loss_type == "gspo" and correction not in GSPO_CORRECTIONS:
                            continue
                        level = "token" if token_level else "seq"
                        name = f"{loss_type}-dual{dual_clip}-{level}-{normalizers}-{correction}"
                        yield pytest.param(
                            loss_type, dual_clip, token_level, normalizers, correction, id=name
                        )


def loss_inputs():
    """parity_helpers' inputs (ratios in ~[0.14, 7.4]: every clip regime; an all-masked row; a hole), with a
    sampler mismatch of std 0.75 (instead of 0.3) so that the [0.5, 5] band drops some tokens too, old and
    rollout log-probs at most -0.01 (a model's log-probs are <= 0; OpenRLHF's binary KL and TV clamp the
    probabilities to 1 - 1e-6, grpo_kernels' binary KL reads a log-prob above 0 as 0), and one row of
    per-token advantages (OpenRLHF takes [B, A])."""
    inputs = make_token_inputs(5)
    inputs["rollout"] = (inputs["old"] + 2.5 * (inputs["rollout"] - inputs["old"])).clamp(max=-0.01)
    inputs["old"] = inputs["old"].clamp(max=-0.01)
    adv = inputs["adv_seq"][:, None].expand_as(inputs["logp"]).clone()
    adv[0] = inputs["adv_tok"][0]
    inputs["adv"] = adv
    return inputs


def openrlhf_statistic(kwargs, inputs):
    """The statistic OpenRLHF's correction gates, by its formulas in float64: [B, T] per token, [B, 1] per
    sequence (NaN on the all-masked row)."""
    m = inputs["mask"].double()
    old, rollout = inputs["old"].double(), inputs["rollout"].double()
    gating = kwargs.get("is_correction_gating", "ratio")
    if gating == "ratio":
        stat = old - rollout
    else:
        p, q = rollout.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
        stat = (
            p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            if gating == "binary_kl"
            else (p - q).abs()
        )
    if kwargs["is_correction_level"] == "seq":
        stat = (stat * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    return stat.exp() if gating == "ratio" else stat


def _run_policy_loss(cls, kwargs, inputs, dtype, normalizers):
    lp = leaf(inputs["logp"], dtype)
    cast = {k: inputs[k].to(dtype) for k in ("old", "rollout", "adv")}
    info = {} if normalizers == "local" else GLOBAL
    out = cls(**kwargs)(
        lp, cast["old"], cast["adv"], action_mask=inputs["mask"], rollout_log_probs=cast["rollout"], **info
    )
    (grad,) = torch.autograd.grad(out[0], lp)
    return out, grad


@pytest.mark.parametrize("loss_type,dual_clip,token_level,normalizers,correction", list(_loss_cases()))
def test_policy_loss_equals_openrlhf(loss_type, dual_clip, token_level, normalizers, correction):
    inputs = loss_inputs()
    kwargs = dict(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual_clip,
        token_level_loss=token_level,
        policy_loss_type=loss_type,
        **CORRECTIONS[correction],
    )
    theirs, their_grad = _run_policy_loss(StockPolicyLoss, kwargs, inputs, torch.float64, normalizers)
    ours, our_grad = _run_policy_loss(gk_openrlhf.PolicyLoss, kwargs, inputs, torch.float32, normalizers)
    scale = max(1.0, abs(theirs[0].item()))
    assert_close("loss", ours[0], theirs[0], scale=scale)
    assert_close("d loss / d log_probs", our_grad, their_grad, scale=grad_scale(their_grad))
    for name, a, b in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours[1:], theirs[1:]):
        assert (a is None) == (b is None), (name, a, b)
        if b is not None:
            assert_close(name, a, b)


def test_policy_loss_cases_visit_every_regime():
    """The inputs above clip on both sides, engage the dual clip, and every correction drops / clamps some
    units (tokens, or sequences) but not all (a case where nothing binds could not tell a formula apart); no
    gated statistic lies within 1e-4 (relative) of a bound, so that float64 and float32 take the same side."""
    inputs = loss_inputs()
    mask = inputs["mask"]
    ratio = (inputs["logp"] - inputs["old"]).exp()[mask]
    assert (ratio < 0.8).any() and (ratio > 1.28).any() and (ratio > 3.0).any()
    rows = mask.any(-1)
    for name, kwargs in CORRECTIONS.items():
        if not kwargs:
            continue
        stat = openrlhf_statistic(kwargs, inputs)
        units = stat[rows].flatten() if stat.shape[-1] == 1 else stat[mask]
        assert not torch.isnan(units).any(), name
        low, high = kwargs["is_correction_threshold"]
        kept = (units >= low) & (units <= high)
        assert 0 < int(kept.sum()) < units.numel(), (name, units)
        for bound in (low, high):
            if bound > 0:
                gap = float(((units - bound).abs() / bound).min())
                assert gap > 1e-4, (name, bound, gap)


def test_sequence_filter_ratio_counts_the_empty_sequence():
    """OpenRLHF's per-sequence filter ratio is a mean over all B rows: the all-masked row of the inputs has a
    NaN statistic there (0 / 0) and counts as dropped. The adapter's metric counts it the same way."""
    inputs = loss_inputs()
    assert not inputs["mask"].any(-1).all()
    for name in ("seq-mask-ratio", "seq-binary-kl", "seq-tv"):
        stat = openrlhf_statistic(CORRECTIONS[name], inputs)
        low, high = CORRECTIONS[name]["is_correction_threshold"]
        expected = (~((stat >= low) & (stat <= high))).double().mean()
        ours = _run_policy_loss(gk_openrlhf.PolicyLoss, CORRECTIONS[name], inputs, torch.float32, "local")[0]
        assert abs(float(ours[4]) - float(expected)) < 1e-7, (name, ours[4], expected)
        assert 0 < float(expected) < 1, (name, expected)


def test_binary_kl_rounded_below_zero_is_kept():
    """The one place the mapped divergence gates part from OpenRLHF by design: OpenRLHF also compares the
    statistic with the lower threshold (0 when the launcher gets a single HIGH), so a token whose binary KL
    rounds below 0 in its float32 arithmetic (sampler and trainer nearly agree) is dropped there;
    grpo_kernels' divergence gate has no lower bound and keeps it (a KL is >= 0)."""
    old = torch.tensor([[math.log(0.3), math.log(0.3)]])
    rollout = old + torch.tensor([[1e-5, 0.2]])  # binary KL ~ 1.2e-11 and 1e-2
    p, q = rollout.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
    stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()  # OpenRLHF's, in float32
    assert stat[0, 0] < 0 < stat[0, 1], stat
    kwargs = dict(
        is_correction_level="token", is_correction_gating="binary_kl", is_correction_threshold=[0, 1.0]
    )
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    theirs = StockPolicyLoss(**kwargs)(old, old, adv, action_mask=mask, rollout_log_probs=rollout)
    ours = gk_openrlhf.PolicyLoss(**kwargs)(old, old, adv, action_mask=mask, rollout_log_probs=rollout)
    assert float(theirs[4]) == 0.5 and float(ours[4]) == 0.0, (theirs[4], ours[4])
    rho = (old - rollout).exp()  # on-policy ratio 1: the loss is -mean(kept A rho)
    assert abs(float(theirs[0]) + float(rho[0, 1]) / 2) < 1e-6, theirs[0]
    assert abs(float(ours[0]) + float(rho.sum()) / 2) < 1e-6, ours[0]


@pytest.mark.parametrize("level", ["token", "seq"])
def test_thresholds_beyond_grpo_kernels_are_refused(level):
    for gating, threshold, message in (
        ("ratio", [0.5, 1e9], "e\\^20"),
        ("ratio", [2.0, 1.5], "0 <= low < high"),
        ("ratio", [0.5, float("inf")], "0 <= low < high"),
        ("binary_kl", [0, -0.1], "finite upper bound >= 0"),
        ("tv", [0, float("inf")], "finite upper bound >= 0"),
    ):
        kwargs = dict(
            is_correction_level=level, is_correction_gating=gating, is_correction_threshold=threshold
        )
        StockPolicyLoss(**kwargs)  # OpenRLHF accepts it
        with pytest.raises(ValueError, match=message) as info:
            gk_openrlhf.PolicyLoss(**kwargs)
        assert "is_correction_threshold" in str(info.value)
        gk_openrlhf.PolicyLoss(
            policy_loss_type="gspo", **kwargs
        )  # GSPO takes no IS weight: nothing to refuse


def test_policy_loss_config_of_the_gates():
    """The mapping of the correction settings onto PolicyLossConfig's IS weight and sampler gate."""
    cfg = gk_openrlhf.policy_loss_config(is_correction_level="seq", is_correction_threshold=[0.5, 2.0])
    assert (cfg.is_level, cfg.is_max, cfg.is_gate, cfg.is_gate_level) == ("token", None, "ratio", "sequence")
    assert (cfg.is_gate_min, cfg.is_gate_max) == (0.5, 2.0)
    cfg = gk_openrlhf.policy_loss_config(is_correction_level="seq", is_correction_threshold=[0, 2.0])
    assert (cfg.is_gate_min, cfg.is_gate_max) == (None, 2.0)
    for level, gate_level in (("token", "token"), ("seq", "sequence")):
        for gating in ("binary_kl", "tv"):
            cfg = gk_openrlhf.policy_loss_config(
                is_correction_level=level, is_correction_gating=gating, is_correction_threshold=[-1.0, 0.03]
            )
            assert (cfg.is_level, cfg.is_max, cfg.is_gate, cfg.is_gate_level) == (
                "token",
                None,
                gating,
                gate_level,
            )
            assert (cfg.is_gate_min, cfg.is_gate_max) == (None, 0.03)
    cfg = gk_openrlhf.policy_loss_config(is_correction_level="token", is_correction_threshold=[0.5, 2.0])
    assert (cfg.is_level, cfg.is_mode, cfg.is_min, cfg.is_max, cfg.is_gate) == (
        "token",
        "mask",
        0.5,
        2.0,
        None,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(is_correction_level="seq", is_correction_mode="clip"),
        dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="binary_kl"),
        dict(is_correction_level="token", is_correction_gating="kl"),
        dict(is_correction_level="geo"),
        dict(is_correction_level="seq", is_correction_gating="binary_kl", is_correction_threshold=[0.5, 5.0]),
        dict(dual_clip=0.5),
    ],
)
def test_openrlhf_refusals_are_kept(kwargs):
    """What OpenRLHF's constructor refuses, ours refuses with the same exception and message."""
    with pytest.raises((ValueError, AssertionError)) as theirs:
        StockPolicyLoss(**kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        gk_openrlhf.PolicyLoss(**kwargs)
    assert str(ours.value) == str(theirs.value)


def test_policy_loss_input_checks():
    inputs = loss_inputs()
    loss = gk_openrlhf.PolicyLoss(is_correction_level="token")
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        loss(inputs["logp"], inputs["old"], inputs["adv_tok"], action_mask=inputs["mask"])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        gk_openrlhf.PolicyLoss()(
            inputs["logp"], inputs["old"], inputs["adv_tok"], action_mask=inputs["mask"] * 0.5
        )


# ---------------------------------------------------------------------------------------------------
# The KL mapping
# ---------------------------------------------------------------------------------------------------
def test_kl_config_k3_equals_openrlhf_compute_approx_kl():
    """OpenRLHF's KL loss term, aggregate_loss(compute_approx_kl(lp, base, kl_estimator="k3"), mask, **info)
    (token mean, global normalizers), equals grpo_kernels' KL term with kl_config("k3"), value and gradient,
    on log-ratios from -100 to 100 (both of OpenRLHF's clamps and both of low_var_kl's bind)."""
    inputs = make_token_inputs(5)
    mask = inputs["mask"]
    base = inputs["ref"].clone()
    base[0, :6] = base[0, :6] + torch.tensor(
        [100.0, 30.0, 12.0, -12.0, -30.0, -100.0]
    )  # x = base - lp extremes
    info = dict(dp_size=2, batch_num_tokens=torch.tensor(61.0))
    lp64 = leaf(inputs["logp"], torch.float64)
    theirs = aggregate_loss(
        openrlhf_utils.compute_approx_kl(lp64, base.double(), kl_estimator="k3"), mask, **info
    )
    (their_grad,) = torch.autograd.grad(theirs, lp64)
    lp = leaf(inputs["logp"], torch.float32)
    config = gk.PolicyLossConfig(loss_type="gpg", kl_coef=1.0, **gk_openrlhf.kl_config("k3"))
    out = gk.grpo_loss(
        lp,
        torch.zeros_like(lp),
        mask,
        old_logprobs=lp.detach(),
        ref_logprobs=base,
        config=config,
        num_tokens=61.0,
        dp_size=2,
        backend="torch",
    )
    (our_grad,) = torch.autograd.grad(out.loss, lp)
    assert_close("KL term", out.loss, theirs, scale=max(1.0, theirs.abs().item()))
    assert_close("d KL / d log_probs", our_grad, their_grad, scale=grad_scale(their_grad))
    assert their_grad[0, :6].abs().max() == 0 and our_grad[0, :6].abs().max() == 0  # the clamps bound there


@pytest.mark.parametrize("estimator,unbiased", [("k1", False), ("k2", False), ("k3", True)])
def test_kl_config_refuses_what_differs(estimator, unbiased):
    with pytest.raises(ValueError, match="unbiased_gradient" if unbiased else "clamps its value"):
        gk_openrlhf.kl_config(estimator, unbiased)


# ---------------------------------------------------------------------------------------------------
# Actor.forward: tiny models built here
# ---------------------------------------------------------------------------------------------------
VOCAB = 97


def make_model(kind: str):
    """A 2-layer model of `kind` with large initial weights (varied log-probs), fp32, seeded."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2-tied":  # the head's weight is the input embedding's
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**{**common, "tie_word_embeddings": True})
        )
    if (
        kind == "llama-lora"
    ):  # PEFT LoRA on the attention projections, as OpenRLHF's --ds.lora.* (head frozen)
        import peft

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        lora = peft.LoraConfig(
            task_type=peft.TaskType.CAUSAL_LM,
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
        )
        return peft.get_peft_model(model, lora)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "gemma2":  # final_logit_softcapping = 30 -> the kernels' softcap; a low cap so that it binds
        return transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0)
        )
    if kind == "granite":  # logits / logits_scaling -> logit_scale = 1 / 4
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0))
    raise ValueError(kind)


def batch(B: int = 3, T: int = 12, A: int = 6):
    """Left-padded prompts, right-padded responses (OpenRLHF's layout): sequences, attention mask, action mask
    (one response shorter, one of length 2), old log-probs and advantages for the loss."""
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(1, VOCAB, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, :3] = 0
    attention_mask[2, :1] = 0
    action_mask = torch.ones(B, A, dtype=torch.bool)
    action_mask[0, 4:] = False
    action_mask[2, 2:] = False
    attention_mask[:, T - A :] = action_mask.long()
    sequences = sequences * attention_mask
    old = -3.0 - 1.5 * torch.rand(B, A, generator=g)
    advantages = torch.randn(B, 1, generator=g).expand(B, A).contiguous()
    return sequences, attention_mask, action_mask, old, advantages


def _actor_step(model, patched, *, packing=False, temperature=0.7):
    """One policy forward + PolicyLoss + entropy bonus + backward, stock or with both parts of the adapter."""
    if patched:
        gk_openrlhf.install_actor_forward(Actor)
    else:
        gk_openrlhf.uninstall_actor_forward(Actor)
    model = copy.deepcopy(model)
    actor = Actor(model, temperature=temperature)
    actor.packing_samples = packing
    head = model.get_output_embeddings()
    seen = {}
    hook = head.register_forward_pre_hook(
        lambda module, args: seen.update(hidden=args[0]) or args[0].retain_grad()
    )
    sequences, attention_mask, action_mask, old, advantages = batch()
    try:
        log_probs, output = actor(
            sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=True
        )
    finally:
        hook.remove()
    width = action_mask.shape[1]
    entropy = output.entropy[:, -width:]
    loss_cls = gk_openrlhf.PolicyLoss if patched else StockPolicyLoss
    policy = loss_cls(clip_eps_low=0.2, clip_eps_high=0.28)(
        log_probs, old, advantages, action_mask=action_mask, batch_num_tokens=action_mask.sum(), dp_size=1
    )[0]
    entropy_loss = aggregate_loss(entropy, action_mask)
    loss = policy - 0.01 * entropy_loss
    loss.backward()
    return dict(
        log_probs=log_probs.detach(),
        entropy=(entropy * action_mask).detach(),
        loss=loss.detach(),
        hidden_grad=seen["hidden"].grad,
        weight_grad=None if head.weight.grad is None else head.weight.grad.clone(),
        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        logits=output["logits"],
    )


def _compare_steps(ours, theirs, label):
    assert_close(f"{label} log-probs", ours["log_probs"], theirs["log_probs"], atol=VALUE_ATOL, rtol=0)
    assert_close(f"{label} entropy", ours["entropy"], theirs["entropy"], atol=VALUE_ATOL, rtol=0)
    assert_close(f"{label} loss", ours["loss"], theirs["loss"], atol=VALUE_ATOL, rtol=0)
    assert (ours["weight_grad"] is None) == (theirs["weight_grad"] is None), (
        label
    )  # a frozen head stays frozen
    assert sorted(ours["grads"]) == sorted(theirs["grads"]) and theirs["grads"], label
    for name in ("hidden_grad", "weight_grad") if theirs["weight_grad"] is not None else ("hidden_grad",):
        assert_close(
            f"{label} {name}",
            ours[name],
            theirs[name],
            scale=grad_scale(theirs[name]),
            atol=GRAD_TOL,
            rtol=GRAD_TOL,
        )
    for name, g in theirs["grads"].items():
        assert_close(
            f"{label} grad {name}", ours["grads"][name], g, scale=grad_scale(g), atol=GRAD_TOL, rtol=GRAD_TOL
        )


@pytest.mark.parametrize(
    "kind,packing",
    [
        ("llama", False),
        ("llama", True),
        ("qwen2", False),
        ("qwen2", True),
        ("gemma2", False),
        ("granite", False),
        ("qwen2-tied", False),
        ("llama-lora", False),
    ],
)
def test_actor_forward_equals_openrlhf(kind, packing):
    """OpenRLHF's full-logits path and the adapter's on the same model and batch: log-probs and entropy of the
    action tokens, the loss, the gradients of the hidden states entering the LM head, of its weight and of
    every parameter. Packed samples run OpenRLHF's packing code (flash-attn's padding helpers, stood in)."""
    model = make_model(kind)
    theirs = _actor_step(model, False, packing=packing)
    ours = _actor_step(model, True, packing=packing)
    assert theirs["logits"] is not None and ours["logits"] is None  # the adapter never made the logits
    _compare_steps(ours, theirs, f"{kind} packing={packing}")


def test_actor_forward_other_calls():
    """No grad (the old-policy / reference passes), `return_logprobs` without an action mask (every position),
    and a call for the logits (OpenRLHF's own forward); the prompt columns of the entropy are NaN."""
    model = make_model("qwen2")
    sequences, attention_mask, action_mask, _, _ = batch()
    stock = Actor(copy.deepcopy(model), temperature=0.7)
    stock.packing_samples = False
    with torch.no_grad():
        their_action = stock(sequences, action_mask, attention_mask=attention_mask)
        their_all, their_out = stock(
            sequences,
            attention_mask=attention_mask,
            return_logprobs=True,
            return_output=True,
            return_entropy=True,
        )
        their_logits = stock(sequences, attention_mask=attention_mask, return_output=True)["logits"]
    gk_openrlhf.install_actor_forward(Actor)
    with torch.no_grad():
        our_action = stock(sequences, action_mask, attention_mask=attention_mask)
        our_all, our_out = stock(
            sequences,
            attention_mask=attention_mask,
            return_logprobs=True,
            return_output=True,
            return_entropy=True,
        )
        our_logits = stock(sequences, attention_mask=attention_mask, return_output=True)["logits"]
        _, action_out = stock(
            sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=True
        )
    assert_close("action log-probs (no grad)", our_action, their_action, atol=VALUE_ATOL, rtol=0)
    assert_close("all log-probs", our_all, their_all, atol=VALUE_ATOL, rtol=0)
    assert_close("all entropy", our_out.entropy, their_out.entropy, atol=VALUE_ATOL, rtol=0)
    assert torch.equal(our_logits, their_logits)  # OpenRLHF's forward, untouched
    width = action_mask.shape[1]
    assert (
        torch.isnan(action_out.entropy[:, :-width]).all()
        and not torch.isnan(action_out.entropy[:, -width:]).any()
    )


def test_actor_forward_refuses_a_model_without_a_linear_head():
    class TableLM(torch.nn.Module):  # logits from a table: no LM head (as OpenRLHF's own entropy test)
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB))

        def forward(self, input_ids, **_):
            return transformers.modeling_outputs.CausalLMOutputWithPast(logits=self.table[input_ids])

    actor = Actor(TableLM())
    actor.packing_samples = False
    sequences, attention_mask, action_mask, _, _ = batch()
    gk_openrlhf.install_actor_forward(Actor)
    with pytest.raises(RuntimeError, match="no LM head grpo_kernels can read"):
        actor(sequences, action_mask, attention_mask=attention_mask)


def test_logit_transform_of_configs():
    assert gk_openrlhf.logit_transform(make_model("gemma2").config) == (3.0, 1.0)
    assert gk_openrlhf.logit_transform(make_model("granite").config) == (None, 0.25)
    assert gk_openrlhf.logit_transform(make_model("llama").config) == (None, 1.0)


@pytest.mark.slow
@pytest.mark.distributed
def test_actor_under_deepspeed_zero3(tmp_path):
    """ZeRO-3 as OpenRLHF's strategy sets it up (Actor.model = the engine), one process on DeepSpeed's CPU
    accelerator: the head is partitioned outside the forward, the adapter reads it inside the LM head's
    forward and gathers it again in the backward. Log-probs, entropy, loss, full gradients and the parameters
    after an SGD step equal OpenRLHF's."""
    from grpo_kernels.testing.distributed import free_port

    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=str(CHECKOUT),
    )
    proc = subprocess.run(
        [sys.executable, str(CHECKOUT / "tests" / "_openrlhf_zero3_case.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["head_partitioned"] == [True, True], report
    assert report["grads_present"], report
    assert report["log_probs"] <= VALUE_ATOL and report["entropy"] <= VALUE_ATOL, report
    assert report["loss"] <= VALUE_ATOL * max(1.0, abs(report["loss_value"])), report
    assert report["grad_diff"] <= GRAD_TOL * report["grad_scale"], report
    # one SGD step (lr 0.5): the parameters differ by at most lr x the gradient bound, plus their rounding
    assert (
        report["param_diff"] <= 0.5 * GRAD_TOL * report["grad_scale"] + 4 * 2**-23 * report["param_scale"]
    ), report


# ---------------------------------------------------------------------------------------------------
# The seam in place: OpenRLHF's ActorPPOTrainer
# ---------------------------------------------------------------------------------------------------
TRAINER_CORRECTIONS = {  # --algo.advantage.is_correction_{level,mode,gating,threshold}
    "token-mask-ratio": ("token", "mask", "ratio", [0.5, 5.0]),
    # the per-sequence binary KL of the experience below: 0.0014, 0.0027, 0.0004: the second row is dropped
    "seq-binary-kl": ("seq", "mask", "binary_kl", [0.0, 0.002]),
}


def _trainer_args(correction="token-mask-ratio"):
    level, mode, gating, threshold = TRAINER_CORRECTIONS[correction]
    ns = SimpleNamespace
    return ns(
        train=ns(max_epochs=1, colocate_all=False, async_enable=False, dynamic_batch_enable=False),
        actor=ns(
            eps_clip_low_high=(0.2, 0.28),
            dual_clip=3.0,
            loss_agg_mode="token-mean",
            policy_loss_type="ppo",
            entropy_coef=0.01,
            aux_loss_coef=0.0,
        ),
        algo=ns(
            advantage=ns(
                is_correction_level=level,
                is_correction_mode=mode,
                is_correction_gating=gating,
                is_correction_threshold=list(threshold),
            ),
            kl=ns(use_loss=True, init_coef=0.05, estimator="k3", unbiased_gradient=False),
        ),
        ds=ns(packing_samples=False),
        vllm=ns(sync_backend="gloo"),
    )


def _training_step(ppo_actor, model, monkeypatch, correction="token-mask-ratio"):
    """OpenRLHF's ActorPPOTrainer built by its own __init__ (a stand-in strategy: backward is loss.backward,
    no optimizer step; the CUDA-only replay buffer and barrier stood in), one training_step."""
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *args, **kwargs: None)
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    model = copy.deepcopy(model)
    actor = Actor(model, temperature=0.7)
    actor.packing_samples = False
    args = _trainer_args(correction)
    strategy = SimpleNamespace(
        args=args,
        ring_attn_group=None,
        backward=lambda loss, model, optimizer: loss.backward(),
        optimizer_step=lambda *a, **k: None,
        get_grad_norm=lambda model: 0.0,
    )
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-6])
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, None, scheduler)
    sequences, attention_mask, action_mask, old, advantages = batch()
    g = torch.Generator().manual_seed(2)
    experience = Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old,
        base_action_log_probs=old + 0.2 * torch.randn(old.shape, generator=g),
        rollout_log_probs=old + 0.3 * torch.randn(old.shape, generator=g),
        advantages=advantages,
    )
    info = dict(dp_size=1, batch_num_tokens=action_mask.sum().float(), global_batch_size=torch.tensor(3.0))
    status = trainer.training_step(experience, 0.05, 0, info)
    metrics = {
        k: float(v)
        for k, v in status["metrics"].items()
        if isinstance(v, (torch.Tensor, float)) and (not isinstance(v, torch.Tensor) or v.dim() == 0)
    }
    return trainer, metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("correction", sorted(TRAINER_CORRECTIONS))
def test_actor_ppo_trainer_training_step_equals_openrlhf(monkeypatch, correction):
    """The module globals OpenRLHF's trainer reads: with `install()`, ActorPPOTrainer.__init__ builds this
    module's PolicyLoss and training_step's forward runs grpo_kernels' head; the step logs the same values
    (policy loss, entropy loss, KL loss, clip ratio, ppo_kl, vllm_kl, is_filter_ratio...) and leaves the same
    gradients as OpenRLHF's (dual clip, the token-level IS mask or the sequence binary-KL gate, k3 KL loss,
    entropy bonus)."""
    model = make_model("llama")
    stock_trainer, theirs, their_grads = _training_step(ppo_actor, model, monkeypatch, correction)
    assert type(stock_trainer.actor_loss_fn) is StockPolicyLoss
    assert gk_openrlhf.install() == ("logprobs", "loss")
    trainer, ours, our_grads = _training_step(ppo_actor, model, monkeypatch, correction)
    assert type(trainer.actor_loss_fn) is gk_openrlhf.PolicyLoss
    assert set(ours) == set(theirs) and {
        "policy_loss",
        "entropy_loss",
        "kl",
        "vllm_kl",
        "is_filter_ratio",
    } <= set(ours)
    for name, value in theirs.items():
        assert abs(ours[name] - value) <= VALUE_ATOL * max(1.0, abs(value)), (name, ours[name], value)
    if correction == "seq-binary-kl":  # the gate binds: one sequence of three dropped
        assert abs(theirs["is_filter_ratio"] - 1 / 3) < 1e-6, theirs
    for name, g in their_grads.items():
        assert_close(f"grad {name}", our_grads[name], g, scale=grad_scale(g), atol=GRAD_TOL, rtol=GRAD_TOL)


# ---------------------------------------------------------------------------------------------------
# install: the import hook, the version gate, Ray workers
# ---------------------------------------------------------------------------------------------------
def _python(code: str, tmp_path, env=None, timeout=600):
    run_env = dict(os.environ, PYTHONPATH=str(CHECKOUT), **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", PYTHON_PREAMBLE + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=run_env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_install_before_openrlhf_is_imported(tmp_path):
    """In a fresh interpreter: install() imports nothing of OpenRLHF; importing it afterwards gets the
    adapter's names everywhere OpenRLHF binds them (`openrlhf.models`, the loss module, the PPO actor module);
    uninstall restores OpenRLHF's."""
    code = """
import json, sys
import _openrlhf_support; _openrlhf_support.install_stubs()
import grpo_kernels.integrations.openrlhf as gk_openrlhf
parts = gk_openrlhf.install()
before = sorted(n for n in sys.modules if n.startswith("openrlhf"))
import openrlhf.models, openrlhf.models.loss, openrlhf.trainer.ray.ppo_actor as ppo_actor
ours = [openrlhf.models.PolicyLoss is gk_openrlhf.PolicyLoss, openrlhf.models.loss.PolicyLoss is
gk_openrlhf.PolicyLoss,
        ppo_actor.PolicyLoss is gk_openrlhf.PolicyLoss, openrlhf.models.Actor.forward is
        gk_openrlhf.actor_forward]
gk_openrlhf.uninstall()
stock = [openrlhf.models.PolicyLoss.__module__, ppo_actor.PolicyLoss.__module__,
         openrlhf.models.Actor.forward.__module__]
print(json.dumps(dict(parts=parts, before=before, ours=ours, stock=stock)))
"""
    report = _python(code, tmp_path)
    assert report["parts"] == ["logprobs", "loss"]
    assert report["before"] == [], report  # nothing of OpenRLHF imported by install()
    assert report["ours"] == [True, True, True, True], report
    assert report["stock"] == ["openrlhf.models.loss", "openrlhf.models.loss", "openrlhf.models.actor"], (
        report
    )


def test_install_refuses_another_version_and_bad_parts(monkeypatch):
    with pytest.raises(ValueError, match="non-empty subset"):
        gk_openrlhf.install("logprobs,fused")
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.11.1" if name == "openrlhf" else real(name)
    )
    with pytest.raises(RuntimeError, match="supports OpenRLHF 0.11.2 .* found 0.11.1"):
        gk_openrlhf.install()
    assert gk_openrlhf.installed_parts() == ()


def test_runtime_env():
    env = gk_openrlhf.runtime_env(
        "loss", backend="torch", base={"env_vars": {"NCCL_DEBUG": "INFO"}, "pip": []}
    )
    assert env["worker_process_setup_hook"] == "grpo_kernels.integrations.openrlhf.ray_worker_setup"
    assert env["pip"] == [] and env["env_vars"]["NCCL_DEBUG"] == "INFO"
    assert env["env_vars"]["GRPO_KERNELS_OPENRLHF"] == "loss"
    assert env["env_vars"]["GRPO_KERNELS_OPENRLHF_BACKEND"] == "torch"
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == os.environ.get("TOKENIZERS_PARALLELISM", "true")
    with pytest.raises(ValueError, match="already has a worker_process_setup_hook"):
        gk_openrlhf.runtime_env(base={"worker_process_setup_hook": "my.hook"})


@pytest.mark.slow
def test_ray_workers_get_the_patch(tmp_path):
    """`launch` (what `python -m grpo_kernels.integrations.openrlhf` runs) starts a real local Ray (one CPU)
    with the adapter's runtime_env and runs a launcher module as __main__; that module starts a Ray actor,
    which imports OpenRLHF the way OpenRLHF's actors do. In the worker: the parts installed by the setup hook
    (from the environment, with its backend), OpenRLHF's names replaced, OpenRLHF's env defaults set."""
    pytest.importorskip("ray")
    target = tmp_path / "_openrlhf_ray_target.py"
    target.write_text(RAY_TARGET)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(CHECKOUT), str(CHECKOUT / "tests"), str(tmp_path)]),
        GRPO_KERNELS_OPENRLHF="logprobs,loss",
        GRPO_KERNELS_OPENRLHF_BACKEND="torch",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
    )
    env.pop("RAY_ADDRESS", None)
    code = PYTHON_PREAMBLE + (
        "import grpo_kernels.integrations.openrlhf as gk_openrlhf\n"
        "gk_openrlhf.launch(['--probe-arg', 'x'], module='_openrlhf_ray_target')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["argv"][1:] == ["--probe-arg", "x"], report  # argv[0]: the module's file (runpy)
    assert report["argv"][0].endswith("_openrlhf_ray_target.py"), report
    assert report["driver_parts"] == ["logprobs", "loss"], report
    worker = report["worker"]
    assert worker["pid"] != report["driver_pid"], report
    assert worker["parts"] == ["logprobs", "loss"] and worker["backend"] == "torch", worker
    assert worker["patched"] == [True, True, True], worker
    assert worker["env"]["TOKENIZERS_PARALLELISM"] in ("true", os.environ.get("TOKENIZERS_PARALLELISM")), (
        worker
    )
    assert worker["env"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] is not None, worker
    assert worker["openrlhf_imported_by_hook"] is False, worker


RAY_TARGET = """
import json, os, sys
import ray


@ray.remote(num_cpus=1)
class Probe:
    def check(self):
        before = any(n.startswith("openrlhf") for n in sys.modules)
        import _openrlhf_support
        _openrlhf_support.install_stubs()
        import openrlhf.models, openrlhf.trainer.ray.ppo_actor as ppo_actor
        import grpo_kernels.integrations.openrlhf as gk_openrlhf
        return dict(
            pid=os.getpid(), parts=list(gk_openrlhf.installed_parts()),
            backend=gk_openrlhf._options["backend"], patched=[openrlhf.models.PolicyLoss is
            gk_openrlhf.PolicyLoss, ppo_actor.PolicyLoss is gk_openrlhf.PolicyLoss,
                     openrlhf.models.Actor.forward is gk_openrlhf.actor_forward],
            env={k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM",
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")}, openrlhf_imported_by_hook=before,
        )


if __name__ == "__main__":
    import grpo_kernels.integrations.openrlhf as gk_openrlhf
    worker = ray.get(Probe.remote().check.remote())
    print(json.dumps(dict(argv=sys.argv, driver_parts=list(gk_openrlhf.installed_parts()),
    driver_pid=os.getpid(),
                          worker=worker)))
    ray.shutdown()
"""
