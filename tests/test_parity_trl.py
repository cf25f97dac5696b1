"""Parity with TRL 1.16.0: `GRPOTrainer._compute_loss` itself, called on our inputs.

`_compute_loss(self, model, inputs)` reads only attributes of `self`, so it is called unbound on a
stand-in (`trl_trainer`) that provides exactly those attributes: the loss settings, `args`, an
accelerator of one process whose gather / reduce / pad are identities, `model.training`, `_metrics`,
TRL's own `get_high_entropy_mask` (bound), `get_off_policy_mask` / `get_gamma_weights` (static), and a
`_get_per_token_logps_and_entropies` that returns our leaf tensors. Compared: the returned loss, its
gradient w.r.t. the per-token log-probs and entropies, and every value logged in
`_metrics["train"|"eval"]` (TRL_METRICS says which of ours each one equals).

TRL computes the vLLM importance-sampling ratio in `_generate_and_score_completions`, not in the
loss; `trl_vllm_is_ratio` below reproduces those lines (trl/trainer/grpo_trainer.py:2659-2707 in
1.16.0) and feeds the result as inputs["importance_sampling_ratio"]; ours gets the sampler's
log-probs (rollout_logprobs) and is_level / is_mode / is_min / is_max.

Mapping (`our_config`, `our_normalizers`); GA = current_gradient_accumulation_steps (1 in eval):
  grpo, bnpo, dr_grpo, dapo, luspo -> ppo_clip (clip_low = epsilon, clip_high = epsilon_high, delta)
  cispo -> cispo, cispo_form="absolute", cispo_cap = epsilon_high; sapo -> sapo; vespo -> vespo
  importance_sampling_level "sequence" -> ratio_level "sequence"; no log-ratio clamp (TRL has none)
  beta -> kl_coef with kl_estimator "k3" (unclamped); use_bias_correction_kl -> kl_ratio_correction
  grpo, sapo -> seq-mean-token-mean, num_sequences = B * GA
  bnpo       -> token-mean, local count, grad_accum_steps = GA
  dr_grpo    -> seq-mean-token-sum-norm, num_sequences = B * GA, max_completion_length
  dapo, cispo, vespo -> token-mean, num_tokens = max(num_items_in_batch, 1) * GA / steps_per_generation
                 (train; eval: max(num_items_in_batch, 1)), dp_size = num_processes
  luspo      -> seq-mean-token-sum, num_sequences = B * GA
  entropy_coef -> entropy_coef, entropy_agg_mode "token-mean-local", grad_accum_steps = GA
  vllm_importance_sampling_mode {token,sequence}_{truncate,mask} -> is_level, is_mode; clip_min /
  clip_max -> is_min / is_max; off_policy_mask_threshold and top_entropy_quantile: same names.

Where TRL counts differently: at importance_sampling_level="sequence" TRL's clip metrics average a
(B, 1) tensor over all B rows, all-masked rows included (their ratio is exp(0) = 1, never clipped),
and clip_ratio/low_min takes their 0 into the min; ours average over the nonempty sequences.
`trl_view` converts ours to TRL's count. The same holds for vespo/phi_seq_mean (an all-masked row
has phi(1) = 1).
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from parity_helpers import (
    EMPTY_ROW,
    HOLE,
    LENGTHS,
    SEED,
    assert_close,
    grad_scale,
    leaf,
    make_mask,
    make_token_inputs,
    require_peer,
)

require_peer("trl", "trl")

from trl import GRPOTrainer

import grpo_kernels as gk

pytestmark = pytest.mark.parity

B, T = len(LENGTHS), 9
MAX_COMPLETION_LENGTH = 12
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = (*CLIP_LOSSES, "cispo", "sapo", "vespo")
EPSILON, EPSILON_HIGH, CISPO_CAP = 0.2, 0.28, 2.0  # cap 2: the ratios here reach ~7, so it binds
# the vLLM IS clip range: both bounds are hit at token and at sequence level (test_inputs_visit_every_regime)
IS_CLIP_MIN, IS_CLIP_MAX = 0.7, 1.3
OFF_POLICY_THRESHOLD = 0.1


# ---------------------------------------------------------------------------------------------------
# TRL side
# ---------------------------------------------------------------------------------------------------
class _Accelerator:
    """One process: gather / reduce / pad are identities, as accelerate's are for num_processes=1.
    num_processes only enters the dapo / cispo / vespo normalizer."""

    sync_gradients = True

    def __init__(self, num_processes: int):
        self.num_processes = num_processes

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_case(loss_type, **overrides) -> dict:
    """The TRL settings of one case (GRPOConfig names where there is one)."""
    case = dict(
        loss_type=loss_type,
        importance_sampling_level="token",
        beta=0.0,
        use_bias_correction_kl=True,
        delta=None,
        epsilon=EPSILON,
        epsilon_high=CISPO_CAP if loss_type == "cispo" else EPSILON_HIGH,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        grad_accum=1,
        steps_per_generation=None,
        num_processes=1,
        vllm_mode=None,
        clip_min=None,
        clip_max=IS_CLIP_MAX,
        off_policy_mask_threshold=None,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        training=True,
        advantages="seq",
    )
    case.update(overrides)
    if case["steps_per_generation"] is None:  # GRPOConfig default: steps_per_generation = GA
        case["steps_per_generation"] = case["grad_accum"]
    return case


def trl_trainer(case: dict, per_token_logps, entropies):
    """A stand-in for `self` with exactly the attributes `_compute_loss` reads."""
    args = types.SimpleNamespace(
        delta=case["delta"],
        use_bias_correction_kl=case["use_bias_correction_kl"],
        sapo_temperature_pos=case["sapo_temperature_pos"],
        sapo_temperature_neg=case["sapo_temperature_neg"],
        steps_per_generation=case["steps_per_generation"],
        entropy_target=0.2,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
    )
    trainer = types.SimpleNamespace(
        args=args,
        loss_type=case["loss_type"],
        beta=case["beta"],
        epsilon_low=case["epsilon"],
        epsilon_high=case["epsilon_high"],
        importance_sampling_level=case["importance_sampling_level"],
        top_entropy_quantile=case["top_entropy_quantile"],
        off_policy_mask_threshold=case["off_policy_mask_threshold"],
        use_vllm=case["vllm_mode"] is not None,
        vllm_importance_sampling_correction=True,
        max_completion_length=MAX_COMPLETION_LENGTH,
        current_gradient_accumulation_steps=case["grad_accum"],
        aux_loss_enabled=False,
        _entropy_bonus_enabled=case["entropy_coef"] != 0.0,
        entropy_coef=case["entropy_coef"],
        use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=types.SimpleNamespace(training=case["training"]),
        accelerator=_Accelerator(case["num_processes"]),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (per_token_logps, entropies, None),
    )
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    return trainer


def trl_vllm_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """The vLLM importance-sampling ratio exactly as GRPOTrainer._generate_and_score_completions
    computes it (trl/trainer/grpo_trainer.py:2659-2707, trl 1.16.0)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def completion_and_tool_masks():
    """TRL's completion_mask (right padding; row EMPTY_ROW all zero) and a tool_mask that masks one
    tool-output token inside row HOLE[0]: mask = completion_mask * tool_mask = make_mask()."""
    completion_mask = make_mask(hole=None).int()
    tool_mask = torch.ones(B, T, dtype=torch.int32)
    tool_mask[HOLE] = 0
    return completion_mask, tool_mask


def num_items_in_batch(case) -> int:
    """Valid tokens of the whole generation batch: this slice plus steps_per_generation - 1 others
    (and those of the other processes), deliberately not a multiple of the local count."""
    local = int(make_mask().sum())
    return local * case["steps_per_generation"] * case["num_processes"] + 5


def run_trl(case: dict, x: dict):
    lp, ent = leaf(x["logp"]), leaf(x["entropy"])
    completion_mask, tool_mask = completion_and_tool_masks()
    adv = x["adv_seq"] if case["advantages"] == "seq" else x["adv_tok"]
    inputs = dict(
        prompt_ids=torch.ones(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.int32),
        completion_ids=torch.ones(B, T, dtype=torch.long),
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        advantages=adv.double(),
        num_items_in_batch=torch.tensor(num_items_in_batch(case)),
        old_per_token_logps=x["old"].double(),
    )
    if case["beta"] != 0.0:
        inputs["ref_per_token_logps"] = x["ref"].double()
    if case["vllm_mode"] is not None:
        inputs["sampling_per_token_logps"] = x["rollout"].double()
        inputs["importance_sampling_ratio"] = trl_vllm_is_ratio(
            x["old"].double(),
            x["rollout"].double(),
            completion_mask * tool_mask,
            case["vllm_mode"],
            case["clip_min"],
            case["clip_max"],
        )
    trainer = trl_trainer(case, lp, ent)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    mode = "train" if case["training"] else "eval"
    metrics = {k: v for k, v in trainer._metrics[mode].items()}
    assert all(len(v) == 1 for v in metrics.values()), metrics
    metrics = {k: v[0] for k, v in metrics.items()}
    if case["vllm_mode"] in ("token_truncate", "token_mask") and case["loss_type"] != "vespo":
        metrics.update(
            trl_vllm_is_ratio_metrics(inputs["importance_sampling_ratio"], completion_mask * tool_mask)
        )
    return loss.detach(), metrics, lp.grad, ent.grad


def trl_vllm_is_ratio_metrics(ratio, mask):
    """The IS-ratio statistics _generate_and_score_completions logs for token-level modes
    (grpo_trainer.py:2874-2896; one process). At sequence level TRL takes them over the B rows, an
    all-masked row's ratio 1 included, and its mean is per row where ours is per token: not compared.
    vespo: ours applies no IS weight to the loss (it folds the ratio into phi), so its is_weight
    statistics are those of a weight 1, not comparable either."""
    flat = ratio[mask.bool()]
    prefix = "sampling/importance_sampling_ratio/"
    return {
        prefix + "min": flat.min().item(),
        prefix + "mean": flat.mean().item(),
        prefix + "max": flat.max().item(),
    }


# ---------------------------------------------------------------------------------------------------
# Our side
# ---------------------------------------------------------------------------------------------------
AGG = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "luspo": "seq-mean-token-sum",
}


def our_config(case: dict) -> gk.PolicyLossConfig:
    lt = case["loss_type"]
    fields = dict(
        loss_agg_mode=AGG[lt],
        ratio_level=case["importance_sampling_level"],
        log_ratio_clamp=None,
        kl_coef=case["beta"],
        kl_estimator="k3",
        kl_ratio_correction=case["use_bias_correction_kl"],
        off_policy_mask_threshold=case["off_policy_mask_threshold"],
        top_entropy_quantile=case["top_entropy_quantile"],
        entropy_coef=case["entropy_coef"],
    )
    if lt in CLIP_LOSSES:
        fields.update(
            loss_type="ppo_clip",
            clip_low=case["epsilon"],
            clip_high=case["epsilon_high"],
            delta=case["delta"],
        )
    elif lt == "cispo":
        fields.update(loss_type="cispo", cispo_form="absolute", cispo_cap=case["epsilon_high"])
    elif lt == "sapo":
        fields.update(
            loss_type="sapo",
            sapo_tau_pos=case["sapo_temperature_pos"],
            sapo_tau_neg=case["sapo_temperature_neg"],
        )
    else:
        fields.update(loss_type="vespo")
    if lt == "dr_grpo":
        fields["max_completion_length"] = MAX_COMPLETION_LENGTH
    if case["entropy_coef"] != 0.0:
        fields["entropy_agg_mode"] = "token-mean-local"
    if case["vllm_mode"] is not None:
        level, _, how = case["vllm_mode"].partition("_")
        fields.update(is_level=level, is_mode=how, is_min=case["clip_min"], is_max=case["clip_max"])
    return gk.PolicyLossConfig(**fields)


def our_normalizers(case: dict) -> dict:
    ga = case["grad_accum"] if case["training"] else 1
    lt = case["loss_type"]
    if lt in ("grpo", "sapo", "dr_grpo", "luspo"):
        return dict(num_sequences=B * ga, grad_accum_steps=ga)
    if lt == "bnpo":
        return dict(grad_accum_steps=ga)
    n = max(num_items_in_batch(case), 1)
    num_tokens = n * ga / case["steps_per_generation"] if case["training"] else n
    return dict(num_tokens=num_tokens, dp_size=case["num_processes"], grad_accum_steps=ga)


def run_ours(case: dict, x: dict):
    lp, ent = leaf(x["logp"], torch.float32), leaf(x["entropy"], torch.float32)
    adv = x["adv_seq"] if case["advantages"] == "seq" else x["adv_tok"]
    out = gk.grpo_loss(
        lp,
        adv,
        x["mask"],
        old_logprobs=x["old"],
        ref_logprobs=x["ref"] if case["beta"] != 0.0 else None,
        rollout_logprobs=x["rollout"] if case["vllm_mode"] is not None else None,
        entropy=ent,
        config=our_config(case),
        backend="torch",
        **our_normalizers(case),
    )
    out.loss.backward()
    return out, lp.grad, ent.grad


# TRL's logged name -> ours (converted by trl_view where TRL counts all-masked rows).
TRL_METRICS = {
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/low_mean": "clip_ratio/low_mean",
    "clip_ratio/high_mean": "clip_ratio/high_mean",
    "clip_ratio/region_mean": "clip_ratio/region_mean",
    "clip_ratio/low_min": "clip_ratio/low_min",
    "clip_ratio/high_max": "clip_ratio/high_max",
    "cispo_clip_ratio": "clip_ratio/high_mean",  # absolute form: ratio > cap and A > 0
    "vespo/phi_seq_mean": "vespo/phi_seq_mean",
    "policy_loss": "policy_loss",  # TRL: before the entropy bonus, KL included, before / GA (see trl_view)
    "entropy_coef": "entropy_coef",
    "sampling/importance_sampling_ratio/min": "is_weight/min",  # token-level modes only
    "sampling/importance_sampling_ratio/mean": "is_weight/mean",
    "sampling/importance_sampling_ratio/max": "is_weight/max",
}


def trl_view(trl_name: str, case: dict, ours: dict) -> float:
    """The value TRL logs under trl_name, computed from our metrics."""
    our_name = TRL_METRICS[trl_name]
    if our_name == "entropy_coef":
        return case["entropy_coef"]
    if our_name == "policy_loss":  # TRL's per_token_loss includes beta * KL; the /GA comes after it
        value = float(ours["policy_loss"]) + case["beta"] * float(ours.get("kl_loss", 0.0))
        divided_by_ga = case["loss_type"] not in ("dapo", "cispo", "vespo") and case["training"]
        return value * case["grad_accum"] if divided_by_ga else value
    value = float(ours[our_name])
    nonempty = sum(n > 0 for n in LENGTHS)
    per_row = case["importance_sampling_level"] == "sequence" and our_name.startswith("clip_ratio")
    if (per_row or our_name == "vespo/phi_seq_mean") and nonempty < B:  # TRL counts all B rows (module doc)
        empty_value = 1.0 if our_name == "vespo/phi_seq_mean" else 0.0
        if our_name.endswith("_min"):
            return min(value, empty_value)
        if our_name.endswith("_max"):
            return max(value, empty_value)
        return (value * nonempty + empty_value * (B - nonempty)) / B
    return value


def check(case: dict, x: dict | None = None) -> None:
    x = make_token_inputs(SEED) if x is None else x
    loss_t, metrics_t, grad_t, grad_ent_t = run_trl(case, x)
    out, grad_o, grad_ent_o = run_ours(case, x)
    ctx = "trl " + " ".join(f"{k}={v}" for k, v in case.items() if v != trl_case(case["loss_type"]).get(k))
    ctx = f"{ctx} [{case['loss_type']}]"
    assert_close(f"{ctx} loss", out.loss, loss_t)
    assert_close(f"{ctx} dloss/dlogp", grad_o, grad_t, scale=grad_scale(grad_t))
    if grad_ent_t is None:  # entropy only selects tokens (or is only logged): no gradient on either side
        assert grad_ent_o is None or not grad_ent_o.any(), f"{ctx}: ours has an entropy gradient, TRL none"
    else:
        assert_close(f"{ctx} dloss/dentropy", grad_ent_o, grad_ent_t, scale=grad_scale(grad_ent_t))
    unknown = set(metrics_t) - set(TRL_METRICS)
    assert not unknown, f"{ctx}: TRL logged metrics with no mapping: {sorted(unknown)}"
    for name, value in metrics_t.items():
        assert_close(f"{ctx} metric {name}", trl_view(name, case, out.metrics), value, equal_nan=True)


@pytest.fixture(scope="module")
def inputs():
    return make_token_inputs(SEED)


def test_inputs_visit_every_regime(inputs):
    x, m = inputs, inputs["mask"]
    lr = x["logp"] - x["old"]
    r, a = lr.exp()[m], x["adv_seq"][:, None].expand(B, T)[m]
    assert ((r < 1 - EPSILON) & (a < 0)).any() and ((r > 1 + EPSILON_HIGH) & (a > 0)).any()
    assert ((r > CISPO_CAP) & (a > 0)).any() and ((r < CISPO_CAP) & (a > 0)).any()
    assert ((r > 1.6) & (a > 0)).any(), "delta=1.6 never binds"
    seq_r = ((lr * m).sum(1) / m.sum(1).clamp(min=1)).exp()
    assert ((seq_r < 1 - EPSILON) & (x["adv_seq"] < 0)).any() and (
        (seq_r > 1 + EPSILON_HIGH) & (x["adv_seq"] > 0)
    ).any()
    mask = m.double()
    for mode in ("token_mask", "sequence_mask"):  # no bounds: the raw ratio
        rho = trl_vllm_is_ratio(x["old"].double(), x["rollout"].double(), mask, mode, None, None)
        rho = rho[m] if mode.startswith("token") else rho[m.any(1)]
        assert (rho < IS_CLIP_MIN).any() and (rho > IS_CLIP_MAX).any(), f"{mode}: IS clip bounds never hit"
        assert ((rho > IS_CLIP_MIN) & (rho < IS_CLIP_MAX)).any()
    seq_kl = ((x["old"] - x["logp"]) * m).sum(1) / m.sum(1).clamp(min=1)
    negative = (x["adv_seq"] < 0) & m.any(1)
    assert (seq_kl[negative] > OFF_POLICY_THRESHOLD).any() and (
        seq_kl[negative] <= OFF_POLICY_THRESHOLD
    ).any()
    assert not m[EMPTY_ROW].any()


def _loss_type_cases():
    for lt in LOSS_TYPES:
        for level in ("token", "sequence"):
            if lt == "vespo" and level == "sequence":
                continue  # TRL warns: vespo is defined on token log-ratios (and so is ours)
            for ga in (1, 2):
                yield pytest.param(lt, level, ga, id=f"{lt}-{level}-GA{ga}")


@pytest.mark.parametrize(("loss_type", "level", "grad_accum"), list(_loss_type_cases()))
def test_loss_type_matches_trl(loss_type, level, grad_accum, inputs):
    """Every loss_type x importance_sampling_level x GA, with the (default) bias-corrected k3 KL."""
    check(trl_case(loss_type, importance_sampling_level=level, grad_accum=grad_accum, beta=0.04), inputs)


@pytest.mark.parametrize("bias_correction", [False, True], ids=["plain-kl", "bias-corrected-kl"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_kl_matches_trl(loss_type, level, bias_correction, inputs):
    check(
        trl_case(
            loss_type, importance_sampling_level=level, beta=0.1, use_bias_correction_kl=bias_correction
        ),
        inputs,
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_delta_matches_trl(loss_type, level, inputs):
    """INTELLECT-2 two-sided clipping: the unclipped ratio is capped at delta (after coef_2 is built,
    and after the bias-corrected KL took the uncapped ratio)."""
    check(trl_case(loss_type, importance_sampling_level=level, delta=1.6, beta=0.04), inputs)


def _vllm_cases():
    for loss_type in ("dapo", "grpo", "vespo"):
        for vllm_mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
            if loss_type == "vespo" and vllm_mode.startswith("sequence"):
                continue  # TRL's __init__ refuses it (grpo_trainer.py:936-940), and so does our config
            for clip_min in (None, IS_CLIP_MIN):
                yield pytest.param(
                    loss_type, vllm_mode, clip_min, id=f"{loss_type}-{vllm_mode}-min{clip_min}"
                )


@pytest.mark.parametrize(("loss_type", "vllm_mode", "clip_min"), list(_vllm_cases()))
def test_vllm_importance_sampling_matches_trl(loss_type, vllm_mode, clip_min, inputs):
    """TIS / MIS at token and sequence level; vespo folds the token-level ratio into phi instead."""
    check(trl_case(loss_type, vllm_mode=vllm_mode, clip_min=clip_min, beta=0.04), inputs)


@pytest.mark.parametrize("with_vllm", [False, True], ids=["old-logps", "sampling-logps"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_off_policy_mask_matches_trl(loss_type, with_vllm, inputs):
    """DeepSeek-V3.2 off-policy sequence masking; with vLLM it measures the KL to the sampler."""
    case = trl_case(
        loss_type,
        off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
        beta=0.04,
        vllm_mode="token_truncate" if with_vllm else None,
    )
    check(case, inputs)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05], ids=["no-bonus", "bonus"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_top_entropy_quantile_matches_trl(loss_type, entropy_coef, inputs):
    """Only tokens whose entropy is in the top 40% train; the entropy bonus acts on the same tokens."""
    check(trl_case(loss_type, top_entropy_quantile=0.4, entropy_coef=entropy_coef, grad_accum=2), inputs)


@pytest.mark.parametrize("grad_accum", [1, 2], ids=["GA1", "GA2"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_matches_trl(loss_type, grad_accum, inputs):
    """entropy_coef: a token mean over the batch / GA, whatever the policy normalizer (plus TRL's
    policy_loss metric: the loss before the bonus)."""
    check(trl_case(loss_type, entropy_coef=0.05, grad_accum=grad_accum, beta=0.04), inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo"])
def test_per_token_advantages_match_trl(loss_type, inputs):
    """Advantages [B, T] (a subclass's per-token advantages; TRL keeps them as they are)."""
    check(trl_case(loss_type, advantages="token", beta=0.04, grad_accum=2), inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_eval_mode_matches_trl(loss_type, inputs):
    """model.training False: no GA division and the dapo normalizer without GA / steps_per_generation."""
    check(
        trl_case(
            loss_type, training=False, grad_accum=2, steps_per_generation=4, beta=0.04, entropy_coef=0.05
        ),
        inputs,
    )


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_generation_batch_normalizer_matches_trl(loss_type, inputs):
    """num_items_in_batch over 4 slices x 2 processes, GA 2: num_tokens = N GA / spg, dp_size 2."""
    check(trl_case(loss_type, grad_accum=2, steps_per_generation=4, num_processes=2, beta=0.04), inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_everything_on_matches_trl(loss_type, inputs):
    """All of the above at once, in TRL's order (off-policy mask, entropy mask, IS ratio, then KL)."""
    case = trl_case(
        loss_type,
        beta=0.04,
        delta=1.6,
        grad_accum=2,
        steps_per_generation=4,
        vllm_mode="token_mask",
        clip_min=IS_CLIP_MIN,
        off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
        top_entropy_quantile=0.6,
        entropy_coef=0.05,
        advantages="token",
    )
    check(case, inputs)
