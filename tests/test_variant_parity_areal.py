"""Parity (tier 1): AReaL 1.0.4's own `ppo_actor_loss_fn` with sequence-level rejection sampling on the
ratio (its `RejectionSamplingConfig(level="sequence", metric="ratio", agg="mean")`, mask or clamp) as the
oracle of is_level="sequence_geometric": the behaviour weight is the geometric mean of the proximal /
behaviour ratios of the sequence, not their product (is_level="sequence").

AReaL's package __init__ pulls in its controller and HTTP stack (82 packages); the function lives in
areal/utils/functional/functional.py, whose module imports only numpy, torch and two names from AReaL:
`RejectionSamplingConfig` (areal.api.cli_args: a dataclass the function reads five attributes of) and
`KLEstimator` (areal.utils.data: used only for the KL metrics, metric="kl_k*", not exercised here). The
shim below loads that file as it is, with those two names stubbed, from an installed wheel:
`pip install --no-deps areal==1.0.4`.

Mapping: AReaL's proximal log-probs -> old_logprobs, its behaviour (inference) log-probs ->
rollout_logprobs; level="sequence", metric="ratio", agg="mean" -> is_level="sequence_geometric"; action
"mask" -> is_mode="mask", "clamp" -> is_mode="truncate"; upper / lower -> is_max / is_min (lower None: 0);
eps_clip / eps_clip_higher -> clip_low / clip_high; its token mean over the original mask count ->
loss_agg_mode="token-mean". Differences, none reached by these inputs: AReaL sets non-finite log-ratios to 0
(grpo_kernels: refused, except NaN sampler log-probs, which count as rollout = old: the same 0) and does not
clamp them (grpo_kernels: at +-20 per token).
"""

from __future__ import annotations

import dataclasses
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
PIN = "1.0.4"
_version = installed_version("areal")
if _version != PIN:
    _why = f"areal=={_version} is installed; these tests are pinned to areal=={PIN}" if _version else \
        f"areal is not installed (these tests are pinned to areal=={PIN})"  # fmt: skip
    if os.environ.get("GRPO_KERNELS_REQUIRE_VARIANT_PEERS") == "1":  # CI's peer environment: a skip is a failure
        pytest.fail(_why, pytrace=False)
    pytest.skip(_why, allow_module_level=True)


@dataclasses.dataclass
class RejectionSamplingConfig:  # the fields areal.api.cli_args.RejectionSamplingConfig gives the function
    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None


def _load_functional():
    """areal/utils/functional/functional.py from the installed wheel, its two AReaL imports stubbed."""
    path = os.path.join(os.path.dirname(importlib.util.find_spec("areal").origin), "utils", "functional",
                        "functional.py")  # fmt: skip
    stubs = {"areal.api.cli_args": dict(RejectionSamplingConfig=RejectionSamplingConfig),
             "areal.utils.data": dict(KLEstimator=None)}  # fmt: skip
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, attrs in stubs.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        spec = importlib.util.spec_from_file_location("_areal_functional", path)
        functional = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(functional)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return functional


areal = _load_functional()
MARGIN = 1e-4


@pytest.mark.parametrize("action,lower,upper", [("mask", 0.97, 1.03), ("mask", None, 1.02), ("clamp", 0.97, 1.03)])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sequence_level_rejection_sampling(action, lower, upper, layout):
    d = make_token_inputs(5)
    d["rollout"] = d["old"] + 0.3 * (d["rollout"] - d["old"])  # mismatch of a few percent per sequence
    mask = d["mask"]
    m = mask.double()
    geo = (((d["old"].double() - d["rollout"].double()) * m).sum(-1) / m.sum(-1).clamp(min=1)).exp()
    nonempty = m.sum(-1) > 0
    for bound in (b for b in (lower, upper) if b is not None):
        assert float(((geo - bound).abs() / bound)[nonempty].min()) > MARGIN
    outside = nonempty & ((geo > upper) | ((geo < lower) if lower is not None else False))
    assert 0 < int(outside.sum()) < int(nonempty.sum()), "the draw must put sequences on both sides of a bound"

    rs = RejectionSamplingConfig(level="sequence", action=action, metric="ratio", agg="mean", upper=upper,
                                 lower=lower)  # fmt: skip
    adv = d["adv_tok"]
    if layout == "padded":
        lp64 = leaf(d["logp"])
        loss_peer, _ = areal.ppo_actor_loss_fn(lp64, d["old"].double(), d["rollout"].double(), adv.double(), 0.2,
                                               mask, eps_clip_higher=0.28, rejection_sampling=rs)  # fmt: skip
        (g_peer,) = torch.autograd.grad(loss_peer, lp64)
        g_peer = g_peer[mask]
    else:  # AReaL's packed layout: 1-D tokens with cu_seqlens (the empty sequence has length 0)
        lengths = mask.sum(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        lp64 = leaf(d["logp"][mask])
        loss_peer, _ = areal.ppo_actor_loss_fn(lp64, d["old"][mask].double(), d["rollout"][mask].double(),
                                               adv[mask].double(), 0.2, torch.ones(int(lengths.sum()), dtype=torch.bool),
                                               eps_clip_higher=0.28, rejection_sampling=rs, cu_seqlens=cu)  # fmt: skip
        (g_peer,) = torch.autograd.grad(loss_peer, lp64)

    cfg = C(is_level="sequence_geometric", is_mode="mask" if action == "mask" else "truncate", is_min=lower,
            is_max=upper, clip_low=0.2, clip_high=0.28)  # fmt: skip
    lp = d["logp"].clone().requires_grad_()
    out = gk.grpo_loss(lp, adv, mask, d["old"], rollout_logprobs=d["rollout"], config=cfg, backend="torch")
    (g,) = torch.autograd.grad(out.loss, lp)
    assert_close("loss", out.loss, loss_peer, scale=max(1.0, abs(float(loss_peer.detach()))))
    assert_close("dL/dlogp", g[mask], g_peer, scale=grad_scale(g_peer))

    # the product weight (is_level="sequence") is not AReaL's: the loss moves by more than the bound
    product = cfg.replace(is_level="sequence")
    other = gk.grpo_loss(d["logp"], adv, mask, d["old"], rollout_logprobs=d["rollout"], config=product,
                         backend="torch")  # fmt: skip
    assert abs(float(other.loss) - float(loss_peer.detach())) > 1e-4
