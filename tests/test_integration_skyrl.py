"""The SkyRL adapter (grpo_kernels.integrations.skyrl) against SkyRL 0.4.0's own code.

* every gk_<type> (one for each of SkyRL's policy loss types) against SkyRL's own registered loss of that
  type on the same inputs: the loss, its gradient w.r.t. the log-probs and every metric SkyRL returns, with
  each off-policy correction SkyRL has (token / sequence TIS, the outlier-token sequence mask, the token
  mask, the product and geometric sequence masks, and combinations), both CISPO anchors, both DPPO
  divergences with and without rollout log-probs, and the batches where SkyRL skipped the old forward;
* the refusals, by name;
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
    "geometric": dict(sequence_mask_metric="geometric", geo_mask_low=0.9, geo_mask_high=1.1),
    "token_mask+tis_sequence": dict(token_mask_is_threshold_low=0.8, token_mask_is_threshold_high=1.25,
                                    tis_ratio_type="sequence", sequence_tis_ratio_clip_high=3.0),
    "all": dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.2, outlier_token_is_threshold_high=3.0,
                token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.4, sequence_mask_metric="product",
                product_mask_low=0.3, product_mask_high=3.0),
    # the geometric mean over the tokens the token mask kept (here the third sequence's is 0.963 over them,
    # and would be 0.972 over all its tokens: it is dropped)
    "token_mask+geometric": dict(token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.4,
                                 sequence_mask_metric="geometric", geo_mask_low=0.97, geo_mask_high=1.05),
    # all of them: the sequence TIS and the geometric mean over the tokens the outlier and token masks kept
    # (here: one sequence dropped by the outlier mask, two by the geometric one, a capped and an uncapped TIS
    # weight on the two kept, each with tokens the token mask dropped)
    "all_geometric": dict(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=1.05,
                          outlier_token_is_threshold_high=2.0, token_mask_is_threshold_low=0.7,
                          token_mask_is_threshold_high=1.4,
                          sequence_mask_metric="geometric", geo_mask_low=0.95, geo_mask_high=1.05),
}


def algorithm(loss_type, correction="none", **fields):
    cfg = AlgorithmConfig(policy_loss_type=loss_type, eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0,
                          off_policy_correction=OffPolicyCorrectionConfig(**CORRECTIONS[correction]), **fields)
    cfg.clip_cov.clip_ratio, cfg.clip_cov.clip_cov_lb, cfg.clip_cov.clip_cov_ub = 0.2, -0.05, 0.05
    cfg.kl_cov.kl_cov_frac, cfg.kl_cov.ppo_kl_coef = 0.15, 0.7
    cfg.sapo.tau_pos, cfg.sapo.tau_neg = 1.0, 1.05
    cfg.cispo.cispo_eps_clip_low, cfg.cispo.cispo_eps_clip_high = 0.2, 0.3
    cfg.dppo.dppo_type, cfg.dppo.delta_low, cfg.dppo.delta_high = "binary_tv", 0.1, 0.15
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


CORRECTED = ("regular", "dual_clip", "gspo", "cispo", "rollout_is", "dppo", "sapo")
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
    """The correction cases are not vacuous: each mask removes some tokens and keeps some, TIS caps some, and
    the trust regions and ranges of dppo and rollout_is drop some tokens and keep some."""
    log_probs, old, adv, mask, rollout = inputs()

    def correct(name):
        opc = algorithm("regular", name).off_policy_correction
        return gk_skyrl.off_policy_weights(old, rollout, mask, opc)

    for name in ("outlier", "token_mask", "product_mask", "geometric", "token_mask+geometric", "all",
                 "all_geometric"):  # fmt: skip
        weights, _ = correct(name)
        kept = ((weights > 0) * mask).sum() / mask.sum()
        assert 0.0 < kept < 1.0, (name, kept)
    for name, metric in (("tis_token", "tis_token_clip_high_ratio"), ("tis_sequence", "tis_seq_clip_high_ratio"),
                         ("all_geometric", "tis_seq_clip_high_ratio"),
                         ("all_geometric", "geo_sequence_mask_masked_ratio")):  # fmt: skip
        _, metrics = correct(name)
        assert 0.0 < metrics[metric] < 1.0, (name, metrics)
    for loss_type, given in (("rollout_is", rollout), ("dppo", rollout), ("dppo", None)):
        fn = ppo_utils.PolicyLossRegistry.get(loss_type)
        _, metrics, _ = run(fn, algorithm(loss_type), log_probs, old, adv, mask, given)
        assert 0.0 < metrics["clip_ratio"] < 1.0, (loss_type, given is None, metrics)


@pytest.mark.parametrize("loss_type", ["regular", "cispo", "gspo", "dppo"])
def test_without_rollout_logprobs_no_correction_applies(loss_type):
    """SkyRL corrects only when the batch has rollout log-probs: the same configuration without them."""
    log_probs, old, adv, mask, _ = inputs(seed=1)
    config = algorithm(loss_type, "all")
    theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, mask, None)
    ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, mask, None)
    compare(ours, theirs)


@pytest.mark.parametrize("correction", ["none", "outlier", "product_mask", "geometric", "token_mask"])
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


@pytest.mark.parametrize("dppo_type,delta_low,delta_high",
                         [("binary_tv", 0.1, 0.15), ("binary_kl", 0.02, 0.03)])  # fmt: skip
@pytest.mark.parametrize("with_rollout", [True, False])
@pytest.mark.parametrize("correction", ["none", "tis_token", "all_geometric"])
def test_dppo_divergences(dppo_type, delta_low, delta_high, with_rollout, correction):
    """Both DPPO divergences, anchored on the rollout log-probs when the batch has them (then corrected), on
    the old ones when not; the trust region drops some tokens and keeps some."""
    log_probs, old, adv, mask, rollout = inputs(seed=4)
    rollout = rollout if with_rollout else None
    config = algorithm("dppo", correction)
    config.dppo.dppo_type, config.dppo.delta_low, config.dppo.delta_high = dppo_type, delta_low, delta_high
    theirs = run(ppo_utils.PolicyLossRegistry.get("dppo"), config, log_probs, old, adv, mask, rollout)
    ours = run(gk_skyrl.GKPolicyLoss("dppo"), config, log_probs, old, adv, mask, rollout)
    compare(ours, theirs)
    assert 0.0 < theirs[1]["clip_ratio"] < 1.0, theirs[1]


@pytest.mark.parametrize("loss_type", ["rollout_is", "dppo", "cispo"])
def test_old_forward_skipped(loss_type):
    """SkyRL skips the old policy's forward for the rollout-anchored losses when nothing else reads it
    (trainer._skip_policy_forward): old_log_probs is None."""
    log_probs, _, adv, mask, rollout = inputs(seed=5)
    config = algorithm(loss_type)
    config.cispo.cispo_anchor = "rollout"
    theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, None, adv, mask, rollout)
    ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, None, adv, mask, rollout)
    compare(ours, theirs)


def test_no_loss_mask_rollout_is_and_dppo():
    log_probs, old, adv, _, rollout = inputs(seed=3)
    for loss_type in ("rollout_is", "dppo"):
        config = algorithm(loss_type)
        theirs = run(ppo_utils.PolicyLossRegistry.get(loss_type), config, log_probs, old, adv, None, rollout)
        ours = run(gk_skyrl.GKPolicyLoss(loss_type), config, log_probs, old, adv, None, rollout)
        compare(ours, theirs)


@pytest.mark.parametrize(
    "loss_type,fields,message",
    [
        ("clip_cov", dict(off_policy_correction=OffPolicyCorrectionConfig(tis_ratio_type="token")),
         "validate_cfg refuses it too"),
        ("dual_clip", dict(clip_ratio_c=1.0), "clip_ratio_c=1.0"),
        ("regular", dict(off_policy_correction=OffPolicyCorrectionConfig(sequence_mask_metric="harmonic")),
         "sequence_mask_metric='harmonic'"),
    ],
)
def test_refusals_name_the_option(loss_type, fields, message):
    log_probs, old, adv, mask, rollout = inputs()
    config = AlgorithmConfig(policy_loss_type=loss_type, **fields)
    with pytest.raises(ValueError, match=message):
        gk_skyrl.GKPolicyLoss(loss_type)(log_probs, old, adv, config, loss_mask=mask, rollout_logprobs=rollout)


@pytest.mark.parametrize("loss_type", ["rollout_is", "cispo"])
def test_rollout_anchor_without_rollout_logprobs_asserts_as_skyrl(loss_type):
    log_probs, old, adv, mask, _ = inputs()
    config = algorithm(loss_type)
    config.cispo.cispo_anchor = "rollout"
    for fn in (ppo_utils.PolicyLossRegistry.get(loss_type), gk_skyrl.GKPolicyLoss(loss_type)):
        with pytest.raises(AssertionError, match="rollout_logprobs are required"):
            fn(log_probs, old, adv, config, loss_mask=mask, rollout_logprobs=None)
    with pytest.raises(ValueError, match="which the batch does not have"):
        gk_skyrl.policy_loss_config(config, loss_type, with_rollout=False)


def test_every_skyrl_policy_loss_type_has_a_gk_loss():
    assert set(gk_skyrl.LOSS_TYPES) == {str(t.value) for t in ppo_utils.PolicyLossType}


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
    assert set(names) == {f"gk_{t}" for t in gk_skyrl.LOSS_TYPES}
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
