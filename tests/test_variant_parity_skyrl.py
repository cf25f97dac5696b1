"""Parity (tier 1): SkyRL 0.4.0's own loss functions as the oracle of the variants grpo_kernels took from it:
`dppo` (binary TV and binary KL, anchored on the rollout log-probs when given, else old), `rollout_is`
(CISPO against the rollout log-probs with a hard zero), `cispo` with `cispo_anchor="rollout"`, and the
off-policy correction's geometric sequence mask (alone, with token TIS, and after DPPO).

SkyRL's functions are called as they are (skyrl/backends/skyrl_train/utils/ppo_utils.py). Its package
declares Python >= 3.12 and `skyrl/backends/__init__.py` imports the tinker API, whose pydantic models refuse
`typing.TypedDict` below 3.12; the shim below makes `skyrl.backends` a bare package (its own __init__ is not
run), after which ppo_utils imports on 3.11 (ray, which it imports for its registry's actor sync, is an
empty stand-in where it is not installed). Install: `pip install --no-deps --ignore-requires-python
skyrl==0.4.0 skyrl-gym==0.4.0` and the small packages its config module imports, pinned in
.ci/steps/trainers.sh (CI's environment for this module and AReaL's; OpenRLHF's runs in .ci/steps/openrlhf.sh).

Mapping (SkyRL -> PolicyLossConfig): its `reduce_loss` is a plain sum of the masked per-token loss (the
reduction is folded into the advantages before), so loss_agg_mode="token-sum"; `dppo` -> loss_type="dppo",
dppo_divergence=dppo_type, clip_low / clip_high = delta_low / delta_high, ratio_anchor="rollout" when
rollout_logprobs are given; `rollout_is` -> loss_type="cispo", cispo_form="mask", ratio_anchor="rollout",
clip_low / clip_high = eps_clip_low / eps_clip_high; `cispo` with cispo_anchor="rollout" -> the same with
cispo_form="relative" and the cispo_eps bounds; off_policy_correction sequence_mask_metric="geometric" ->
is_gate="ratio", is_gate_level="sequence", is_gate_min / max = geo_mask_low / high; tis_ratio_type="token"
-> is_level="token", is_max=token_tis_ratio_clip_high. Differences, none reached by these inputs: SkyRL
clamps the mean log-ratio of the geometric mask at +-20, grpo_kernels each token's (|old - rollout| > 20
nats); SkyRL computes the ratio in float32 whatever the input dtype (safe_exp_delta), so its float64 run
carries float32 rounding in r (~6e-8 relative, inside the bounds below).

SkyRL runs in float64 on float32-drawn inputs, ours in float32 (parity_helpers' tolerances). Each case
asserts that no probability change, binary KL, ratio or geometric mean lies within 1e-4 of a bound, so both
precisions take the same side of every mask.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from parity_helpers import assert_close, grad_scale, installed_version, leaf, make_token_inputs

pytestmark = pytest.mark.parity
PIN = "0.4.0"
_version = installed_version("skyrl")
if _version != PIN:
    _why = f"skyrl=={_version} is installed; these tests are pinned to skyrl=={PIN}" if _version else \
        f"skyrl is not installed (these tests are pinned to skyrl=={PIN})"  # fmt: skip
    if os.environ.get("GRPO_KERNELS_REQUIRE_VARIANT_PEERS") == "1":  # CI's peer environment: a skip is a failure
        pytest.fail(_why, pytrace=False)
    pytest.skip(_why, allow_module_level=True)


def _import_ppo_utils():
    """skyrl.backends as a bare package (its __init__ needs Python 3.12), then ppo_utils. ppo_utils imports
    ray for its registry's actor sync, which the loss functions never call: an empty stand-in where ray is
    not installed (an environment of the peer alone)."""
    if importlib.util.find_spec("ray") is None and "ray" not in sys.modules:
        ray = types.ModuleType("ray")
        ray.remote = lambda *args, **kwargs: args[0] if args else (lambda cls: cls)  # @ray.remote(...) at import
        ray.is_initialized = lambda: False  # the registry then stays in this process (no actor to sync)
        sys.modules["ray"] = ray
    if "skyrl.backends" not in sys.modules:
        root = os.path.dirname(importlib.util.find_spec("skyrl").origin)
        shim = types.ModuleType("skyrl.backends")
        shim.__path__ = [os.path.join(root, "backends")]
        sys.modules["skyrl.backends"] = shim
    from skyrl.backends.skyrl_train.utils import ppo_utils
    from skyrl.train import config

    return ppo_utils, config


ppo_utils, sk = _import_ppo_utils()
MARGIN = 1e-4


def no_correction(**changes):
    fields = dict(tis_ratio_type=None, sequence_mask_metric=None, outlier_token_is_threshold_low=None,
                  outlier_token_is_threshold_high=None)  # fmt: skip
    fields.update(changes)
    return sk.OffPolicyCorrectionConfig(**fields)


def inputs(seed=5, spread=3.0):
    """Token inputs with log-probs of probabilities (<= 0) and the sampler `spread` x N(0, 0.3) from old."""
    d = make_token_inputs(seed)
    d["rollout"] = (d["old"] + spread * (d["rollout"] - d["old"])).clamp(max=-0.01)
    d["old"] = d["old"].clamp(max=-0.01)
    return d


def margin(name, stat, bound, where):
    gap = ((stat - bound).abs() / max(abs(bound), 1e-3))[where]
    assert gap.numel() == 0 or float(gap.min()) > MARGIN, f"{name}: within {float(gap.min()):.1e} of {bound}"


def run_pair(loss_name, sk_config, cfg, d, *, rollout=True):
    """SkyRL's function in float64 and grpo_loss in float32 on the same inputs: (both losses, both
    dL/dlogp, SkyRL's metrics, ours)."""
    fn = getattr(ppo_utils, loss_name)
    lp64 = leaf(d["logp"])
    mask = d["mask"]
    loss_sk, metrics_sk = fn(
        lp64, d["old"].double(), d["adv_tok"].double(), sk_config, loss_mask=mask.double(),
        rollout_logprobs=d["rollout"].double() if rollout else None,
    )  # fmt: skip
    (g_sk,) = torch.autograd.grad(loss_sk, lp64)
    lp = d["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, d["adv_tok"], mask, d["old"], rollout_logprobs=d["rollout"] if cfg.uses_rollout_logprobs
                       else None, config=cfg, backend="torch")  # fmt: skip
    (g,) = torch.autograd.grad(out.loss, lp)
    assert_close("loss", out.loss, loss_sk, scale=max(1.0, abs(float(loss_sk.detach()))))
    assert_close("dL/dlogp", g, g_sk, scale=grad_scale(g_sk))
    return metrics_sk, out.metrics


@pytest.mark.parametrize("dppo_type,delta_low,delta_high", [("binary_tv", 0.1, 0.15), ("binary_kl", 0.02, 0.03)])
@pytest.mark.parametrize("with_rollout", [True, False])
def test_dppo(dppo_type, delta_low, delta_high, with_rollout):
    d = inputs()
    mu = (d["rollout"] if with_rollout else d["old"]).double()
    diff = d["logp"].double().exp() - mu.exp()
    adv, mask = d["adv_tok"], d["mask"]
    if dppo_type == "binary_tv":
        margin("p - mu", diff, delta_high, mask & (adv > 0))
        margin("mu - p", -diff, delta_low, mask & (adv < 0))
    else:
        p, q = mu.exp(), d["logp"].double().exp()
        div = p * (mu - d["logp"].double()) + (1 - p) * torch.log((1 - p + 1e-8) / (1 - q + 1e-8))
        margin("binary KL", div, delta_high, mask & (adv > 0) & (diff > 0))
        margin("binary KL", div, delta_low, mask & (adv < 0) & (diff < 0))
    sk_config = sk.AlgorithmConfig(policy_loss_type="dppo", max_seq_len=9, off_policy_correction=no_correction(),
                                   dppo=sk.DPPOConfig(dppo_type=dppo_type, delta_low=delta_low, delta_high=delta_high))  # fmt: skip
    cfg = C.dppo(dppo_divergence=dppo_type, clip_low=delta_low, clip_high=delta_high, loss_agg_mode="token-sum",
                 ratio_anchor="rollout" if with_rollout else "old")  # fmt: skip
    metrics_sk, metrics = run_pair("dppo_policy_loss", sk_config, cfg, d, rollout=with_rollout)
    assert 0 < metrics_sk["clip_ratio"] < 1, "the draw must put tokens inside and outside the trust region"
    assert_close("clip_ratio (dropped share)", metrics["clip_ratio/region_mean"], metrics_sk["clip_ratio"])


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.1, 0.28)])
def test_rollout_is(eps_low, eps_high):
    d = inputs(spread=1.0)
    r = (d["logp"].double() - d["rollout"].double()).exp()
    margin("r vs 1 - eps_low", r, 1 - eps_low, d["mask"])
    margin("r vs 1 + eps_high", r, 1 + eps_high, d["mask"])
    sk_config = sk.AlgorithmConfig(policy_loss_type="rollout_is", eps_clip_low=eps_low, eps_clip_high=eps_high,
                                   max_seq_len=9, off_policy_correction=no_correction())  # fmt: skip
    cfg = C(loss_type="cispo", cispo_form="mask", ratio_anchor="rollout", clip_low=eps_low, clip_high=eps_high,
            loss_agg_mode="token-sum")  # fmt: skip
    metrics_sk, metrics = run_pair("rollout_is_policy_loss", sk_config, cfg, d)
    assert 0 < metrics_sk["clip_ratio"] < 1
    assert_close("clip_ratio (outside the range)", metrics["clip_ratio/any_mean"], metrics_sk["clip_ratio"])


def test_cispo_rollout_anchor():
    d = inputs(spread=1.0)
    r = (d["logp"].double() - d["rollout"].double()).exp()
    margin("r vs 0.8", r, 0.8, d["mask"])
    margin("r vs 1.28", r, 1.28, d["mask"])
    sk_config = sk.AlgorithmConfig(
        policy_loss_type="cispo", max_seq_len=9, off_policy_correction=no_correction(),
        cispo=sk.CISPOConfig(cispo_eps_clip_low=0.2, cispo_eps_clip_high=0.28, cispo_anchor="rollout"),
    )  # fmt: skip
    cfg = C(loss_type="cispo", cispo_form="relative", ratio_anchor="rollout", clip_low=0.2, clip_high=0.28,
            loss_agg_mode="token-sum")  # fmt: skip
    metrics_sk, metrics = run_pair("compute_policy_loss_cispo", sk_config, cfg, d)
    assert 0 < metrics_sk["clip_ratio"] < 1
    assert_close("clip_ratio", metrics["clip_ratio/any_mean"], metrics_sk["clip_ratio"])


@pytest.mark.parametrize(
    "loss_name,policy_loss_type,tis",
    [("ppo_policy_loss", "regular", None), ("ppo_policy_loss", "regular", "token"), ("dppo_policy_loss", "dppo", None)],
)  # fmt: skip
def test_geometric_sequence_mask(loss_name, policy_loss_type, tis):
    """sequence_mask_metric="geometric": sequences whose geometric-mean old / rollout ratio leaves
    [geo_mask_low, geo_mask_high] are dropped (SkyRL zeroes their loss mask); with token TIS the kept
    tokens carry min(exp(old - rollout), cap)."""
    d = inputs(spread=0.3)
    lo, hi = 0.97, 1.03
    m = d["mask"].double()
    geo = (((d["old"].double() - d["rollout"].double()) * m).sum(-1) / m.sum(-1).clamp(min=1)).exp()
    margin("geometric mean", geo, lo, m.sum(-1) > 0)
    margin("geometric mean", geo, hi, m.sum(-1) > 0)
    dropped = ((geo < lo) | (geo > hi)) & (m.sum(-1) > 0)
    assert 0 < int(dropped.sum()) < int((m.sum(-1) > 0).sum()), "the draw must drop some sequences and keep some"
    correction = no_correction(sequence_mask_metric="geometric", geo_mask_low=lo, geo_mask_high=hi,
                               tis_ratio_type=tis, token_tis_ratio_clip_high=1.5)  # fmt: skip
    sk_config = sk.AlgorithmConfig(policy_loss_type=policy_loss_type, max_seq_len=9, off_policy_correction=correction,
                                   dppo=sk.DPPOConfig(dppo_type="binary_tv", delta_low=0.1, delta_high=0.15))  # fmt: skip
    gate = dict(is_gate="ratio", is_gate_level="sequence", is_gate_min=lo, is_gate_max=hi)
    if tis == "token":
        gate.update(is_level="token", is_mode="truncate", is_max=1.5)
    if policy_loss_type == "dppo":  # SkyRL's DPPO anchors on the rollout log-probs it is given
        cfg = C.dppo(clip_low=0.1, clip_high=0.15, ratio_anchor="rollout", loss_agg_mode="token-sum", **gate)
        diff = d["logp"].double().exp() - d["rollout"].double().exp()
        margin("p - mu", diff, 0.15, d["mask"] & (d["adv_tok"] > 0))
        margin("mu - p", -diff, 0.1, d["mask"] & (d["adv_tok"] < 0))
    else:
        cfg = C(loss_agg_mode="token-sum", **gate)
    run_pair(loss_name, sk_config, cfg, d)
