"""TRL adapter: `GRPOKernelsTrainer`, a `trl.GRPOTrainer` whose LM head, or whole loss, runs on grpo_kernels.

    from grpo_kernels.integrations.trl import GRPOKernelsTrainer as GRPOTrainer   # the one line

Supported TRL: exactly 1.16.0 (SUPPORTED_TRL; the parity tests run against it). Any other version is
refused when the trainer class is first used: the seams below and the loss semantics move between
releases (the fused LM head arrived in 1.15 with a new signature; loss types, defaults and
normalizers keep changing).

Two modes (`grpo_kernels_mode=`):

* "fused" (default): the whole policy loss is `grpo_kernels.fused_linear_grpo_loss`, from the last
  hidden states to the scalar loss in one call (LM-head statistics, ratio, clipping, KL, IS
  correction, masks, aggregation, entropy bonus; gradients computed in the forward), reproducing
  `GRPOTrainer._compute_loss` of TRL 1.16.0: same loss, gradients and `self._metrics` entries. The
  mapping from TRL's settings is `policy_loss_config`, `loss_normalizers` and `log_trl_metrics`
  below; tests/test_parity_trl.py proves it against TRL's own `_compute_loss`. Settings it cannot
  reproduce are refused when the trainer is built (`unsupported_settings`), naming the field.
* "logprobs": TRL's loss code runs untouched; only the per-token log-probs and entropies of the
  policy, old-policy and reference passes come from `grpo_kernels.fused_linear_logprobs` instead of
  TRL's `ChunkedLogProbFunction`. Every loss setting TRL has is honoured, because TRL computes it.

The seam (both modes). TRL 1.16 patches the model's forward with `add_fused_lm_head`; called with
`fused_lm_head=True` that forward runs the backbone, drops the positions labelled -100, gathers the
LM-head weight (`weight.full_tensor()` for an FSDP2 DTensor, `maybe_gather_lm_head_ctx` for ZeRO-3)
and calls the module global `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias,
targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`, looked up at call
time. Every log-prob pass goes through `GRPOTrainer._get_per_token_logps_and_entropies`; this
trainer overrides that method to put a grpo_kernels head in place of the global for the duration
of the call (and restores it: other trainers in the process are not affected), so that backbone,
label masking, PEFT, FSDP2 / ZeRO-3 gathering, autocast, `cast_lm_head_to_fp32` and the MoE aux
loss all stay TRL's code. In "fused" mode the head receives, besides the hidden states, the
per-token loss inputs of the micro-batch, computes the fused loss inside the model's forward (where
FSDP / ZeRO-3 hooks are armed) and passes its gradient out through the forward's own log-prob
output. A forward that does not reach the grpo_kernels head (something else replaced the model's
forward) is an error, never a silent fallback to TRL's kernel.

The logit transform: TRL computes z = softcap tanh(scale x / softcap) / T with x = hidden W^T + b and
passes the final_logit_softcapping and logit_scale it reads from the config by attribute name; the heads
apply instead the transform of the model the pass runs, `grpo_kernels.hf.logit_transform` (per
architecture: the same values for Gemma 2 / 3, Granite, Cohere, HyperCLOVA X; the model's own where TRL's
reading misses or misapplies one), as grpo_kernels' `softcap` / `logit_scale`, the same formula in the
kernels' epilogue.

Distributed: the LM-head weight arrives gathered (TRL's forward does it). In "logprobs" mode the
backward re-enters `maybe_gather_lm_head_ctx` before recomputing (as TRL's kernel does); "fused"
mode computes its gradients inside the forward. Metrics are reduced across processes exactly as
TRL does (token-weighted global means, gathered min / max). Tested in one process, ZeRO-3 included (both
modes, DeepSpeed's CPU accelerator); the FSDP2 and multi-process paths follow TRL's code but are not
exercised by the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch

import grpo_kernels as gk
from grpo_kernels import hf

logger = logging.getLogger("grpo_kernels")

SUPPORTED_TRL = "1.16.0"
MODES = ("fused", "logprobs")

# TRL loss_type -> the aggregation it performs (verl's names; see _compute_loss of TRL 1.16.0): grpo_kernels.hf's
LOSS_AGG_MODE = hf.TRL_LOSS_AGG_MODE
TRL_LOSS_TYPES = tuple(LOSS_AGG_MODE)
CLIP_LOSS_TYPES = hf.TRL_CLIP_LOSS_TYPES
# loss types TRL divides by current_gradient_accumulation_steps after logging `policy_loss`
DIVIDED_BY_GA_AFTER_LOGGING = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
# inputs of vision-language models (TRL's _compute_loss passes these to the forward)
MULTIMODAL_INPUTS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
# TRL leaves the upper IS bound open when vllm_importance_sampling_clip_max is None; ours is finite
_OPEN_UPPER_BOUND = float(torch.finfo(torch.float32).max)


# ---------------------------------------------------------------------------------------------------
# TRL settings -> grpo_kernels. These read the attributes GRPOTrainer._compute_loss reads, so they
# work on a GRPOTrainer and on the stand-in of tests/test_parity_trl.py alike. No TRL import.
# ---------------------------------------------------------------------------------------------------


def policy_loss_config(trainer, *, temperature: float = 1.0) -> gk.PolicyLossConfig:
    """The PolicyLossConfig that computes `trainer._compute_loss`'s loss (TRL 1.16.0).

    grpo / bnpo / dr_grpo / dapo / luspo -> ppo_clip (clip_low = epsilon, clip_high = epsilon_high,
    delta); cispo -> cispo with TRL's absolute cap epsilon_high; sapo, vespo -> the same names;
    importance_sampling_level -> ratio_level; no log-ratio clamp (TRL has none); beta -> kl_coef with
    the unclamped k3; use_bias_correction_kl -> kl_ratio_correction; entropy_coef -> a token mean over
    the micro-batch / GA ("token-mean-local"); vllm_importance_sampling_{mode, clip_min, clip_max}
    -> is_level, is_mode, is_min, is_max (when use_vllm and the correction are on); use_adaptive_entropy
    -> this step's coefficient of TRL's controller (its current value, or 0 while the last window's
    entropy is above entropy_target; the controller itself: update_adaptive_entropy). `temperature` is
    the trainer's sampling temperature (the config's, so that log-probs match the sampler)."""
    args = trainer.args
    loss_type = trainer.loss_type
    fields = hf.trl_family_loss_fields(
        loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=args.delta,
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, max_completion_length=trainer.max_completion_length,
    )  # fmt: skip
    fields.update(
        ratio_level=trainer.importance_sampling_level,
        log_ratio_clamp=None,
        kl_coef=float(trainer.beta),
        kl_estimator="k3",
        kl_ratio_correction=bool(args.use_bias_correction_kl),
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        top_entropy_quantile=float(trainer.top_entropy_quantile),
        temperature=float(temperature),
    )
    if trainer._entropy_bonus_enabled:
        coef = float(trainer.entropy_coef)
        if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
            coef = 0.0  # TRL's gate: the bonus acts while the last window's entropy is at or under the target
        fields.update(entropy_coef=coef, entropy_agg_mode="token-mean-local")
    if vllm_is_correction_on(trainer):
        level, _, how = trainer.vllm_importance_sampling_mode.partition("_")
        clip_max = trainer.vllm_importance_sampling_clip_max
        fields.update(is_level=level, is_mode=how, is_min=trainer.vllm_importance_sampling_clip_min,
                      is_max=_OPEN_UPPER_BOUND if clip_max is None else float(clip_max))  # fmt: skip
    return gk.PolicyLossConfig(**fields)


def vllm_is_correction_on(trainer) -> bool:
    """TRL multiplies the loss by (or, for vespo, folds into phi) the vLLM importance ratio."""
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def loss_normalizers(trainer, batch_size: int, num_items_in_batch) -> dict:
    """The normalizer keywords of grpo_kernels' loss functions that reproduce TRL's division.

    GA = current_gradient_accumulation_steps in train mode, 1 in eval.
      grpo, sapo, dr_grpo, luspo: num_sequences = B GA (B = the micro-batch's rows, empty ones included)
      bnpo: the local token count, times GA
      dapo, cispo, vespo: num_tokens = max(num_items_in_batch, 1) GA / steps_per_generation (train;
        eval: max(num_items_in_batch, 1)), dp_size = num_processes
      entropy bonus: grad_accum_steps = GA (a local token mean / GA).
      top_entropy_quantile < 1 with several processes: entropy_group = the default process group.
    `trainer` is the GRPOTrainer, `batch_size` the micro-batch's rows, `num_items_in_batch` TRL's count."""
    training = trainer.model.training
    ga = trainer.current_gradient_accumulation_steps if training else 1
    # TRL takes the top-entropy quantile over every process's tokens (get_high_entropy_mask gathers them):
    # accelerate's processes are torch.distributed's default group
    group = {}
    if trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1:
        import torch.distributed as dist

        group = dict(entropy_group=dist.group.WORLD)
    normalizers = hf.trl_family_normalizers(
        trainer.loss_type, batch_size, num_items_in_batch, training=training, grad_accum_steps=ga,
        steps_per_generation=trainer.args.steps_per_generation, num_processes=trainer.accelerator.num_processes,
    )  # fmt: skip
    return dict(normalizers, **group)


def log_trl_metrics(
    trainer, metrics: dict | None, mask: torch.Tensor, aux_loss: torch.Tensor | None = None
) -> None:
    """Append to `trainer._metrics[mode]` what TRL 1.16's `_compute_loss` logs, from our metrics of
    this micro-batch (`metrics=None`: the micro-batch had no scored row), reduced across processes
    as TRL reduces them: token-weighted global means (`accelerator.reduce`), gathered nanmin / nanmax,
    gathered nanmean of the policy loss.

    Where TRL counts differently: at importance_sampling_level="sequence" TRL averages the (B, 1)
    clip indicators over all B rows, all-masked rows included (ratio exp(0) = 1: never clipped), and
    its per-row min takes their 0; ours average over non-empty sequences. vespo/phi_seq_mean likewise
    counts all-masked rows, whose phi(1) = 1. `mask` is the micro-batch's completion mask (the token
    weights of the means); `aux_loss` an MoE router loss TRL adds and logs, when the model has one."""
    mode = "train" if trainer.model.training else "eval"
    log = trainer._metrics[mode]
    accelerator = trainer.accelerator
    device = mask.device
    m = mask.float()
    rows = float(mask.shape[0])
    tokens = m.sum()
    nonempty = (m.sum(-1) > 0).float().sum()
    sequence_level = trainer.importance_sampling_level == "sequence"
    metrics = metrics or {}

    def ours(name, default=0.0):
        value = metrics.get(name)
        return torch.tensor(default, device=device) if value is None else value.float().to(device)

    def global_mean(local_sum, local_count):
        totals = accelerator.reduce(torch.stack([local_sum.float(), local_count.float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def token_mean(name):
        return global_mean(ours(name) * tokens, tokens)

    def row_mean(name, empty_row_value):  # a (B, 1) tensor in TRL: every row counts
        total = ours(name) * nonempty + empty_row_value * (rows - nonempty)
        return global_mean(total, torch.tensor(rows, device=device))

    def extreme(name, pick, empty_row_value):  # nanmin / nanmax over the gathered per-row values
        local = ours(name, default=float("nan")).reshape(1)
        if nonempty == 0:  # grpo_kernels gives an all-masked micro-batch defined extremes; TRL's nanmin /
            local = local.new_tensor([float("nan")])  # nanmax skip it: so must the logged value
        if sequence_level and nonempty < rows:  # TRL's all-masked rows hold their own value
            local = _nan_reduce(torch.cat([local, local.new_tensor([empty_row_value])]), pick).reshape(1)
        return _nan_reduce(accelerator.gather(local), pick).item()

    if trainer._entropy_bonus_enabled:
        # TRL: the loss before the bonus (beta * KL included), before its division by GA
        policy_loss = ours("policy_loss") + float(trainer.beta) * ours("kl_loss")
        if mode == "train" and trainer.loss_type in DIVIDED_BY_GA_AFTER_LOGGING:
            policy_loss = policy_loss * trainer.current_gradient_accumulation_steps
        log["policy_loss"].append(accelerator.gather(policy_loss.reshape(1)).nanmean().item())
        if mode == "train" and accelerator.sync_gradients:
            log["entropy_coef"].append(trainer.entropy_coef)
    if aux_loss is not None:
        log["aux_loss"].append(accelerator.gather_for_metrics(aux_loss).mean().item())
    if trainer.beta != 0.0:
        log["kl"].append(token_mean("kl"))
    log["entropy"].append(token_mean("entropy"))
    clip_mean = (lambda name: row_mean(name, 0.0)) if sequence_level else token_mean
    if trainer.loss_type in CLIP_LOSS_TYPES:
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            log[name].append(clip_mean(name))
        log["clip_ratio/low_min"].append(extreme("clip_ratio/low_min", torch.min, 0.0))
        log["clip_ratio/high_max"].append(extreme("clip_ratio/high_max", torch.max, 0.0))
    elif trainer.loss_type == "cispo":  # the absolute cap: ratio > epsilon_high and A > 0
        log["cispo_clip_ratio"].append(clip_mean("clip_ratio/high_mean"))
    elif trainer.loss_type == "vespo":
        log["vespo/phi_seq_mean"].append(row_mean("vespo/phi_seq_mean", 1.0))


def _nan_reduce(x: torch.Tensor, pick) -> torch.Tensor:
    """TRL's nanmin / nanmax (trl.trainer.utils): NaN only when every value is NaN."""
    finite = x[~torch.isnan(x)]
    return pick(finite) if finite.numel() else x.new_tensor(float("nan"))


def unsupported_settings(trainer, mode: str) -> list[str]:
    """What `GRPOKernelsTrainer` in `mode` cannot reproduce for this trainer, one line per field.

    `trainer` is the GRPOTrainer being built, `mode` "fused" (the whole loss) or "logprobs" (the LM
    head only). Empty: everything is honoured. Checked when the trainer is built; a non-empty list
    refuses the configuration with these lines as the message."""
    problems = []
    args = trainer.args
    for role, model in (("model", trainer.model), ("ref_model", getattr(trainer, "ref_model", None))):
        if model is None:
            continue
        try:
            hf.logit_transform(model)  # the shared reader: what the heads apply (model_transform)
        except ValueError as exc:
            problems.append(f"{role}: {exc}")
    if mode == "logprobs":
        return problems
    hint = "; grpo_kernels_mode='logprobs' keeps TRL's loss and supports it"
    if trainer.loss_type not in LOSS_AGG_MODE:
        problems.append(f"loss_type={trainer.loss_type!r}: the fused loss knows {TRL_LOSS_TYPES}{hint}")
        return problems
    if not problems:
        try:
            policy_loss_config(trainer)
        except ValueError as exc:  # a GRPOConfig value TRL accepts but no PolicyLossConfig can express
            settings = (
                f"loss_type={trainer.loss_type!r}, epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, "
                f"delta={args.delta}, entropy_coef={args.entropy_coef}"
            )
            problems.append(f"{exc} (from GRPOConfig: {settings}){hint}")
    return problems


def update_adaptive_entropy(trainer, entropies: torch.Tensor, mask: torch.Tensor) -> None:
    """TRL 1.16's adaptive entropy controller, one training micro-batch (fused mode).

    `entropies` [B, T] per-token entropy of the completions (0 where not scored), `mask` [B, T] the loss
    mask. As TRL: the window's entropy sum and token count accumulate over the micro-batches of the
    optimizer step (over the top-entropy tokens when top_entropy_quantile < 1); at the step boundary they
    are summed over processes, and the coefficient moves by entropy_coef_delta toward more bonus when the
    window's mean entropy is at or under entropy_target, toward less otherwise, within
    [entropy_coef_min, entropy_coef_max]; the next step's loss uses it (policy_loss_config)."""
    args = trainer.args
    effective = mask
    if trainer.top_entropy_quantile < 1.0:
        effective = mask * trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if trainer.accelerator.sync_gradients:
        totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        if world_entropy <= args.entropy_target:
            trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        trainer._last_world_entropy = world_entropy
        trainer._entropy_window_stats = None


def _is_prompt_learning(model) -> bool:
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict):
        return False
    return any(getattr(c, "is_prompt_learning", False) for c in peft_config.values())


# ---------------------------------------------------------------------------------------------------
# The heads that stand in for trl.trainer.utils._ChunkedLogProbFunction
# ---------------------------------------------------------------------------------------------------


def _cast(x, dtype):
    return None if x is None else x.to(dtype)


def _connected_empty(hidden, weight, bias) -> torch.Tensor:
    """A [0] fp32 tensor in the graph of hidden, weight and bias (zero gradients): what an
    all-masked micro-batch returns, so that backward reaches every parameter as with TRL's kernel."""
    zero = hidden.sum() * 0 + weight.sum() * 0 + (0 if bias is None else bias.sum() * 0)
    return hidden.new_zeros(0, dtype=torch.float32) + zero.float()


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the adapter calls grpo_kernels: the backend, and the batch-invariant mode (each token's log-prob
    bitwise independent of the micro-batch it is scored in: the old-policy and training passes then
    give ratio exactly 1 on-policy, whatever their batch sizes)."""

    backend: str = "auto"  # grpo_kernels backend: "auto", "triton" or "torch"
    batch_invariant: bool = False  # see fused_linear_logprobs(batch_invariant=)
    softcap: float | None = None  # the call's soft cap
    logit_scale: float = 1.0  # the call's logit scale
    # When set (grpo_kernels.hf.logit_transform of the model the pass runs), what the kernels apply whatever TRL
    # passes: TRL reads configs by attribute name, so it misses RecurrentGemma's and xLSTM's caps and applies a
    # cap or scale that PaliGemma, Gemma 3's vision-language model and MPT configs carry but never apply.
    model_transform: hf.LogitTransform | None = None  # the transform of the model's own forward

    def kwargs(self) -> dict:
        return {"backend": self.backend, "batch_invariant": self.batch_invariant, "softcap": self.softcap,
                "logit_scale": self.logit_scale}  # fmt: skip

    def with_transform(self, final_logit_softcapping, logit_scale) -> "KernelOptions":
        """The options of one kernel call: the logit transform z = c tanh(s x / c) / T, as grpo_kernels'
        softcap / logit_scale (the temperature stays T): the model's own (`model_transform`) when known, else
        the one TRL passes."""
        if self.model_transform is not None:
            return dataclasses.replace(self, softcap=self.model_transform.softcap,
                                       logit_scale=self.model_transform.logit_scale)  # fmt: skip
        if not (math.isfinite(logit_scale) and logit_scale > 0):
            raise ValueError(f"logit_scale must be finite and > 0 for grpo_kernels, got {logit_scale}")
        cap = None if final_logit_softcapping is None else float(final_logit_softcapping)
        return dataclasses.replace(self, softcap=cap, logit_scale=float(logit_scale))


def _options(options) -> KernelOptions:
    return options if isinstance(options, KernelOptions) else KernelOptions(backend=options)


def _logprobs(hidden, weight, bias, targets, temperature, compute_entropy, options) -> gk.LogProbsOutput:
    """fused_linear_logprobs in TRL's compute dtype, outside autocast (which would otherwise run
    grpo_kernels' fp32-accumulating tiles in half precision)."""
    dtype = hf.compute_dtype(hidden)  # TRL's rule: autocast's, else the hidden states'
    with torch.autocast(hidden.device.type, enabled=False):
        return gk.fused_linear_logprobs(
            hidden.to(dtype), weight.to(dtype), targets, _cast(bias, dtype), temperature,
            compute_entropy=compute_entropy, **_options(options).kwargs(),
        )  # fmt: skip


class _LogProbsWithGatheredBackward(torch.autograd.Function):
    """grpo_kernels.fused_linear_logprobs whose backward runs inside trl's maybe_gather_lm_head_ctx,
    as TRL's ChunkedLogProbFunction does: under ZeRO-3 the LM-head weight is gathered again before
    the logits are recomputed. The forward builds grpo_kernels' graph on the weight itself (not a
    copy), and the backward differentiates that graph inside the gather."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, options):
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        hidden_leaf = hidden.detach().requires_grad_(hidden.requires_grad)
        with torch.enable_grad():
            out = _logprobs(hidden_leaf, weight, bias, targets, temperature, compute_entropy, options)
        ctx.graph_outputs = (out.logprobs, out.entropy)
        ctx.hidden_leaf, ctx.weight, ctx.bias = hidden_leaf, weight, bias
        ctx.gather = maybe_gather_lm_head_ctx
        ctx.set_materialize_grads(False)
        entropy = None if out.entropy is None else out.entropy.detach()
        return out.logprobs.detach(), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        outputs = [(o, g) for o, g in zip(ctx.graph_outputs, (grad_logprobs, grad_entropy), strict=True)
                   if o is not None and g is not None]  # fmt: skip
        inputs = [(i, t) for i, t in enumerate((ctx.hidden_leaf, ctx.weight, ctx.bias))
                  if t is not None and t.requires_grad]  # fmt: skip
        grads = [None, None, None]
        if outputs and inputs:
            with ctx.gather(ctx.weight, ctx.bias):
                grad_outputs = [g for _, g in outputs]
                computed = torch.autograd.grad(
                    [o for o, _ in outputs], [t for _, t in inputs], grad_outputs, allow_unused=True
                )
            for (i, _), g in zip(inputs, computed, strict=True):
                grads[i] = g
        ctx.graph_outputs = None
        return grads[0], grads[1], grads[2], None, None, None, None


class LogProbsHead:
    """Stands in for trl.kernels.ChunkedLogProbFunction (same `apply` arguments, same 5 outputs:
    log-probs, entropy or None, and None for the statistics GRPO does not request)."""

    def __init__(self, options: KernelOptions | str = "auto"):
        self.options = _options(options)  # a backend name is accepted too
        self.calls = 0

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):  # fmt: skip
        unsupported = set(outputs) - {"log_probs", "entropy"}
        if unsupported:
            raise NotImplementedError(
                f"grpo_kernels' LM head computes log_probs and entropy, not {sorted(unsupported)}"
            )
        options = self.options.with_transform(final_logit_softcapping, logit_scale)
        temperature = float(temperature)
        self.calls += 1
        compute_entropy = "entropy" in outputs
        if hidden.shape[0] == 0:
            empty = _connected_empty(hidden, weight, bias)
            return empty, (empty.clone() if compute_entropy else None), None, None, None
        if not torch.is_grad_enabled():  # old-policy and reference passes
            out = _logprobs(hidden, weight, bias, targets, temperature, compute_entropy, options)
            return out.logprobs, out.entropy, None, None, None
        logprobs, entropy = _LogProbsWithGatheredBackward.apply(
            hidden, weight, bias, targets, temperature, compute_entropy, options
        )
        return logprobs, entropy, None, None, None


class FusedLossHead:
    """Stands in for trl.kernels.ChunkedLogProbFunction during the policy forward of a fused loss.

    It receives the rows TRL's forward scores (the positions whose shifted label is not -100, or,
    where TRL does not compact, every position), computes `fused_linear_grpo_loss` on them with the
    micro-batch's per-token inputs gathered to the same rows (packed layout, one segment per
    sequence), keeps the loss, and returns the detached log-probs and entropies with the loss's
    gradient attached to one scored row: the loss then leaves the model's forward through its own
    output (`log_probs`), as TRL's loss does."""

    def __init__(self, *, label_mask, per_token, advantages, config, normalizers, options,
                 virtual_tokens_allowed=False):  # fmt: skip
        self.label_mask = label_mask  # [B, L - 1] bool: TRL's scored positions (shifted labels != -100)
        self.per_token = per_token  # name -> [B, L - 1] tensor (completion values in the last T columns)
        self.advantages = advantages  # [B] or [B, L - 1]
        self.config = config
        self.normalizers = normalizers
        self.options = _options(options)
        self.calls = 0
        self.virtual_tokens_allowed = virtual_tokens_allowed  # a prompt-learning adapter is in the model
        self.scored_rows = None  # flat positions of the rows TRL passed (None: every position)
        self.output = None  # GRPOLossOutput of the micro-batch (None: no scored row)
        self.loss = None

    def _rows(self, n_rows: int):
        """Flat positions of the rows TRL passed, and the row count of each sequence."""
        batch, positions = self.label_mask.shape
        scored = self.label_mask.sum()
        if n_rows == int(scored):  # compact (TRL on Triton devices; also "all scored")
            return self.label_mask.reshape(-1).nonzero().squeeze(-1), self.label_mask.sum(-1)
        if n_rows % batch == 0 and n_rows // batch > positions and self.virtual_tokens_allowed:
            self._prepend_virtual_positions(n_rows // batch - positions)
            batch, positions = self.label_mask.shape
        if n_rows == batch * positions:  # every position (TRL elsewhere)
            return None, torch.full((batch,), positions, dtype=torch.long, device=self.label_mask.device)
        raise RuntimeError(
            f"grpo_kernels fused loss: TRL's forward passed {n_rows} rows, expected {int(scored)} scored "
            f"positions or all {batch * positions}; the model's inputs do not match the completion layout"
        )

    def _prepend_virtual_positions(self, count: int) -> None:
        """Prompt-learning PEFT (prompt tuning, P-tuning) prepends `count` virtual tokens to every row, with
        labels -100: every per-position input gets `count` unscored columns in front."""

        def pad(x):
            return None if x is None else torch.nn.functional.pad(x, (count, 0))

        self.label_mask = pad(self.label_mask)
        self.per_token = {name: pad(x) for name, x in self.per_token.items()}
        if self.advantages.dim() == 2:
            self.advantages = pad(self.advantages)

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):  # fmt: skip
        self.call_options = self.options.with_transform(final_logit_softcapping, logit_scale)
        temperature = float(temperature)
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("grpo_kernels fused loss: the LM head ran twice in one policy forward")
        compute_entropy = "entropy" in outputs
        n_rows = hidden.shape[0]
        if n_rows == 0:  # nothing scored in this micro-batch: loss 0, connected like TRL's
            empty = _connected_empty(hidden, weight, bias)
            self.loss = empty.sum()
            return empty, (empty.clone() if compute_entropy else None), None, None, None
        rows, per_sequence = self._rows(n_rows)
        self.scored_rows = rows

        def take(x):
            if x is None:
                return None
            flat = x.reshape(-1)
            return flat if rows is None else flat.index_select(0, rows)

        cu_seqlens = torch.zeros(per_sequence.numel() + 1, dtype=torch.long, device=hidden.device)
        cu_seqlens[1:] = per_sequence.to(hidden.device).cumsum(0)
        advantages = self.advantages if self.advantages.dim() == 1 else take(self.advantages)
        dtype = hf.compute_dtype(hidden)  # TRL's rule: autocast's, else the hidden states'
        with torch.autocast(hidden.device.type, enabled=False):
            out = gk.fused_linear_grpo_loss(
                hidden.to(dtype), weight.to(dtype), targets, advantages, take(self.per_token["mask"]),
                old_logprobs=take(self.per_token.get("old")), ref_logprobs=take(self.per_token.get("ref")),
                rollout_logprobs=take(self.per_token.get("rollout")), bias=_cast(bias, dtype),
                config=self.config.replace(temperature=temperature), cu_seqlens=cu_seqlens,
                **self.call_options.kwargs(), **self.normalizers,
            )  # fmt: skip
        self.output, self.loss = out, out.loss
        # The loss leaves through one scored row of the log-probs: value + 0, gradient d loss. Every
        # compacted row is scored; uncompacted, the first scored position (TRL zeroes the others), or
        # row 0 when nothing is scored (the loss is then 0 and its gradient too, as with TRL).
        carrier = 0
        if rows is None and bool(self.label_mask.any()):
            carrier = int(self.label_mask.reshape(-1).nonzero()[0])
        attached = (out.loss - out.loss.detach()).reshape(1)
        index = (torch.tensor([carrier], device=hidden.device),)
        logprobs = out.logprobs.detach().clone().index_put(index, attached, accumulate=True)
        entropy = out.entropy.detach() if compute_entropy else None
        return logprobs, entropy, None, None, None


    def completion_entropy(self, columns: int) -> torch.Tensor:
        """The micro-batch's per-token entropy laid out as TRL's [B, T] completion tensors (0 where not
        scored)."""
        batch, positions = self.label_mask.shape
        flat = torch.zeros(batch * positions, device=self.label_mask.device)
        if self.output is not None:
            entropy = self.output.entropy.detach().float().reshape(-1)
            if self.scored_rows is None:
                flat = entropy
            else:
                flat = flat.index_put((self.scored_rows,), entropy)
        return flat.view(batch, positions)[:, -columns:]


def check_fsdp2_head(model) -> None:
    """Under FSDP2 TRL gathers a DTensor LM-head weight with `full_tensor()`, whose gradient placement is
    Replicate: each rank would keep only its own rows of its own gradient (the ranks' gradients are
    never averaged for the head). The head is a DTensor inside the forward only when it is its own
    FSDP2 unit; in the root unit (accelerate's default wrapping) it is unsharded there and exact. Refuse
    the first case when gradients flow, saying what to do. `model` is the (possibly wrapped) policy."""
    if model is None or not torch.is_grad_enabled():
        return
    head = hf.unwrap(model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    if isinstance(weight, DTensor) and weight.requires_grad:
        raise RuntimeError(
            "grpo_kernels: the LM head is its own FSDP2 unit, so TRL gathers lm_head.weight with full_tensor(), "
            "whose Replicate gradient placement leaves each rank only its own rows of its own gradient (the "
            "ranks' head gradients would never be averaged). Keep lm_head in the root FSDP unit (accelerate's "
            "default auto-wrap), or call grpo_kernels.fused_linear_grpo_loss yourself on the DTensor weight "
            "(it gathers with an averaged Partial placement)"
        )


@contextlib.contextmanager
def _lm_head_kernel(head):
    """Put `head` in place of TRL's LM-head kernel for the duration of a forward, then restore it."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = head
    try:
        yield head
    finally:
        trl_utils._ChunkedLogProbFunction = saved


def _check_trl():
    import trl
    import trl.trainer.utils as trl_utils

    hf.require_version("trl", "TRL", SUPPORTED_TRL, trl.__version__, source="trl", install=f"trl=={SUPPORTED_TRL}",
                       otherwise="use trl.GRPOTrainer")  # fmt: skip
    forward_code = [c for c in trl_utils.add_fused_lm_head.__code__.co_consts if hasattr(c, "co_names")]
    if not hasattr(trl_utils, "_ChunkedLogProbFunction") or not any(
        "_ChunkedLogProbFunction" in c.co_names for c in forward_code
    ):
        raise RuntimeError(
            "grpo_kernels.integrations.trl: this trl install does not route the fused LM head through "
            "trl.trainer.utils._ChunkedLogProbFunction (patched or modified TRL?); the adapter cannot plug in"
        )
    return trl


# ---------------------------------------------------------------------------------------------------
# The trainer (built on first access: importing this module does not import TRL)
# ---------------------------------------------------------------------------------------------------


def _build_trainer_class():
    trl = _check_trl()

    class GRPOKernelsTrainer(trl.GRPOTrainer):
        """`trl.GRPOTrainer` (TRL 1.16.0) with its LM head, or its whole policy loss, on grpo_kernels.

        Same arguments as GRPOTrainer, plus:
          grpo_kernels_mode: "fused" (default; the loss is fused_linear_grpo_loss) or "logprobs"
            (TRL's loss on log-probs and entropies from fused_linear_logprobs).
          grpo_kernels_backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
          grpo_kernels_batch_invariant: each token's log-prob bitwise independent of the micro-batch
            (the old-policy pass and the training pass then agree exactly on-policy); default False.
        Raises ValueError naming every setting the chosen mode cannot honour."""

        def __init__(
            self, *args, grpo_kernels_mode: str = "fused", grpo_kernels_backend: str = "auto",
            grpo_kernels_batch_invariant: bool = False, **kwargs,
        ):  # fmt: skip
            hf.check_trainer_options(grpo_kernels_mode, MODES, grpo_kernels_backend, grpo_kernels_batch_invariant)
            self.grpo_kernels_mode = grpo_kernels_mode
            self.grpo_kernels_backend = grpo_kernels_backend
            self.grpo_kernels_options = KernelOptions(grpo_kernels_backend, grpo_kernels_batch_invariant)
            self._grpo_kernels_head = None
            super().__init__(*args, **kwargs)
            problems = unsupported_settings(self, grpo_kernels_mode)
            if problems:
                raise ValueError(
                    f"GRPOKernelsTrainer (grpo_kernels_mode={grpo_kernels_mode!r}) cannot reproduce these "
                    "settings:\n  - " + "\n  - ".join(problems)
                )
            if grpo_kernels_mode == "fused":
                logger.info(
                    "grpo_kernels: TRL loss_type=%r fused as %s", self.loss_type, policy_loss_config(self)
                )

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            model = args[0] if args else kwargs.get("model")
            check_fsdp2_head(model)
            head = self._grpo_kernels_head or LogProbsHead(self.grpo_kernels_options)
            if model is not None:  # the transform of the model this pass runs (policy or reference)
                head.options = dataclasses.replace(head.options, model_transform=hf.logit_transform(model))
            with _lm_head_kernel(head):
                result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if head.calls == 0:
                raise RuntimeError(
                    "grpo_kernels: the model's forward did not reach the LM-head seam "
                    "(trl.trainer.utils._ChunkedLogProbFunction). Something replaced the forward that "
                    "GRPOTrainer installs with add_fused_lm_head (e.g. Liger's fused linear cross-entropy)."
                )
            return result

        def _compute_loss(self, model, inputs):
            if self.grpo_kernels_mode == "logprobs":
                return super()._compute_loss(model, inputs)
            return self._fused_loss(model, inputs)

        def _fused_loss(self, model, inputs):
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.size(1)
            mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

            # TRL's labels (_get_per_token_logps_and_entropies), shifted as its forward shifts them
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-logits_to_keep] = -100
            label_mask = labels[:, 1:] != -100
            prompt_pad = label_mask.shape[1] - logits_to_keep

            def positions(x):  # [B, T] completion values -> [B, L - 1] positions of the shifted labels
                return None if x is None else torch.nn.functional.pad(x, (prompt_pad, 0))

            per_token = {"mask": positions(mask.bool())}
            per_token["old"] = positions(inputs.get("old_per_token_logps"))
            if self.beta != 0.0:
                per_token["ref"] = positions(inputs["ref_per_token_logps"])
            if vllm_is_correction_on(self) or (
                self.off_policy_mask_threshold is not None and "sampling_per_token_logps" in inputs
            ):
                per_token["rollout"] = positions(inputs["sampling_per_token_logps"])
            advantages = inputs["advantages"]
            if advantages.dim() == 2:
                advantages = positions(advantages)
            head = FusedLossHead(
                label_mask=label_mask, per_token=per_token, advantages=advantages,
                config=policy_loss_config(self), options=self.grpo_kernels_options,
                normalizers=loss_normalizers(self, completion_ids.size(0), inputs["num_items_in_batch"]),
                virtual_tokens_allowed=_is_prompt_learning(self.model),
            )  # fmt: skip
            self._grpo_kernels_head = head
            try:
                # a vision-language model's inputs go to its forward as in TRL's _compute_loss; its language
                # model's hidden states reach the seam like a text model's (image tokens are prompt positions)
                logps, _, aux_loss = self._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
                    compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in MULTIMODAL_INPUTS},
                )  # fmt: skip
            finally:
                self._grpo_kernels_head = None
            # the value of the fused loss, its gradient through the forward's output
            loss = head.loss.detach() + (logps - logps.detach()).sum()
            mode = "train" if self.model.training else "eval"
            if self.aux_loss_enabled:
                normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
                loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            if self.use_adaptive_entropy and mode == "train":  # before the logging, as TRL
                update_adaptive_entropy(self, head.completion_entropy(logits_to_keep), mask)
            log_trl_metrics(self, None if head.output is None else head.output.metrics, mask,
                            aux_loss if self.aux_loss_enabled else None)  # fmt: skip
            return loss

    return GRPOKernelsTrainer


__getattr__ = hf.lazy_class(__name__, "GRPOKernelsTrainer", _build_trainer_class)
