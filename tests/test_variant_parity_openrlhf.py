"""Parity (tier 1): OpenRLHF 0.11.2's own `PolicyLoss` as the oracle of its train / rollout correction,
every combination it accepts: `is_correction_level` token or seq, `is_correction_mode` mask or clip,
`is_correction_gating` ratio, binary_kl or tv; and GSPO measured against the rollout log-probs.

`openrlhf/models/loss.py` is imported through a bare `openrlhf.models` package (the shim below): the
package's __init__ imports the actor, which needs flash_attn; loss.py itself needs torch and
`openrlhf/models/utils.py` only (whose deepspeed import serves a ZeRO-3 helper: an empty stand-in where
deepspeed is absent). Install beside the base environment: `pip install --no-deps openrlhf==0.11.2`.

Mapping (OpenRLHF -> PolicyLossConfig), the per-token IS ratio rho = exp(old - rollout):
  token, clip, ratio                -> is_level="token", is_mode="truncate", is_min / is_max = the threshold
  token, mask, ratio                -> is_level="token", is_mode="mask", is_min / is_max = the threshold
  seq, mask, ratio                  -> is_level="token", is_max=None (the raw weight), is_gate="ratio",
                                       is_gate_level="sequence", is_gate_min / is_gate_max = the threshold
  token | seq, mask, binary_kl | tv -> is_level="token", is_max=None, is_gate=<gating>,
                                       is_gate_level=<level>, is_gate_max = the threshold's upper bound
  gspo with a correction level      -> ratio_level="sequence", ratio_anchor="rollout" (OpenRLHF applies no
                                       IS weight to gspo, it measures the ratio against the sampler)
token_level_loss (ppo) -> loss_agg_mode="token-mean"; gspo's per-sample mean -> "seq-mean-token-mean".
Differences, none reached by these inputs: OpenRLHF's binary KL clamps both probabilities to
[1e-6, 1 - 1e-6] and has no 1e-8 inside its logarithms (grpo_kernels: SkyRL's form); its divergence gates
compare with a lower bound <= 0 (a divergence rounded below 0 fails `stat >= 0`; grpo_kernels' divergence
gates have no lower bound); its IS ratio is not clamped (grpo_kernels: log-ratio clamp 20); its
per-sample mean divides by count + 1e-8.

OpenRLHF runs in float64 on float32-drawn inputs, ours in float32; each case asserts that no gated
statistic lies within 1e-4 of a bound, so both precisions take the same side.
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
PIN = "0.11.2"
_version = installed_version("openrlhf")
if _version != PIN:
    _why = f"openrlhf=={_version} is installed; these tests are pinned to openrlhf=={PIN}" if _version else \
        f"openrlhf is not installed (these tests are pinned to openrlhf=={PIN})"  # fmt: skip
    if os.environ.get("GRPO_KERNELS_REQUIRE_VARIANT_PEERS") == "1":  # CI's peer environment: a skip is a failure
        pytest.fail(_why, pytrace=False)
    pytest.skip(_why, allow_module_level=True)


def _import_policy_loss():
    """openrlhf.models as a bare package (its __init__ imports the actor and flash_attn), then loss.py. Its
    models/utils.py imports deepspeed for a ZeRO-3 helper the loss never calls: an empty stand-in where
    deepspeed is not installed (an environment of the peer alone)."""
    if importlib.util.find_spec("deepspeed") is None and "deepspeed" not in sys.modules:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    if "openrlhf.models" not in sys.modules:
        root = os.path.dirname(importlib.util.find_spec("openrlhf").origin)
        shim = types.ModuleType("openrlhf.models")
        shim.__path__ = [os.path.join(root, "models")]
        sys.modules["openrlhf.models"] = shim
    from openrlhf.models.loss import PolicyLoss

    return PolicyLoss


PolicyLoss = _import_policy_loss()
MARGIN = 1e-4


def inputs(seed=5, spread=1.0):
    d = make_token_inputs(seed)
    d["rollout"] = (d["old"] + spread * (d["rollout"] - d["old"])).clamp(max=-0.01)
    d["old"] = d["old"].clamp(max=-0.01)
    return d


def statistic(gating, level, d):
    """The gated statistic as OpenRLHF defines it (float64), for the margin check."""
    m = d["mask"].double()
    old, rollout = d["old"].double(), d["rollout"].double()
    if gating == "ratio":
        s = old - rollout
    else:
        p, q = rollout.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
        s = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if gating == "binary_kl" else (p - q).abs()
    if level == "seq":
        s = ((s * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(m)
    return s.exp() if gating == "ratio" else s


def our_config(level, mode, gating, threshold):
    low, high = threshold
    if gating == "ratio" and level == "token":
        return C(is_level="token", is_mode="truncate" if mode == "clip" else "mask", is_min=low, is_max=high)
    gate = dict(is_gate=gating, is_gate_level="sequence" if level == "seq" else "token", is_gate_max=high)
    if gating == "ratio":
        gate["is_gate_min"] = low
    return C(is_level="token", is_max=None, **gate)


CASES = [
    ("token", "clip", "ratio", (0.8, 1.25)),
    ("token", "mask", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.95, 1.05)),
    ("token", "mask", "binary_kl", (0.0, 0.01)),
    ("seq", "mask", "binary_kl", (0.0, 0.01)),
    ("token", "mask", "tv", (0.0, 0.05)),
    ("seq", "mask", "tv", (-1.0, 0.05)),
]


@pytest.mark.parametrize("level,mode,gating,threshold", CASES)
def test_train_rollout_correction(level, mode, gating, threshold):
    d = inputs()
    mask = d["mask"]
    s = statistic(gating, level, d)
    for bound in threshold:
        if bound > 0 or gating == "ratio":
            gap = ((s - bound).abs() / max(abs(bound), 1e-3))[mask]
            assert float(gap.min()) > MARGIN, f"a statistic lies within {float(gap.min()):.1e} of {bound}"
    kept = mask & (s >= threshold[0]) & (s <= threshold[1])
    assert 0 < int(kept.sum()) < int(mask.sum()), "the draw must put units on both sides of the gate"

    peer = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level=level, is_correction_mode=mode,
                      is_correction_gating=gating, is_correction_threshold=threshold)  # fmt: skip
    lp64 = leaf(d["logp"])
    loss_peer, _, _, _, filtered_peer = peer(lp64, d["old"].double(), d["adv_tok"].double(), action_mask=mask.double(),
                                             rollout_log_probs=d["rollout"].double())  # fmt: skip
    (g_peer,) = torch.autograd.grad(loss_peer, lp64)

    cfg = our_config(level, mode, gating, threshold).replace(clip_low=0.2, clip_high=0.28)
    lp = d["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, d["adv_tok"], mask, d["old"], rollout_logprobs=d["rollout"], config=cfg, backend="torch")
    (g,) = torch.autograd.grad(out.loss, lp)
    assert_close("loss", out.loss, loss_peer, scale=max(1.0, abs(float(loss_peer.detach()))))
    assert_close("dL/dlogp", g, g_peer, scale=grad_scale(g_peer))
    if level == "token" and mode == "mask":  # the share of tokens the correction drops
        ours = out.metrics["is_weight/masked_frac" if gating == "ratio" else "is_weight/gated_frac"]
        assert_close("is_filter_ratio", ours, filtered_peer)


def test_gspo_against_the_rollout():
    """GSPO with a correction level: the sequence ratio exp(mean_t (logp - rollout)), per-sample means."""
    d = inputs()
    peer = PolicyLoss(clip_eps_low=0.05, clip_eps_high=0.05, policy_loss_type="gspo", is_correction_level="token")
    lp64 = leaf(d["logp"])
    adv = d["adv_seq"][:, None].expand_as(d["logp"]).contiguous()
    loss_peer, *_ = peer(lp64, d["old"].double(), adv.double(), action_mask=d["mask"].double(),
                         rollout_log_probs=d["rollout"].double())  # fmt: skip
    (g_peer,) = torch.autograd.grad(loss_peer, lp64)
    cfg = C.gspo(ratio_anchor="rollout", clip_low=0.05, clip_high=0.05, loss_agg_mode="seq-mean-token-mean")
    lp = d["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, d["adv_seq"], d["mask"], d["old"], rollout_logprobs=d["rollout"], config=cfg,
                       backend="torch")  # fmt: skip
    (g,) = torch.autograd.grad(out.loss, lp)
    assert 0 < out.metrics["clip_ratio/region_mean"].item() < 1, "the draw must clip some sequences"
    assert_close("loss", out.loss, loss_peer, scale=max(1.0, abs(float(loss_peer.detach()))))
    assert_close("dL/dlogp", g, g_peer, scale=grad_scale(g_peer))
