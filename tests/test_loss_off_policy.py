"""Off-policy values of the objectives whose other tests run on-policy (ratio 1, no clipping): PSPO,
TIC-GRPO, the GRPO-lambda prefix trace and Lopti's two stages. Each case is small enough to compute by
hand; the expected loss and gradient below are written from the formulas with math.exp, not from the
library. The loss head computes in fp32 (its documented numerics, whatever the input dtype); every value
here is O(1) and passes through a handful of fp32 roundings (exp, products, a mean of <= 3 terms), so the
tolerance is 8 fp32 ulps of 1."""

from __future__ import annotations

import math

import torch

import grpo_kernels as gk

C = gk.PolicyLossConfig
EPS = 8 * 2.0**-23  # 8 fp32 ulps at magnitude 1
TOL = dict(rtol=0, atol=EPS)


def loss_and_grad(config, logprobs, old, advantages, mask=None):
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    adv = torch.tensor(advantages, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask)
    out = gk.grpo_loss(lp, adv, mask, old_logprobs=old, config=config, backend="torch")
    out.loss.backward()
    return out.loss.detach(), lp.grad, out.metrics


def test_pspo_off_policy():
    # r = exp(lp - old) = (e^0.2, e^-0.3); r~ = 0.9 r + 0.1 replaces clipping; objective -r~ A, token mean
    loss, grad, _ = loss_and_grad(C.pspo(), [[-1.0, -2.0]], [[-1.2, -1.7]], [1.0])
    r = (math.exp(0.2), math.exp(-0.3))
    assert abs(loss.item() - (-(0.9 * (r[0] + r[1]) / 2 + 0.1))) < EPS
    torch.testing.assert_close(grad, torch.tensor([[-0.9 * r[0] / 2, -0.9 * r[1] / 2]], dtype=torch.float64), **TOL)


def test_tic_grpo_trajectory_ratio_off_policy():
    # row 0: sum of log-ratios -0.1 -> r = e^-0.1 inside [0.8, 1.2]: objective -r, gradient -r per token
    # row 1: sum 0.5 -> r = e^0.5 > 1.2 with A > 0: clipped, objective -1.2, no gradient
    # seq-mean-token-mean over two sequences: each sequence weighs 1/2
    loss, grad, _ = loss_and_grad(C.tic_grpo(), [[-1.0, -2.0], [-1.0, -2.0]], [[-1.2, -1.7], [-1.3, -2.2]],
                                  [1.0, 1.0])  # fmt: skip
    r0 = math.exp(-0.1)
    assert abs(loss.item() - (-r0 - 1.2) / 2) < EPS
    torch.testing.assert_close(grad, torch.tensor([[-r0 / 2, -r0 / 2], [0.0, 0.0]], dtype=torch.float64), **TOL)


def test_grpo_lambda_prefix_trace_off_policy():
    # log-ratios (0.1, 0.2, -0.4), decay 0.5: log w = (0.1, 0.2 + 0.05, -0.4 + 0.125) = (0.1, 0.25, -0.275)
    # A = 1, clip 0.2: w_1 = e^0.25 > 1.2 is clipped (no gradient); w_0 and w_2 are not
    # d log w_t / d lp_k = 0.5^(t - k) for k <= t; token mean over 3 tokens
    config = C(ratio_level="prefix", prefix_decay=0.5, kl_coef=0.0)
    loss, grad, _ = loss_and_grad(config, [[-1.0, -2.0, -3.0]], [[-1.1, -2.2, -2.6]], [1.0])
    w = (math.exp(0.1), math.exp(0.25), math.exp(-0.275))
    assert abs(loss.item() - (-(w[0] + 1.2 + w[2]) / 3)) < EPS
    expected = [-(w[0] + 0.25 * w[2]) / 3, -(0.5 * w[2]) / 3, -w[2] / 3]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=torch.float64), **TOL)


def test_lopti_stages_off_policy():
    # old probabilities e^-0.1 = 0.905 (high) and e^-2 = 0.135 (low); log-ratios (-0.2, 0.1), A = -1:
    # PPO objective max(r, clip(r)) = r for both (0.819 and 1.105 are inside [0.8, 1.2] or on the side
    # clipping does not bind for A < 0); each stage keeps its tokens, the token mean still divides by 2
    r = (math.exp(-0.2), math.exp(0.1))
    for side, kept in (("low", 1), ("high", 0)):
        config = C.grpo(kl_coef=0.0, old_prob_threshold=0.5, old_prob_side=side)
        loss, grad, metrics = loss_and_grad(config, [[-0.3, -1.9]], [[-0.1, -2.0]], [-1.0])
        assert abs(loss.item() - r[kept] / 2) < EPS, side
        expected = [0.0, 0.0]
        expected[kept] = r[kept] / 2
        torch.testing.assert_close(grad, torch.tensor([expected], dtype=torch.float64), **TOL)
        assert metrics["selection/old_prob_kept_frac"].item() == 0.5


def test_grpo_lambda_long_sequence_weighting_off_policy():
    # ratio_level="prefix_symmetric": log w_t = sum_{k<=t} max(d^k, d^(t-k)) lr_k, d = 0.5, 4 tokens,
    # log-ratios (0.1, 0.2, -0.4, 0.3); the weights max(d^k, d^(t-k)) by hand:
    #   t=0: (1)                 t=1: (1, 1)
    #   t=2: (1, 0.5, 1)         t=3: (1, 0.5, 0.5, 1)
    lr = (0.1, 0.2, -0.4, 0.3)
    weights = ((1,), (1, 1), (1, 0.5, 1), (1, 0.5, 0.5, 1))
    log_w = [sum(c * x for c, x in zip(row, lr)) for row in weights]  # 0.1, 0.3, -0.2, 0.2
    old = [-1.0 - x for x in lr]
    # a clip range [0.1, 10] that never binds here: each token's objective is -w_t
    config = C(ratio_level="prefix_symmetric", prefix_decay=0.5, kl_coef=0.0, clip_low=0.9, clip_high=9.0)
    loss, grad, _ = loss_and_grad(config, [[-1.0] * 4], [old], [1.0])
    w = [math.exp(v) for v in log_w]
    assert abs(loss.item() - (-sum(w) / 4)) < EPS
    # d loss / d lp_k = -(1/4) sum_{t>=k} w_t * weight_{t,k}
    expected = [-sum(w[t] * weights[t][k] for t in range(k, 4)) / 4 for k in range(4)]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=torch.float64), **TOL)
    # decay 1: every weight is 1, the trajectory-sum ratio of each prefix
    config = config.replace(prefix_decay=1.0)
    loss, _, _ = loss_and_grad(config, [[-1.0] * 4], [old], [1.0])
    prefix = [sum(lr[: t + 1]) for t in range(4)]
    assert abs(loss.item() - (-sum(math.exp(v) for v in prefix) / 4)) < EPS


def test_prefix_symmetric_has_no_triton_kernel_and_says_so():
    import warnings

    import pytest

    from grpo_kernels import _backend
    from grpo_kernels.functional import _loss_head_backend

    config = C(ratio_level="prefix_symmetric", kl_coef=0.0)
    cpu = torch.device("cpu")
    with pytest.raises(NotImplementedError, match="prefix_symmetric"):
        _loss_head_backend(config, "triton", cpu, "triton")  # as resolved for CUDA tensors
    _backend._notified.clear()  # the notice is once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _loss_head_backend(config, "auto", cpu, "triton") == "torch"
    assert any("prefix_symmetric" in str(w.message) for w in caught)
    assert _loss_head_backend(C(ratio_level="prefix"), "auto", cpu, "triton") == "triton"
