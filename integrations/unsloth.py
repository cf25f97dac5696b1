"""Unsloth adapter: Unsloth's GRPO trainer with its LM-head log-prob kernel replaced by grpo_kernels.

    import unsloth                                    # first, as always with Unsloth (it patches TRL)
    from grpo_kernels.integrations.unsloth import GRPOKernelsTrainer as GRPOTrainer   # the one line

Supported: unsloth and unsloth_zoo 2026.10.9 (SUPPORTED_UNSLOTH, SUPPORTED_UNSLOTH_ZOO), with the TRL
they pin (trl <= 1.15.0; tested with 1.15.0). Another version is refused when the trainer class is
first used: the seam below is internal to unsloth_zoo and moves between releases.

One mode, "logprobs" (`grpo_kernels_mode=`). Unsloth's GRPO trainer (`UnslothGRPOTrainer`, generated
from TRL's source when Unsloth patches TRL) computes every per-token log-prob of GRPO from the last
hidden states: the policy pass inside `grpo_accumulated_loss` (packed sequences, shared prompts, mini
batches, an offloaded recompute), the old-policy and reference passes in
`_get_per_token_logps_and_entropies`, the entropies for `entropy_coef` / `top_entropy_quantile`. All of
them end in one function, `unsloth_zoo.fused_losses.fused_linear.fused_linear_logprobs`, which every
caller imports inside its body when it runs (`from unsloth_zoo.fused_losses.fused_linear import
fused_linear_logprobs`): a module attribute looked up per call. `use_grpo_kernels()` puts
`UnslothLogProbsKernel` (the same signature, computed by `grpo_kernels.fused_linear_logprobs`) in that
attribute for the duration of a block and restores it; `GRPOKernelsTrainer` does so around each
training step, evaluation step and log-prob pass of its own, so other trainers in the process keep
Unsloth's kernel. Unsloth's loss (`grpo_compute_loss` under `UnslothEfficientGRPO`), its accumulation,
packing and metrics run untouched, on our log-probs.

No "fused" mode: Unsloth computes the log-probs of a micro-batch in pieces (mini batches, packed
rows, a shared prompt forwarded once per group, an offloaded recompute in the backward) and only then
the loss on the assembled [B, T] log-probs; `fused_linear_grpo_loss` needs the hidden states and the
loss inputs in one call, which means re-implementing `grpo_accumulated_loss`. Refused, saying so.

What it gains: Unsloth's kernel already avoids the [tokens, V] logits, so the memory it holds for the
backward is of the same order (docs/guides/unsloth.md has the measured numbers). The gains are
grpo_kernels' accuracy (fp32 logits and statistics everywhere: Unsloth's kernel rounds the logits to
the compute dtype except on CUDA GPUs that have an fp32-output GEMM), one kernel shared with the TRL
and verl adapters, and its batch-invariant mode (for the LM head; the hidden states are Unsloth's). Speed on a GPU against Unsloth's Triton kernel is
not measured.

The loss options. `loss_settings(trainer)` reads what Unsloth's loss will use (the trainer's
settings with Unsloth's environment overrides applied), `policy_loss_config` maps them onto a
`PolicyLossConfig` and `loss_normalizers` onto the normalizer keywords, so that `grpo_kernels.grpo_loss`
on the same log-probs computes Unsloth's loss (tests/test_integration_unsloth.py proves it against
`grpo_compute_loss`); `unmapped_settings` names each option that has no exact grpo_kernels counterpart,
with the reason. In "logprobs" mode Unsloth computes the loss, so these are reported (logged when the
trainer is built), not refused; they are the contract a fused mode would have to meet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os

import torch

import grpo_kernels as gk
from grpo_kernels import hf

logger = logging.getLogger("grpo_kernels")

SUPPORTED_UNSLOTH = "2026.10.9"
SUPPORTED_UNSLOTH_ZOO = "2026.10.9"
MODES = ("logprobs",)
KERNEL_MODULE = "unsloth_zoo.fused_losses.fused_linear"
KERNEL_NAME = "fused_linear_logprobs"

# Unsloth loss_type -> the aggregation grpo_compute_loss performs (verl's names): TRL's (grpo_kernels.hf)
LOSS_AGG_MODE = hf.TRL_LOSS_AGG_MODE
CLIP_LOSS_TYPES = hf.TRL_CLIP_LOSS_TYPES
# Unsloth's vLLM importance-sampling modes -> (is_level, is_mode); each weight is pi_old / pi_sampler:
# per token, per sequence (the product of the token weights), or "geometric" (their geometric mean,
# exp(mean_t (old_t - sampler_t)), verl's seq_mean_k1 weight)
VLLM_IS_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
    "geometric_truncate": ("sequence_geometric", "truncate"),
    "geometric_mask": ("sequence_geometric", "mask"),
}
# Unsloth (as verl) clamps a log-ratio against the sampler to [-20, 20]: the policy ratio's when the
# sampler's log-probs are the old policy's (UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD), and each token's in
# the rollout rejection statistics
ROLLOUT_LOG_RATIO_CLAMP = 20.0
# The rollout rejection option (UNSLOTH_GRPO_ROLLOUT_RS, verl's rollout_rs) that grpo_kernels' sampler gate
# computes: token_k1 keeps a token when pi_sampler / pi_old lies in [lower, upper]
ROLLOUT_RS_MAPPED = "token_k1"
# Why each other rollout rejection statistic has no grpo_kernels gate
_ROLLOUT_RS_REASONS = {
    "seq_mean_k1": "the sequence ratio gate (is_gate_level='sequence') bounds the same geometric mean, but Unsloth "
    "clamps each token's log-ratio to [-20, 20] before the mean and grpo_kernels' gate clamps with log_ratio_clamp, "
    "which Unsloth's policy ratio and IS weights do not have: they differ on a sequence with a token whose "
    "|old - sampler| log-ratio exceeds 20",
    "seq_sum_k1": "it bounds the product of the token ratios; grpo_kernels' sequence gate bounds their geometric mean",
    "k2": "a bound on k2 = (log-ratio)^2 / 2; grpo_kernels' gates bound the ratio, the binary KL or the TV",
    "k3": "a bound on k3 = r - 1 - log r; grpo_kernels' gates bound the ratio, the binary KL or the TV",
}


# ---------------------------------------------------------------------------------------------------
# Unsloth's loss options -> grpo_kernels
# ---------------------------------------------------------------------------------------------------


def _env_on(name: str) -> bool:
    return os.environ.get(name, "0").strip() == "1"


def loss_settings(trainer) -> dict:
    """The options Unsloth's GRPO loss uses for `trainer` (an UnslothGRPOTrainer), as the keyword names of
    `unsloth_zoo.rl_replacements.grpo_compute_loss` plus `beta`, `use_bias_correction_kl`, `entropy_coef`,
    `top_entropy_quantile` and `temperature`: what `grpo_accumulated_loss` hands its loss, Unsloth's
    environment overrides included (UNSLOTH_GRPO_VLLM_IS_MODE, UNSLOTH_GRPO_VLLM_IS_CLIP,
    UNSLOTH_GRPO_ROLLOUT_RS and its UNSLOTH_GRPO_ROLLOUT_RS_THRESHOLD, as the strings Unsloth parses,
    UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD, UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE, UNSLOTH_GRPO_LOSS_AGGREGATION).
    No Unsloth import."""
    args = trainer.args
    entropy_coef = float(getattr(trainer, "entropy_coef", getattr(args, "entropy_coef", 0.0)) or 0.0)
    if getattr(args, "use_adaptive_entropy", False):  # Unsloth drops the adaptive bonus whole (and warns)
        entropy_coef = 0.0
    settings = dict(
        loss_type=args.loss_type,
        epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(trainer.epsilon_high),
        max_completion_length=args.max_completion_length,
        delta=args.delta,
        importance_sampling_level=getattr(trainer, "importance_sampling_level", "token"),
        beta=float(trainer.beta),
        use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        use_vllm=bool(trainer.use_vllm),
        vllm_importance_sampling_correction=bool(getattr(trainer, "vllm_importance_sampling_correction", False)),
        vllm_importance_sampling_mode=getattr(args, "vllm_importance_sampling_mode", None) or "token_truncate",
        vllm_importance_sampling_clip_min=getattr(args, "vllm_importance_sampling_clip_min", None),
        vllm_importance_sampling_clip_max=getattr(args, "vllm_importance_sampling_clip_max", None),
        sapo_temperature_pos=getattr(args, "sapo_temperature_pos", 1.0),
        sapo_temperature_neg=getattr(args, "sapo_temperature_neg", 1.05),
        vespo_k_pos=getattr(args, "vespo_k_pos", 2.0),
        vespo_lambda_pos=getattr(args, "vespo_lambda_pos", 3.0),
        vespo_k_neg=getattr(args, "vespo_k_neg", 3.0),
        vespo_lambda_neg=getattr(args, "vespo_lambda_neg", 2.0),
        off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
        top_entropy_quantile=float(getattr(args, "top_entropy_quantile", 1.0) or 1.0),
        entropy_coef=entropy_coef,
        temperature=float(args.temperature),
        rollout_rs=os.environ.get("UNSLOTH_GRPO_ROLLOUT_RS", "").strip() or None,
        rollout_rs_threshold=os.environ.get("UNSLOTH_GRPO_ROLLOUT_RS_THRESHOLD", "").strip() or None,
        rollout_logps_as_old=_env_on("UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD"),
        sample_weight=_env_on("UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE")
        or bool(os.environ.get("UNSLOTH_GRPO_LOSS_AGGREGATION", "").strip()),
    )
    cap = getattr(args, "vllm_importance_sampling_cap", None)
    if settings["vllm_importance_sampling_clip_max"] is None and cap is not None:  # Unsloth's legacy cap
        settings.update(vllm_importance_sampling_clip_min=0, vllm_importance_sampling_clip_max=cap)
    if os.environ.get("UNSLOTH_GRPO_VLLM_IS_MODE", ""):
        settings["vllm_importance_sampling_mode"] = os.environ["UNSLOTH_GRPO_VLLM_IS_MODE"]
    clip = os.environ.get("UNSLOTH_GRPO_VLLM_IS_CLIP", "")
    if clip:  # "lower_upper", either side may be empty
        lower, _, upper = clip.partition("_")
        settings["vllm_importance_sampling_clip_min"] = float(lower) if lower.strip() else None
        settings["vllm_importance_sampling_clip_max"] = float(upper) if upper.strip() else None
    return settings


def _is_correction_on(settings: dict) -> bool:
    """Unsloth weights the loss by pi_old / pi_sampler: vLLM with the correction on, and the sampler's log-probs
    not taken as the old policy's (UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD drops them from the loss)."""
    return bool(settings.get("use_vllm") and settings.get("vllm_importance_sampling_correction")
                and not settings.get("rollout_logps_as_old", False))  # fmt: skip


def _rollout_rs_on(settings: dict) -> bool:
    """Unsloth's rollout rejection acts where it has a log-ratio to test: the old policy against the sampler (the
    importance-sampling correction on), or the current policy against the sampler's log-probs taken as old."""
    return bool(settings.get("rollout_rs")) and (
        _is_correction_on(settings) or bool(settings.get("rollout_logps_as_old", False))
    )


def _token_k1_bounds(spec) -> tuple[float, float] | None:
    """The bounds (lower, upper) on pi_sampler / pi_old of a token_k1 threshold as Unsloth reads it: one
    comma-separated entry, "upper" (lower = 1 / upper) or "lower_upper", with 0 < lower <= upper < inf; None
    for anything else."""
    specs = [x.strip() for x in str(spec).split(",") if x.strip()]
    if len(specs) != 1:
        return None
    spec = specs[0]
    try:
        if "_" in spec:
            lower, upper = (float(x) for x in spec.split("_", 1))
        else:
            upper = float(spec)
            lower = 1.0 / upper
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return (lower, upper) if 0 < lower <= upper < math.inf else None


def _rollout_rs_problem(settings: dict) -> str | None:
    """Why `settings`' rollout rejection has no exact grpo_kernels gate, or None when it has one."""
    name = f"UNSLOTH_GRPO_ROLLOUT_RS={settings['rollout_rs']!r}"
    options = list(dict.fromkeys(o.strip() for o in str(settings["rollout_rs"]).split(",") if o.strip()))
    if settings.get("rollout_logps_as_old", False):
        return (f"{name} with UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD=1: Unsloth's statistic is then the current policy "
                "against the sampler; grpo_kernels' gate compares old_logprobs with rollout_logprobs")  # fmt: skip
    if options != [ROLLOUT_RS_MAPPED]:
        reasons = []
        for option in (o for o in options if o != ROLLOUT_RS_MAPPED):
            key = option if option in _ROLLOUT_RS_REASONS else option[-2:]  # k2 / k3 statistics share a reason
            reasons.append(f"{option}: {_ROLLOUT_RS_REASONS.get(key, 'unknown to Unsloth')}")
        if len(options) > 1:
            reasons.append("a token must pass every option; grpo_kernels has one gate")
        return f"{name}: grpo_kernels' sampler gate computes {ROLLOUT_RS_MAPPED} alone; " + "; ".join(reasons)
    spec = settings.get("rollout_rs_threshold")
    bounds = _token_k1_bounds(spec)
    if bounds is None:
        return (f"{name} with UNSLOTH_GRPO_ROLLOUT_RS_THRESHOLD={spec!r}: not a token_k1 threshold Unsloth accepts "
                "('upper' or 'lower_upper', 0 < lower <= upper)")  # fmt: skip
    lower, upper = bounds
    if not math.exp(-ROLLOUT_LOG_RATIO_CLAMP) < lower < upper < math.exp(ROLLOUT_LOG_RATIO_CLAMP):
        return (f"{name} with bounds {lower}, {upper}: grpo_kernels' gate equals Unsloth's (which clamps the "
                "log-ratio to [-20, 20]) for bounds strictly inside (e^-20, e^20), lower < upper")  # fmt: skip
    if settings.get("loss_type") == "vespo":
        return (f"{name} with loss_type='vespo': Unsloth folds a rejected token's IS weight 0 into VESPO's sequence "
                "weight (at log 1e-8); grpo_kernels defines no gate for vespo")  # fmt: skip
    if float(settings.get("beta", 0.0)) != 0.0 or float(settings.get("entropy_coef", 0.0)) != 0.0:
        return (f"{name} with beta != 0 or entropy_coef != 0: Unsloth drops a rejected token from the KL term and "
                "the entropy bonus too; grpo_kernels' gate zeroes its IS weight, which only the policy term "
                "carries")  # fmt: skip
    return None


def unmapped_settings(settings: dict) -> list[str]:
    """The options in `settings` (loss_settings' keys) that no PolicyLossConfig computes exactly, one line
    each, naming the option and why. Empty: policy_loss_config reproduces Unsloth's loss. Options not in
    effect (the importance-sampling mode without the correction, the rollout rejection without a sampler
    log-ratio to test) are not named."""
    problems = []
    loss_type = settings.get("loss_type", "grpo")
    if loss_type not in LOSS_AGG_MODE:
        problems.append(f"loss_type={loss_type!r}: grpo_kernels maps {tuple(LOSS_AGG_MODE)}")
    if settings.get("use_vllm") and settings.get("vllm_importance_sampling_correction"):  # Unsloth checks the mode
        mode = settings.get("vllm_importance_sampling_mode", "sequence_mask")
        key = f"vllm_importance_sampling_mode={mode}"
        if mode not in VLLM_IS_MODES:
            problems.append(f"{key}: unknown to Unsloth and grpo_kernels")
        elif loss_type == "vespo" and VLLM_IS_MODES[mode][0] != "token":
            problems.append(f"{key} with loss_type='vespo': Unsloth refuses it (VESPO folds token-level IS weights "
                            "only), as grpo_kernels does")  # fmt: skip
        elif (_is_correction_on(settings) and mode.endswith("_truncate")
              and settings.get("vllm_importance_sampling_clip_min") is None
              and settings.get("vllm_importance_sampling_clip_max", 3.0) is None):  # fmt: skip
            problems.append(f"{key} with neither vllm_importance_sampling_clip_min nor _clip_max: Unsloth's clamp "
                            "raises (TRL refuses the token and sequence modes so)")  # fmt: skip
    if settings.get("beta", 0.0) != 0.0 and settings.get("use_bias_correction_kl", False):
        problems.append(
            "use_bias_correction_kl=True with beta != 0: Unsloth caps the bias-corrected KL (k3 x ratio) at 10, "
            "grpo_kernels caps k3 at 10 and then multiplies by the ratio (they differ where k3 x ratio > 10)"
        )
    if _rollout_rs_on(settings):
        problem = _rollout_rs_problem(settings)
        if problem:
            problems.append(problem)
    if settings.get("rollout_logps_as_old", False) and settings.get("importance_sampling_level") == "sequence":
        problems.append(
            "UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD=1 with importance_sampling_level='sequence': Unsloth clamps each "
            "token's log-ratio to [-20, 20] before the sequence mean, grpo_kernels clamps the mean (log_ratio_clamp): "
            "they differ where a token's |log-ratio| exceeds 20"
        )
    if settings.get("sample_weight", False):
        problems.append(
            "UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE / UNSLOTH_GRPO_LOSS_AGGREGATION: per-completion sample weights "
            "that replace the loss_type's normalizer: not mapped"
        )
    return problems


def policy_loss_config(settings: dict) -> gk.PolicyLossConfig:
    """The PolicyLossConfig of Unsloth's `grpo_compute_loss` for `settings` (loss_settings' keys).

    grpo / bnpo / dr_grpo / dapo / luspo -> ppo_clip (clip_low = epsilon_low, clip_high = epsilon_high,
    delta); cispo -> cispo with the absolute cap epsilon_high; sapo, vespo -> the same names;
    importance_sampling_level -> ratio_level, no log-ratio clamp (Unsloth has none); beta -> kl_coef with
    Unsloth's clamped k3 (verl's low_var_kl: log-ratio in [-20, 20], KL in [-10, 10]);
    use_bias_correction_kl -> kl_ratio_correction (beta = 0 only, see unmapped_settings); the vLLM
    importance-sampling correction (token / sequence / geometric, truncate / mask, clip_min / clip_max) ->
    is_level ("token", "sequence", "sequence_geometric"), is_mode, is_min, is_max (None: no bound; a mask
    with neither bound keeps every weight, as truncate with none); the rollout rejection token_k1 with
    bounds [lower, upper] on pi_sampler / pi_old -> the token ratio gate on pi_old / pi_sampler
    (is_gate="ratio", is_gate_min = 1 / upper, is_gate_max = 1 / lower); UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD
    -> log_ratio_clamp=20 (Unsloth's clamp of the ratio to the sampler), no IS weight, and old_logprobs are
    then the sampler's log-probs as Unsloth passes them (an unscored token holding the current log-prob);
    off_policy_mask_threshold and top_entropy_quantile -> the same names; a fixed entropy_coef ->
    entropy_coef with TRL's aggregation ("token-mean-local"). The loss takes the log-probs
    grpo_compute_loss receives: `old_logprobs` its `old`, `rollout_logprobs` its sampling log-probs.
    Raises ValueError listing unmapped_settings when there are any."""
    problems = unmapped_settings(settings)
    if problems:
        raise ValueError("Unsloth GRPO options grpo_kernels cannot map:\n  - " + "\n  - ".join(problems))
    loss_type = settings.get("loss_type", "grpo")
    beta = float(settings.get("beta", 0.0))
    fields = hf.trl_family_loss_fields(
        loss_type, epsilon_low=float(settings.get("epsilon_low", 0.2)),
        epsilon_high=float(settings.get("epsilon_high", 0.2)), delta=settings.get("delta"),
        sapo_temperature_pos=float(settings.get("sapo_temperature_pos", 1.0)),
        sapo_temperature_neg=float(settings.get("sapo_temperature_neg", 1.05)),
        vespo_k_pos=float(settings.get("vespo_k_pos", 2.0)), vespo_lambda_pos=float(settings.get("vespo_lambda_pos", 3.0)),
        vespo_k_neg=float(settings.get("vespo_k_neg", 3.0)), vespo_lambda_neg=float(settings.get("vespo_lambda_neg", 2.0)),
        max_completion_length=settings.get("max_completion_length", 8192),
    )  # fmt: skip
    fields.update(
        ratio_level=settings.get("importance_sampling_level", "token"),
        log_ratio_clamp=None,
        kl_coef=beta,
        kl_estimator="low_var_kl",
        kl_ratio_correction=bool(settings.get("use_bias_correction_kl", False)) and beta != 0.0,
        off_policy_mask_threshold=settings.get("off_policy_mask_threshold"),
        top_entropy_quantile=float(settings.get("top_entropy_quantile", 1.0)),
        temperature=float(settings.get("temperature", 1.0)),
    )
    coef = float(settings.get("entropy_coef", 0.0))
    if coef != 0.0:
        fields.update(entropy_coef=coef, entropy_agg_mode="token-mean-local")
    if settings.get("rollout_logps_as_old", False):  # the ratio to the sampler, clamped as Unsloth does
        fields["log_ratio_clamp"] = ROLLOUT_LOG_RATIO_CLAMP
    if _is_correction_on(settings):
        level, how = VLLM_IS_MODES[settings.get("vllm_importance_sampling_mode", "sequence_mask")]
        clip_min = settings.get("vllm_importance_sampling_clip_min")
        clip_max = settings.get("vllm_importance_sampling_clip_max", 3.0)
        if how == "mask" and clip_min is None and clip_max is None:  # masks nothing: the raw weight
            how = "truncate"
        fields.update(is_level=level, is_mode=how, is_min=None if clip_min is None else float(clip_min),
                      is_max=None if clip_max is None else float(clip_max))  # fmt: skip
    if _rollout_rs_on(settings):  # token_k1 (unmapped_settings refused the rest): lower <= 1 / r <= upper
        lower, upper = _token_k1_bounds(settings.get("rollout_rs_threshold"))
        fields.update(is_gate="ratio", is_gate_level="token", is_gate_min=1.0 / upper, is_gate_max=1.0 / lower)
    return gk.PolicyLossConfig(**fields)


def loss_normalizers(settings: dict, batch_size: int, num_items_in_batch=None, *, training: bool = True,
                     grad_accum_steps: int = 1, steps_per_generation: int | None = None,
                     num_processes: int = 1) -> dict:  # fmt: skip
    """The normalizer keywords of grpo_kernels' loss functions that reproduce grpo_compute_loss's division, for
    the loss options `settings` (loss_settings' keys), a micro-batch of `batch_size` rows and Unsloth's
    `num_items_in_batch`, `training`, `grad_accum_steps`, `steps_per_generation` and `num_processes`.

    GA = grad_accum_steps: Unsloth's current_gradient_accumulation_steps in training, 1 in eval (its
    `_unsloth_grpo_accumulation_steps`); it divides the entropy bonus too.
      grpo, sapo, dr_grpo, luspo: num_sequences = B GA (B = batch_size, the micro-batch's rows)
      bnpo: the local token count, times GA
      dapo, cispo, vespo: num_tokens = max(num_items_in_batch, 1) GA / steps_per_generation in training
        (max(num_items_in_batch, 1) in eval), dp_size = num_processes
      entropy bonus: its own token mean over the micro-batch, divided by GA."""
    return hf.trl_family_normalizers(settings.get("loss_type", "grpo"), batch_size, num_items_in_batch,
                                     training=training, grad_accum_steps=grad_accum_steps,
                                     steps_per_generation=steps_per_generation, num_processes=num_processes)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The kernel that stands in for unsloth_zoo.fused_losses.fused_linear.fused_linear_logprobs
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the adapter calls grpo_kernels: the backend, and the batch-invariant mode (each token's log-prob
    from the LM head bitwise independent of the other rows of the call; the hidden states are still those
    of Unsloth's forward, packed or not)."""

    backend: str = "auto"  # "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch"
    batch_invariant: bool = False  # fused_linear_logprobs(batch_invariant=): fixed reduction orders


class UnslothLogProbsKernel:
    """A callable with the signature of `unsloth_zoo.fused_losses.fused_linear.fused_linear_logprobs`
    (unsloth_zoo 2026.10.9), computed by `grpo_kernels.fused_linear_logprobs`.

    Per-token log_softmax(transform(hidden @ weight.T + bias) / temperature)[targets], fp32, the shape of
    targets, on hidden's device; transform(x) = c tanh(s x / c) with s = logit_scale_multiply /
    logit_scale_divide (each 0: absent) and c = logit_softcapping (0: none), Unsloth's order, as
    grpo_kernels' logit_scale / softcap; with `model_transform` set (GRPOKernelsTrainer sets the model's own,
    grpo_kernels.hf.logit_transform) that transform replaces the one passed. `mask`: rows outside it get 0 (and no
    gradient).
    `return_entropy` adds the entropy; `entropy_requires_grad` False detaches it (True and None: it is
    differentiable, the gradient computed when one arrives). `rows_per_chunk` / `max_rows_per_chunk` are
    Unsloth's chunk sizes: grpo_kernels plans its own chunks (its memory is bounded by them), so they do
    not change a result. What grpo_kernels does not compute is refused by name: `return_mean_logits`,
    `return_log_sum_sq_probs`, `return_is_top1` (Unsloth's DPO / KTO statistics, never asked for by
    GRPO), and a target outside [0, V) (Unsloth returns 0 for it; grpo_kernels raises ValueError).
    `calls` counts the calls (the trainer checks that its passes reached the kernel)."""

    def __init__(self, options: KernelOptions | None = None, model_transform: hf.LogitTransform | None = None):
        self.options = options or KernelOptions()
        # the transform the model's own forward applies (grpo_kernels.hf.logit_transform; GRPOKernelsTrainer sets
        # it): when set, what the kernel applies instead of the one Unsloth passes
        self.model_transform = model_transform
        self.calls = 0

    def __call__(self, hidden, weight, targets, *, bias=None, mask=None, temperature=1.0,
                 logit_scale_multiply=0.0, logit_scale_divide=0.0, logit_softcapping=0.0,
                 return_entropy=False, return_mean_logits=False, return_log_sum_sq_probs=False,
                 return_is_top1=False, rows_per_chunk=None, entropy_requires_grad=True,
                 max_rows_per_chunk=None):  # fmt: skip
        refused = [name for name, flag in (("return_mean_logits", return_mean_logits),
                                           ("return_log_sum_sq_probs", return_log_sum_sq_probs),
                                           ("return_is_top1", return_is_top1)) if flag]  # fmt: skip
        if refused:
            raise NotImplementedError(
                f"grpo_kernels' Unsloth kernel computes log-probs and entropy, not {refused}; run this trainer "
                "outside grpo_kernels.integrations.unsloth.use_grpo_kernels()"
            )
        scale = 1.0
        if logit_scale_multiply:
            scale *= float(logit_scale_multiply)
        if logit_scale_divide:
            scale /= float(logit_scale_divide)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"grpo_kernels needs a finite logit scale > 0, got {scale} "
                             f"(logit_scale_multiply={logit_scale_multiply}, logit_scale_divide={logit_scale_divide})")  # fmt: skip
        self.calls += 1
        device = weight.device
        lead = targets.shape
        flat_hidden = hidden.reshape(-1, hidden.shape[-1]).to(device)
        flat_targets = targets.reshape(-1).to(device)
        flat_mask = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.bool)
        if bias is not None:
            bias = bias.reshape(-1).to(device)
        if flat_targets.numel() == 0:  # nothing scored: an empty result in the graph of the inputs
            zero = flat_hidden.sum() * 0 + weight.sum() * 0 + (0 if bias is None else bias.sum() * 0)
            empty = flat_hidden.new_zeros(lead, dtype=torch.float32) + zero.float()
            return (empty, empty.clone()) if return_entropy else empty
        dtype = hf.compute_dtype(hidden, weight)  # Unsloth's rule: autocast's, else the head's
        cap = float(logit_softcapping or 0.0)
        if self.model_transform is not None:
            cap, scale = float(self.model_transform.softcap or 0.0), self.model_transform.logit_scale
        with torch.autocast(device.type, enabled=False):
            out = gk.fused_linear_logprobs(
                flat_hidden.to(dtype), weight.to(dtype), flat_targets.long(),
                None if bias is None else bias.to(dtype), float(temperature), mask=flat_mask,
                compute_entropy=bool(return_entropy), softcap=cap if cap != 0.0 else None, logit_scale=scale,
                backend=self.options.backend, batch_invariant=self.options.batch_invariant,
            )  # fmt: skip
        logprobs = out.logprobs.reshape(lead).to(hidden.device)
        if not return_entropy:
            return logprobs
        entropy = out.entropy.reshape(lead).to(hidden.device)
        if entropy_requires_grad is False:
            entropy = entropy.detach()
        return logprobs, entropy


def _kernel_module():
    import importlib

    return importlib.import_module(KERNEL_MODULE)


_active: list = []  # the kernels installed by use_grpo_kernels, innermost last


@contextlib.contextmanager
def use_grpo_kernels(backend: str = "auto", batch_invariant: bool = False, *, kernel=None):
    """Within the block, Unsloth's log-prob kernel (`unsloth_zoo.fused_losses.fused_linear.fused_linear_logprobs`,
    looked up by its callers at call time) is an `UnslothLogProbsKernel` on grpo_kernels; restored on exit.
    `backend` ("auto", "triton", "torch") and `batch_invariant` configure it (KernelOptions), or pass your
    own `kernel`.
    Re-entrant (an inner block keeps the outer kernel). Yields the kernel (its `calls` counts the calls).
    Any Unsloth code in the block is affected: Unsloth's DPO / KTO / GKD routes ask for statistics the
    kernel refuses, so keep them outside the block (GRPOKernelsTrainer scopes it to its own steps)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    module = _kernel_module()
    if _active:  # already inside a block: keep its kernel
        yield _active[-1]
        return
    kernel = kernel or UnslothLogProbsKernel(KernelOptions(backend, bool(batch_invariant)))
    saved = getattr(module, KERNEL_NAME)
    setattr(module, KERNEL_NAME, kernel)
    _active.append(kernel)
    try:
        yield kernel
    finally:
        _active.pop()
        setattr(module, KERNEL_NAME, saved)


def bypass_reasons(trainer=None) -> list[str]:
    """Why Unsloth's GRPO log-prob passes would not reach the replaced kernel in this process (empty: they
    do). Unsloth then scores with its older chunked functions, which keep each chunk's logits: the
    environment switches UNSLOTH_FUSED_LINEAR=0 and UNSLOTH_GRPO_CHUNKED_LOGPROBS=0 (read when unsloth_zoo
    is imported, or per call), an fp32 LM head for vLLM (UNSLOTH_VLLM_FP32_LM_HEAD=1), and scoring over
    the rollout's top-k / top-p / min-p kept set (UNSLOTH_GRPO_TRUNCATED_SUPPORT or Unsloth's automatic
    gate: `grpo_truncated_support_kwargs(trainer)` non-empty)."""
    reasons = []
    from unsloth_zoo.fused_losses import chunked_logprob

    if not chunked_logprob._FUSED_LINEAR or os.environ.get("UNSLOTH_FUSED_LINEAR", "1") == "0":
        reasons.append("UNSLOTH_FUSED_LINEAR=0 (Unsloth's chunked kernel instead of fused_linear_logprobs)")
    if os.environ.get("UNSLOTH_GRPO_CHUNKED_LOGPROBS", "1") == "0":
        reasons.append("UNSLOTH_GRPO_CHUNKED_LOGPROBS=0 (Unsloth's older chunked scorer)")
    if os.environ.get("UNSLOTH_VLLM_FP32_LM_HEAD", "0").strip().lower() in ("1", "true", "on", "yes"):
        reasons.append("UNSLOTH_VLLM_FP32_LM_HEAD=1 (Unsloth scores with an fp32 head copy of its own)")
    if trainer is not None:
        from unsloth_zoo.rl_replacements import grpo_truncated_support_kwargs

        if grpo_truncated_support_kwargs(trainer):
            reasons.append("truncated-support scoring (log-probs over the rollout's top-k / top-p / min-p kept set)")
    return reasons


def _check_versions():
    for name, wanted in (("unsloth", SUPPORTED_UNSLOTH), ("unsloth_zoo", SUPPORTED_UNSLOTH_ZOO)):
        hf.require_version("unsloth", name, wanted, hf.installed_version(name),
                           install=f"unsloth=={SUPPORTED_UNSLOTH}\" \"unsloth_zoo=={SUPPORTED_UNSLOTH_ZOO}",
                           otherwise="use Unsloth's GRPOTrainer")  # fmt: skip
    module = _kernel_module()
    if not callable(getattr(module, KERNEL_NAME, None)):
        raise RuntimeError(f"grpo_kernels.integrations.unsloth: {KERNEL_MODULE} has no {KERNEL_NAME}")


# ---------------------------------------------------------------------------------------------------
# The trainer (built on first access: importing this module imports neither Unsloth nor TRL)
# ---------------------------------------------------------------------------------------------------


def _unsloth_grpo_trainer():
    import trl

    cls = trl.GRPOTrainer
    if not cls.__name__.startswith("Unsloth"):
        raise RuntimeError(
            "grpo_kernels.integrations.unsloth: trl.GRPOTrainer is TRL's own, not Unsloth's generated "
            "UnslothGRPOTrainer. Import unsloth (and load the model with FastLanguageModel) before using "
            "GRPOKernelsTrainer; without Unsloth use grpo_kernels.integrations.trl. On a machine without a GPU "
            "Unsloth's CPU backend trains SFT only and leaves TRL's GRPOTrainer as it is: set UNSLOTH_ALLOW_CPU=1 "
            "before importing unsloth to generate its GRPO trainer there."
        )
    return cls


def _build_trainer_class():
    _check_versions()
    base = _unsloth_grpo_trainer()

    class GRPOKernelsTrainer(base):
        """Unsloth's GRPOTrainer (UnslothGRPOTrainer) with its log-prob kernel on grpo_kernels.

        Same arguments as Unsloth's GRPOTrainer, plus:
          grpo_kernels_mode: "logprobs" (the only mode; see the module docstring for why no "fused").
          grpo_kernels_backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
          grpo_kernels_batch_invariant: each token's log-prob bitwise independent of the batch; default False.
        Raises ValueError when Unsloth would not route its log-probs through the kernel (bypass_reasons)."""

        def __init__(self, *args, grpo_kernels_mode: str = "logprobs", grpo_kernels_backend: str = "auto",
                     grpo_kernels_batch_invariant: bool = False, **kwargs):  # fmt: skip
            if grpo_kernels_mode == "fused":
                raise ValueError(
                    "grpo_kernels_mode='fused' is not available for Unsloth: its loss runs on log-probs that Unsloth "
                    "assembles from mini batches, packed rows and shared prompts, so fusing the LM head into the loss "
                    "would re-implement unsloth_zoo's grpo_accumulated_loss. Use grpo_kernels_mode='logprobs'."
                )
            hf.check_trainer_options(grpo_kernels_mode, MODES, grpo_kernels_backend, grpo_kernels_batch_invariant)
            self.grpo_kernels_mode = grpo_kernels_mode
            self.grpo_kernels_kernel = UnslothLogProbsKernel(
                KernelOptions(grpo_kernels_backend, grpo_kernels_batch_invariant)
            )
            super().__init__(*args, **kwargs)
            self.grpo_kernels_kernel.model_transform = hf.logit_transform(self.model)
            reasons = bypass_reasons(self)
            if reasons:
                raise ValueError(
                    "GRPOKernelsTrainer: Unsloth would not compute its log-probs with the replaced kernel:\n  - "
                    + "\n  - ".join(reasons)
                )
            settings = loss_settings(self)
            unmapped = unmapped_settings(settings)
            if unmapped:  # Unsloth computes the loss in this mode: reported, not refused
                logger.info("grpo_kernels: Unsloth loss options without a grpo_kernels mapping (Unsloth computes "
                            "the loss in 'logprobs' mode, so they stay in effect): %s", "; ".join(unmapped))  # fmt: skip
            else:
                logger.info("grpo_kernels: Unsloth loss_type=%r is %s", settings["loss_type"],
                            policy_loss_config(settings))  # fmt: skip

        def _grpo_kernels_scope(self):
            return use_grpo_kernels(kernel=self.grpo_kernels_kernel)

        def training_step(self, *args, **kwargs):
            before = self.grpo_kernels_kernel.calls
            with self._grpo_kernels_scope():
                loss = super().training_step(*args, **kwargs)
            if self.grpo_kernels_kernel.calls == before:
                raise RuntimeError(
                    "grpo_kernels: a GRPO training step did not reach the replaced Unsloth log-prob kernel "
                    f"({KERNEL_MODULE}.{KERNEL_NAME}). The model's forward returned logits instead of hidden "
                    "states (a model Unsloth's hidden-state path does not cover), or Unsloth changed its seam."
                )
            return loss

        def prediction_step(self, *args, **kwargs):
            with self._grpo_kernels_scope():
                return super().prediction_step(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            with self._grpo_kernels_scope():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    return GRPOKernelsTrainer


__getattr__ = hf.lazy_class(__name__, "GRPOKernelsTrainer", _build_trainer_class)
