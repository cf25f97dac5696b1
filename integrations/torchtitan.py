"""torchtitan 0.3.0 RL adapter: the policy loss from the hidden states and the LM head, by grpo_kernels.

torchtitan's RL trainer (``torchtitan.experiments.rl``, ``PolicyTrainer``) builds its loss from
``PolicyTrainer.Config.loss``; when the built loss is a ``ChunkedLossWrapper`` it hands it the model's
LM head (``set_lm_head``) and runs the model with ``_skip_lm_head = True``, so the loss receives the last
hidden states: exactly ``grpo_kernels.fused_linear_grpo_loss``'s inputs. ``GRPOKernelsLoss`` is such a
subclass with a config of its own::

    from grpo_kernels.integrations.torchtitan import GRPOKernelsLoss
    config.loss = GRPOKernelsLoss.Config(ratio_clip_low=0.2, ratio_clip_high=0.28)   # DAPOLoss's fields

It computes torchtitan's ``DAPOLoss`` (``GRPOLoss`` is DAPO with one symmetric clip): the per-token PPO
clip of the ratio to the generator's (vLLM's) log-probs, log-ratio clamped at +-10, tokens with a
non-finite generator log-prob dropped, the token sum divided by ``global_valid_tokens``, and
torchtitan's metric names, pre-normalised for its SUM reduction across ranks. Mode "fused" (default):
one ``fused_linear_grpo_loss`` call, gradients inside the forward, no ``[B, L, V]`` logits and no
per-chunk backward loop; mode "logprobs": ``fused_linear_logprobs`` then ``grpo_loss`` (an autograd graph
through the log-probs). torchtitan's own ``ChunkedLossWrapper`` materialises ``[B, L / num_chunks, V]``
logits per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import grpo_kernels as gk
from grpo_kernels import hf

SUPPORTED_TORCHTITAN = "0.3.0"
MODES = ("fused", "logprobs")
MAX_LOG_RATIO = 10.0  # torchtitan DAPOLoss's clamp of the log-ratio
IGNORE_INDEX = -100


def _check_version() -> None:
    hf.require_version("torchtitan", "torchtitan", SUPPORTED_TORCHTITAN, hf.installed_version("torchtitan"),
                       install=f"torchtitan=={SUPPORTED_TORCHTITAN}", otherwise="use torchtitan's own loss")  # fmt: skip


def policy_loss_config(ratio_clip_low: float, ratio_clip_high: float) -> gk.PolicyLossConfig:
    """torchtitan DAPOLoss -> PolicyLossConfig: PPO clip [1 - low, 1 + high], log-ratio clamp 10, a token mean
    over ``global_valid_tokens`` (passed as num_tokens)."""
    return gk.PolicyLossConfig(loss_type="ppo_clip", clip_low=float(ratio_clip_low), clip_high=float(ratio_clip_high),
                               log_ratio_clamp=MAX_LOG_RATIO, loss_agg_mode="token-mean")  # fmt: skip


def dapo_metrics(logprobs, generator_logprobs, mask, entropy, loss, denominator, cfg) -> dict:
    """torchtitan DAPOLoss's metrics (its names; sums divided by global_valid_tokens) from the detached
    per-token log-probs and entropies."""
    with torch.no_grad():
        m = mask.float()
        diff = torch.where(mask, logprobs - generator_logprobs, torch.zeros_like(logprobs))
        ratio = torch.exp(diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        return {
            "loss/mean": loss.detach(),
            "loss/ratio_mean": (ratio * m).sum() / denominator,
            "loss/ratio_clipped_frac": (((ratio - clipped).abs() > 1e-6).float() * m).sum() / denominator,
            "bit_wise/logprob_diff/mean": diff.sum() / denominator,
            "bit_wise/ratio_tokens_different/mean": ((diff.abs() > 1e-6).float() * m).sum() / denominator,
            "bit_wise/logprob_diff/max": diff.abs().max(),
            "trainer/entropy/mean": (entropy * m).sum() / denominator,
        }


def _base_classes():
    from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper

    return BaseLoss, ChunkedLossWrapper


def _build_class():
    BaseLoss, ChunkedLossWrapper = _base_classes()

    class GRPOKernelsLoss(ChunkedLossWrapper):
        """torchtitan's DAPO / GRPO policy loss on the hidden states and the LM head, by grpo_kernels.

        A ``ChunkedLossWrapper`` for torchtitan's trainer (which then hands it the LM head and hidden states)
        that does not chunk: grpo_kernels tiles the tokens and the vocabulary itself."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseLoss.Config):
            ratio_clip_low: float = 0.2
            """Lower clip: the ratio is clamped to >= 1 - ratio_clip_low (DAPOLoss's field)."""
            ratio_clip_high: float = 0.2
            """Upper clip: <= 1 + ratio_clip_high (DAPOLoss's field; 0.28 for DAPO's clip-higher)."""
            mode: str = "fused"
            """"fused" (fused_linear_grpo_loss) or "logprobs" (fused_linear_logprobs, then grpo_loss)."""
            backend: str = "auto"
            """grpo_kernels backend: "auto" (Triton on CUDA), "triton" or "torch"."""

        def __init__(self, config: Config, *, compile_config=None):
            del compile_config  # the kernels are compiled ahead of time; nothing here for torch.compile
            _check_version()
            if config.mode not in MODES:
                raise ValueError(f"GRPOKernelsLoss.Config.mode must be one of {MODES}, got {config.mode!r}")
            self.config = config
            self.policy_config = policy_loss_config(config.ratio_clip_low, config.ratio_clip_high)
            self.num_chunks = 1
            self.loss_fn = None
            self.lm_head = None

        def __call__(self, pred, labels, global_valid_tokens=None, *, generator_logprobs, advantages, loss_mask):
            """pred: [B, L, H] hidden states (the model run with _skip_lm_head); labels: [B, L] pre-shifted ids;
            generator_logprobs, advantages: [B, L]; loss_mask: [B, L] bool. Returns (loss, metrics) as DAPOLoss."""
            lm_head = self.lm_head
            if lm_head is None:
                raise ValueError("GRPOKernelsLoss: call set_lm_head(model.lm_head) first (torchtitan's trainer does)")
            if pred.dim() != 3 or pred.shape[:2] != labels.shape or pred.shape[-1] != lm_head.weight.shape[-1]:
                raise ValueError(f"GRPOKernelsLoss: pred must be the [B, L, H] hidden states of labels {tuple(labels.shape)} "
                                 f"(run the model with _skip_lm_head = True), got {tuple(pred.shape)}")  # fmt: skip
            mask = loss_mask.bool() & torch.isfinite(generator_logprobs)  # DAPOLoss drops non-finite generator tokens
            generator = torch.where(mask, generator_logprobs, torch.zeros_like(generator_logprobs)).float()
            targets = torch.where(mask, labels, torch.zeros_like(labels))
            denominator = max(float(global_valid_tokens), 1.0) if global_valid_tokens is not None else 1.0
            weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
            common = dict(num_tokens=denominator, config=self.policy_config, backend=self.config.backend)
            if self.config.mode == "fused":
                out = gk.fused_linear_grpo_loss(pred, weight, targets, advantages.float(), mask, generator, bias=bias,
                                                **common)  # fmt: skip
                logprobs, entropy = out.logprobs, out.entropy
                if entropy is None:  # reported as a metric only (as DAPOLoss: under no_grad)
                    with torch.no_grad():
                        entropy = gk.fused_linear_logprobs(pred, weight, targets, bias, mask=mask,
                                                           backend=self.config.backend).entropy  # fmt: skip
            else:
                lp = gk.fused_linear_logprobs(pred, weight, targets, bias, mask=mask, backend=self.config.backend)
                out = gk.grpo_loss(lp.logprobs, advantages.float(), mask, generator, **common)
                logprobs, entropy = lp.logprobs.detach(), lp.entropy.detach()
            return out.loss, dapo_metrics(logprobs, generator, mask, entropy, out.loss, denominator, self.policy_config)

    return GRPOKernelsLoss


# torchtitan is imported when the class is first used, not with this module
__getattr__ = hf.lazy_class(__name__, "GRPOKernelsLoss", _build_class)
