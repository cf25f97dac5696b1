"""verl 0.9.1 adapter, loaded in every verl process through the `verl.plugins` entry point.

1. Policy losses `gk_<mode>` for verl's modes vanilla, gspo, gpg, clip_cov, kl_cov, geo_mean, cispo
   and sapo, with verl's exact signature, normalisation (`config.global_batch_info`) and metric names,
   computed by `grpo_kernels.grpo_loss` (the Triton loss head on CUDA). Select one with
   `actor_rollout_ref.actor.policy_loss.loss_mode=gk_vanilla` (etc.).
2. `linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
   dist_process_group=None)`: a drop-in for verl's fused log-prob + entropy kernel, backed by
   `grpo_kernels.fused_linear_logprobs` (vocabulary-parallel when verl's Megatron path passes its
   tensor-parallel group). Switch it on with `actor_rollout_ref.model.use_fused_kernels=True`,
   `...fused_kernel_options.impl_backend=triton` and the environment variable
   `GRPO_KERNELS_VERL_LINEAR_CE=1` (propagate it to the Ray workers through `runtime_env`), or call
   `install_linear_cross_entropy()` yourself.

Verl swallows plugin load errors at DEBUG level; `registered_losses()` tells what this module added.
"""

from __future__ import annotations

import os

import grpo_kernels as gk
from grpo_kernels import hf

SUPPORTED_VERL = "0.9.1"
# verl loss_mode -> the grpo_kernels loss it maps to (see _policy_config)
MODES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo")

_registered: list[str] = []


def _check_version() -> None:
    import verl

    hf.require_version("verl", "verl", SUPPORTED_VERL, getattr(verl, "__version__", None),
                       install=f"verl=={SUPPORTED_VERL}",
                       otherwise="set VERL_USE_EXTERNAL_PLUGINS=none to run without grpo_kernels")  # fmt: skip


def _clip_bounds(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(low), float(high)


def _policy_config(mode: str, config, loss_agg_mode: str, horizon: int) -> gk.PolicyLossConfig:
    """verl ActorConfig + loss_mode -> PolicyLossConfig (the exact correspondence is tested in
    tests/test_integration_verl.py)."""
    low, high = _clip_bounds(config)
    info = getattr(config, "global_batch_info", None) or {}
    agg = dict(loss_agg_mode=loss_agg_mode)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        # verl: loss_scale_factor, or the padded response length of this micro-batch
        agg["max_completion_length"] = int(info.get("loss_scale_factor") or horizon)
    if mode == "vanilla":
        return gk.PolicyLossConfig(
            loss_type="ppo_clip", clip_low=low, clip_high=high, dual_clip=float(config.get("clip_ratio_c", 3.0)),
            log_ratio_clamp=20.0, **agg,
        )  # fmt: skip
    if mode == "gspo":  # sequence value, token gradient; verl clamps the combined log-ratio at 10
        return gk.PolicyLossConfig(
            loss_type="ppo_clip", ratio_level="sequence_token", clip_low=low, clip_high=high,
            log_ratio_clamp=10.0, **agg,
        )  # fmt: skip
    if mode == "gpg":
        return gk.PolicyLossConfig(loss_type="gpg", **agg)
    if mode == "cispo":
        return gk.PolicyLossConfig(loss_type="cispo", cispo_form="relative", clip_low=low, clip_high=high,
                                   log_ratio_clamp=20.0, **agg)  # fmt: skip
    if mode == "sapo":  # verl forces seq-mean-token-mean
        return gk.PolicyLossConfig(loss_type="sapo", sapo_tau_pos=float(config.tau_pos),
                                   sapo_tau_neg=float(config.tau_neg), log_ratio_clamp=20.0,
                                   loss_agg_mode="seq-mean-token-mean")  # fmt: skip
    pl = config.policy_loss
    if mode == "clip_cov":
        return gk.PolicyLossConfig(
            loss_type="clip_cov", clip_low=low, clip_high=high, log_ratio_clamp=None,
            clip_cov_ratio=float(pl.clip_cov_ratio if pl.clip_cov_ratio is not None else 2e-4),
            clip_cov_lb=float(pl.clip_cov_lb if pl.clip_cov_lb is not None else 1.0),
            clip_cov_ub=float(pl.clip_cov_ub if pl.clip_cov_ub is not None else 5.0), **agg,
        )  # fmt: skip
    if mode == "kl_cov":
        return gk.PolicyLossConfig(
            loss_type="kl_cov", log_ratio_clamp=None,
            kl_cov_ratio=float(pl.kl_cov_ratio if pl.kl_cov_ratio is not None else 2e-4),
            kl_cov_coef=float(pl.ppo_kl_coef if pl.ppo_kl_coef is not None else 1.0), **agg,
        )  # fmt: skip
    if mode == "geo_mean":  # verl ignores loss_agg_mode: a mean over the micro-batch's rows
        return gk.PolicyLossConfig(loss_type="gmpo", clip_low=low, clip_high=high, log_ratio_clamp=None)
    raise ValueError(f"unsupported verl loss_mode {mode!r}; supported: {MODES}")


def policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):  # fmt: skip
    """verl's PolicyLossFn for `mode` (registered as "gk_<mode>"), computed by grpo_kernels.

    old_log_prob, log_prob, advantages, response_mask: [bs, T] as verl passes them; loss_agg_mode: verl's
    aggregation; config: verl's actor config (clip ratios, global batch info for the normalizers);
    rollout_is_weights: verl's rollout importance weights, multiplied into the policy term.
    Returns (loss, verl's pg metrics as floats)."""
    if config is None:
        raise ValueError(f"gk_{mode}: verl passes the actor config; got config=None")
    cfg = _policy_config(mode, config, loss_agg_mode, horizon=response_mask.shape[-1])
    info = getattr(config, "global_batch_info", None) or {}
    dp_size = int(info.get("dp_size") or 1)
    num_tokens = info.get("batch_num_tokens")
    num_sequences = info.get("global_batch_size")
    if dp_size > 1 and cfg.loss_agg_mode == "token-mean" and num_tokens is None and mode != "geo_mean":
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1 (verl agg_loss)")
    if mode == "geo_mean":  # torch.mean over the local rows, no global normalisation
        num_tokens, num_sequences, dp_size = None, response_mask.shape[0], 1
    out = gk.grpo_loss(
        log_prob, advantages, response_mask.bool(), old_logprobs=old_log_prob, config=cfg,
        is_weights=rollout_is_weights, num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size,
    )  # fmt: skip
    return out.loss, _verl_metrics(mode, out.metrics)


def _verl_metrics(mode, m) -> dict:
    """verl's pg metrics from ours (floats, as verl returns them)."""
    if mode == "gpg":
        return {}
    if mode == "kl_cov":  # verl logs the mean |log r| here
        return {"actor/ppo_kl": m["ppo_kl_abs"].item()}
    if mode == "clip_cov":
        return {"actor/pg_clipfrac": m["selection/cov_frac"].item(), "actor/ppo_kl": m["ppo_kl"].item()}
    clipfrac = {
        "vanilla": "clip_ratio/region_mean",
        "gspo": "clip_ratio/region_mean",
        "cispo": "clip_ratio/any_mean",
        "geo_mean": "clip_ratio/high_mean",
    }
    lower = {"vanilla": "clip_ratio/dual_mean", "geo_mean": "clip_ratio/low_mean"}
    return {
        "actor/pg_clipfrac": m[clipfrac[mode]].item() if mode in clipfrac else 0.0,
        "actor/ppo_kl": m["ppo_kl"].item(),
        "actor/pg_clipfrac_lower": m[lower[mode]].item() if mode in lower else 0.0,
    }


def _make_loss(mode):
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):  # fmt: skip
        return policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                           rollout_is_weights)  # fmt: skip

    loss_fn.__name__ = f"gk_{mode}"
    loss_fn.__doc__ = f"grpo_kernels implementation of verl's {mode!r} policy loss (same signature and metrics)."
    return loss_fn


def register_policy_losses() -> list[str]:
    """Register gk_<mode> for every supported mode in verl's policy-loss registry (idempotent).

    Select one with ``actor_rollout_ref.actor.policy_loss.loss_mode=gk_vanilla`` (etc.); returns the
    registered names. Loading this module runs it: verl's plugin discovery (the ``verl.plugins`` entry
    point) imports it in the driver and every worker."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    _check_version()
    for mode in MODES:
        name = f"gk_{mode}"
        if name not in POLICY_LOSS_REGISTRY:
            register_policy_loss(name)(_make_loss(mode))
        if name not in _registered:
            _registered.append(name)
    return list(_registered)


def registered_losses() -> list[str]:
    return list(_registered)


# ---- linear_cross_entropy drop-in ------------------------------------------------------------------


def linear_cross_entropy(hidden, weight, labels, temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None, *, softcap: float | None = None):  # fmt: skip
    """verl's signature: hidden [..., H], weight [V, H], labels [...]; returns flat fp32 (log-probs,
    entropy) for reduction "none", or (sum / mean of the log-probs, per-token entropy).

    dist_process_group: verl's Megatron path passes the tensor-parallel group (also at TP = 1): then
    `weight` is this rank's block of the vocabulary (Megatron's ColumnParallelLinear output layer,
    rank r holding the rows after ranks 0..r-1), `labels` are global ids, and the results are those of
    the whole head on every rank (grpo_kernels' vocabulary-parallel LM head, `tp_group`).
    softcap: the model's final_logit_softcapping (Gemma 2 / 3), z = softcap tanh(x / softcap) / T. verl's
    own call never passes it (its fused path has no soft-capping); a caller that knows its model does.
    temperature: a float (verl's contract), the sampling temperature T; reduction: "none", "sum", "mean"."""
    if not isinstance(temperature, float):
        raise TypeError(f"temperature must be a float (verl's contract), got {type(temperature).__name__}")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    out = gk.fused_linear_logprobs(flat_hidden, weight, labels.reshape(-1), temperature=temperature,
                                   tp_group=dist_process_group, softcap=softcap)  # fmt: skip
    logprobs = out.logprobs
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, out.entropy


def install_linear_cross_entropy() -> None:
    """Make verl's fused-kernel forward (impl_backend=triton) call grpo_kernels' LM head.

    Replaces ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` with this module's
    ``linear_cross_entropy`` (the same signature), also where Megatron's forward modules already bound
    it, so verl's ``use_fused_kernels=True`` path runs on grpo_kernels; idempotent. Loading this module
    runs it when the environment sets ``GRPO_KERNELS_VERL_LINEAR_CE=1``."""
    import verl.utils.kernel.linear_cross_entropy as lce

    lce.linear_cross_entropy = linear_cross_entropy
    for name in ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap"):
        module = __import__("sys").modules.get(name)  # Megatron binds the function at import time
        if module is not None and hasattr(module, "linear_cross_entropy"):
            module.linear_cross_entropy = linear_cross_entropy


# Loaded by verl's plugin discovery (`import verl`) in the driver and every worker.
register_policy_losses()
if os.environ.get("GRPO_KERNELS_VERL_LINEAR_CE", "0") == "1":
    install_linear_cross_entropy()
