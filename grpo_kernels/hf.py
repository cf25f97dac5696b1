"""What every adapter (integrations/*) and the reference trainer read from a Hugging Face model, in one place:

* `logit_transform(model)`: how the model's causal-LM forward transforms the LM head's output before the
  softmax, as grpo_kernels' `softcap` / `logit_scale` (z = softcap tanh(logit_scale x / softcap), then / T).
  Read per architecture from the pinned transformers' modeling files (the table below; each row is tested
  against the model's own forward in tests/test_logit_transform_architectures.py, which also fails when
  transformers gains an architecture that transforms its logits and is not in the table).
* `unwrap(model)`: the transformers model inside PEFT, DDP / FSDP1, a DeepSpeed engine and torch.compile.
* `compute_dtype(hidden, weight)`: the dtype a peer's LM-head kernel projects in (autocast's when it is on).
* `require_version(...)`: the one version-pin check and its one error format.
* `trl_family_loss_fields` / `trl_family_normalizers`: TRL's loss types (TRL 1.16 and Unsloth's generated
  trainer share them) -> PolicyLossConfig fields and grpo_kernels' normalizer keywords.

Nothing here imports transformers, TRL or a trainer at module level.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch


# ---------------------------------------------------------------------------------------------------------
# The logit transform
# ---------------------------------------------------------------------------------------------------------


class LogitTransform(NamedTuple):
    """z = softcap tanh(logit_scale x / softcap) (no tanh when softcap is None), x = hidden W^T + b: the
    keywords of grpo_kernels' fused functions (`**t._asdict()`)."""

    softcap: float | None = None
    logit_scale: float = 1.0


class _Rule(NamedTuple):
    attribute: str  # the config attribute the forward reads
    op: str  # "softcap", "multiply" or "divide"
    where: str = "config"  # "config", "text_config" (config.get_text_config()) or "model" (an attribute on
    # the model or its backbone, set from the config attribute of the same name in __init__)


# The causal-LM classes of transformers 5.10.4 whose forward transforms the LM head's output, and how (the line
# each mirrors is in tests/test_logit_transform_architectures.py). A class of transformers that is not here does
# not transform its logits, whatever its config carries (Gemma 3 / PaliGemma's vision-language models keep a
# text config with final_logit_softcapping that their forward never applies; MPT's config has a logit_scale
# its forward ignores).
_SOFTCAP = _Rule("final_logit_softcapping", "softcap")
_SOFTCAP_TEXT = _Rule("final_logit_softcapping", "softcap", "text_config")
_GRANITE = _Rule("logits_scaling", "divide")
_COHERE = _Rule("logit_scale", "multiply", "model")
RULES: dict[str, _Rule] = {
    "CohereForCausalLM": _COHERE,
    "Cohere2ForCausalLM": _COHERE,
    "Cohere2MoeForCausalLM": _COHERE,
    "FalconH1ForCausalLM": _Rule("lm_head_multiplier", "multiply", "model"),  # self.model.lm_head_multiplier
    "Gemma2ForCausalLM": _SOFTCAP,
    "Gemma3ForCausalLM": _SOFTCAP,
    "Gemma3nForCausalLM": _SOFTCAP,
    "Gemma3nForConditionalGeneration": _SOFTCAP_TEXT,
    "Gemma4ForCausalLM": _SOFTCAP,
    "Gemma4ForConditionalGeneration": _SOFTCAP_TEXT,
    "Gemma4UnifiedForCausalLM": _SOFTCAP,
    "Gemma4UnifiedForConditionalGeneration": _SOFTCAP_TEXT,
    "GraniteForCausalLM": _GRANITE,
    "GraniteMoeForCausalLM": _GRANITE,
    "GraniteMoeHybridForCausalLM": _GRANITE,
    "GraniteMoeSharedForCausalLM": _GRANITE,
    "Granite4VisionForConditionalGeneration": _Rule("logits_scaling", "divide", "text_config"),
    "HyperCLOVAXForCausalLM": _Rule("logits_scaling", "multiply"),  # multiplies, unlike Granite
    "NanoChatForCausalLM": _SOFTCAP,
    "RecurrentGemmaForCausalLM": _Rule("logits_soft_cap", "softcap"),
    "VaultGemmaForCausalLM": _SOFTCAP,
    "xLSTMForCausalLM": _Rule("output_logit_soft_cap", "softcap"),
}
# Classes of that list grpo_kernels cannot score, with why (refused by name)
REFUSED: dict[str, str] = {
    "T5Gemma2ForConditionalGeneration": "an encoder-decoder model (its decoder's soft-capped logits depend on an "
    "encoder pass); grpo_kernels' adapters and trainer score decoder-only causal LMs",
}
# What a model class outside transformers (remote code) is read with: the convention TRL's add_fused_lm_head
# uses (trl 1.16), the sampler's too, since nothing else is known about its forward
_GENERIC_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier")


def _architecture(config) -> str | None:
    """The causal-LM class a bare config stands for: its `architectures`, else transformers' auto mappings."""
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    model_type = getattr(config, "model_type", None)
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if model_type in mapping:
            return mapping[model_type]
    return None


def _model_class(model) -> type:
    """The transformers class the model is (or subclasses: FSDP2's fully_shard swaps in an FSDP<name> subclass
    defined in torch, a user may subclass), else its own class (remote code)."""
    mro = type(model).__mro__
    return next((c for c in mro if c.__module__.startswith("transformers.")), None) or next(
        (c for c in mro if not c.__module__.startswith("torch.")), type(model)
    )


def _is_transformers_class(name: str | None, model) -> bool:
    if model is not None:
        return _model_class(model).__module__.startswith("transformers.")
    if name is None:
        return False
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, name)


def _read(rule: _Rule, config, model):
    if rule.where == "text_config":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
    elif rule.where == "model" and model is not None:  # the value the forward multiplies by
        for owner in (model, getattr(model, "model", None)):
            if owner is not None and rule.attribute in vars(owner):
                return getattr(owner, rule.attribute)
    return getattr(config, rule.attribute, None)


def logit_transform(model_or_config) -> LogitTransform:
    """How `model_or_config`'s causal-LM forward transforms the LM head's output x before the softmax, as
    grpo_kernels' keywords: z = softcap tanh(logit_scale x / softcap).

    A model (any wrapper: `unwrap`) is read by its class, a config by its `architectures` (or its model
    type's causal-LM class). Classes of transformers: `RULES` (Gemma 2 / 3 / 3n / 4, NanoChat, VaultGemma:
    final_logit_softcapping; RecurrentGemma: logits_soft_cap; xLSTM: output_logit_soft_cap; Cohere 1 / 2 /
    2 MoE: logit_scale; Falcon-H1: lm_head_multiplier; Granite (all four) and Granite 4 Vision: 1 /
    logits_scaling; HyperCLOVA X: logits_scaling), no transform for any other. A class from outside
    transformers (remote code) is read as TRL reads it: final_logit_softcapping, then the first of
    logit_scale, output_multiplier, lm_head_multiplier, else 1 / logits_scaling. Raises ValueError naming
    the class and the reason for one grpo_kernels cannot score (`REFUSED`), and naming the attribute for a
    scale or cap that is not finite and > 0."""
    model = None
    if isinstance(model_or_config, torch.nn.Module):
        model = unwrap(model_or_config)
        config = model.config
        name = _model_class(model).__name__
    else:
        config = model_or_config
        name = _architecture(config)
    if name in REFUSED:
        raise ValueError(f"{name}: {REFUSED[name]}")
    softcap, scale = None, 1.0
    if name in RULES:
        rule = RULES[name]
        value = _read(rule, config, model)
        if value is not None:
            value = _positive(value, f"{name}'s {rule.attribute}")
            if rule.op == "softcap":
                softcap = value
            else:
                scale = value if rule.op == "multiply" else 1.0 / value
    elif not _is_transformers_class(name, model):  # remote code: TRL's convention
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        cap = getattr(text, "final_logit_softcapping", None)
        softcap = None if cap is None else _positive(cap, f"{name}'s final_logit_softcapping")
        found = next((a for a in _GENERIC_SCALES if getattr(text, a, None) is not None), None)
        if found is not None:
            scale = _positive(getattr(text, found), f"{name}'s {found}")
        elif getattr(text, "logits_scaling", None) is not None:
            scale = 1.0 / _positive(text.logits_scaling, f"{name}'s logits_scaling")
    return LogitTransform(softcap, float(scale))


def _positive(value, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is {value!r}: grpo_kernels needs a finite number > 0") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{what} is {number}: grpo_kernels needs a finite number > 0")
    return number


# ---------------------------------------------------------------------------------------------------------
# Unwrapping and the compute dtype
# ---------------------------------------------------------------------------------------------------------


def unwrap(model):
    """The transformers model inside PEFT (`get_base_model`), DDP / FSDP1 and a DeepSpeed engine (`.module`;
    ZeRO-3 wraps the reference model in one, whose `.config` is DeepSpeed's dict) and torch.compile
    (`._orig_mod`), nested in any order."""
    for _ in range(8):  # wrappers nest (a DeepSpeed engine around a PEFT model, ...)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        if hasattr(getattr(model, "config", None), "get_text_config"):
            return model
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.dtype:
    """The dtype a peer's LM-head kernel projects in, which grpo_kernels then takes (it accumulates in fp32
    either way): autocast's when autocast is on for the device, else the head's when `weight` is given and a
    float (Unsloth's rule), else the hidden states' (TRL's rule: it passes no weight)."""
    device_type = (hidden if weight is None else weight).device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if weight is not None and weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return weight.dtype
    return hidden.dtype


# ---------------------------------------------------------------------------------------------------------
# A class built on first access
# ---------------------------------------------------------------------------------------------------------


def lazy_class(module: str, name: str, build):
    """A module-level `__getattr__` for `module` that builds its class `name` with `build()` on first access
    (importing the trainer it subclasses only then: importing an adapter imports no trainer), names it as
    defined in `module` and keeps it there."""

    def __getattr__(attribute):
        if attribute != name:
            raise AttributeError(f"module {module!r} has no attribute {attribute!r}")
        cls = build()
        cls.__module__, cls.__qualname__ = module, name
        setattr(sys.modules[module], name, cls)
        return cls

    return __getattr__


# ---------------------------------------------------------------------------------------------------------
# Version pins
# ---------------------------------------------------------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution (pip's name), or None."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_version(adapter: str, name: str, supported: str, found: str | None, *, install: str,
                    otherwise: str, source: str | None = None, exc=RuntimeError) -> None:  # fmt: skip
    """Raise `exc` unless `found` (the installed version, None: not installed) is `supported`, in the one
    format of every adapter: "grpo_kernels.integrations.<adapter> supports <name> <supported> (tested); found
    [<source> ]<found>. Install the tested version (pip install "<install>") or <otherwise>." `source` names
    where the version was read when that is not the distribution's metadata (TRL: `trl.__version__`)."""
    if found == supported:
        return
    shown = "nothing installed" if found is None else f"{source} {found}" if source else found
    raise exc(
        f"grpo_kernels.integrations.{adapter} supports {name} {supported} (tested); found {shown}. Install the "
        f'tested version (pip install "{install}") or {otherwise}.'
    )


# ---------------------------------------------------------------------------------------------------------
# The grpo_kernels_* arguments of the TRL-family trainers (TRL's and Unsloth's GRPOKernelsTrainer)
# ---------------------------------------------------------------------------------------------------------

BACKENDS = ("auto", "triton", "torch")


def check_trainer_options(mode: str, modes: tuple, backend: str, batch_invariant) -> None:
    """Refuse a `grpo_kernels_mode` outside `modes`, a `grpo_kernels_backend` outside BACKENDS and a
    `grpo_kernels_batch_invariant` that is not a bool (ValueError naming the argument and the value)."""
    if mode not in modes:
        raise ValueError(f"grpo_kernels_mode must be one of {modes}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"grpo_kernels_backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"grpo_kernels_batch_invariant must be True or False, got {batch_invariant!r}")


# ---------------------------------------------------------------------------------------------------------
# TRL's loss types (TRL 1.16.0 and Unsloth's generated trainer) -> grpo_kernels
# ---------------------------------------------------------------------------------------------------------

# TRL loss_type -> the aggregation its _compute_loss performs (verl's names)
TRL_LOSS_AGG_MODE = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "luspo": "seq-mean-token-sum",
}
TRL_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_TRL_PER_SEQUENCE = ("grpo", "sapo", "dr_grpo", "luspo")  # divided by the micro-batch's rows x GA


def trl_family_loss_fields(loss_type: str, *, epsilon_low, epsilon_high, delta=None, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0, max_completion_length=None) -> dict:  # fmt: skip
    """PolicyLossConfig fields of a TRL-family `loss_type`'s objective and aggregation: grpo / bnpo / dr_grpo
    / dapo / luspo -> ppo_clip (clip_low = epsilon_low, clip_high = epsilon_high, delta); cispo -> cispo with
    the absolute cap epsilon_high; sapo, vespo -> the same names with their temperatures / shapes; dr_grpo's
    max_completion_length. The KL, IS, entropy and temperature fields are each trainer's."""
    if loss_type not in TRL_LOSS_AGG_MODE:
        raise ValueError(f"loss_type={loss_type!r} has no grpo_kernels mapping; known: {tuple(TRL_LOSS_AGG_MODE)}")
    fields = dict(loss_agg_mode=TRL_LOSS_AGG_MODE[loss_type])
    if loss_type in TRL_CLIP_LOSS_TYPES:
        fields.update(loss_type="ppo_clip", clip_low=epsilon_low, clip_high=epsilon_high, delta=delta)
    elif loss_type == "cispo":
        fields.update(loss_type="cispo", cispo_form="absolute", cispo_cap=epsilon_high)
    elif loss_type == "sapo":
        fields.update(loss_type="sapo", sapo_tau_pos=sapo_temperature_pos, sapo_tau_neg=sapo_temperature_neg)
    else:  # vespo
        fields.update(loss_type="vespo", vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
                      vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)  # fmt: skip
    if loss_type == "dr_grpo":
        fields["max_completion_length"] = int(max_completion_length)
    return fields


def trl_family_normalizers(loss_type: str, batch_size: int, num_items_in_batch, *, training: bool,
                           grad_accum_steps: int, steps_per_generation: int | None, num_processes: int) -> dict:  # fmt: skip
    """The normalizer keywords of grpo_kernels' loss functions that reproduce a TRL-family loss's division.

    GA = grad_accum_steps (the current gradient accumulation steps in training, 1 in eval):
      grpo, sapo, dr_grpo, luspo: num_sequences = B GA (B = batch_size, the micro-batch's rows)
      bnpo: the local token count, times GA
      dapo, cispo, vespo: num_tokens = max(num_items_in_batch, 1) GA / steps_per_generation in training
        (max(num_items_in_batch, 1) in eval), dp_size = num_processes
      entropy bonus: grad_accum_steps = GA (a local token mean / GA)."""
    ga = int(grad_accum_steps)
    if loss_type in _TRL_PER_SEQUENCE:
        return dict(num_sequences=batch_size * ga, grad_accum_steps=ga)
    if loss_type == "bnpo":
        return dict(grad_accum_steps=ga)
    items = num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch
    items = max(float(items), 1.0)
    if training and steps_per_generation:
        items = items * ga / steps_per_generation
    return dict(num_tokens=items, dp_size=int(num_processes), grad_accum_steps=ga)
