"""The verl adapter (grpo_kernels.integrations.verl): every gk_<mode> equals verl 0.9.1's own policy
loss on the same inputs (loss, metrics, gradient w.r.t. log_prob), through verl's registry; the
entry point loads in a fresh process; linear_cross_entropy keeps verl's contract."""

import itertools
import subprocess
import sys

import pytest
import torch

from grpo_kernels.testing import assert_close

verl = pytest.importorskip("verl", reason="needs verl: the [verl] or [parity] extra")
pytestmark = pytest.mark.parity
if verl.__version__ != "0.9.1":
    pytest.skip(f"the adapter is pinned to verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

import grpo_kernels.integrations.verl as gk_verl  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
BS, T = 6, 11


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([11, 3, 8, 1, 6, 9])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    log_prob = -torch.rand(BS, T, generator=g) * 2 - 0.1
    old = log_prob + torch.randn(BS, T, generator=g) * 0.25  # ratios beyond both clip bounds
    adv = torch.randn(BS, generator=g)[:, None].expand(BS, T).contiguous()  # verl: [bs, T]
    is_w = torch.rand(BS, T, generator=g) + 0.5
    return log_prob, old, adv, mask, is_w


def actor_config(mode, global_info):
    cfg = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0,
        tau_pos=1.0, tau_neg=1.05,
        policy_loss=PolicyLossConfig(loss_mode=mode, clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=2.0,
                                     kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    )  # fmt: skip
    cfg.global_batch_info.update(global_info)  # verl mutates this dict in place (losses.py ppo_loss)
    return cfg


def run(fn, log_prob, old, adv, mask, agg, config, is_w):
    lp = log_prob.clone().requires_grad_()
    torch.manual_seed(7)  # clip_cov draws torch.randperm
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                       config=config, rollout_is_weights=is_w)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, metrics, grad


GLOBAL = dict(dp_size=2, batch_num_tokens=80, global_batch_size=14, loss_scale_factor=16)


@pytest.mark.parametrize(
    "mode,agg,global_info,with_is",
    [
        pytest.param(mode, agg, info, with_is, id=f"{mode}-{agg}-{'global' if info else 'local'}-{'is' if with_is else 'nois'}")
        for mode, agg, info, with_is in itertools.product(gk_verl.MODES, AGG_MODES, [{}, GLOBAL], [False, True])
        if not (mode in ("sapo", "geo_mean") and agg != "token-mean")  # these two ignore loss_agg_mode
    ],
)  # fmt: skip
def test_gk_mode_equals_verl(mode, agg, global_info, with_is):
    log_prob, old, adv, mask, is_w = inputs()
    config = actor_config(mode, global_info)
    weights = is_w if with_is else None
    theirs = run(core_algos.get_policy_loss_fn(mode), log_prob, old, adv, mask, agg, config, weights)
    ours = run(core_algos.get_policy_loss_fn(f"gk_{mode}"), log_prob, old, adv, mask, agg, config, weights)
    # fp32 on both sides; summation orders differ: a few ulps of the largest term
    assert_close("loss", ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    assert_close("dL/dlog_prob", ours[2], theirs[2], atol=1e-7, rtol=1e-4)
    assert set(ours[1]) == set(theirs[1]), (sorted(ours[1]), sorted(theirs[1]))
    for key, value in theirs[1].items():
        assert abs(ours[1][key] - value) <= 1e-6 + 1e-5 * abs(value), (key, ours[1][key], value)


def test_entry_point_registers_in_a_fresh_process():
    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(','.join(sorted(k for k in R if k.startswith('gk_'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().split(",") == sorted(f"gk_{m}" for m in gk_verl.MODES)


def test_linear_cross_entropy_contract():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(97, 16, requires_grad=True)
    labels = torch.randint(0, 97, (2, 5))
    logprobs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels, 0.7, "none")
    assert logprobs.shape == (10,) and entropy.shape == (10,) and logprobs.dtype == torch.float32
    z = (hidden.reshape(10, 16) @ weight.T) / 0.7
    expected = torch.log_softmax(z, -1).gather(-1, labels.reshape(10, 1)).squeeze(-1)
    assert_close("logprobs", logprobs, expected, atol=1e-5, rtol=1e-5)
    total, _ = gk_verl.linear_cross_entropy(hidden, weight, labels, 0.7, "sum")
    assert_close("sum", total, expected.sum(), atol=1e-4, rtol=1e-5)
    (logprobs.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape
    with pytest.raises(TypeError, match="temperature must be a float"):
        gk_verl.linear_cross_entropy(hidden, weight, labels, 1)
    # a TP group is passed on as tp_group (tests/test_distributed_tp.py runs it on real groups); a
    # non-group object is refused, saying what is expected
    with pytest.raises(ValueError, match="tp_group"):
        gk_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none", dist_process_group=object())


def test_install_linear_cross_entropy_patches_verl():
    import verl.utils.kernel.linear_cross_entropy as lce

    original = lce.linear_cross_entropy
    try:
        gk_verl.install_linear_cross_entropy()
        assert lce.linear_cross_entropy is gk_verl.linear_cross_entropy
    finally:
        lce.linear_cross_entropy = original


def test_linear_cross_entropy_soft_capping():
    """The drop-in's softcap keyword: Gemma-style z = c tanh(x / c) / T, against torch on the same logits."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 16) * 3
    weight = torch.randn(97, 16)
    labels = torch.randint(0, 97, (10,))
    logprobs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels, 0.7, "none", softcap=5.0)
    z = 5.0 * torch.tanh((hidden @ weight.T) / 5.0) / 0.7
    log_p = torch.log_softmax(z, -1)
    assert_close("logprobs", logprobs, log_p.gather(-1, labels[:, None]).squeeze(-1), atol=1e-5, rtol=1e-5)
    assert_close("entropy", entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=1e-5)
