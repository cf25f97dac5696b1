"""The SkyRL adapter (grpo_kernels.integrations.skyrl) against SkyRL 0.4.0's own code.

* every gk_<type> against SkyRL's own registered loss of that type on the same inputs: the loss, its
  gradient w.r.t. the log-probs and every metric SkyRL returns, with each off-policy correction SkyRL has
  (token / sequence TIS, the outlier-token sequence mask, the token mask, the product sequence mask, and
  combinations) and both CISPO anchors;
* the refusals, by name: the options that wait for a grpo_kernels loss variant (NEEDS_VARIANT) and the
  rest;
* a loss carried to another process by cloudpickle (as SkyRL's registry ships it to Ray workers)
  installs its mode there.
The model-level tests (the FSDP head in both modes, a worker step) are in test_integration_skyrl_step.py.
Both sides compute in fp32; the sums differ in order only: a few ulps of the largest term.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from checkout import PYTHON_PREAMBLE
from trainer_support import require_skyrl

from grpo_kernels.testing import assert_close

ppo_utils = require_skyrl()
from skyrl.train.config import AlgorithmConfig, OffPolicyCorrectionConfig  # noqa: E402

import grpo_kernels.integrations.skyrl as gk_skyrl  # noqa: E402

pytestmark = pytest.mark.parity
B, T = 6, 11
LENGTHS = [11, 3, 8, 0, 6, 9]  # one all-masked row


def inputs(seed=0, spread=0.25):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    log_probs = -torch.rand(B, T, generator=g) * 2 - 0.1
    old = log_probs + torch.randn(B, T, generator=g) * spread  # ratios beyond both clip bounds
    rollout = old + torch.randn(B, T, generator=g) * 0.3
    # SkyRL folds the reduction into the advantages: per token, already divided (token_mean here)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T) / mask.sum()
    return log_probs, old, adv.contiguous(), mask, rollout


CORRECTIONS = {
    "none": {},
    "tis_token": dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.3),
    "tis_sequence": dict(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=1.5),
    "outlier": dict(outlier_token_is_threshold_low=0.6, outlier_token_is_threshold_high=1.6),
    "outlier_high_only": dict(outlier_token_is_threshold_high=1.4),
    "token_mask": dict(token_mask_is_threshold_low=0.8, token_mask_is_threshold_high=1.25),
    "product_mask": dict(sequence_mask_metric="product", product_mask_low=0.4, product_mask_high=2.5),
    "token_mask+tis_sequence": dict(token_mask_is_threshold_low=0.8, token_mask_is_threshold_high=1.25,
                                    tis_ratio_type="sequence", sequence_tis_ratio_clip_high=3.0),
    "all": dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.2, outlier_token_is_threshold_high=3.0,
                token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.4, sequence_mask_metric="product",
                product_mask_low=0.3, product_mask_high=3.0),
}


def algorithm(loss_type, correction="none", **fields):
    cfg = AlgorithmConfig(policy_loss_type=loss_type, eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0,
                          off_policy_correction=OffPolicyCorrectionConfig(**CORRECTIONS[correction]), **fields)
    cfg.clip_cov.clip_ratio, cfg.clip_cov.clip_cov_lb, cfg.clip_cov.clip_cov_ub = 0.2, -0.05, 0.05
    cfg.kl_cov.kl_cov_frac, cfg.kl_cov.ppo_kl_coef = 0.15, 0.7
    cfg.sapo.tau_pos, cfg.sapo.tau_neg = 1.0, 1.05
    cfg.cispo.cispo_eps_clip_low, cfg.cispo.cispo_eps_clip_high = 0.2, 0.3
    return cfg


def run(fn, config, log_probs, old, adv, mask, rollout):
    lp = log_probs.clone().requires_grad_()
    torch.manual_seed(7)  # clip_cov draws torch.randperm
    loss, metrics = fn(lp, old, adv, config, loss_mask=mask, rollout_logprobs=rollout)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, metrics, grad


def compare(ours, theirs):
    scale = max(1.0, abs(theirs[0].item()))
    assert_close("loss", ours[0], theirs[0], atol=1e-6 * scale, rtol=1e-5)
    assert_close("dL/dlog_probs", ours[2], theirs[2], atol=1e-7 * theirs[2].abs().max().item() + 1e-9, rtol=1e-4)
    assert set(ours[1]) == set(theirs[1]), (sorted(ours[1]), sorted(theirs[1]))
    for key, value in theirs[1].items():
        assert abs(ours[1][key] - value) <= 1e-6 + 1e-5 * abs(value), (key, ours[1][key], value)


CORRECTED = ("regular", "dual_clip", "gspo", "cispo", "sapo")
CASES = [(t, c) for t, c in itertools.product(gk_skyrl.LOSS_TYPES, CORRECTIONS)
         if c == "none" or t in CORRECTED] + [(t, "tis_token") for t in ("cross_entropy", "importance_sampling")]


@pytest.mark.parametrize("loss_type,correction", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_gk_loss_equals_skyrl(loss_type, correction):
    log_probs, old, adv, mask, rollout = inputs()
    config = algorithm(loss_type, correction)
    theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, mask, rollout)
    ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, mask, rollout)
    compare(ours, theirs)


def test_the_corrections_bind_on_these_inputs():
    """The correction cases are not vacuous: each mask removes some tokens and keeps some, TIS caps some."""
    log_probs, old, adv, mask, rollout = inputs()
    for name in ("outlier", "token_mask", "product_mask", "all"):
        weights, _, _ = gk_skyrl.off_policy_weights(old, rollout, mask, algorithm("regular", name).off_policy_correction)
        kept = (weights * mask).sum() / mask.sum()
        assert 0.0 < kept < 1.0, (name, kept)
    _, _, metrics = gk_skyrl.off_policy_weights(old, rollout, mask, algorithm("regular", "tis_token").off_policy_correction)
    assert 0.0 < metrics["tis_token_clip_high_ratio"] < 1.0, metrics


@pytest.mark.parametrize("loss_type", ["regular", "cispo", "gspo"])
def test_without_rollout_logprobs_no_correction_applies(loss_type):
    """SkyRL corrects only when the batch has rollout log-probs: the same configuration without them."""
    log_probs, old, adv, mask, _ = inputs(seed=1)
    config = algorithm(loss_type, "all")
    theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, mask, None)
    ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, mask, None)
    compare(ours, theirs)


@pytest.mark.parametrize("correction", ["none", "outlier", "product_mask"])
def test_cispo_rollout_anchor(correction):
    log_probs, old, adv, mask, rollout = inputs(seed=2)
    config = algorithm("cispo", correction)
    config.cispo.cispo_anchor = "rollout"
    theirs = run(ppo_utils.PolicyLossRegistry.get("cispo"), config, log_probs, old, adv, mask, rollout)
    ours = run(gk_skyrl.GKPolicyLoss("cispo"), config, log_probs, old, adv, mask, rollout)
    compare(ours, theirs)


def test_no_loss_mask_and_weighted_sft_mask():
    log_probs, old, adv, mask, rollout = inputs(seed=3)
    for loss_type in ("regular", "sapo", "importance_sampling"):
        config = algorithm(loss_type)
        theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, None, None)
        ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, None, None)
        compare(ours, theirs)
    weighted = mask * torch.rand(B, T, generator=torch.Generator().manual_seed(4))  # SkyRL's SFT collator
    for loss_type in ("cross_entropy", "importance_sampling"):
        config = algorithm(loss_type)
        theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, weighted, None)
        ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, weighted, None)
        compare(ours, theirs)
    with pytest.raises(ValueError, match="loss_mask must be 0 / 1"):
        run(gk_skyrl.GKPolicyLoss("regular"), algorithm("regular"), log_probs, old, adv, weighted, None)


def test_dual_clip_follows_policy_loss_type():
    """SkyRL's regular and dual_clip are one function that reads config.policy_loss_type; so are ours."""
    log_probs, old, adv, mask, rollout = inputs()
    for registered, configured in itertools.product(("regular", "dual_clip"), ("regular", "dual_clip", "gk_dual_clip")):
        config = algorithm(configured.removeprefix("gk_"))
        config.policy_loss_type = configured
        theirs_config = algorithm(configured.removeprefix("gk_"))
        theirs = run(ppo_utils.PolicyLossRegistry.get(registered), theirs_config, log_probs, old, adv, mask, rollout)
        ours = run(gk_skyrl.GKPolicyLoss(registered), config, log_probs, old, adv, mask, rollout)
        compare(ours, theirs)


@pytest.mark.parametrize(
    "loss_type,fields,message",
    [
        ("dppo", {}, "DPPO binary-TV"),
        ("rollout_is", {}, "rollout_is loss"),
        ("regular", dict(off_policy_correction=OffPolicyCorrectionConfig(sequence_mask_metric="geometric")),
         "geometric-mean sequence-level IS"),
        ("clip_cov", dict(off_policy_correction=OffPolicyCorrectionConfig(tis_ratio_type="token")),
         "validate_cfg refuses it too"),
        ("dual_clip", dict(clip_ratio_c=1.0), "clip_ratio_c=1.0"),
    ],
)
def test_refusals_name_the_option(loss_type, fields, message):
    log_probs, old, adv, mask, rollout = inputs()
    config = AlgorithmConfig(policy_loss_type=loss_type, **fields)
    with pytest.raises(ValueError, match=message):
        gk_skyrl.GKPolicyLoss(loss_type)(log_probs, old, adv, config, loss_mask=mask, rollout_logprobs=rollout)


def test_needs_variant_lists_each_refusal_once():
    assert set(gk_skyrl.NEEDS_VARIANT) == {
        "policy_loss_type='dppo'", "policy_loss_type='rollout_is'",
        "off_policy_correction.sequence_mask_metric='geometric'",
    }


def test_cispo_rollout_anchor_refuses_tis_as_skyrl():
    log_probs, old, adv, mask, rollout = inputs()
    config = algorithm("cispo", "tis_token")
    config.cispo.cispo_anchor = "rollout"
    for fn in (ppo_utils.PolicyLossRegistry.get("cispo"), gk_skyrl.GKPolicyLoss("cispo")):
        with pytest.raises(ValueError, match="double-count"):
            fn(log_probs, old, adv, config, loss_mask=mask, rollout_logprobs=rollout)


def test_register_policy_losses_is_idempotent_and_selectable():
    names = gk_skyrl.register_policy_losses()
    assert names == gk_skyrl.register_policy_losses()
    assert set(names) == {f"gk_{t}" for t in (*gk_skyrl.LOSS_TYPES, *gk_skyrl.VARIANT_TYPES)}
    available = ppo_utils.PolicyLossRegistry.list_available()
    assert set(names) <= set(available) and "regular" in available  # SkyRL's own stay
    log_probs, old, adv, mask, rollout = inputs()
    config = algorithm("gk_regular")
    ours = run(ppo_utils.PolicyLossRegistry.get("gk_regular"), config, log_probs, old, adv, mask, rollout)
    theirs = run(ppo_utils.PolicyLossRegistry.get("regular"), algorithm("regular"), log_probs, old, adv, mask, rollout)
    compare(ours, theirs)


def test_a_pickled_loss_installs_its_mode_in_the_receiving_process():
    """SkyRL's registry ships losses to Ray workers with cloudpickle; the worker gets the mode with them."""
    import cloudpickle

    blob = cloudpickle.dumps(gk_skyrl.GKPolicyLoss("regular", mode="fused"))
    code = PYTHON_PREAMBLE + (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from trainer_support import skyrl_shims; skyrl_shims()\n"
        "import cloudpickle\n"
        "from skyrl.backends.skyrl_train.workers import model_wrapper, worker\n"
        f"loss = cloudpickle.loads({blob!r})\n"
        "print(loss.skyrl_type, loss.mode, model_wrapper.HFModelWrapper.forward._grpo_kernels,\n"
        "      worker.PolicyWorkerBase._forward_backward_micro._grpo_kernels)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["regular", "fused", "True", "True"], out.stdout
