"""torch.library custom ops for the three public functions, so `torch.compile(fullgraph=True)` traces a
training step that calls them without a graph break.

Under torch.compile the public functions (grpo_kernels.functional) call these ops instead of running
their Python directly. Each op's body is the eager function itself, so every check runs, host
synchronisations included (the value checks: finite inputs, target ids in range, mask values), inside the
op, where they cannot break the graph; the fake implementations give the outputs' shapes from the inputs'
alone. Gradients:

  logprobs   the backward op recomputes the LM-head statistics and runs their backward (kernel A again,
             then C: one more forward pass than eager, which keeps the statistics from the forward)
  losses     the forward op computes the loss's gradients with the loss (as the fused eager path does
             anyway); the backward scales them by grad_output

What compiled calls do not take: tp_group (a process group is not an op argument: call the function
outside the compiled region, or compile the rest of the step), and weights that are FSDP2 DTensors or
ZeRO-3 stubs (gather the head first). They raise ValueError saying so.

Checks that fail while tracing (argument types, the config, what compile cannot take) become one op,
``grpo_kernels::refuse``, that raises the same ValueError when the compiled graph runs: the exception a
compiled call raises is the eager call's, not dynamo's ``Unsupported``.

Imports run one way: grpo_kernels.functional imports this module and hands it the eager functions the
op bodies run (``register_eager``); nothing here imports grpo_kernels.functional.
"""

import contextlib
import json
from typing import Optional

import torch
from torch import Tensor

_NAMESPACE = "grpo_kernels"


# the public eager functions the op bodies run, registered by grpo_kernels.functional when it is imported
_EAGER: dict = {}


def register_eager(**functions) -> None:
    """functional.py hands over fused_linear_logprobs, grpo_loss and fused_linear_grpo_loss (by name)."""
    _EAGER.update(functions)


def config_to_json(cfg) -> str:
    """The config's fields as JSON, computed when it was built (a constant for torch.compile)."""
    return cfg._as_json


def config_from_json(text: str):
    from .config import PolicyLossConfig

    return PolicyLossConfig(**json.loads(text))


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd inside an op body. A custom op's kernel runs below the autograd dispatch keys (and under
    no_grad while AOT autograd executes a compiled graph); the eager functions the ops wrap differentiate
    with autograd (the PyTorch loss head), so the body puts the keys back for its own computation."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "AutogradFunctionality", "ADInplaceOrView"):
        if hasattr(torch._C.DispatchKey, key):
            exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


def _need(x: Optional[Tensor], flag: bool) -> Optional[Tensor]:
    """A leaf copy that requires grad when flag (the op's autograd runs inside the op)."""
    if x is None:
        return None
    return x.detach().requires_grad_(flag)


def _count(x: float):
    """dp_size / grad_accum_steps travel as floats (so 1.5 reaches eager's integer check instead of being
    truncated on the way): whole numbers go back to int."""
    return int(x) if float(x).is_integer() else x


def _empty_like_or_none(x: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty((0,)) if x is None else torch.zeros_like(x)


# ---- fused_linear_logprobs ------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NAMESPACE}::logprobs", mutates_args=())
def logprobs_op(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, mask: Optional[Tensor],
    temperature: float, ignore_index: int, compute_entropy: bool, check_finite: bool, batch_invariant: bool,
    softcap: Optional[float], logit_scale: float, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():
        out = _EAGER["fused_linear_logprobs"](hidden, weight, targets, bias, temperature, mask=mask, ignore_index=ignore_index,
                                    compute_entropy=compute_entropy, check_finite=check_finite,
                                    batch_invariant=batch_invariant, softcap=softcap, logit_scale=logit_scale,
                                    backend=backend)  # fmt: skip
    entropy = out.entropy if compute_entropy else out.logprobs.new_empty((0,))
    return out.logprobs.clone(), entropy.clone()


@logprobs_op.register_fake
def _(hidden, weight, bias, targets, mask, temperature, ignore_index, compute_entropy, check_finite,
      batch_invariant, softcap, logit_scale, backend):  # fmt: skip
    logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
    entropy = hidden.new_empty(targets.shape if compute_entropy else (0,), dtype=torch.float32)
    return logprobs, entropy


@torch.library.custom_op(f"{_NAMESPACE}::logprobs_backward", mutates_args=())
def logprobs_backward_op(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, mask: Optional[Tensor],
    grad_logprobs: Tensor, grad_entropy: Optional[Tensor], temperature: float, ignore_index: int,
    batch_invariant: bool, softcap: Optional[float], logit_scale: float, backend: str,
    need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    with _autograd_inside_op():
        h, w, b = _need(hidden, need_hidden), _need(weight, need_weight), _need(bias, need_bias)
        out = _EAGER["fused_linear_logprobs"](h, w, targets, b, temperature, mask=mask, ignore_index=ignore_index,
                                    compute_entropy=grad_entropy is not None, check_finite=False,
                                    batch_invariant=batch_invariant, softcap=softcap, logit_scale=logit_scale,
                                    backend=backend)  # fmt: skip
        outputs, grads = [out.logprobs], [grad_logprobs]
        if grad_entropy is not None:
            outputs.append(out.entropy)
            grads.append(grad_entropy)
        wanted = [x for x in (h, w, b) if x is not None and x.requires_grad]
        found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True) if wanted else [])
    result = []
    for x, original in ((h, hidden), (w, weight), (b, bias)):
        grad = next(found) if x is not None and x.requires_grad else None
        if grad is None:
            grad = _empty_like_or_none(original, hidden)
        result.append(grad)
    return tuple(result)


@logprobs_backward_op.register_fake
def _(hidden, weight, bias, targets, mask, grad_logprobs, grad_entropy, temperature, ignore_index,
      batch_invariant, softcap, logit_scale, backend, need_hidden, need_weight, need_bias):  # fmt: skip
    return (torch.empty_like(hidden), torch.empty_like(weight),
            hidden.new_empty((0,)) if bias is None else torch.empty_like(bias))  # fmt: skip


def _logprobs_setup(ctx, inputs, output):
    (hidden, weight, bias, targets, mask, temperature, ignore_index, compute_entropy, _check, batch_invariant,
     softcap, logit_scale, backend) = inputs  # fmt: skip
    ctx.save_for_backward(hidden, weight, bias, targets, mask)
    ctx.options = (temperature, ignore_index, batch_invariant, softcap, logit_scale, backend)
    ctx.compute_entropy = compute_entropy


def _logprobs_backward(ctx, grad_logprobs, grad_entropy):
    hidden, weight, bias, targets, mask = ctx.saved_tensors
    temperature, ignore_index, batch_invariant, softcap, logit_scale, backend = ctx.options
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    gh, gw, gb = logprobs_backward_op(
        hidden, weight, bias, targets, mask, grad_logprobs, grad_entropy if ctx.compute_entropy else None,
        temperature, ignore_index, batch_invariant, softcap, logit_scale, backend, need_h, need_w,
        need_b and bias is not None,
    )  # fmt: skip
    return (gh if need_h else None, gw if need_w else None, gb if need_b and bias is not None else None,
            None, None, None, None, None, None, None, None, None, None)  # fmt: skip


logprobs_op.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


# ---- grpo_loss and fused_linear_grpo_loss: the gradients come with the loss -----------------------------


def _metric_vector(metrics: dict, names: tuple[str, ...], like: Tensor) -> Tensor:
    if tuple(sorted(metrics)) != names:
        raise AssertionError(f"metric names {sorted(metrics)} differ from the declared {list(names)}")
    if not names:
        return like.new_zeros((0,), dtype=torch.float32)
    return torch.stack([metrics[n].float().reshape(()) for n in names])


@torch.library.custom_op(f"{_NAMESPACE}::grpo_loss", mutates_args=())
def grpo_loss_op(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor], rollout_logprobs: Optional[Tensor], entropy: Optional[Tensor],
    cu_seqlens: Optional[Tensor], is_weights: Optional[Tensor], token_weights: Optional[Tensor], config: str,
    num_tokens: Optional[float], num_sequences: Optional[float], dp_size: float, grad_accum_steps: float,
    check_finite: bool, backend: str, need_logprobs: bool, need_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from .ops.loss_head.reference import metric_names

    cfg = config_from_json(config)
    with _autograd_inside_op():
        lp, ent = _need(logprobs, need_logprobs), _need(entropy, need_entropy)
        out = _EAGER["grpo_loss"](lp, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, ent, cfg,
                        cu_seqlens=cu_seqlens, is_weights=is_weights, token_weights=token_weights,
                        num_tokens=num_tokens, num_sequences=num_sequences, dp_size=_count(dp_size),
                        grad_accum_steps=_count(grad_accum_steps), check_finite=check_finite, backend=backend)  # fmt: skip
        wanted = [x for x in (lp, ent) if x is not None and x.requires_grad]
        grads = iter(torch.autograd.grad(out.loss, wanted, allow_unused=True) if wanted else [])
    grad_lp = next(grads) if need_logprobs else None
    grad_ent = next(grads) if need_entropy and ent is not None else None
    names = metric_names(cfg, has_ref=ref_logprobs is not None, has_entropy=entropy is not None,
                         has_is_weights=is_weights is not None)  # fmt: skip
    return (out.loss.detach().float().clone(), _metric_vector(out.metrics, names, logprobs),
            torch.zeros_like(logprobs, dtype=torch.float32) if grad_lp is None else grad_lp.float(),
            logprobs.new_zeros((0,), dtype=torch.float32) if entropy is None
            else (torch.zeros_like(entropy, dtype=torch.float32) if grad_ent is None else grad_ent.float()))  # fmt: skip


@grpo_loss_op.register_fake
def _(logprobs, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, entropy, cu_seqlens,
      is_weights, token_weights, config, num_tokens, num_sequences, dp_size, grad_accum_steps, check_finite,
      backend, need_logprobs, need_entropy):  # fmt: skip
    from .ops.loss_head.reference import metric_names

    names = metric_names(config_from_json(config), has_ref=ref_logprobs is not None,
                         has_entropy=entropy is not None, has_is_weights=is_weights is not None)  # fmt: skip
    f32 = torch.float32
    return (logprobs.new_empty((), dtype=f32), logprobs.new_empty((len(names),), dtype=f32),
            logprobs.new_empty(logprobs.shape, dtype=f32),
            logprobs.new_empty((0,) if entropy is None else entropy.shape, dtype=f32))  # fmt: skip


def _grpo_loss_setup(ctx, inputs, output):
    _, _, grad_lp, grad_ent = output
    ctx.save_for_backward(grad_lp, grad_ent)
    ctx.dtypes = (inputs[0].dtype, None if inputs[6] is None else inputs[6].dtype)


def _grpo_loss_backward(ctx, grad_loss, _grad_metrics, _grad_lp, _grad_ent):
    grad_lp, grad_ent = ctx.saved_tensors
    lp_dtype, ent_dtype = ctx.dtypes
    scale = grad_loss.float()
    return ((grad_lp * scale).to(lp_dtype), None, None, None, None, None,
            None if ent_dtype is None else (grad_ent * scale).to(ent_dtype),
            *([None] * 12))  # fmt: skip


grpo_loss_op.register_autograd(_grpo_loss_backward, setup_context=_grpo_loss_setup)


@torch.library.custom_op(f"{_NAMESPACE}::fused_linear_grpo_loss", mutates_args=())
def fused_loss_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, advantages: Tensor, mask: Tensor,
    old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor], rollout_logprobs: Optional[Tensor],
    bias: Optional[Tensor], cu_seqlens: Optional[Tensor], is_weights: Optional[Tensor],
    token_weights: Optional[Tensor], config: str, num_tokens: Optional[float], num_sequences: Optional[float],
    dp_size: float, grad_accum_steps: float, check_finite: bool, batch_invariant: bool, softcap: Optional[float],
    logit_scale: float, backend: str, schedule: str, need_hidden: bool, need_weight: bool, need_bias: bool,
    max_extra_memory: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from .ops.loss_head.reference import metric_names

    cfg = config_from_json(config)
    with _autograd_inside_op():
        h, w, b = _need(hidden, need_hidden), _need(weight, need_weight), _need(bias, need_bias)
        out = _EAGER["fused_linear_grpo_loss"](h, w, targets, advantages, mask, old_logprobs, ref_logprobs,
                                     rollout_logprobs, b, cfg, cu_seqlens=cu_seqlens, is_weights=is_weights,
                                     token_weights=token_weights, num_tokens=num_tokens,
                                     num_sequences=num_sequences, dp_size=_count(dp_size),
                                     grad_accum_steps=_count(grad_accum_steps),
                                     check_finite=check_finite, batch_invariant=batch_invariant, softcap=softcap,
                                     logit_scale=logit_scale, backend=backend, schedule=schedule,
                                     max_extra_memory=max_extra_memory)  # fmt: skip
        wanted = [x for x in (h, w, b) if x is not None and x.requires_grad]
        found = iter(torch.autograd.grad(out.loss, wanted, allow_unused=True) if wanted else [])
    grads = []
    for x, original in ((h, hidden), (w, weight), (b, bias)):
        grad = next(found) if x is not None and x.requires_grad else None
        grads.append(_empty_like_or_none(original, hidden) if grad is None else grad)
    names = metric_names(cfg, has_ref=ref_logprobs is not None, has_entropy=True,
                         has_is_weights=is_weights is not None)  # fmt: skip
    return (out.loss.detach().float().clone(), _metric_vector(out.metrics, names, hidden),
            out.logprobs.float().clone(), out.entropy.float().clone(), *grads)


@fused_loss_op.register_fake
def _(hidden, weight, targets, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, bias, cu_seqlens,
      is_weights, token_weights, config, num_tokens, num_sequences, dp_size, grad_accum_steps, check_finite,
      batch_invariant, softcap, logit_scale, backend, schedule, need_hidden, need_weight, need_bias,
      max_extra_memory=None):  # fmt: skip
    from .ops.loss_head.reference import metric_names

    names = metric_names(config_from_json(config), has_ref=ref_logprobs is not None, has_entropy=True,
                         has_is_weights=is_weights is not None)  # fmt: skip
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32), hidden.new_empty((len(names),), dtype=f32),
            hidden.new_empty(targets.shape, dtype=f32), hidden.new_empty(targets.shape, dtype=f32),
            torch.empty_like(hidden), torch.empty_like(weight),
            hidden.new_empty((0,)) if bias is None else torch.empty_like(bias))  # fmt: skip


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[4:])
    ctx.has_bias = inputs[8] is not None


def _fused_backward(ctx, grad_loss, *_unused):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.needs_input_grad[8] and ctx.has_bias
    scale = grad_loss.to(grad_hidden.dtype)
    return (grad_hidden * scale if need_h else None, grad_weight * scale.to(grad_weight.dtype) if need_w else None,
            None, None, None, None, None, None, grad_bias * scale.to(grad_bias.dtype) if need_b else None,
            *([None] * 18))  # fmt: skip


fused_loss_op.register_autograd(_fused_backward, setup_context=_fused_setup)


# ---- what the public functions call while torch.compile traces them -------------------------------------
# The public functions have checked the arguments' types first (functional._check_argument_types, the same
# check eager runs), so the numbers below are numbers of the right kind: float() / int() only change their
# Python type (an int temperature), never accept a string or a bool. Their ranges are checked at run time
# by the eager function inside the op, with eager's messages.


@torch.library.custom_op(f"{_NAMESPACE}::refuse", mutates_args=())
def refuse_op(message: str) -> Tensor:
    """Raises ValueError(message) when the compiled graph runs: a check that failed while tracing."""
    raise ValueError(message)


@refuse_op.register_fake
def _(message):
    return torch.empty(())


def refuse_untraceable(tp_group, **tensors) -> None:
    """What a compiled call cannot take (ValueError naming it; traced, so it becomes refuse_op)."""
    if tp_group is not None:
        raise ValueError("tp_group is not supported inside torch.compile (a process group is not an op "
                         "argument): call this function outside the compiled region")  # fmt: skip
    for name, x in tensors.items():
        if x is not None and (type(x) is not Tensor and not isinstance(x, torch.nn.Parameter)):
            raise ValueError(f"{name} is a {type(x).__name__} (FSDP2 DTensor / ZeRO-3 stub?): inside "
                             "torch.compile pass the gathered head weight")  # fmt: skip


def _optional_float(x):
    return None if x is None else float(x)


def compiled_logprobs(hidden, weight, targets, bias, temperature, mask, ignore_index, compute_entropy,
                      check_finite, batch_invariant, softcap, logit_scale, backend):  # fmt: skip
    """(logprobs, entropy or None) from the logprobs op."""
    logprobs, entropy = logprobs_op(hidden, weight, bias, targets, mask, float(temperature), ignore_index,
                                    compute_entropy, check_finite, batch_invariant, _optional_float(softcap),
                                    float(logit_scale), backend)  # fmt: skip
    return logprobs, entropy if compute_entropy else None


def compiled_grpo_loss(logprobs, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, entropy, cfg,
                       cu_seqlens, is_weights, token_weights, num_tokens, num_sequences, dp_size, grad_accum_steps,
                       check_finite, backend):  # fmt: skip
    """(loss, metrics dict) from the grpo_loss op."""
    from .ops.loss_head.reference import metric_names

    loss, metrics, _, _ = grpo_loss_op(
        logprobs, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, entropy, cu_seqlens, is_weights,
        token_weights, config_to_json(cfg), _optional_float(num_tokens), _optional_float(num_sequences),
        float(dp_size), float(grad_accum_steps), check_finite, backend, logprobs.requires_grad,
        entropy is not None and entropy.requires_grad,
    )  # fmt: skip
    names = metric_names(cfg, has_ref=ref_logprobs is not None, has_entropy=entropy is not None,
                         has_is_weights=is_weights is not None)  # fmt: skip
    return loss, {n: metrics[i] for i, n in enumerate(names)}


def compiled_fused_loss(hidden, weight, targets, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs,
                        bias, cfg, cu_seqlens, is_weights, token_weights, num_tokens, num_sequences, dp_size,
                        grad_accum_steps, check_finite, batch_invariant, softcap, logit_scale, backend,
                        schedule, max_extra_memory=None):  # fmt: skip
    """(loss, metrics dict, logprobs, entropy) from the fused_linear_grpo_loss op."""
    from .ops.loss_head.reference import metric_names

    loss, metrics, logprobs, entropy, *_ = fused_loss_op(
        hidden, weight, targets, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, bias, cu_seqlens,
        is_weights, token_weights, config_to_json(cfg), _optional_float(num_tokens), _optional_float(num_sequences),
        float(dp_size), float(grad_accum_steps), check_finite, batch_invariant, _optional_float(softcap),
        float(logit_scale), backend, schedule, hidden.requires_grad, weight.requires_grad,
        bias is not None and bias.requires_grad,
        None if max_extra_memory is None else int(max_extra_memory),
    )  # fmt: skip
    names = metric_names(cfg, has_ref=ref_logprobs is not None, has_entropy=True,
                         has_is_weights=is_weights is not None)  # fmt: skip
    return loss, {n: metrics[i] for i, n in enumerate(names)}, logprobs, entropy
