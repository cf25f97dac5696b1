"""Parity with Liger-Kernel 0.8.5: `LigerFusedLinearGRPOLoss` (chunked_loss), from hidden states.

Liger's module (compiled=False, so it runs eagerly on CPU) and ours see the same hidden [B, T, H],
lm_head weight [V, H] and bias [V]; compared: the loss, its gradients w.r.t. hidden, weight and bias,
and Liger's metrics. Ours runs two ways: `fused_linear_grpo_loss(..., backend="torch")` and the
composition `fused_linear_logprobs` + `grpo_loss`.

Covered: Liger's loss types grpo, bnpo, dr_grpo, dapo, cispo (TRL's absolute cap), sapo, luspo,
vespo; beta > 0 with ref_per_token_logps; temperature != 1; importance_sampling_level token /
sequence; delta; use_bias_correction_kl; vllm_is_ratio [B, T] and [B, 1] (ours: is_weights);
num_items_in_batch; old_per_token_logps=None (on-policy). The mapping to our config is TRL's
(test_parity_trl.py) without gradient accumulation: grpo / sapo divide by the full B, bnpo by the
local token count, dr_grpo by B * max_completion_length, dapo / cispo / vespo by num_items_in_batch
(else the local token count), luspo: mean over B of the token sums.

Numerics: Liger computes the log-probs in fp32 (whatever the input dtype), so both sides are fp32,
each with its own rounding (logsumexp over V, the loss chain, two GEMMs over V and N for the
gradients: a few ulp each). parity_helpers' bound (RTOL = ATOL = 1e-6, ~17 ulp; the gradients'
absolute floor relative to their largest element) covers the sum of both sides' errors.

Where Liger differs (not comparable, listed in the report):
  * luspo at importance_sampling_level="token" (or with beta > 0, or a token-level vllm_is_ratio):
    Liger weights every position's loss by its sequence length and averages over B * T positions,
    padding included (`(per_token_loss * mask.sum(1, keepdim=True)).sum() / (B * T)`), which is not
    TRL 1.16's mean_b(sum_t loss * mask) nor any of our aggregations. At the sequence level without
    KL its per_token_loss is [B, 1] and the two agree, which is what is tested.
  * Its clip_ratio metric at importance_sampling_level="sequence" is token-weighted (a sequence
    counts with its length); ours (and TRL's) weight sequences equally, so it is compared at the
    token level only.
"""

from __future__ import annotations

import pytest
import torch
from parity_helpers import LENGTHS, SEED, assert_close, grad_scale, make_token_inputs, require_peer

require_peer("liger-kernel", "liger_kernel")

from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

import grpo_kernels as gk
from grpo_kernels.hf import TRL_LOSS_AGG_MODE

pytestmark = pytest.mark.parity

B, T, H, V = len(LENGTHS), 9, 16, 37  # odd V and H; T = 9 with ragged masks, an empty row and a hole
MAX_COMPLETION_LENGTH = 12
EPSILON, EPSILON_HIGH, CISPO_CAP = 0.2, 0.28, 2.0
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def make_inputs(seed: int = SEED, temperature: float = 1.0) -> dict:
    """Hidden states and an LM head (log-probs ~[-6, -1]) plus the per-token inputs of
    parity_helpers.make_token_inputs laid around the model's own log-probs: the same log-ratios
    (straddling the clip bounds at token and sequence level), ref offsets, advantages. The IS ratio
    is 1 on masked tokens, as TRL produces it (exp of a masked difference); Liger's vespo sums its
    log over every position."""
    tok = make_token_inputs(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    hidden = torch.randn(B, T, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    bias = 0.3 * torch.randn(V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logits = (hidden @ weight.T + bias) / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    mask = tok["mask"]
    return dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        targets=targets,
        mask=mask,
        logp=logp,
        old=logp - (tok["logp"] - tok["old"]),
        ref=logp + (tok["ref"] - tok["logp"]),
        adv=tok["adv_seq"],
        is_tok=torch.where(mask, tok["is_weights"], torch.ones(())),
        is_seq=0.5 + torch.rand(B, 1, generator=g),
    )


def liger_case(loss_type, **overrides) -> dict:
    case = dict(
        loss_type=loss_type,
        importance_sampling_level="token",
        beta=0.0,
        epsilon_low=EPSILON,
        epsilon_high=CISPO_CAP if loss_type == "cispo" else EPSILON_HIGH,
        temperature=1.0,
        delta=None,
        use_bias_correction_kl=False,
        vllm_is_ratio=None,
        num_items_in_batch=None,
        old=True,
    )
    case.update(overrides)
    return case


def run_liger(case: dict, x: dict):
    h, w, b = (x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=case["beta"],
        compiled=False,
        use_ref_model=case["beta"] != 0.0,
        chunk_size=1,
        epsilon_low=case["epsilon_low"],
        epsilon_high=case["epsilon_high"],
        loss_type=case["loss_type"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level=case["importance_sampling_level"],
        temperature=case["temperature"],
        delta=case["delta"],
        use_bias_correction_kl=case["use_bias_correction_kl"],
    )
    vllm = {"token": x["is_tok"], "sequence": x["is_seq"], None: None}[case["vllm_is_ratio"]]
    loss, metrics = loss_fn(
        h,
        w,
        x["targets"],
        x["mask"].long(),
        x["adv"],
        bias=b,
        ref_per_token_logps=x["ref"] if case["beta"] != 0.0 else None,
        old_per_token_logps=x["old"] if case["old"] else None,
        vllm_is_ratio=vllm,
        num_items_in_batch=case["num_items_in_batch"],
    )
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], h.grad, w.grad, b.grad


# TRL's loss types -> verl's aggregation names: the mapping every TRL-family adapter uses (grpo_kernels.hf)
AGG = TRL_LOSS_AGG_MODE


def our_config(case: dict) -> gk.PolicyLossConfig:
    lt = case["loss_type"]
    fields = dict(
        loss_agg_mode=AGG[lt],
        ratio_level=case["importance_sampling_level"],
        log_ratio_clamp=None,
        kl_coef=case["beta"],
        kl_estimator="k3",
        kl_ratio_correction=case["use_bias_correction_kl"],
        temperature=case["temperature"],
    )
    if lt in CLIP_LOSSES:
        fields.update(
            loss_type="ppo_clip",
            clip_low=case["epsilon_low"],
            clip_high=case["epsilon_high"],
            delta=case["delta"],
        )
    elif lt == "cispo":
        fields.update(loss_type="cispo", cispo_form="absolute", cispo_cap=case["epsilon_high"])
    else:
        fields.update(loss_type=lt)  # sapo, vespo: Liger's defaults are ours
    if lt == "dr_grpo":
        fields["max_completion_length"] = MAX_COMPLETION_LENGTH
    return gk.PolicyLossConfig(**fields)


def our_kwargs(case: dict, x: dict) -> dict:
    lt = case["loss_type"]
    kwargs = dict(
        old_logprobs=x["old"] if case["old"] else None,
        ref_logprobs=x["ref"] if case["beta"] != 0.0 else None,
        config=our_config(case),
        backend="torch",
    )
    if case["vllm_is_ratio"] is not None and lt == "vespo":
        # Liger folds the ratio into phi in log space, as TRL folds importance_sampling_ratio. Ours folds
        # the token-level weight old / rollout: give it the sampler log-probs whose ratio is exactly
        # Liger's (no truncation within [0, 1e6]).
        config = kwargs["config"].replace(is_level="token", is_mode="truncate", is_max=1e6)
        kwargs.update(config=config, rollout_logprobs=x["old"] - torch.log(x["is_tok"]))
    elif case["vllm_is_ratio"] is not None:  # Liger multiplies the per-token loss by it: our is_weights
        kwargs["is_weights"] = x["is_tok"] if case["vllm_is_ratio"] == "token" else x["is_seq"].expand(B, T)
    if lt in ("grpo", "sapo", "dr_grpo", "luspo"):
        kwargs["num_sequences"] = B  # the full batch, all-masked rows included
    elif lt in ("dapo", "cispo", "vespo") and case["num_items_in_batch"] is not None:
        kwargs["num_tokens"] = case["num_items_in_batch"]
    return kwargs


def run_ours(case: dict, x: dict, path: str):
    h, w, b = (x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    if path == "fused":
        out = gk.fused_linear_grpo_loss(
            h, w, x["targets"], x["adv"], x["mask"], bias=b, **our_kwargs(case, x)
        )
    else:
        lp = gk.fused_linear_logprobs(
            h, w, x["targets"], bias=b, temperature=case["temperature"], mask=x["mask"], backend="torch"
        )
        out = gk.grpo_loss(lp.logprobs, x["adv"], x["mask"], entropy=lp.entropy, **our_kwargs(case, x))
    out.loss.backward()
    return out, h.grad, w.grad, b.grad


def liger_metric_names(case: dict) -> list:
    """Liger's metrics tuple, as ours: (kl if beta != 0, clip_ratio)."""
    lt = case["loss_type"]
    names = ["kl"] if case["beta"] != 0.0 else []
    if lt in ("sapo", "vespo"):
        names.append(0.0)  # no clipping in these objectives: Liger reports 0
    elif case["importance_sampling_level"] == "sequence":
        names.append(None)  # token-weighted sequence clip fraction: not comparable (module doc)
    else:
        names.append("clip_ratio/high_mean" if lt == "cispo" else "clip_ratio/region_mean")
    return names


def check(case: dict, path: str, x: dict | None = None) -> None:
    x = make_inputs(temperature=case["temperature"]) if x is None else x
    loss_l, metrics_l, gh_l, gw_l, gb_l = run_liger(case, x)
    out, gh_o, gw_o, gb_o = run_ours(case, x, path)
    ctx = f"liger {path} " + " ".join(
        f"{k}={v}" for k, v in case.items() if v != liger_case(case["loss_type"]).get(k)
    )
    ctx = f"{ctx} [{case['loss_type']}]"
    assert_close(f"{ctx} loss", out.loss, loss_l)
    for name, ours, theirs in (("hidden", gh_o, gh_l), ("weight", gw_o, gw_l), ("bias", gb_o, gb_l)):
        assert_close(f"{ctx} dloss/d{name}", ours, theirs, scale=grad_scale(theirs))
    names = liger_metric_names(case)
    assert len(names) == len(metrics_l), (
        f"{ctx}: Liger returned {len(metrics_l)} metrics, expected {len(names)}"
    )
    for name, theirs in zip(names, metrics_l, strict=True):
        if name is None:
            continue
        ours = name if isinstance(name, float) else out.metrics[name]
        assert_close(f"{ctx} metric {name}", ours, theirs)


PATHS = ("fused", "composed")


def test_inputs_visit_every_regime():
    x = make_inputs()
    m = x["mask"]
    lr = x["logp"] - x["old"]
    r, a = lr.exp()[m], x["adv"][:, None].expand(B, T)[m]
    assert ((r < 1 - EPSILON) & (a < 0)).any() and ((r > 1 + EPSILON_HIGH) & (a > 0)).any()
    assert ((r > CISPO_CAP) & (a > 0)).any() and ((r > 1.6) & (a > 0)).any()
    seq_r = ((lr * m).sum(1) / m.sum(1).clamp(min=1)).exp()
    assert ((seq_r < 1 - EPSILON) & (x["adv"] < 0)).any() and (
        (seq_r > 1 + EPSILON_HIGH) & (x["adv"] > 0)
    ).any()
    assert not m[3].any() and x["logp"][m].max() < -0.5


def _loss_type_cases():
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        for level in ("token", "sequence"):
            if level == "sequence" and lt in ("cispo", "sapo", "vespo"):
                continue  # Liger raises: sequence level is for the clip family only
            if level == "token" and lt == "luspo":
                continue  # Liger's token-level luspo is another formula (module doc)
            for beta in (0.0, 0.04):
                if lt == "luspo" and beta != 0.0:
                    continue  # ditto: the KL makes Liger's luspo loss [B, T]
                for path in PATHS:
                    yield pytest.param(lt, level, beta, path, id=f"{lt}-{level}-beta{beta}-{path}")


@pytest.mark.parametrize(("loss_type", "level", "beta", "path"), list(_loss_type_cases()))
def test_loss_type_matches_liger(loss_type, level, beta, path):
    check(liger_case(loss_type, importance_sampling_level=level, beta=beta), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_temperature_matches_liger(loss_type, path):
    check(liger_case(loss_type, temperature=0.7, beta=0.04), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_delta_and_bias_corrected_kl_match_liger(level, path):
    check(
        liger_case(
            "dapo", importance_sampling_level=level, delta=1.6, beta=0.04, use_bias_correction_kl=True
        ),
        path,
    )
    check(liger_case("grpo", importance_sampling_level=level, beta=0.04, use_bias_correction_kl=True), path)


def _vllm_cases():
    for lt in ("dapo", "grpo", "vespo"):
        for shape in ("token", "sequence"):
            if lt == "vespo" and shape == "sequence":
                continue  # vespo folds token-level ratios only (TRL requires a token_* mode)
            for path in PATHS:
                yield pytest.param(lt, shape, path, id=f"{lt}-{shape}-{path}")


@pytest.mark.parametrize(("loss_type", "shape", "path"), list(_vllm_cases()))
def test_vllm_is_ratio_matches_liger(loss_type, shape, path):
    """A precomputed vLLM IS ratio multiplies the per-token policy loss before the KL is added."""
    check(liger_case(loss_type, vllm_is_ratio=shape, beta=0.04), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_num_items_in_batch_matches_liger(loss_type, path):
    check(liger_case(loss_type, num_items_in_batch=97, beta=0.04), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo"])
def test_on_policy_matches_liger(loss_type, path):
    """old_per_token_logps=None: the ratio is exp(logp - logp.detach()) = 1 with gradient."""
    check(liger_case(loss_type, old=False, beta=0.04), path)
