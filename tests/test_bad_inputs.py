"""Bad and edge inputs that once went through silently: forbidden tokens (-inf bias), normalizers that
cannot be global counts, non-tensor inputs, meta tensors, all-masked metrics. Both backends (the Triton
one under the interpreter, in a subprocess)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C

HERE = Path(__file__).resolve().parent


def run_cases(backend: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    if backend == "triton":
        pytest.importorskip("triton")
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "_bad_inputs_cases.py"), backend], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def cases(request):
    return run_cases(request.param)


def test_forbidden_tokens_are_the_head_without_them(cases):
    """A -inf bias (the default check allows it) gives p = 0 for those tokens: log-probs, entropy and
    gradients equal the head without their rows (fp32 sums over 97 or 93 columns: a few ulp), their
    own weight gradient is exactly 0, and nothing is NaN."""
    assert cases["finite"], cases
    for key in ("logprobs", "entropy", "grad_hidden", "grad_weight_allowed"):
        assert cases[key] <= 1e-5, (key, cases[key])
    assert cases["grad_weight_forbidden"] == 0.0
    assert cases["loss_finite"], "entropy bonus with forbidden tokens gave a non-finite loss or gradient"


def test_all_masked_batch_has_defined_metrics(cases):
    """Loss 0 and zero gradients, and every metric a number: ratio min / max 1 (no update), the clip
    extremes 0 (nothing clipped)."""
    assert cases["empty_loss"] == 0.0 and cases["empty_grads_zero"]
    metrics = cases["empty_metrics"]
    assert not [k for k, v in metrics.items() if math.isnan(v)], metrics
    assert metrics["ratio/min"] == metrics["ratio/max"] == 1.0
    assert metrics["clip_ratio/low_min"] == metrics["clip_ratio/high_max"] == 0.0


def _batch():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(31, 8, generator=g)
    targets = torch.randint(0, 31, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # 8 valid tokens, 2 sequences
    return hidden, weight, targets, mask, torch.randn(2, generator=g)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_tokens=0), r"num_tokens must be a finite number > 0 \(the valid tokens .*got 0"),
    (dict(num_tokens=-3.5), r"num_tokens must be a finite number > 0 .*got -3.5"),
    (dict(num_tokens=float("inf")), r"num_tokens must be a finite number > 0 .*got inf"),
    (dict(num_tokens=float("nan")), r"num_tokens must be a finite number > 0 .*got nan"),
    (dict(num_tokens=torch.tensor(float("inf"))), r"num_tokens must be a finite number > 0 .*got inf"),
    (dict(num_sequences=0), r"num_sequences must be a finite number > 0 .*got 0"),
    (dict(num_sequences=float("inf")), r"num_sequences must be a finite number > 0 .*got inf"),
    (dict(num_sequences=1), "num_sequences=1 is fewer than the 2 sequences"),
    (dict(dp_size=0), r"dp_size must be a whole number >= 1 \(data-parallel ranks\), got 0"),
    (dict(dp_size=float("inf")), r"dp_size must be a whole number >= 1 .*got inf"),
    (dict(grad_accum_steps=2.5), r"grad_accum_steps must be a whole number >= 1 .*got 2.5"),
    (dict(grad_accum_steps=float("nan")), r"grad_accum_steps must be a whole number >= 1 .*got nan"),
])  # fmt: skip
def test_normalizers_that_cannot_count_this_call_are_refused(kwargs, match):
    hidden, weight, targets, mask, adv = _batch()
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(hidden, weight, targets, adv, mask, config=C.dapo(), backend="torch", **kwargs)
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(torch.randn(2, 5), adv, mask, config=C.dapo(), **kwargs)


def test_num_tokens_below_one_is_taken_as_given():
    """No clamp to 1: a normaliser of 0.25 divides the token sum by 0.25 (float64 end to end: exact up to
    the sum's rounding), as documented ("any value > 0 is taken as given")."""
    _, _, _, mask, adv = _batch()
    logp = torch.randn(2, 5, dtype=torch.float64)
    at_one = gk.grpo_loss(logp, adv.double(), mask, config=C.dapo(), num_tokens=1.0).loss
    quarter = gk.grpo_loss(logp, adv.double(), mask, config=C.dapo(), num_tokens=0.25).loss
    torch.testing.assert_close(quarter, at_one * 4, rtol=1e-12, atol=0)


def test_num_tokens_may_be_an_estimate_below_this_calls_count():
    """TRL's window estimate (num_items GA / steps_per_generation) can fall below one micro-batch's count:
    taken as given, the token sum divided by it."""
    hidden, weight, targets, mask, adv = _batch()
    logp = torch.randn(2, 5, dtype=torch.float64)
    at_count = gk.grpo_loss(logp, adv.double(), mask, config=C.dapo(), num_tokens=8).loss
    below = gk.grpo_loss(logp, adv.double(), mask, config=C.dapo(), num_tokens=5).loss
    torch.testing.assert_close(below, at_count * 8 / 5, rtol=1e-12, atol=0)
    fused = gk.fused_linear_grpo_loss(hidden, weight, targets, adv, mask, config=C.dapo(), backend="torch",
                                      num_tokens=5).loss
    fused_at_count = gk.fused_linear_grpo_loss(hidden, weight, targets, adv, mask, config=C.dapo(),
                                               backend="torch", num_tokens=8).loss
    # fp32: the two divisions and the rescaling by 8 / 5 round once each
    torch.testing.assert_close(fused, fused_at_count * 8 / 5, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize("config,group,match", [
    (C.dapo(top_entropy_quantile=0.5, entropy_coef=0.01), "world", "entropy_group must be a torch.distributed ProcessGroup, got str"),
    (C.dapo(), "world", "entropy_group is only used with top_entropy_quantile < 1"),
])  # fmt: skip
def test_bad_entropy_group_is_refused(config, group, match):
    """entropy_group: a process group, and only where a quantile is taken (never silently ignored)."""
    hidden, weight, targets, mask, adv = _batch()
    kwargs = dict(config=config, backend="torch", entropy_group=group)
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(hidden, weight, targets, adv, mask, **kwargs)
    with pytest.raises(ValueError, match=match):
        gk.grpo_loss(torch.randn(2, 5), adv, mask, entropy=torch.rand(2, 5), **kwargs)


@pytest.mark.parametrize("name", ["mask", "advantages", "cu_seqlens"])
def test_non_tensor_inputs_say_what_is_expected(name):
    hidden, weight, targets, mask, adv = _batch()
    args = dict(mask=mask, advantages=adv)
    if name == "mask":
        args["mask"] = mask.numpy()
        expected = "mask must be a torch.Tensor, got numpy.ndarray"
    elif name == "advantages":
        args["advantages"] = adv.tolist()
        expected = "advantages must be a torch.Tensor, got builtins.list"
    else:
        hidden, targets = hidden.reshape(10, 8), targets.reshape(10)
        args.update(mask=torch.ones(10, dtype=torch.bool), cu_seqlens=[0, 5, 10])
        expected = "cu_seqlens must be a torch.Tensor, got builtins.list"
    with pytest.raises(ValueError, match=expected):
        gk.fused_linear_grpo_loss(hidden, weight, targets, config=C.dapo(), backend="torch", **args)


def test_meta_tensors_are_refused_before_torch_sees_them():
    with pytest.raises(ValueError, match="rewards is on the meta device"):
        gk.advantages.estimate("grpo", torch.zeros(4, device="meta"), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="group_index is on the meta device"):
        gk.advantages.estimate("grpo", torch.zeros(4), torch.zeros(4, dtype=torch.long, device="meta"))
    hidden, weight, targets, mask, adv = _batch()
    with pytest.raises(ValueError, match="hidden is on the meta device"):
        gk.fused_linear_logprobs(hidden.to("meta"), weight.to("meta"), targets.to("meta"))


def test_nan_bias_is_still_refused():
    hidden, weight, targets, mask, adv = _batch()
    bias = torch.zeros(31)
    bias[4] = float("nan")
    with pytest.raises(ValueError, match="bias has 1 non-finite"):
        gk.fused_linear_logprobs(hidden, weight, targets, bias)
