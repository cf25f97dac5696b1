"""SkyRL 0.4.0 adapter: SkyRL's policy losses computed by grpo_kernels, and its FSDP log-prob head.

1. Policy losses ``gk_<type>`` in SkyRL's ``PolicyLossRegistry`` (verl's design: SkyRL folds the loss
   reduction into the advantages beforehand, ``apply_loss_reduction_to_advantages_minibatch``, and the
   loss is a plain sum over the mask), for every SkyRL type: regular, dual_clip, gspo, cispo (both anchors),
   rollout_is, dppo (binary TV / KL), sapo, clip_cov, kl_cov, cross_entropy and importance_sampling, with
   SkyRL's signature
   ``(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs) -> (loss, metrics)``,
   SkyRL's off-policy correction (``algorithm.off_policy_correction``) and SkyRL's metric names. Select one
   with ``trainer.algorithm.policy_loss_type=gk_regular`` (etc.) after ``register_policy_losses()``.
2. ``mode="logprobs"``: in every worker that loads the losses, ``HFModelWrapper.forward`` (the FSDP
   policy) computes the action log-probs and entropies with ``grpo_kernels.fused_linear_logprobs`` inside
   the model's forward (where FSDP has gathered the head), instead of the ``[B, S, V]`` logits, their
   in-place temperature division and ``logprobs_from_logits``; SkyRL's loss, KL and entropy code run
   unchanged on them.
3. ``mode="fused"``: as "logprobs", and the training forward of ``PolicyWorkerBase`` computes SkyRL's
   whole actor loss (the policy term, ``use_kl_loss``'s KL and ``use_entropy_loss``'s entropy term, with
   SkyRL's weights ``dp_size`` and ``microbatch_weight``) in one ``grpo_kernels.fused_linear_grpo_loss``
   call on the last hidden states; SkyRL then logs the same values.

The mode travels with the registered losses: SkyRL ships registered functions to its Ray workers
(cloudpickle through a named actor), and unpickling a ``gk_`` loss installs its mode in that worker.
Options grpo_kernels cannot reproduce raise ``ValueError`` naming the option.
"""

from __future__ import annotations

import threading

import torch

import grpo_kernels as gk
from grpo_kernels import hf

SUPPORTED_SKYRL = "0.4.0"
MODES = ("loss", "logprobs", "fused")
# SkyRL policy_loss_type -> registered here as gk_<type> (the mapping: policy_loss_config)
LOSS_TYPES = ("regular", "dual_clip", "gspo", "cispo", "rollout_is", "dppo", "sapo", "clip_cov", "kl_cov",
              "cross_entropy", "importance_sampling")  # fmt: skip
# log-ratio clamp of each type's exp() (SkyRL's safe_exp_delta clip 20; gspo clamps at 10, one-sided; the
# covariance losses and importance_sampling exponentiate without a clamp)
_LOG_RATIO_CLAMP = {"regular": 20.0, "dual_clip": 20.0, "gspo": 10.0, "cispo": 20.0, "rollout_is": 20.0,
                    "dppo": 20.0, "sapo": 20.0, "clip_cov": None, "kl_cov": None, "cross_entropy": None,
                    "importance_sampling": None}  # fmt: skip
# types whose SkyRL function applies algorithm.off_policy_correction
_CORRECTED = ("regular", "dual_clip", "gspo", "cispo", "rollout_is", "dppo", "sapo")
_KL = {"k1": "k1", "k2": "k2", "k3": "low_var_kl", "abs": "abs"}  # SkyRL's k3 clamps as verl's low_var_kl

_registered: list[str] = []
_installed: set[str] = set()
_originals: dict = {}  # (owner, attribute) -> SkyRL's own function, restored by uninstall()


def _check_version() -> None:
    hf.require_version("skyrl", "skyrl", SUPPORTED_SKYRL, hf.installed_version("skyrl"),
                       install=f"skyrl=={SUPPORTED_SKYRL}", otherwise="use SkyRL's own policy losses")  # fmt: skip


# ---- configuration ---------------------------------------------------------------------------------


def _type_of(config, registered_type: str) -> str:
    """The SkyRL type to compute: the registered one, except that SkyRL's regular / dual_clip are one
    function that reads config.policy_loss_type (as SkyRL's ppo_policy_loss does)."""
    if registered_type in ("regular", "dual_clip"):
        name = str(config.policy_loss_type).removeprefix("gk_")
        if name not in ("regular", "dual_clip"):
            raise ValueError(f"gk_{registered_type}: policy_loss_type must be 'regular' or 'dual_clip' "
                             f"(SkyRL's ppo_policy_loss), got {config.policy_loss_type!r}")  # fmt: skip
        return name
    return registered_type


def correction_enabled(opc) -> bool:
    """SkyRL's off_policy_correction_enabled: TIS, a sequence mask, the outlier or the token mask."""
    if opc is None:
        return False
    return (
        opc.tis_ratio_type is not None
        or opc.sequence_mask_metric is not None
        or opc.outlier_token_is_threshold_low is not None
        or opc.outlier_token_is_threshold_high is not None
        or (opc.token_mask_is_threshold_low is not None and opc.token_mask_is_threshold_high is not None)
    )


def unsupported_options(config, skyrl_type: str) -> list[str]:
    """The options of this SkyRL AlgorithmConfig that the gk_ loss cannot reproduce, each with why."""
    problems = []
    opc = getattr(config, "off_policy_correction", None)
    if opc is not None and opc.sequence_mask_metric not in (None, "product", "geometric"):
        problems.append(f"off_policy_correction.sequence_mask_metric={opc.sequence_mask_metric!r} is not one of "
                        "None, 'product', 'geometric'")  # fmt: skip
    if opc is not None and opc.tis_ratio_type not in (None, "token", "sequence"):
        problems.append(f"off_policy_correction.tis_ratio_type={opc.tis_ratio_type!r} is not None, 'token' or 'sequence'")
    cispo_on_rollout = skyrl_type == "cispo" and rollout_anchored(config, skyrl_type)
    if cispo_on_rollout and opc is not None and opc.tis_ratio_type:
        problems.append(  # SkyRL's words
            "cispo_anchor='rollout' is already rollout-anchored and performs the off-policy correction; TIS "
            f"(tis_ratio_type={opc.tis_ratio_type!r}) would double-count it. "
            "Set off_policy_correction.tis_ratio_type=None."
        )
    if skyrl_type in ("clip_cov", "kl_cov") and correction_enabled(opc):
        problems.append(f"off_policy_correction with policy_loss_type={skyrl_type!r} (SkyRL's validate_cfg refuses it "
                        "too: its clip_cov / kl_cov losses never apply it)")  # fmt: skip
    if skyrl_type in ("dual_clip",) and not float(config.clip_ratio_c) > 1.0:
        problems.append(f"clip_ratio_c={config.clip_ratio_c} (grpo_kernels' dual clip needs c > 1)")
    return problems


def policy_loss_config(config, skyrl_type: str, with_rollout: bool = True) -> gk.PolicyLossConfig:
    """SkyRL AlgorithmConfig + policy loss type -> PolicyLossConfig: the per-token objective, a token sum
    (the reduction is in SkyRL's advantages), the ratio's anchor (the rollout log-probs for rollout_is, cispo
    with ``cispo_anchor="rollout"`` and, when the batch has them, dppo) and, for the types SkyRL corrects,
    token TIS (``tis_ratio_type="token"``, cap ``token_tis_ratio_clip_high``). SkyRL's other corrections
    (its masks and the sequence TIS weight) are per-token weights: ``off_policy_weights``.
    ``with_rollout``: whether the batch carries rollout log-probs (SkyRL corrects, and DPPO anchors on
    them, only then). Raises ValueError naming what cannot be mapped."""
    problems = unsupported_options(config, skyrl_type)
    if not with_rollout and rollout_anchored(config, skyrl_type):
        problems.append(f"policy_loss_type={skyrl_type!r} measures its ratio against rollout_logprobs, "
                        "which the batch does not have")
    if problems:
        raise ValueError(f"gk_{skyrl_type}: " + "; ".join(problems))
    common = dict(loss_agg_mode="token-sum", log_ratio_clamp=_LOG_RATIO_CLAMP[skyrl_type])
    opc = config.off_policy_correction
    if skyrl_type in _CORRECTED and with_rollout and opc.tis_ratio_type == "token":
        common.update(is_level="token", is_mode="truncate", is_max=float(opc.token_tis_ratio_clip_high))
    if rollout_anchored(config, skyrl_type) or (skyrl_type == "dppo" and with_rollout):
        common.update(ratio_anchor="rollout")
    low, high = float(config.eps_clip_low), float(config.eps_clip_high)
    if skyrl_type == "regular":
        return gk.PolicyLossConfig(loss_type="ppo_clip", clip_low=low, clip_high=high, **common)
    if skyrl_type == "dual_clip":
        return gk.PolicyLossConfig(loss_type="ppo_clip", clip_low=low, clip_high=high,
                                   dual_clip=float(config.clip_ratio_c), **common)  # fmt: skip
    if skyrl_type == "gspo":  # GSPO-token: sequence value, token gradient
        return gk.PolicyLossConfig(loss_type="ppo_clip", ratio_level="sequence_token", clip_low=low, clip_high=high,
                                   **common)  # fmt: skip
    if skyrl_type == "cispo":
        return gk.PolicyLossConfig(loss_type="cispo", cispo_form="relative", clip_low=float(config.cispo.cispo_eps_clip_low),
                                   clip_high=float(config.cispo.cispo_eps_clip_high), **common)  # fmt: skip
    if skyrl_type == "rollout_is":  # CISPO against the rollout log-probs, a hard zero outside (1 - lo, 1 + hi)
        return gk.PolicyLossConfig(loss_type="cispo", cispo_form="mask", clip_low=low, clip_high=high,
                                   **common)  # fmt: skip
    if skyrl_type == "dppo":  # -r A on the tokens inside the binary trust region; delta_low for A < 0
        dppo = config.dppo
        return gk.PolicyLossConfig(loss_type="dppo", dppo_divergence=str(dppo.dppo_type),
                                   clip_low=float(dppo.delta_low), clip_high=float(dppo.delta_high),
                                   **common)  # fmt: skip
    if skyrl_type == "sapo":
        return gk.PolicyLossConfig(loss_type="sapo", sapo_tau_pos=float(config.sapo.tau_pos),
                                   sapo_tau_neg=float(config.sapo.tau_neg), **common)  # fmt: skip
    if skyrl_type == "clip_cov":
        return gk.PolicyLossConfig(loss_type="clip_cov", clip_low=low, clip_high=high,
                                   clip_cov_ratio=float(config.clip_cov.clip_ratio),
                                   clip_cov_lb=float(config.clip_cov.clip_cov_lb),
                                   clip_cov_ub=float(config.clip_cov.clip_cov_ub), **common)  # fmt: skip
    if skyrl_type == "kl_cov":
        return gk.PolicyLossConfig(loss_type="kl_cov", kl_cov_ratio=float(config.kl_cov.kl_cov_frac),
                                   kl_cov_coef=float(config.kl_cov.ppo_kl_coef), **common)  # fmt: skip
    if skyrl_type == "cross_entropy":  # -log p summed: a policy gradient with unit advantages
        return gk.PolicyLossConfig(loss_type="gpg", **common)
    if skyrl_type == "importance_sampling":  # -exp(lp - old) A, no clip: PSPO with no smoothing
        return gk.PolicyLossConfig(loss_type="pspo", pspo_alpha=0.0, **common)
    raise ValueError(f"unsupported SkyRL policy_loss_type {skyrl_type!r}; supported: {LOSS_TYPES}")


def rollout_anchored(config, skyrl_type: str) -> bool:
    """Whether SkyRL's loss of this type always measures its ratio against the rollout log-probs (rollout_is,
    and cispo with ``cispo_anchor="rollout"``; dppo does when the batch has them) and asserts without them."""
    return skyrl_type == "rollout_is" or (skyrl_type == "cispo" and config.cispo.cispo_anchor == "rollout")


def _safe_exp(x: torch.Tensor) -> torch.Tensor:  # SkyRL's safe_exp_delta(clip=20), in fp32
    return x.float().clamp(-20.0, 20.0).exp()


def off_policy_weights(old, rollout, mask, opc) -> tuple[torch.Tensor | None, dict]:
    """SkyRL's off-policy masks, sequence TIS weight and metrics from the old, rollout and mask tensors
    ([B, T], no gradient), in SkyRL's order and arithmetic (fp32, its clamp of each exponent at 20).

    Returns (weights, metrics): ``weights`` ([B, T], passed as ``is_weights``; None when neither a mask nor
    sequence TIS is on) the product of the outlier-token sequence mask, the token mask, the sequence TIS
    weight ``min(exp(sum_t (old - rollout)), sequence_tis_ratio_clip_high)`` over the tokens those masks kept,
    and the product or geometric sequence mask over the same tokens; ``metrics`` SkyRL's names and values
    (floats). Token TIS is the loss config's (``is_level="token"``, ``policy_loss_config``)."""
    if rollout is None or not correction_enabled(opc):
        return None, {}
    mask = mask.float()
    delta = (old - rollout).float()
    ratio = _safe_exp(delta)
    valid = mask > 0
    metrics = {
        "is_ratio_mean": ((ratio * mask).sum() / mask.sum().clamp(min=1.0)).item(),
        "is_ratio_std": (ratio * mask).std().item(),
        "is_ratio_max": (ratio * mask).max().item(),
        "is_ratio_min": (ratio * mask).min().item(),
    }
    keep = mask.clone()  # SkyRL's loss mask as each step leaves it
    weights = None
    rows = float(mask.shape[0])
    low, high = opc.outlier_token_is_threshold_low, opc.outlier_token_is_threshold_high
    if low is not None or high is not None:
        over = (ratio > high) & valid if high is not None else torch.zeros_like(valid)
        under = (ratio < low) & valid if low is not None else torch.zeros_like(valid)
        seq_ok = ((~over & ~under) | ~valid).all(dim=-1, keepdim=True)
        metrics["outlier_seq_masked_ratio"] = ((~seq_ok).sum() / rows).item()
        metrics["outlier_seq_over_high_ratio"] = (over.any(dim=-1).sum() / rows).item()
        metrics["outlier_seq_under_low_ratio"] = (under.any(dim=-1).sum() / rows).item()
        keep = keep * seq_ok.float()
        weights = keep
    if opc.token_mask_is_threshold_low is not None and opc.token_mask_is_threshold_high is not None:
        in_bounds = (ratio >= opc.token_mask_is_threshold_low) & (ratio <= opc.token_mask_is_threshold_high)
        now_valid = keep > 0
        metrics["token_mask_ratio"] = ((~in_bounds & now_valid).sum() / now_valid.sum().clamp(min=1)).item()
        keep = keep * (in_bounds | ~now_valid).float()
        weights = keep
    if opc.tis_ratio_type == "token":
        capped = (ratio > opc.token_tis_ratio_clip_high) & (keep > 0)
        metrics["tis_token_clip_high_ratio"] = (capped.sum() / (keep > 0).sum().clamp(min=1)).item()
    elif opc.tis_ratio_type == "sequence":  # the product of the kept tokens' ratios, capped above
        seq_ratio = _safe_exp((delta * keep).sum(dim=-1, keepdim=True))
        cap = opc.sequence_tis_ratio_clip_high
        metrics["tis_seq_clip_high_ratio"] = ((seq_ratio > cap).sum() / rows).item()
        weights = keep * seq_ratio.clamp(max=cap)
    if opc.sequence_mask_metric is not None:
        log_seq = (delta * keep).sum(dim=-1, keepdim=True)
        if opc.sequence_mask_metric == "geometric":  # exp of the mean over the kept tokens
            name, lo, hi = "geo_sequence_mask", opc.geo_mask_low, opc.geo_mask_high
            seq_ratio = _safe_exp(log_seq / keep.sum(dim=-1, keepdim=True).clamp(min=1.0))
        else:
            name, lo, hi = "product_sequence_mask", opc.product_mask_low, opc.product_mask_high
            seq_ratio = _safe_exp(log_seq)
        over, under = seq_ratio > hi, seq_ratio < lo
        metrics[f"{name}_masked_ratio"] = ((over | under).sum() / rows).item()
        metrics[f"{name}_over_high_ratio"] = (over.sum() / rows).item()
        metrics[f"{name}_under_low_ratio"] = (under.sum() / rows).item()
        weights = (keep if weights is None else weights) * (~over & ~under).float()
    return weights, metrics


class SkyRLAssertionError(ValueError, AssertionError):
    """A refusal where SkyRL's own loss asserts: an AssertionError as SkyRL's (its callers and tests catch
    that), and a ValueError as every grpo_kernels refusal."""


class _Prepared:
    """One call's grpo_kernels inputs, from SkyRL's (config, tensors)."""

    def __init__(self, skyrl_type, config, old, advantages, loss_mask, rollout, like):
        self.skyrl_type = skyrl_type
        if rollout is None and rollout_anchored(config, skyrl_type):  # SkyRL asserts before anything else
            what = "rollout_is" if skyrl_type == "rollout_is" else "cispo with cispo_anchor='rollout'"
            raise SkyRLAssertionError(f"gk_{skyrl_type}: rollout_logprobs are required for {what}")
        self.cfg = policy_loss_config(config, skyrl_type, with_rollout=rollout is not None)
        if loss_mask is None:
            loss_mask = torch.ones_like(like, dtype=torch.float32)
        binary = bool(((loss_mask == 0) | (loss_mask == 1)).all())
        self.mask = loss_mask != 0
        self.token_weights = None
        if not binary:  # SkyRL's SFT collator pre-scales the mask: a weight of the summed term
            if skyrl_type not in ("cross_entropy", "importance_sampling"):
                raise ValueError(f"gk_{skyrl_type}: loss_mask must be 0 / 1 for this loss (SkyRL's metrics average "
                                 "over it); a weighted mask is supported by cross_entropy and importance_sampling")
            self.token_weights = loss_mask.float()
        self.old = None if skyrl_type == "cross_entropy" else old
        self.advantages = torch.ones_like(like, dtype=torch.float32) if skyrl_type == "cross_entropy" else advantages
        # what the ratio is measured against (old is None where SkyRL skipped the old forward)
        self.anchor = rollout if self.cfg.ratio_anchor == "rollout" else self.old
        self.rollout = rollout if self.cfg.uses_rollout_logprobs else None
        self.is_weights = None
        self.metrics: dict = {}
        if skyrl_type in _CORRECTED:
            opc = config.off_policy_correction
            self.is_weights, self.metrics = off_policy_weights(old, rollout, loss_mask, opc)

    def kwargs(self) -> dict:
        return dict(old_logprobs=self.old, rollout_logprobs=self.rollout, is_weights=self.is_weights,
                    token_weights=self.token_weights)  # fmt: skip

    def skyrl_metrics(self, ours: dict, logprobs: torch.Tensor, clip_bounds=None) -> dict:
        """SkyRL's metric dict (floats) from ours and the detached per-token log-probs."""
        t = self.skyrl_type
        if t in ("regular", "dual_clip", "gspo", "dppo"):  # dppo: the share outside the trust region
            out = {"clip_ratio": ours["clip_ratio/region_mean"].item()}
        elif t == "rollout_is":  # the share outside (1 - eps_clip_low, 1 + eps_clip_high)
            out = {"clip_ratio": ours["clip_ratio/any_mean"].item()}
        elif t == "cispo":
            low, high = 1.0 - self.cfg.clip_low, 1.0 + self.cfg.clip_high
            anchor = logprobs if self.anchor is None else self.anchor
            ratio = _safe_exp(logprobs - anchor.float())
            m = self.mask.float()
            out = {
                "clip_ratio": ours["clip_ratio/any_mean"].item(),
                "cispo/ratio_mean": ours["ratio/mean"].item(),
                "cispo/ratio_clamped_mean": ((ratio.clamp(low, high) * m).sum() / m.sum().clamp(min=1.0)).item(),
                "cispo/ratio_max": ours["ratio/max"].item(),
                "cispo/ratio_min": ours["ratio/min"].item(),
            }
        elif t == "clip_cov":
            out = {"clip_ratio": ours["selection/cov_frac"].item()}
        elif t == "importance_sampling":  # SkyRL's mean weighs the ratio by the (possibly weighted) mask
            w = self.mask.float() if self.token_weights is None else self.token_weights
            out = {"importance_ratio": ((torch.exp(logprobs - self.old.float()) * w).sum() / w.sum()).item()}
        else:  # sapo, kl_cov, cross_entropy report a constant
            out = {"clip_ratio": 0.0}
        out.update(self.metrics)
        return out


# ---- the registered losses -----------------------------------------------------------------------------

_local = threading.local()  # the fused head's result for the micro-batch being trained (mode "fused")


class GKPolicyLoss:
    """SkyRL's policy loss ``skyrl_type`` computed by grpo_kernels, with SkyRL's signature and metrics.

    Picklable by reference (SkyRL ships registered losses to its Ray workers with cloudpickle); unpickling
    installs ``mode`` in the receiving process."""

    def __init__(self, skyrl_type: str, mode: str = "loss", backend: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.skyrl_type, self.mode, self.backend = skyrl_type, mode, backend
        self.__name__ = f"gk_{skyrl_type}"

    def __getstate__(self):
        return {"skyrl_type": self.skyrl_type, "mode": self.mode, "backend": self.backend}

    def __setstate__(self, state):
        self.__init__(**state)
        install(self.mode)

    def __call__(self, log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
        skyrl_type = _type_of(config, self.skyrl_type)
        fused = getattr(_local, "result", None)
        if fused is not None:  # mode "fused": the head computed the whole actor loss in the forward
            _local.result = None
            return fused
        prep = _Prepared(skyrl_type, config, old_log_probs, advantages, loss_mask, rollout_logprobs, log_probs)
        out = gk.grpo_loss(log_probs, prep.advantages, prep.mask, config=prep.cfg, backend=self.backend, **prep.kwargs())
        return out.loss, prep.skyrl_metrics(out.metrics, out.logprobs)


def register_policy_losses(mode: str = "loss", backend: str = "auto") -> list[str]:
    """Register ``gk_<type>`` for SkyRL's policy loss types in ``PolicyLossRegistry`` (idempotent) and
    install ``mode`` in this process ("loss": the losses only; "logprobs": also the FSDP log-prob head;
    "fused": also the fused actor loss). Call it in the driver before SkyRL's ``initialize_ray`` (it syncs
    the registry to the workers, which install the mode when they load a gk_ loss). Returns the names."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    _check_version()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    install(mode)
    for skyrl_type in LOSS_TYPES:
        name = f"gk_{skyrl_type}"
        if name in PolicyLossRegistry._functions:
            PolicyLossRegistry.unregister(name)  # a new mode or backend replaces the old entry
        PolicyLossRegistry.register(name, GKPolicyLoss(skyrl_type, mode, backend))
        if name not in _registered:
            _registered.append(name)
    return list(_registered)


def registered_losses() -> list[str]:
    return list(_registered)


# ---- the FSDP head (modes "logprobs" and "fused") ---------------------------------------------------


class _HeadCall:
    """What one HFModelWrapper.forward call's head needs, and what it computed."""

    def __init__(self, wrapper, sequences, num_actions, attention_mask, temperature, compute_entropy,
                 entropy_requires_grad, fused_request):  # fmt: skip
        self.sequences, self.temperature = sequences, float(temperature)
        self.compute_entropy, self.entropy_requires_grad = compute_entropy, entropy_requires_grad
        self.fused_request = fused_request
        batch, seqlen = sequences.shape
        self.targets = torch.roll(sequences, shifts=-1, dims=1)
        window = torch.zeros(seqlen, dtype=torch.bool, device=sequences.device)
        window[max(seqlen - int(num_actions) - 1, 0) : seqlen - 1] = True  # the positions SkyRL keeps
        self.positions = attention_mask.bool() & window[None, :]
        self.num_actions = int(num_actions)
        self.softcap, self.logit_scale = hf.logit_transform(wrapper.model)  # the shared reader
        self.backend = getattr(wrapper, "_gk_backend", "auto")
        self.logprobs = self.entropy = None

    def head(self, lm_head, hidden):
        """The LM head's forward, inside the model's forward: the log-probs (and the fused loss)."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        batch, seqlen = self.sequences.shape
        if hidden.shape[:2] != (batch, seqlen):
            raise ValueError(f"grpo_kernels' SkyRL head expects [B, S, H] hidden states of the padded batch "
                             f"{(batch, seqlen)}, got {tuple(hidden.shape)}")  # fmt: skip
        if self.fused_request is not None and torch.is_grad_enabled():
            self._fused(hidden, weight, bias)
        else:
            out = gk.fused_linear_logprobs(
                hidden, weight, self.targets, bias, self.temperature, mask=self.positions,
                compute_entropy=self.compute_entropy, softcap=self.softcap, logit_scale=self.logit_scale,
                backend=self.backend,
            )  # fmt: skip
            self.logprobs, self.entropy = out.logprobs, out.entropy
        return hidden.new_zeros(batch, seqlen, 1)  # what SkyRL divides by T in place and never reads

    def _fused(self, hidden, weight, bias):
        request = self.fused_request
        algorithm, exp, a = request["algorithm"], request["experience"], self.num_actions
        prep = _Prepared(request["skyrl_type"], algorithm, exp.action_log_probs, exp.advantages, exp.loss_mask,
                         exp.rollout_logprobs, exp.advantages)  # fmt: skip
        dp, weight_mb = int(request["dp_size"]), float(request["microbatch_weight"])
        rows = exp.advantages.shape[0]
        valid = float(prep.mask.sum().clamp(min=1))
        cfg = prep.cfg.replace(temperature=self.temperature)
        ref = None
        if algorithm.use_kl_loss:
            if algorithm.kl_estimator_type not in _KL:
                raise ValueError(f"kl_estimator_type={algorithm.kl_estimator_type!r}: SkyRL's are {tuple(_KL)}")
            cfg = cfg.replace(kl_coef=float(algorithm.kl_loss_coef), kl_estimator=_KL[algorithm.kl_estimator_type],
                              kl_agg_mode="seq-mean-token-mean")  # fmt: skip
            ref = exp.base_action_log_probs
        if algorithm.use_entropy_loss:
            cfg = cfg.replace(entropy_coef=float(algorithm.entropy_loss_coef), entropy_agg_mode="token-mean")
        # SkyRL: loss = policy_sum * dp + (kl_coef KL - ent_coef H) * microbatch_weight, KL a mean over the
        # micro-batch's rows of per-row token means, H a token mean over the micro-batch: the normalizers
        # that give those weights with dp_size = dp
        out = gk.fused_linear_grpo_loss(
            hidden[:, -a - 1 : -1], weight, self.sequences[:, -a:], prep.advantages, prep.mask, ref_logprobs=ref,
            bias=bias, config=cfg, num_tokens=valid * dp / weight_mb, num_sequences=rows * dp / weight_mb,
            dp_size=dp, softcap=self.softcap, logit_scale=self.logit_scale, backend=self.backend, **prep.kwargs(),
        )  # fmt: skip
        batch, seqlen = self.sequences.shape
        self.logprobs = hidden.new_zeros(batch, seqlen, dtype=torch.float32)
        self.logprobs[:, -a - 1 : -1] = out.logprobs
        self.entropy = torch.zeros_like(self.logprobs)
        if out.entropy is not None:
            self.entropy[:, -a - 1 : -1] = out.entropy
        policy = out.metrics["policy_loss"] / dp  # SkyRL's policy_loss value (its sum); the gradient: all terms
        loss = (out.loss - out.loss.detach()) / dp + policy
        request["result"] = (loss, prep.skyrl_metrics(out.metrics, out.logprobs))

    def entropy_fn(self, logits, requires_grad=False, attention_mask=None, chunk_size=1024):
        entropy = self.entropy
        return entropy if requires_grad and entropy.requires_grad else entropy.detach()


def _current_call():
    return getattr(_local, "head_call", None)


def _install_logprobs() -> None:
    from skyrl.backends.skyrl_train.workers import model_wrapper

    if getattr(model_wrapper.HFModelWrapper.forward, "_grpo_kernels", False):
        return
    original_forward = model_wrapper.HFModelWrapper.forward
    original_logprobs = model_wrapper.logprobs_from_logits

    def forward(self, sequences, num_actions, attention_mask=None, temperature=1.0, return_output=False,
                compute_entropy=False, entropy_requires_grad=True, **kwargs):  # fmt: skip
        refused = []
        if self.sequence_parallel_size > 1:
            refused.append(f"sequence_parallel_size={self.sequence_parallel_size}")
        if self.remove_microbatch_padding:
            refused.append("use_sample_packing (remove_microbatch_padding)")
        if kwargs.get("enable_sample_support_replay"):
            refused.append("algorithm.enable_sample_support_replay (it scores the sampler's support on the logits)")
        if not isinstance(num_actions, int):
            refused.append(f"num_actions={num_actions!r} (a list)")
        if refused:
            raise ValueError("grpo_kernels' SkyRL head (modes 'logprobs' / 'fused') does not support: "
                             + "; ".join(refused) + ". Use mode='loss' (SkyRL's own head).")  # fmt: skip
        request = getattr(_local, "fused_request", None)
        call = _HeadCall(self, sequences, num_actions, attention_mask, temperature, compute_entropy,
                         entropy_requires_grad, request)  # fmt: skip
        lm_head = self.model.get_output_embeddings()
        saved_forward = lm_head.__dict__.get("forward")  # an instance-level forward, if something set one
        saved_entropy_fn = self.chunked_entropy_from_logits_fn
        _local.head_call = call
        lm_head.forward = lambda hidden: call.head(lm_head, hidden)
        self.chunked_entropy_from_logits_fn = call.entropy_fn
        try:
            result = original_forward(self, sequences, num_actions, attention_mask, temperature, return_output,
                                      compute_entropy, entropy_requires_grad, **kwargs)  # fmt: skip
        finally:
            if saved_forward is None:
                del lm_head.forward  # back to the class's forward
            else:
                lm_head.forward = saved_forward
            self.chunked_entropy_from_logits_fn = saved_entropy_fn
            _local.head_call = None
        if call.logprobs is None:
            raise RuntimeError("grpo_kernels' SkyRL head was installed but the model's forward never called its "
                               "LM head (get_output_embeddings()): nothing else may replace that module's forward")
        if request is not None and "result" in request:
            _local.result = request.pop("result")
        return result

    def logprobs_from_logits(logits, labels, inplace_backward=True):
        call = _current_call()
        if call is None:
            return original_logprobs(logits, labels, inplace_backward=inplace_backward)
        return call.logprobs

    forward._grpo_kernels = True
    _originals[(model_wrapper.HFModelWrapper, "forward")] = original_forward
    _originals[(model_wrapper, "logprobs_from_logits")] = original_logprobs
    model_wrapper.HFModelWrapper.forward = forward
    model_wrapper.logprobs_from_logits = logprobs_from_logits


def _install_fused() -> None:
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers import worker

    base = worker.PolicyWorkerBase
    if getattr(base._forward_backward_micro, "_grpo_kernels", False):
        return
    original = base._forward_backward_micro

    def _forward_backward_micro(self, experience, microbatch_weight, loss_fn=None, loss_fn_config=None, **kwargs):
        fn = self.policy_loss_fn if loss_fn is None else PolicyLossRegistry.get(loss_fn)
        ours = isinstance(fn, GKPolicyLoss)
        if not ours or loss_fn_config or fn.skyrl_type == "cross_entropy":
            return original(self, experience, microbatch_weight, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                            **kwargs)  # fmt: skip
        _local.fused_request = dict(
            skyrl_type=_type_of(self.cfg.algorithm, fn.skyrl_type), algorithm=self.cfg.algorithm,
            experience=experience, dp_size=self.mesh_rank.dp_size, microbatch_weight=microbatch_weight,
        )  # fmt: skip
        _local.result = None
        try:
            return original(self, experience, microbatch_weight, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                            **kwargs)  # fmt: skip
        finally:
            _local.fused_request = None
            _local.result = None

    _forward_backward_micro._grpo_kernels = True
    _originals[(base, "_forward_backward_micro")] = original
    base._forward_backward_micro = _forward_backward_micro


def uninstall() -> None:
    """Put SkyRL's own head and worker functions back in this process (the registered losses stay)."""
    for (owner, attribute), function in _originals.items():
        setattr(owner, attribute, function)
    _originals.clear()
    _installed.clear()


def install(mode: str) -> None:
    """Install ``mode`` in this process (idempotent): "loss" nothing, "logprobs" the FSDP head,
    "fused" the head and the fused actor loss."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode in ("logprobs", "fused") and "logprobs" not in _installed:
        _install_logprobs()
        _installed.add("logprobs")
    if mode == "fused" and "fused" not in _installed:
        _install_fused()
        _installed.add("fused")
