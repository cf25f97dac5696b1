"""The SkyRL adapter's head and fused loss inside SkyRL 0.4.0's own FSDP model wrapper and policy worker.

* ``HFModelWrapper.forward`` (SkyRL's FSDP policy forward) on a tiny Qwen2 built here: with the adapter's
  head ("logprobs") the action log-probs, the entropies and the gradients of every parameter (LM head and
  backbone) against SkyRL's own full-logits path, with a sampling temperature;
* ``PolicyWorkerBase._forward_backward_micro`` (SkyRL's training micro-step: the policy loss from the
  registry, its KL and entropy terms, the ``dp_size`` and micro-batch weights, ``loss.backward()``, the
  status it logs) run on CPU on a worker built around that model: stock SkyRL, the adapter's losses on
  SkyRL's head ("loss"), on the adapter's head ("logprobs"), and the whole actor loss fused ("fused"), for
  PPO / dual clip / GSPO / CISPO / SAPO / rollout_is / DPPO (both divergences) with KL, entropy, TIS and the
  masks, and a batch whose old log-probs SkyRL never computed (its skipped forward for rollout-anchored
  losses): every logged value and every parameter gradient, then the parameters after two SGD steps (Adam's
first step is lr x sign(g): it would turn the rounding of gradients that are 0 in exact arithmetic into
steps of lr, so it cannot compare two implementations).
The worker is SkyRL's class with its process-group and device plumbing stubbed (``strategy.backward`` is
``loss.backward()``, ``torch.cuda.current_device`` is the CPU): nothing of its loss computation is.
Tolerances: fp32 on both sides, the same formulas in different summation orders; gradients are sums over
the vocabulary (97) and the batch, so their elements are held to 1e-5 of the largest (about 100 fp32 ulps).
"""

from __future__ import annotations

import types

import pytest
import torch
from trainer_support import require_skyrl

from grpo_kernels.testing import assert_close

ppo_utils = require_skyrl()
transformers = pytest.importorskip("transformers")
from skyrl.backends.skyrl_train.workers import model_wrapper, worker  # noqa: E402
from skyrl.train.config import AlgorithmConfig, DPPOConfig, OffPolicyCorrectionConfig  # noqa: E402
from skyrl.train.dataset.replay_buffer import Experience  # noqa: E402

import grpo_kernels.integrations.skyrl as gk_skyrl  # noqa: E402

pytestmark = pytest.mark.parity
V, PROMPT, ACTIONS, B = 97, 5, 7, 4


@pytest.fixture(autouse=True)
def _skyrl_own_functions_after():
    yield
    gk_skyrl.uninstall()


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # a head large enough that the ratios and clips move
        model.lm_head.weight.mul_(8.0)
    return model_wrapper.HFModelWrapper(model, use_flash_attention_2=False, bf16=False)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqlen = PROMPT + ACTIONS
    sequences = torch.randint(0, V, (B, seqlen), generator=g)
    attention = torch.ones(B, seqlen, dtype=torch.long)
    attention[1, :2] = 0  # left-padded prompt
    response_lengths = torch.tensor([7, 4, 6, 1])
    loss_mask = (torch.arange(ACTIONS)[None, :] < response_lengths[:, None]).long()
    attention[:, PROMPT:] = loss_mask  # right-padded responses
    return sequences, attention, loss_mask


def head_outputs(wrapper, sequences, attention, temperature):
    log_probs, output = wrapper(sequences, ACTIONS, attention_mask=attention, temperature=temperature,
                                return_output=True, compute_entropy=True, entropy_requires_grad=True)  # fmt: skip
    entropy = output["entropy"][:, -ACTIONS - 1 : -1]
    return log_probs, entropy


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def compare_grads(ours, theirs):
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    for name, g in theirs.items():
        assert_close(f"grad {name}", ours[name], g, atol=1e-5 * g.abs().max().item() + 1e-12, rtol=1e-4)


def test_logprobs_head_equals_skyrl_full_logits():
    sequences, attention, loss_mask = batch()
    stock, ours = tiny_model(), tiny_model()
    weights = torch.randn(B, ACTIONS, generator=torch.Generator().manual_seed(5))
    results = {}
    for name, wrapper in (("stock", stock), ("ours", ours)):
        if name == "ours":
            gk_skyrl.install("logprobs")
        log_probs, entropy = head_outputs(wrapper, sequences, attention, temperature=0.7)
        m = loss_mask.bool()
        ((log_probs * weights)[m].sum() + (entropy * weights.flip(0))[m].sum()).backward()
        results[name] = (log_probs.detach(), entropy.detach(), grads(wrapper))
    m = loss_mask.bool()
    assert_close("log-probs", results["ours"][0][m], results["stock"][0][m], atol=2e-6, rtol=1e-5)
    assert_close("entropy", results["ours"][1][m], results["stock"][1][m], atol=2e-6, rtol=1e-5)
    compare_grads(results["ours"][2], results["stock"][2])
    assert any("lm_head" in n for n in results["ours"][2])


def test_head_refuses_what_it_cannot_compute():
    gk_skyrl.install("logprobs")
    wrapper = tiny_model()
    sequences, attention, _ = batch()
    wrapper.sequence_parallel_size = 2
    with pytest.raises(ValueError, match="sequence_parallel_size=2"):
        wrapper(sequences, ACTIONS, attention_mask=attention)


class _Strategy:
    def backward(self, loss, model, optimizer):
        loss.backward()


def make_worker(wrapper, algorithm, dp_size):
    w = worker.PolicyWorkerBase.__new__(worker.PolicyWorkerBase)
    w.cfg = types.SimpleNamespace(algorithm=algorithm)
    w.model, w.strategy, w.optimizer = wrapper, _Strategy(), None
    w.scheduler = types.SimpleNamespace(get_last_lr=lambda: [1e-3])
    w.mesh_rank = types.SimpleNamespace(dp_size=dp_size)
    w.policy_loss_fn = ppo_utils.PolicyLossRegistry.get(algorithm.policy_loss_type)
    return w


def experience(seed, with_old=True):
    """A micro-batch; without ``with_old`` its old log-probs are None (SkyRL's skipped old forward)."""
    sequences, attention, loss_mask = batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():  # the old policy: a slightly different model, so ratios move and clips bind
        old_model = tiny_model(seed=1)
        old, _ = head_outputs(old_model, sequences, attention, temperature=0.7)
    return Experience(
        sequences=sequences, action_log_probs=old.detach() if with_old else None,
        base_action_log_probs=old.detach() - 0.1 * torch.rand(
            B, ACTIONS, generator=g), values=None, returns=None,
        advantages=torch.randn(B, 1, generator=g).expand(B, ACTIONS) / loss_mask.sum(), attention_mask=attention,
        loss_mask=loss_mask, response_mask=loss_mask, rollout_logprobs=old.detach() + 0.2 * torch.randn(
            B, ACTIONS, generator=g), rollout_expert_indices=None, num_actions=ACTIONS, info={},
    )  # fmt: skip


ALGORITHMS = {
    "regular-kl-entropy": dict(policy_loss_type="regular", use_kl_loss=True, kl_loss_coef=0.3,
                               kl_estimator_type="k3", use_entropy_loss=True, entropy_loss_coef=0.05),
    "dual_clip-tis": dict(policy_loss_type="dual_clip", use_kl_loss=False, off_policy_correction=
                          OffPolicyCorrectionConfig(tis_ratio_type="token", token_tis_ratio_clip_high=1.1)),
    "gspo-k1": dict(policy_loss_type="gspo", use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k1"),
    "cispo-masks": dict(policy_loss_type="cispo", use_kl_loss=False, off_policy_correction=OffPolicyCorrectionConfig(
        token_mask_is_threshold_low=0.8, token_mask_is_threshold_high=1.2, sequence_mask_metric="product",
        product_mask_low=0.2, product_mask_high=5.0)),
    "sapo-entropy": dict(policy_loss_type="sapo", use_kl_loss=False, use_entropy_loss=True, entropy_loss_coef=0.1),
    # the probabilities here are ~1e-3..4e-2: trust regions of that size bind
    # (test_the_step_cases_clip_and_correct)
    "dppo-tis-geometric": dict(
        policy_loss_type="dppo", use_kl_loss=False,
        dppo=DPPOConfig(dppo_type="binary_tv", delta_low=0.01, delta_high=0.004),
        off_policy_correction=OffPolicyCorrectionConfig(tis_ratio_type="token", token_tis_ratio_clip_high=1.1,
                                                        sequence_mask_metric="geometric", geo_mask_low=0.95,
                                                        geo_mask_high=1.2)),
    "rollout_is-masks-entropy": dict(policy_loss_type="rollout_is", use_kl_loss=False, use_entropy_loss=True,
                                     entropy_loss_coef=0.05, off_policy_correction=OffPolicyCorrectionConfig(
        token_mask_is_threshold_low=0.85, token_mask_is_threshold_high=1.2, tis_ratio_type="sequence",
        sequence_tis_ratio_clip_high=1.1)),
    "dppo_kl-kl-no-old": dict(policy_loss_type="dppo", use_kl_loss=True, kl_loss_coef=0.3,
                              kl_estimator_type="k3",
                              dppo=DPPOConfig(dppo_type="binary_kl", delta_low=0.005, delta_high=0.002)),
}
NO_OLD_FORWARD = ("dppo_kl-kl-no-old",)  # SkyRL skips the old forward there (no correction, rollout logprobs)


def algorithm_config(case, prefix):
    fields = dict(ALGORITHMS[case])
    fields["policy_loss_type"] = prefix + fields["policy_loss_type"]
    return AlgorithmConfig(eps_clip_low=0.1, eps_clip_high=0.15, temperature=0.7, **fields)


def train(mode, case, dp_size, monkeypatch):
    """Two micro-batches (weights 1/2 each) and an SGD step, twice; the logged status of each micro-step."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    gk_skyrl.uninstall()
    if mode == "stock":
        algorithm = algorithm_config(case, "")
    else:
        gk_skyrl.register_policy_losses(mode=mode)
        algorithm = algorithm_config(case, "gk_")
    wrapper = tiny_model()
    w = make_worker(wrapper, algorithm, dp_size)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    statuses, first_grads = [], None
    for step in range(2):
        for micro in range(2):
            status = w._forward_backward_micro(experience(2 * step + micro, case not in NO_OLD_FORWARD), 0.5)
            status.pop("loss_fn_outputs")
            statuses.append(status)
        if first_grads is None:
            first_grads = grads(wrapper)
        optimizer.step()
        optimizer.zero_grad()
    return statuses, first_grads, {n: p.detach().clone() for n, p in wrapper.named_parameters()}


# dp_size only changes what the fused loss computes (SkyRL scales the other modes' losses itself)
STEP_CASES = [(mode, case, 1) for mode in ("loss", "logprobs", "fused") for case in ALGORITHMS]
STEP_CASES += [("fused", case, 2) for case in ALGORITHMS]


@pytest.mark.parametrize("mode,case,dp_size", STEP_CASES, ids=[f"{m}-{c}-dp{d}" for m, c, d in STEP_CASES])
def test_worker_step_logs_and_trains_like_skyrl(mode, case, dp_size, monkeypatch):
    theirs = train("stock", case, dp_size, monkeypatch)
    ours = train(mode, case, dp_size, monkeypatch)
    for step, (s_ours, s_theirs) in enumerate(zip(ours[0], theirs[0])):
        assert set(s_ours) == set(s_theirs), (step, sorted(set(s_ours) ^ set(s_theirs)))
        for key, value in s_theirs.items():
            assert abs(s_ours[key] - value) <= 2e-6 + 1e-5 * abs(value), (step, key, s_ours[key], value)
    compare_grads(ours[1], theirs[1])
    for name, p in theirs[2].items():
        assert_close(f"parameter {name} after 2 steps", ours[2][name], p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", list(ALGORITHMS))
def test_the_step_cases_clip_and_correct(case):
    """The step cases are not vacuous: on the first micro-batch (SkyRL's own loss and metrics) the clip,
    range or trust region drops some tokens and keeps some, each mask drops some tokens and keeps some, and
    each TIS cap binds on some."""
    exp = experience(0, case not in NO_OLD_FORWARD)
    with torch.no_grad():
        lp, _ = head_outputs(tiny_model(), exp.sequences, exp.attention_mask, temperature=0.7)
    algorithm = algorithm_config(case, "")
    _, metrics = ppo_utils.PolicyLossRegistry.get(algorithm.policy_loss_type)(
        lp, exp.action_log_probs, exp.advantages, algorithm, loss_mask=exp.loss_mask,
        rollout_logprobs=exp.rollout_logprobs)  # fmt: skip
    if algorithm.policy_loss_type != "sapo":
        assert 0 < metrics["clip_ratio"] < 1, metrics
    for key in ("token_mask_ratio", "geo_sequence_mask_masked_ratio", "tis_token_clip_high_ratio",
                "tis_seq_clip_high_ratio"):  # fmt: skip
        if key in metrics:
            assert 0 < metrics[key] < 1, (key, metrics)
    if exp.action_log_probs is not None:
        weights, _ = gk_skyrl.off_policy_weights(exp.action_log_probs, exp.rollout_logprobs, exp.loss_mask,
                                                 algorithm.off_policy_correction)  # fmt: skip
        if weights is not None:
            kept = (weights > 0).sum() / exp.loss_mask.sum()
            assert 0 < kept < 1, kept
