"""OpenRLHF 0.11.2 adapter: its policy loss and its actor's log-probs on grpo_kernels, in every Ray worker.

    python -m grpo_kernels.integrations.openrlhf <the arguments of openrlhf.cli.train_ppo_ray>

or, in your own launcher, before OpenRLHF builds its actors:

    import ray
    import grpo_kernels.integrations.openrlhf as gk_openrlhf
    ray.init(runtime_env=gk_openrlhf.runtime_env())          # then openrlhf.cli.train_ppo_ray.train(args)

Supported OpenRLHF: exactly 0.11.2 (SUPPORTED_OPENRLHF); another version is refused when the patch is
installed (the module globals below and the loss semantics move between releases).

OpenRLHF has no registry and no plugin entry point. Its PPO actor (`openrlhf/trainer/ray/ppo_actor.py`)
builds `self.actor_loss_fn = PolicyLoss(...)` from the module global it imported from `openrlhf.models`,
and every log-prob pass (policy, old policy, reference, EMA) is `openrlhf.models.Actor.forward`, inside
Ray actors. So the adapter patches those two names in each process where OpenRLHF runs, through Ray's
worker setup hook (`runtime_env={"worker_process_setup_hook": ...}`, what `runtime_env()` returns). The
hook imports nothing from OpenRLHF: it registers the patch to be applied when `openrlhf.models.actor` and
`openrlhf.models.loss` are first imported (OpenRLHF keeps deepspeed out of its vLLM workers; so does
this), or applies it at once where they already are.

Two parts, both on by default (`install(parts=...)`, or `GRPO_KERNELS_OPENRLHF=logprobs,loss` for Ray):

* "logprobs": `Actor.forward` computes the log-probs (and the entropy, when asked for) with
  `grpo_kernels.fused_linear_logprobs` from the hidden states that enter the LM head, instead of
  OpenRLHF's `[B, T, V]` fp32 logits. The backbone, packing, ring attention, vision inputs and the MoE
  router loss stay OpenRLHF's / transformers' code: the model's forward runs as usual with the LM head's
  forward replaced, for that call only, by one that hands its input to grpo_kernels inside the LM head
  module (where DeepSpeed ZeRO-3 has gathered the weight; the backward runs with it gathered again). Only
  the action columns are computed when the caller passes `action_mask` (not the prompt); the returned
  `output.logits` is None (not computed) and `output.entropy` holds NaN in the prompt columns. A caller
  that wants the logits (no `action_mask`, no `return_logprobs`) gets OpenRLHF's own forward.
* "loss": `PolicyLoss` is this module's `PolicyLoss`: OpenRLHF's constructor and call, computed by
  `grpo_kernels.grpo_loss` (`policy_loss_config` gives the mapping), returning OpenRLHF's 5-tuple with its
  metrics computed by OpenRLHF's definitions. Every train/rollout correction maps (token or sequence level,
  ratio, binary_kl or tv gating: grpo_kernels' IS weight and sampler gate); thresholds it cannot reproduce
  are refused by name when the loss is built (`unsupported_options`).

Options (`install(backend=, batch_invariant=)`, or GRPO_KERNELS_OPENRLHF_BACKEND / _BATCH_INVARIANT for Ray):
grpo_kernels' backend ("auto": Triton on CUDA) and batch-invariant log-probs (the old-policy pass and the
training pass then agree bitwise on-policy). Tested on CPU against OpenRLHF's own code (tests/
test_integration_openrlhf.py): both parts, packed samples, DeepSpeed ZeRO-3 in one process, OpenRLHF's
`ActorPPOTrainer.training_step`, Ray workers. Not exercised here: ring attention (several processes),
DeepSpeed tensor parallelism (a head it replaces is not an nn.Linear: refused), vision-language models, GPUs.

The KL to the reference stays OpenRLHF's `compute_approx_kl`: per-token and elementwise, grpo_kernels has
nothing to add there; `kl_config` maps its options for a caller who puts the KL into grpo_kernels' loss
(k3 exactly; k1 / k2 and the importance-weighted `unbiased_gradient` are refused by name). There is no
fused mode: OpenRLHF adds the KL and entropy terms to the policy loss in `training_step`, after the
model's forward has returned, so one call from the hidden states to the whole loss would mean
restructuring `training_step` (docs/guides/openrlhf.md).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import math
import os
import sys
from collections.abc import Iterable

import torch

import grpo_kernels as gk
from grpo_kernels import hf

SUPPORTED_OPENRLHF = "0.11.2"
PARTS = ("logprobs", "loss")
PARTS_ENV = "GRPO_KERNELS_OPENRLHF"  # comma-separated parts, read by the Ray worker hook
BACKEND_ENV = "GRPO_KERNELS_OPENRLHF_BACKEND"  # grpo_kernels backend: auto, triton or torch
BATCH_INVARIANT_ENV = "GRPO_KERNELS_OPENRLHF_BATCH_INVARIANT"  # "1": batch-invariant log-probs
SETUP_HOOK = "grpo_kernels.integrations.openrlhf.ray_worker_setup"
# OpenRLHF's own ray.init (openrlhf/cli/train_ppo_ray.py) sets these when it starts Ray itself; a launcher
# that starts Ray first must set them too (same defaults, a value in the environment wins)
OPENRLHF_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}

# OpenRLHF's PolicyLoss clamps the token log-ratio to [-20, 20] before exp() (policy_loss_type="ppo")
PPO_LOG_RATIO_CLAMP = 20.0

# OpenRLHF clamps the sampled token's probabilities to [1e-6, 1 - 1e-6] before its binary_kl / tv statistics
OPENRLHF_PROB_CLAMP = 1e-6

# ---------------------------------------------------------------------------------------------------
# OpenRLHF's PolicyLoss options -> PolicyLossConfig
# ---------------------------------------------------------------------------------------------------


def check_openrlhf_options(
    *,
    dual_clip,
    policy_loss_type,
    is_correction_level,
    is_correction_mode,
    is_correction_gating,
    is_correction_threshold,
) -> None:
    """OpenRLHF 0.11.2's own validation in `PolicyLoss.__init__`, with the same exceptions and messages, so
    that a configuration OpenRLHF refuses is refused the same way here. The arguments are PolicyLoss's:
    dual_clip, policy_loss_type, is_correction_level, is_correction_mode, is_correction_gating and
    is_correction_threshold ([low, high])."""
    if policy_loss_type not in ("ppo", "gspo"):  # OpenRLHF raises this one in forward
        raise ValueError(f"Invalid policy loss type: {policy_loss_type}")
    if dual_clip is not None:
        assert dual_clip > 1.0, f"dual_clip must be > 1.0, got {dual_clip}"
    if is_correction_level not in ("off", "token", "seq"):
        raise ValueError(f"is_correction_level must be off/token/seq, got {is_correction_level}")
    if is_correction_mode not in ("mask", "clip"):
        raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
    if is_correction_gating not in ("ratio", "binary_kl", "tv"):
        raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got {is_correction_gating}")
    if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
        raise ValueError(
            "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"
        )
    if is_correction_gating != "ratio" and is_correction_level != "off" and is_correction_threshold[0] > 0:
        raise ValueError(
            f"is_correction_gating={is_correction_gating} takes an upper bound only (a single delta)"
        )


def unsupported_options(
    *,
    policy_loss_type="ppo",
    is_correction_level="off",
    is_correction_mode="mask",
    is_correction_gating="ratio",
    is_correction_threshold=(0.5, 5.0),
    **_,
) -> list[str]:
    """The PolicyLoss options grpo_kernels cannot reproduce, one line each naming the option (empty: all
    honoured). The train/rollout correction (is_correction_level, is_correction_mode, is_correction_gating,
    is_correction_threshold) is applied by OpenRLHF to policy_loss_type="ppo" only (GSPO measures its ratio
    against the rollout log-probs instead), so only "ppo" can hit these: a threshold OpenRLHF would drop every
    token with, a non-finite upper bound, and a ratio bound above e^20 (grpo_kernels clamps the sampler
    log-ratio to +-20). Other PolicyLoss arguments (`_`) are accepted and ignored: every one of them maps."""
    if policy_loss_type != "ppo" or is_correction_level == "off":
        return []
    low, high = (float(x) for x in is_correction_threshold)
    if is_correction_gating != "ratio":  # a divergence >= 0, bounded above (OpenRLHF checked low <= 0)
        if not (math.isfinite(high) and high >= 0):
            problem = (
                f"is_correction_threshold={list(is_correction_threshold)} with "
                f"is_correction_gating={is_correction_gating!r}: grpo_kernels' divergence gate needs a "
                "finite upper bound >= 0 (OpenRLHF would drop every token below 0, keep every one at inf)"
            )
            return [problem]
        return []
    if not (math.isfinite(high) and high > 0 and high > max(low, 0.0)):
        problem = (
            f"is_correction_threshold={list(is_correction_threshold)}: grpo_kernels' IS band needs "
            "0 <= low < high with a finite high (OpenRLHF would drop every token)"
        )
        return [problem]
    if high > math.exp(PPO_LOG_RATIO_CLAMP):
        problem = (
            f"is_correction_threshold upper bound {high} > e^{PPO_LOG_RATIO_CLAMP:g}: grpo_kernels clamps "
            f"the IS log-ratio to [-{PPO_LOG_RATIO_CLAMP:g}, {PPO_LOG_RATIO_CLAMP:g}] (OpenRLHF does not)"
        )
        return [problem]
    return []


def policy_loss_config(
    *,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    dual_clip=None,
    token_level_loss=True,
    policy_loss_type="ppo",
    is_correction_level="off",
    is_correction_mode="mask",
    is_correction_gating="ratio",
    is_correction_threshold=(0.5, 5.0),
) -> gk.PolicyLossConfig:
    """The PolicyLossConfig that computes OpenRLHF 0.11.2's `PolicyLoss` with these constructor arguments.

    policy_loss_type "ppo" -> ppo_clip with OpenRLHF's log-ratio clamp 20; "gspo" -> ppo_clip at ratio_level
    "sequence" (exp of the mean log-ratio, value and gradient through the mean), no clamp, and always a
    per-sequence mean (OpenRLHF forces token_level_loss=False). clip_eps_low / clip_eps_high -> clip_low /
    clip_high; dual_clip as is; token_level_loss -> "token-mean", else "seq-mean-token-mean".

    The train/rollout correction ("ppo" only): is_correction_level, is_correction_mode, is_correction_gating
    and is_correction_threshold = [low, high], with rho_t = exp(old_t - rollout_t) the token IS weight:

    * level "token", gating "ratio": is_level "token", mode "mask" -> is_mode "mask", "clip" -> "truncate",
      is_min = low (None when low <= 0: ratios are positive), is_max = high.
    * level "seq", gating "ratio" (seq-mask-TIS): is_level "token" with is_max None (the raw rho_t), and the
      sampler gate is_gate "ratio" at is_gate_level "sequence" (the geometric mean of the sequence's rho_t),
      is_gate_min = low (None when low <= 0), is_gate_max = high.
    * gating "binary_kl" / "tv" (either level, mode "mask"; OpenRLHF allows low <= 0 only): is_level "token"
      with is_max None, is_gate = the gating at is_gate_level "token" or "sequence" (the mean over the
      sequence's tokens), is_gate_max = high. A divergence is >= 0, so there is no lower bound (OpenRLHF
      compares with low as well: a statistic rounded below 0 is dropped there, kept here; `PolicyLoss`).

    Raises ValueError for what OpenRLHF refuses (its messages) and for what grpo_kernels cannot reproduce
    (`unsupported_options`)."""
    options = dict(
        dual_clip=dual_clip,
        policy_loss_type=policy_loss_type,
        is_correction_level=is_correction_level,
        is_correction_mode=is_correction_mode,
        is_correction_gating=is_correction_gating,
        is_correction_threshold=is_correction_threshold,
    )
    check_openrlhf_options(**options)
    problems = unsupported_options(**options)
    if problems:
        raise ValueError("grpo_kernels cannot reproduce this OpenRLHF PolicyLoss: " + "; ".join(problems))
    gspo = policy_loss_type == "gspo"
    fields = dict(
        loss_type="ppo_clip",
        clip_low=float(clip_eps_low),
        clip_high=float(clip_eps_high),
        dual_clip=None if dual_clip is None else float(dual_clip),
        ratio_level="sequence" if gspo else "token",
        log_ratio_clamp=None if gspo else PPO_LOG_RATIO_CLAMP,
        loss_agg_mode="token-mean" if token_level_loss and not gspo else "seq-mean-token-mean",
    )
    if not gspo and is_correction_level != "off":
        low, high = (float(x) for x in is_correction_threshold)
        if is_correction_level == "token" and is_correction_gating == "ratio":
            fields.update(
                is_level="token",
                is_mode="mask" if is_correction_mode == "mask" else "truncate",
                is_min=low if low > 0 else None,
                is_max=high,
            )
        else:  # a gate that drops units, the kept tokens weighted by their own rho_t (mode "mask" only)
            fields.update(
                is_level="token",
                is_max=None,
                is_gate=is_correction_gating,
                is_gate_level="sequence" if is_correction_level == "seq" else "token",
                is_gate_min=low if is_correction_gating == "ratio" and low > 0 else None,
                is_gate_max=high,
            )
    return gk.PolicyLossConfig(**fields)


def kl_config(kl_estimator: str = "k1", unbiased_gradient: bool = False) -> dict:
    """PolicyLossConfig KL fields that compute OpenRLHF's `compute_approx_kl(log_probs, log_probs_base,
    log_probs_old, kl_estimator, unbiased_gradient)` per token (then aggregated by the loss, kl_coef =
    OpenRLHF's kl_ctl, kl_agg_mode "token-mean": OpenRLHF always aggregates the KL per token).

    k3 -> "low_var_kl": OpenRLHF computes exp(x) - 1 - x with x = base - log_probs clamped to <= 10, then
    clamps the value to [-10, 10]; "low_var_kl" clamps x to [-20, 20] and the value to [-10, 10]: wherever
    either clamp binds the value is 10 and its gradient 0 in both, elsewhere the formulas are the same. k1 and
    k2: OpenRLHF clamps their values to [-10, 10] (grpo_kernels' k1 / k2 are unclamped): refused.
    unbiased_gradient: OpenRLHF's gradient is min(pi / pi_old, 10) (log_probs - base) d log_probs, an
    importance weight grpo_kernels' straight-through KL (weight 1) does not have: refused."""
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    if unbiased_gradient:
        raise ValueError(
            "kl.unbiased_gradient=True: OpenRLHF's KL gradient is w (log_probs - base) with "
            "w = min(pi / pi_old, 10) detached; grpo_kernels' straight-through KL has w = 1"
        )
    if kl_estimator != "k3":
        raise ValueError(
            f"kl_estimator={kl_estimator!r}: OpenRLHF clamps its value to [-10, 10]; "
            f"grpo_kernels' {kl_estimator} is unclamped (k3 maps exactly)"
        )
    return dict(kl_estimator="low_var_kl", kl_agg_mode="token-mean")


# ---------------------------------------------------------------------------------------------------
# PolicyLoss
# ---------------------------------------------------------------------------------------------------


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """OpenRLHF's masked_mean over every element (no guard: an all-masked batch gives NaN, as OpenRLHF)."""
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum()


class PolicyLoss(torch.nn.Module):
    """OpenRLHF 0.11.2's `openrlhf.models.PolicyLoss` (same constructor, same call, same 5 outputs) computed
    by `grpo_kernels.grpo_loss`.

    forward(log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
    batch_num_tokens=None, global_batch_size=None) -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio):
    [B, T] per-token inputs (advantages [B, T] or broadcastable to it), OpenRLHF's global normalizers (with
    `batch_num_tokens` the token mean is sum / batch_num_tokens x dp_size, else a local mean; likewise
    `global_batch_size` for the per-sequence mean). The metrics are OpenRLHF's: clip_ratio the token mean of
    surr2 < surr1, ppo_kl the token mean of old - new log-prob (unclamped), and with the train/rollout
    correction vllm_kl (token mean of rollout - old) and is_filter_ratio (the share of the units the
    correction drops or clamps: valid tokens at level "token", all B sequences at level "seq", an empty one
    counted as dropped, as OpenRLHF), else None. `backend` picks grpo_kernels' backend ("auto": Triton on
    CUDA).

    Where the gated corrections (seq-level ratio, binary_kl, tv) part from OpenRLHF's numbers, with p / q the
    sampler's / old policy's probability of the sampled token:

    * A divergence gate has no lower bound. OpenRLHF also requires statistic >= low; with low = 0 (what its
      launcher makes of a single HIGH) it drops the tokens (or sequences) whose binary KL rounds below 0 in
      its arithmetic, those on which p and q nearly agree (in float32 about 40% of the tokens whose two
      log-probs differ by less than 1e-4, 10% under 1e-3); they are kept here. TV, |p - q|, is never below 0.
    * The binary KL is grpo_kernels' (SkyRL's form: 1e-8 inside the logarithm); OpenRLHF clamps p and q to
      [1e-6, 1 - 1e-6]. With both inside that range they differ by under 0.4% of a statistic above 1e-4 (the
      1e-8 matters near probability 1); with one outside, several-fold (p = 1.5e-3, q = 1e-14: 0.037 here,
      0.0098 in OpenRLHF). TV differs by at most 1e-6 (the clamp).
    * The sequence ratio gate averages the token log-ratios clamped to +-20 (OpenRLHF: unclamped): it differs
      on a sequence holding a token whose old and rollout log-probs are more than 20 nats apart.

    is_filter_ratio uses OpenRLHF's statistic with the band the loss applies (no lower bound on a
    divergence)."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list = (0.5, 5.0),
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        self.policy_loss_type = policy_loss_type
        # OpenRLHF: GSPO is always a per-sequence mean
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold
        self.backend = backend  # None: the one `install` was given
        self.config = policy_loss_config(
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            dual_clip=dual_clip,
            token_level_loss=token_level_loss,
            policy_loss_type=policy_loss_type,
            is_correction_level=is_correction_level,
            is_correction_mode=is_correction_mode,
            is_correction_gating=is_correction_gating,
            is_correction_threshold=is_correction_threshold,
        )

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens=None,
        global_batch_size=None,
    ):
        correction = self.is_correction_level != "off"
        if correction and rollout_log_probs is None:
            raise ValueError(
                f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs "
                "(the sampler's log-probs)"
            )
        if action_mask is None:
            mask = torch.ones(log_probs.shape, dtype=torch.bool, device=log_probs.device)
        else:
            if action_mask.shape != log_probs.shape:
                raise ValueError(
                    f"action_mask has shape {tuple(action_mask.shape)}, log_probs {tuple(log_probs.shape)}"
                )
            if action_mask.dtype != torch.bool and bool(((action_mask != 0) & (action_mask != 1)).any()):
                raise ValueError(
                    "action_mask holds values other than 0 and 1: grpo_kernels takes a 0/1 token mask"
                )
            mask = action_mask.bool()
        adv = torch.broadcast_to(advantages, log_probs.shape)
        gspo = self.policy_loss_type == "gspo"
        # GSPO with the correction on measures its ratio against the sampler instead of the old policy, and
        # gets no IS weight (OpenRLHF applies the correction block to "ppo" only)
        old = rollout_log_probs if gspo and correction else old_log_probs
        normalizers = {}
        if self.token_level_loss:
            if batch_num_tokens is not None:
                normalizers = dict(num_tokens=_number(batch_num_tokens), dp_size=int(dp_size))
        elif global_batch_size is not None:
            normalizers = dict(num_sequences=_number(global_batch_size), dp_size=int(dp_size))
        out = gk.grpo_loss(
            log_probs,
            adv,
            mask,
            old_logprobs=old,
            rollout_logprobs=rollout_log_probs if correction and not gspo else None,
            config=self.config,
            backend=self.backend or _options["backend"],
            **normalizers,
        )
        return (out.loss, *self._metrics(log_probs, old_log_probs, old, adv, action_mask, rollout_log_probs))

    @torch.no_grad()
    def _metrics(self, log_probs, old_log_probs, ratio_old, adv, action_mask, rollout_log_probs):
        """OpenRLHF's clip_ratio, ppo_kl, vllm_kl and is_filter_ratio, by its definitions (detached)."""
        m = None if action_mask is None else action_mask.to(log_probs.dtype)
        raw = (log_probs - old_log_probs).detach()
        if self.policy_loss_type == "ppo":
            ratio = raw.clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP).exp()
        else:  # the sequence ratio broadcast to its tokens, 0 on masked tokens
            lr = (log_probs - ratio_old).detach()
            mm = torch.ones_like(lr) if m is None else m
            ratio = ((lr * mm).sum(-1) / mm.sum(-1).clamp(min=1)).exp().unsqueeze(-1) * mm
        surr1 = ratio * adv
        surr2 = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * adv
        clip_ratio = _masked_mean((surr2 < surr1).float(), m)
        ppo_kl = _masked_mean(-raw, m)
        if self.is_correction_level == "off" or self.policy_loss_type != "ppo":
            return clip_ratio, ppo_kl, None, None
        filtered = self._filtered(old_log_probs, rollout_log_probs, m)
        if self.is_correction_level == "seq":  # per sequence: the mean over all B rows, empty ones included
            is_filter_ratio = filtered.float().mean()
        else:
            is_filter_ratio = _masked_mean(filtered.float(), m)
        return clip_ratio, ppo_kl, _masked_mean(rollout_log_probs - old_log_probs, m), is_filter_ratio

    def _filtered(self, old_log_probs, rollout_log_probs, m):
        """OpenRLHF's `filtered`: True for the units its correction drops (clip: clamps), [B, T] at token
        level, [B, 1] at sequence level. The statistic is OpenRLHF's: the ratio exp(old - rollout), per
        sequence the exp of its mean; binary_kl and tv on the probabilities clamped to [1e-6, 1 - 1e-6], per
        sequence their mean (an empty sequence: NaN, dropped). The band is the loss's: [low, high] for the
        ratio, the upper bound only for a divergence (a binary KL rounded below 0 is kept, as in the loss)."""
        low, high = self.is_correction_threshold
        old, rollout = old_log_probs.detach(), rollout_log_probs.detach()
        if self.is_correction_gating == "ratio":
            stat = old - rollout
        else:
            p = rollout.exp().clamp(OPENRLHF_PROB_CLAMP, 1 - OPENRLHF_PROB_CLAMP)
            q = old.exp().clamp(OPENRLHF_PROB_CLAMP, 1 - OPENRLHF_PROB_CLAMP)
            if self.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
        if self.is_correction_level == "seq" and m is None:
            stat = stat.mean(-1, keepdim=True)
        elif self.is_correction_level == "seq":  # OpenRLHF's masked_mean: 0 / 0 = NaN on an empty row
            stat = (stat * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        if self.is_correction_gating == "ratio":
            stat = stat.exp()
        if self.is_correction_mode == "clip":
            return (stat < low) | (stat > high)
        if self.is_correction_gating == "ratio":
            return ~((stat >= low) & (stat <= high))
        return ~(stat <= high)


def _number(x) -> float:
    """A normalizer OpenRLHF hands over as a 0-d tensor (or a number), as a Python float."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


# ---------------------------------------------------------------------------------------------------
# Actor.forward on grpo_kernels' LM head
# ---------------------------------------------------------------------------------------------------


def logit_transform(model_or_config) -> tuple[float | None, float]:
    """(softcap, logit_scale) of `model_or_config`, a transformers model (any wrapper) or its config: what its
    causal-LM forward applies to the LM head's output, z = softcap tanh(scale x / softcap), before OpenRLHF
    divides by the temperature. The shared reader of every adapter and the trainer, `grpo_kernels.hf.logit_transform` (per architecture:
    Gemma 2 / 3 / 4's soft cap, Granite's 1 / logits_scaling, HyperCLOVA X's logits_scaling, Cohere's
    logit_scale, Falcon-H1's lm_head_multiplier, ...; ValueError naming what it cannot express).
    Transformations of the head's input need nothing: the adapter reads that input."""
    return hf.logit_transform(model_or_config)


def _lm_head(actor_model):
    """(the transformers model, its LM head) of OpenRLHF's `Actor.model`; raises if the head is not a plain
    linear layer whose weight (and bias) alone give its output."""
    model = hf.unwrap(actor_model)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, torch.nn.Linear) or getattr(head.weight, "dtype", None) not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        raise RuntimeError(
            f"grpo_kernels (OpenRLHF logprobs): the model {type(model).__name__} has no LM head grpo_kernels "
            f"can read (get_output_embeddings() is {type(head).__name__}"
            + ("" if head is None else f", weight dtype {getattr(head.weight, 'dtype', None)}")
            + "): it needs an nn.Linear whose weight alone gives the logits (not a LoRA-adapted or quantized "
            "head). Install the adapter without the 'logprobs' part for this model."
        )
    return model, head


class _HeadCapture:
    """Stands in for the LM head module's forward during one model call: computes the log-probs (and entropy)
    of `select(hidden)` with grpo_kernels inside the head's forward (where DeepSpeed ZeRO-3 has gathered the
    weight), and returns an empty [..., 0] view of its input as the logits (whatever the model's forward does
    to the logits afterwards touches nothing)."""

    def __init__(self, head, select, targets, mask, temperature, compute_entropy, kwargs):
        self.head, self.select, self.targets, self.mask = head, select, targets, mask
        self.temperature, self.compute_entropy, self.kwargs = temperature, compute_entropy, kwargs
        self.result = None
        self.calls = 0

    def __call__(self, hidden, *args, **kwargs):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "grpo_kernels (OpenRLHF logprobs): the model called its LM head twice in one forward"
            )
        h = self.select(hidden)
        weight, bias = self.head.weight, self.head.bias
        with torch.autocast(h.device.type, enabled=False):
            out = gk.fused_linear_logprobs(
                h,
                weight,
                self.targets,
                bias,
                self.temperature,
                mask=self.mask,
                compute_entropy=self.compute_entropy,
                **self.kwargs,
            )
            self.result = (out.logprobs, out.entropy)
        # an empty view of the head's input: connected to it, so that DeepSpeed's backward hooks on the head
        # module's output and input fire in their order when actor_forward ties this output in (ZeRO-3)
        return hidden[..., :0]

    @contextlib.contextmanager
    def installed(self):
        had_own = "forward" in self.head.__dict__
        saved = self.head.__dict__.get("forward")
        self.head.forward = self
        try:
            yield self
        finally:
            if had_own:
                self.head.forward = saved
            else:
                del self.head.forward


def actor_forward(
    self,
    sequences: torch.LongTensor,
    action_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    return_output=False,
    allgather_logits=False,
    return_logprobs=False,
    ring_attn_group=None,
    packed_seq_lens=None,
    return_entropy=False,
    **mm_inputs,
):
    """`openrlhf.models.Actor.forward` (0.11.2) with the log-probs and entropy from grpo_kernels' LM head.

    Same arguments and returns as OpenRLHF's: `self` the Actor, `sequences` [B, T] token ids (prompt then
    response), `action_mask` [B, A] (the response tokens; their log-probs are returned, 0 where masked),
    `attention_mask` [B, T], `return_output` (also return the model's output), `return_logprobs` (without
    action_mask: the log-probs of every position), `return_entropy` (set `output.entropy`), and
    `allgather_logits`, `ring_attn_group`, `packed_seq_lens`, `mm_inputs` passed on as OpenRLHF does.
    Differences, none of which OpenRLHF's own callers read: `output.logits` is None; without packing and with
    `action_mask`, only the action columns are computed, so `output.entropy` ([B, T - 1]) is NaN in the prompt
    columns and 0 where `action_mask` is 0. A call that returns the logits (no `action_mask`, no
    `return_logprobs`) runs OpenRLHF's own forward."""
    stock = type(self).__dict__.get("_grpo_kernels_stock_forward") or _stock_forward_of(type(self))
    if action_mask is None and not return_logprobs:
        return stock(
            self,
            sequences,
            action_mask,
            attention_mask,
            return_output=return_output,
            allgather_logits=allgather_logits,
            return_logprobs=return_logprobs,
            ring_attn_group=ring_attn_group,
            packed_seq_lens=packed_seq_lens,
            return_entropy=return_entropy,
            **mm_inputs,
        )
    if return_entropy:
        assert return_output
    helpers = sys.modules[type(self).__module__]  # the module Actor lives in: OpenRLHF's packing helpers
    batch, seqlen = sequences.size()
    packing = bool(getattr(self, "packing_samples", False))
    if packing:
        sequences, position_ids, rolled_sequences, ring_attn_pad_len, indices = (
            helpers.unpad_and_slice_tensor(sequences, attention_mask, ring_attn_group)
        )
        forward_attention_mask = None
    else:
        rolled_sequences = torch.roll(sequences, shifts=-1, dims=1)
        forward_attention_mask = attention_mask
        if getattr(self, "is_vlm", False):  # as OpenRLHF: the model computes its own positions
            position_ids = None
            if mm_inputs:
                cfg = self._vlm_config
                token_type_ids = (sequences == cfg.image_token_id).to(torch.int32)
                if getattr(cfg, "video_token_id", None) is not None:
                    token_type_ids[sequences == cfg.video_token_id] = 2
                key = "mm_token_type_ids" if "image_grid_thw" in mm_inputs else "token_type_ids"
                mm_inputs[key] = token_type_ids
        else:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)

    model, head = _lm_head(self.model)
    softcap, logit_scale = logit_transform(model)
    kwargs = dict(softcap=softcap, logit_scale=logit_scale, **_options)
    actions = action_mask is not None and not packing
    if actions:  # the hidden state at t predicts token t + 1: the last A tokens need positions T-A-1 .. T-2
        width = action_mask.shape[1]
        if action_mask.shape != (batch, width) or not 0 < width < seqlen:
            raise ValueError(
                f"action_mask has shape {tuple(action_mask.shape)} for sequences {(batch, seqlen)}"
            )
        targets, mask = sequences[:, seqlen - width :], action_mask.bool()
    else:  # every position, as OpenRLHF (packed: the rolled, unpadded tokens of this rank)
        targets, mask = rolled_sequences, None

    def select(hidden):  # [B, T, H] entering the LM head -> the rows whose log-probs are wanted
        if hidden.shape[:-1] != sequences.shape:
            raise RuntimeError(
                "grpo_kernels (OpenRLHF logprobs): the LM head received hidden states "
                f"{tuple(hidden.shape)} for input ids {tuple(sequences.shape)}; cannot tell which position "
                "predicts which token"
            )
        return hidden[:, seqlen - width - 1 : seqlen - 1] if actions else hidden

    capture = _HeadCapture(head, select, targets, mask, float(self.temperature), bool(return_entropy), kwargs)
    with capture.installed():
        output = self.model(
            sequences, attention_mask=forward_attention_mask, position_ids=position_ids, **mm_inputs
        )
    if capture.result is None:
        raise RuntimeError(
            "grpo_kernels (OpenRLHF logprobs): the model's forward did not call its LM head "
            f"({type(head).__name__} of {type(model).__name__}); nothing to replace"
        )
    log_probs, entropy = capture.result
    if torch.is_grad_enabled() and hasattr(head.weight, "ds_id"):
        # ZeRO-3: DeepSpeed gathers a module's parameters in the backward when the gradient reaches the
        # module's output, and releases them when it reaches its input. The head's output (empty: [..., 0])
        # joins the results with weight 0, so that both happen around the head's backward, as for any
        # module: the output's hook node is later in the graph than grpo_kernels' head, and autograd runs
        # later nodes first, so the weight is whole again when grpo_kernels' backward reads it (and its
        # gradient is accumulated into the whole parameter, which DeepSpeed then reduce-scatters).
        tie = output["logits"].sum() * 0.0
        log_probs = log_probs + tie
        entropy = None if entropy is None else entropy + tie
    output["logits"] = None  # not computed

    if actions:
        if return_entropy:
            full = entropy.new_full((batch, seqlen - 1), float("nan"))
            full[:, seqlen - 1 - width :] = entropy
            setattr(output, "entropy", full)
        action_log_probs = log_probs * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs

    if return_entropy:
        if packing:
            entropy = helpers.gather_and_pad_tensor(
                entropy, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen
            )
        setattr(output, "entropy", entropy[:, :-1])
    if packing:
        log_probs = helpers.gather_and_pad_tensor(
            log_probs, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen
        )
    log_probs = log_probs[:, :-1]
    if action_mask is None:  # return_logprobs
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs


def _stock_forward_of(cls):
    for klass in cls.__mro__:
        forward = klass.__dict__.get("_grpo_kernels_stock_forward")
        if forward is not None:
            return forward
    raise RuntimeError(f"grpo_kernels: {cls.__name__}.forward was not patched by install_actor_forward")


def install_actor_forward(actor_cls) -> None:
    """Make `actor_cls.forward` (OpenRLHF's `Actor`, or a copy of the class its tests load by path) this
    module's `actor_forward`, keeping OpenRLHF's as `_grpo_kernels_stock_forward` for the calls that want the
    logits and for `uninstall_actor_forward`. Idempotent."""
    if "_grpo_kernels_stock_forward" not in actor_cls.__dict__:
        actor_cls._grpo_kernels_stock_forward = actor_cls.forward
    actor_cls.forward = actor_forward


def uninstall_actor_forward(actor_cls) -> None:
    """Give `actor_cls` (patched by `install_actor_forward`) OpenRLHF's forward back; a class that was not
    patched is left as it is. `install` / `uninstall` do this for OpenRLHF's own `Actor`; this is for a copy
    of the class loaded elsewhere."""
    stock = actor_cls.__dict__.get("_grpo_kernels_stock_forward")
    if stock is not None:
        actor_cls.forward = stock
        del actor_cls._grpo_kernels_stock_forward


# ---------------------------------------------------------------------------------------------------
# Installing in this process and in every Ray worker
# ---------------------------------------------------------------------------------------------------


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module is first executed (before the importer continues), so that a
    name replaced in `openrlhf.models.loss` is what `openrlhf/models/__init__.py` then re-exports."""

    def __init__(self):
        self.callbacks: dict[str, list] = {}

    def find_spec(self, name, path, target=None):
        if name not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not a module file (a namespace package): let the import system handle it
        callbacks = self.callbacks.pop(name)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_patch  # this module's own loader instance
        return spec


_finder = _PatchOnImport()
_installed: list[str] = []  # the parts installed in this process
_options = {"backend": "auto", "batch_invariant": False}  # how both parts call grpo_kernels (set by install)


def _when_imported(name: str, callback) -> None:
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _finder.callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def check_openrlhf_version() -> str:
    """The installed OpenRLHF's version, if it is the supported one; raises otherwise (without importing
    it): ImportError when it is not installed, RuntimeError for another version."""
    version = hf.installed_version("openrlhf")
    hf.require_version("openrlhf", "OpenRLHF", SUPPORTED_OPENRLHF, version,
                       install=f"openrlhf=={SUPPORTED_OPENRLHF}", otherwise="run without the adapter",
                       exc=ImportError if version is None else RuntimeError)  # fmt: skip
    return version


def _parse_parts(parts) -> tuple[str, ...]:
    if isinstance(parts, str):
        parts = [p.strip() for p in parts.split(",") if p.strip()]
    parts = tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"grpo_kernels OpenRLHF parts must be a non-empty subset of {PARTS}, got {parts!r}")
    return parts


def install(
    parts: Iterable[str] | str = PARTS, *, backend: str = "auto", batch_invariant: bool = False
) -> tuple[str, ...]:
    """Patch OpenRLHF in this process: "logprobs" -> `Actor.forward` is `actor_forward`; "loss" ->
    `PolicyLoss` is this module's (in `openrlhf.models.loss`, `openrlhf.models` and, if already imported, the
    PPO actor's module). Applied now to modules already imported, else right when OpenRLHF imports them
    (nothing is imported here). Idempotent; returns the parts installed. Raises when OpenRLHF is missing or
    not 0.11.2.

    backend: grpo_kernels' backend for both parts ("auto": Triton on CUDA, PyTorch elsewhere; "triton";
    "torch"). batch_invariant: each token's log-prob bitwise independent of the rest of the micro-batch (the
    old-policy pass and the training pass then give ratio 1 exactly on-policy; `fused_linear_logprobs`)."""
    parts = _parse_parts(parts)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    check_openrlhf_version()
    _options.update(backend=backend, batch_invariant=batch_invariant)
    if "logprobs" in parts and "logprobs" not in _installed:
        _when_imported("openrlhf.models.actor", lambda module: install_actor_forward(module.Actor))
        _installed.append("logprobs")
    if "loss" in parts and "loss" not in _installed:
        _when_imported("openrlhf.models.loss", _replace_policy_loss)
        for name in ("openrlhf.models", "openrlhf.trainer.ray.ppo_actor"):  # names bound by earlier imports
            if name in sys.modules:
                _replace_policy_loss(sys.modules[name])
        _installed.append("loss")
    return tuple(_installed)


def _replace_policy_loss(module) -> None:
    """`module.PolicyLoss` -> this module's; OpenRLHF's class is kept on `openrlhf.models.loss` for
    `uninstall`."""
    stock = module.__dict__.get("PolicyLoss")
    if stock is None or stock is PolicyLoss:
        return
    loss = sys.modules.get("openrlhf.models.loss", module)
    loss.__dict__.setdefault("_grpo_kernels_stock_PolicyLoss", stock)
    module.PolicyLoss = PolicyLoss


def uninstall() -> None:
    """Undo `install` in this process: pending patches (modules not imported yet) are dropped, `Actor.forward`
    is OpenRLHF's again, and every module that bound the adapter's `PolicyLoss` (`openrlhf.models.loss`,
    `openrlhf.models`, the PPO actor module) gets OpenRLHF's class back. Losses already built keep theirs."""
    _finder.callbacks.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    actor = sys.modules.get("openrlhf.models.actor")
    if actor is not None:
        uninstall_actor_forward(actor.Actor)
    loss = sys.modules.get("openrlhf.models.loss")
    stock = None if loss is None else loss.__dict__.pop("_grpo_kernels_stock_PolicyLoss", None)
    if stock is not None:  # every module that bound the name (at import, or patched since)
        for name in ("openrlhf.models.loss", "openrlhf.models", "openrlhf.trainer.ray.ppo_actor"):
            module = sys.modules.get(name)
            if module is not None and module.__dict__.get("PolicyLoss") is PolicyLoss:
                module.PolicyLoss = stock
    _installed.clear()


def installed_parts() -> tuple[str, ...]:
    return tuple(_installed)


def ray_worker_setup() -> None:
    """Ray's `worker_process_setup_hook` (see `runtime_env`): `install` with the parts and options of the
    environment variables GRPO_KERNELS_OPENRLHF (default "logprobs,loss"), GRPO_KERNELS_OPENRLHF_BACKEND
    (default "auto") and GRPO_KERNELS_OPENRLHF_BATCH_INVARIANT ("1" for on)."""
    install(**_options_from_environment())


def _options_from_environment() -> dict:
    flag = os.environ.get(BATCH_INVARIANT_ENV, "0")
    if flag not in ("0", "1"):
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be 0 or 1, got {flag!r}")
    return dict(
        parts=os.environ.get(PARTS_ENV) or ",".join(PARTS),
        backend=os.environ.get(BACKEND_ENV) or "auto",
        batch_invariant=flag == "1",
    )


def runtime_env(
    parts: Iterable[str] | str = PARTS,
    *,
    backend: str = "auto",
    batch_invariant: bool = False,
    base: dict | None = None,
) -> dict:
    """A Ray `runtime_env` that installs the adapter in every worker: Ray's `worker_process_setup_hook` set to
    `ray_worker_setup`, the parts, backend and batch_invariant (as for `install`) in `env_vars`, and
    OpenRLHF's own `env_vars` defaults (those its launcher sets when it starts Ray itself). `base`: a
    runtime_env to extend (its env_vars win over the defaults; a setup hook of its own is refused: Ray runs
    one)."""
    parts = _parse_parts(parts)
    env = dict(base or {})
    if env.get("worker_process_setup_hook") not in (None, SETUP_HOOK):
        raise ValueError(
            "base runtime_env already has a worker_process_setup_hook "
            f"({env['worker_process_setup_hook']!r}); "
            "call grpo_kernels.integrations.openrlhf.ray_worker_setup() from it instead"
        )
    env_vars = {name: os.environ.get(name, value) for name, value in OPENRLHF_ENV_DEFAULTS.items()}
    env_vars.update(env.get("env_vars") or {})
    env_vars.update(
        {
            PARTS_ENV: ",".join(parts),
            BACKEND_ENV: backend,
            BATCH_INVARIANT_ENV: "1" if batch_invariant else "0",
        }
    )
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def launch(argv: list[str] | None = None, *, module: str = "openrlhf.cli.train_ppo_ray") -> None:
    """Start Ray with `runtime_env()` (parts and options from the GRPO_KERNELS_OPENRLHF* environment
    variables), install the adapter in this process too, then run `module` as `__main__` with `argv` (default:
    this process's arguments). OpenRLHF's launcher skips its own `ray.init` when Ray is running.
    `python -m grpo_kernels.integrations.openrlhf ARGS` calls this."""
    import runpy

    import ray

    options = _options_from_environment()
    install(**options)
    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env(**options))
    sys.argv = [module, *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # run as a script the module is a second copy: use the package's
    from grpo_kernels.integrations.openrlhf import launch as _launch

    _launch()
