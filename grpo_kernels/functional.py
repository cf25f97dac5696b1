"""Public functions: validation, layout handling and backend choice (docs/design.md §2).

The only layer that validates. Below it (autograd Functions, kernels, references) inputs are trusted.

Layouts
  padded: token tensors [B, T] (hidden [B, T, H]) with a [B, T] mask; advantages [B] or [B, T].
  packed: token tensors [N] (hidden [N, H]) with cu_seqlens [S + 1]; advantages [S] or [N].
Internally both become flat tokens with a sequence id per token.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from . import _agreement
from . import _checks as chk
from . import _custom_ops
from ._backend import resolve_backend
from ._params import gather_lm_head_param
from .config import TORCH_ONLY_RATIO_LEVELS, PolicyLossConfig
from .ops import lm_head as lm_head_ops
from .ops.lm_head.function import LMHeadFunction
from .ops.loss_head.reference import policy_loss_reference

logger = logging.getLogger("grpo_kernels")


@dataclass
class LogProbsOutput:
    """What ``fused_linear_logprobs`` returns.

    Attributes:
        logprobs: fp32, the shape of ``targets``: log softmax(z)[target] per token (differentiable);
            exactly 0 where not computed (mask 0 or target == ignore_index).
        entropy: fp32, the shape of ``targets``: -sum_v p_v log p_v of softmax(z) per token
            (differentiable), 0 where not computed; None when ``compute_entropy=False``.
    """

    logprobs: torch.Tensor  # fp32, shape of targets; 0 where not computed (mask 0 / ignore_index)
    entropy: torch.Tensor | None  # fp32, shape of targets; None when compute_entropy=False


@dataclass
class GRPOLossOutput:
    """What ``grpo_loss`` and ``fused_linear_grpo_loss`` return.

    Attributes:
        loss: 0-d fp32, differentiable: the aggregated policy loss, plus kl_coef x the KL term, minus
            entropy_coef x the entropy term (each aggregated with its own mode), scaled by the normalizers
            (see ``num_tokens`` etc.). Call ``.backward()`` on it (or on a sum of micro-batch losses).
        metrics: detached 0-d fp32 tensors, means over valid tokens (or over sequences for the sequence
            ratio levels, as TRL), each present only when the config computes it:

            ============================= ====================================================================
            name (TRL's where it has one) definition
            ============================= ====================================================================
            policy_loss                   the aggregated policy term (verl ``actor/pg_loss``)
            kl                            mean KL to the reference (estimator ``kl_estimator``); with ref
            kl_loss                       the aggregated KL term that enters the loss (kl_coef > 0)
            entropy                       mean token entropy, when entropy is given or computed
            entropy_loss                  the aggregated entropy term (entropy_coef != 0)
            ppo_kl                        mean of -log r (old minus new log-prob: verl ``actor/ppo_kl``)
            ratio/mean, ratio/min, /max   the importance ratio r (1, 1, 1 for an all-masked batch)
            clip_ratio/low_mean           tokens with r < 1 - clip_low and A < 0 (TRL ``clip_ratio/low_mean``;
                                          dppo: the trust region drops them, A < 0)
            clip_ratio/high_mean          tokens with r > 1 + clip_high and A > 0 (TRL ``clip_ratio/high_mean``;
                                          dppo: dropped, A > 0)
            clip_ratio/region_mean        either of the two (TRL ``clip_ratio/region_mean``)
            clip_ratio/low_min, high_max  per-sequence extremes of the two (TRL's names)
            clip_ratio/dual_mean          tokens where verl's dual clip binds (dual_clip set)
            clip_ratio/any_mean           CISPO: tokens whose weight is capped (cispo_form="mask": zeroed)
            is_weight/mean, min, max      sampler importance weights (is_level or is_gate set, or
                                          is_weights given)
            is_weight/masked_frac         tokens whose weight is 0 with is_mode="mask"
            is_weight/gated_frac          tokens the sampler gate drops (is_gate set)
            ratio_kl, ratio_kl_loss       the squared log-ratio penalty: mean of lr^2 / 2, and its
                                          aggregated term (ratio_kl_coef > 0)
            selection/...                 fractions kept or dropped by token selection (top entropy, Lopti,
                                          off-policy masking, Clip-Cov / KL-Cov)
            ppo_kl_abs                    KL-Cov: mean |log r|
            vespo/phi_seq_mean            VESPO: mean sequence weight phi
            dpo/pairs, reward_margin,     group DPO: preference pairs, mean beta x margin, share of pairs
            dpo/accuracy                  ranked right
            ============================= ====================================================================

        logprobs: detached fp32 per-token log-probs, in the layout of the inputs (what the loss used).
        entropy: detached fp32 per-token entropy, or None when neither given nor computed.
    """

    loss: torch.Tensor  # 0-d, differentiable
    metrics: dict[str, torch.Tensor]  # detached 0-d fp32 tensors (TRL's names where TRL has one)
    logprobs: torch.Tensor  # detached per-token log-probs, layout of the inputs
    entropy: torch.Tensor | None  # detached per-token entropy (None if neither given nor computed)


# ------------------------------------------------------------------------------------------------
# fused_linear_logprobs
# ------------------------------------------------------------------------------------------------


def _check_lm_head_operands(hidden, weight, targets, bias) -> tuple[int, int]:
    """hidden [..., H], weight [V, H], targets [...] (hidden's leading shape), bias [V]; one dtype.
    Returns (V, H)."""
    chk.check_tensor("hidden", hidden, dtypes=chk.FLOAT_DTYPES)
    chk.check_tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=2)
    chk.check_tensor("targets", targets)
    vocab, hidden_size = weight.shape
    if hidden.dim() < 2 or hidden.shape[-1] != hidden_size:
        chk.fail(
            f"hidden must be [..., H] with H = weight.shape[1] = {hidden_size}: its last dimension must equal "
            f"weight.shape[1], got shape {tuple(hidden.shape)}"
        )
    chk.check_shape("targets", targets, hidden.shape[:-1], "hidden[..., 0]")
    if bias is not None:
        chk.check_tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
        chk.check_shape("bias", bias, (vocab,), "weight.shape[0]")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        chk.fail(
            f"hidden, weight and bias must share one dtype, got {hidden.dtype}, {weight.dtype}"
            + ("" if bias is None else f", {bias.dtype}")
        )
    return vocab, hidden_size


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    compute_entropy: bool = True,
    check_finite: bool = True,
    tp_group: torch.distributed.ProcessGroup | None = None,
    batch_invariant: bool = False,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    backend: str = "auto",
) -> LogProbsOutput:
    """Per-token log p(target) and entropy of the LM head's softmax, without the [tokens, V] logits.

    z = (hidden @ weight.T + bias) / temperature (with the model's logit transform, see ``softcap``);
    logprobs = log softmax(z)[target], entropy = -sum_v p_v log p_v, both from fp32 statistics kept in
    the GEMM accumulators. Differentiable w.r.t. hidden, weight and bias (and nothing else).

    Alignment with a causal LM: the hidden state at position t predicts token t + 1, so for completion
    tokens ``completion_ids[:, j]`` pass the backbone's last hidden states at positions P - 1 + j (P the
    prompt length), i.e. ``hidden = last_hidden_state[:, P - 1 : -1]`` and ``targets = completion_ids``.

    Args:
        hidden: [..., H] bf16 / fp16 / fp32, the backbone's last hidden states (after the final norm).
        weight: [V, H], the LM-head weight (``model.get_output_embeddings().weight``), same dtype as
            hidden; an FSDP2 DTensor is gathered, a DeepSpeed ZeRO-3 stub is refused (call inside the forward).
        targets: [...] int64 token ids, the shape of hidden without H.
        bias: optional [V] LM-head bias; -inf forbids a token (-inf for every token is refused by
            check_finite: nothing could be sampled).
        temperature: > 0, the sampling temperature (the sampler's, so that log-probs match it). Default 1.
        mask: optional bool / 0-1 [...]: tokens with 0 are skipped (never multiplied) and get 0.
        ignore_index: targets equal to it are skipped like mask 0 (default -100, as TRL / transformers).
        compute_entropy: compute the entropy too (default True; False saves a little work).
        check_finite: raise on a NaN / inf in hidden (valid tokens) or weight before any work (checked on
            the device, read with the call's one host read; default True).
        tp_group: a torch.distributed process group over which the vocabulary is sharded (Megatron /
            torchtitan tensor parallelism): ``weight`` / ``bias`` are this rank's contiguous block of the
            full head's rows (rank r's block follows ranks 0..r-1's, sizes may differ), ``targets`` are
            global ids and hidden / targets / mask are the same on every rank. Results are those of the
            full head, identical on every rank; grad_hidden is the full gradient (all-reduced inside);
            grad_weight / grad_bias are the local block's. Communication is O(tokens). The ranks check
            in the call's first collective that they agree (fingerprints of the inputs, distinct blocks)
            and raise the same error on every rank when they do not, or when one rank's inputs fail a
            check (README "Scaling out"; GRPO_KERNELS_CHECK_AGREEMENT=0 turns the fingerprints off).
        batch_invariant: each token's log-prob and entropy bitwise the same whatever else is in the batch
            (size, other sequences, padding, packing): fixed reduction orders on both backends, at a cost
            (grpo_kernels/ops/lm_head/README.md, "Batch-invariant mode"); gradients are deterministic.
        softcap: the model's final logit soft-cap (Gemma 2 / 3 ``final_logit_softcapping``): z = softcap x
            tanh(logit_scale x x / softcap) / temperature, x = hidden @ weight.T + bias. With a softcap a
            -inf bias gives the finite logit -softcap / temperature, as transformers' Gemma forward.
            softcap / temperature must not exceed 2^100 (1.3e30) and logit_scale / softcap must lie in
            [2^-126, 2^100] (refused before the work; ops/lm_head/README.md, "Numbers at the edges").
        logit_scale: the model's logit multiplier (Granite's 1 / logits_scaling); default 1. Without a
            softcap, logit_scale / temperature above 2^100 is refused, and above 2^16 it is refused when its
            product with a bound on |hidden @ weight.T + bias| exceeds 2^100 (the kernels' logit limit).
        backend: "auto" (Triton on CUDA, PyTorch elsewhere, said once as a ``BackendFallbackWarning``),
            "triton" or "torch".

    Returns:
        LogProbsOutput: ``logprobs`` and ``entropy`` (fp32, the shape of targets, 0 on skipped tokens).

    Raises:
        ValueError: on a bad shape, dtype, device, temperature, NaN input (with check_finite) or option,
            before any heavy work, naming the offending argument (and its worst element).
    """
    type_error = None  # eager: raised inside the group's first check below, so that every rank raises it
    try:  # types first, the same check eager and compiled (grpo_kernels/_custom_ops.py)
        _check_argument_types(
            tensors=dict(hidden=hidden, weight=weight, targets=targets), optional_tensors=dict(bias=bias, mask=mask),
            floats=dict(temperature=temperature, logit_scale=logit_scale), optional_floats=dict(softcap=softcap),
            ints=dict(ignore_index=ignore_index), strings=dict(backend=backend),
            flags=dict(compute_entropy=compute_entropy, check_finite=check_finite, batch_invariant=batch_invariant),
        )  # fmt: skip
        if torch.compiler.is_compiling():
            _custom_ops.refuse_untraceable(tp_group, weight=weight, bias=bias)
    except ValueError as error:
        if torch.compiler.is_compiling():  # raised when the compiled graph runs, as eager raises it
            refused = _refused(str(error), targets)
            return LogProbsOutput(refused, refused)
        type_error = error
    if torch.compiler.is_compiling():  # one custom op: no graph break (grpo_kernels/_custom_ops.py)
        return LogProbsOutput(*_custom_ops.compiled_logprobs(
            hidden, weight, targets, bias, temperature, mask, ignore_index, compute_entropy, check_finite,
            batch_invariant, softcap, logit_scale, backend))  # fmt: skip
    group = _check_group("tp_group", tp_group)  # None also for a 1-rank group
    agreement = None if group is None else _agreement.Agreement(group, "tp_group", "fused_linear_logprobs")
    checks = chk.DeviceChecks()  # the value checks, read with the valid-token count (the call's one host read)
    try:  # with tp_group a failure here is carried by the first collective: every rank raises it
        if type_error is not None:
            raise type_error
        weight = gather_lm_head_param("weight", weight, tp_group)  # FSDP2 DTensor / ZeRO-3 (see _params.py)
        bias = gather_lm_head_param("bias", bias, tp_group)
        vocab, hidden_size = _check_lm_head_operands(hidden, weight, targets, bias)
        _check_temperature(temperature)
        device = chk.check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias, mask=mask)
        if targets.numel() == 0:
            chk.fail("targets is empty: nothing to compute")
        valid = targets != ignore_index
        if mask is not None:
            chk.check_tensor("mask", mask)
            chk.check_shape("mask", mask, targets.shape, "targets")
            valid = valid & chk.check_mask("mask", mask, checks)
        if group is None:
            chk.check_targets("targets", targets, vocab, valid, checks)
        else:  # against the whole vocabulary, after the exchange; the dtype now
            chk.check_targets("targets", targets[:0], 0, valid[:0], checks)
        if check_finite:
            chk.check_finite("hidden", hidden, valid[..., None], checks=checks)
            chk.check_finite("weight", weight, checks=checks)
            if bias is not None:  # -inf forbids a token (p = 0 for it), a common use: allowed
                chk.check_finite("bias", bias, allow_neg_inf=True, checks=checks)
                _check_bias_allows_a_token(bias, softcap, vocab_parallel=group is not None, checks=checks)
        _check_flag("batch_invariant", batch_invariant)
        _check_transform(softcap, logit_scale)
        _check_logit_limits(softcap, logit_scale, temperature, hidden, weight, bias)
        resolved = resolve_backend(backend, device, "fused_linear_logprobs")
        # the call's one host read: the checks' flags and the valid-token count (the compaction's size)
        (n_valid,) = checks.read(valid.sum())
        n_valid = n_valid[0]
        if agreement is not None:
            agreement.tensors.update(hidden=hidden, targets=targets, mask=valid)
            agreement.values.update(temperature=float(temperature), softcap=softcap, logit_scale=logit_scale,
                                    ignore_index=ignore_index, compute_entropy=compute_entropy,
                                    check_finite=check_finite, batch_invariant=batch_invariant, backend=resolved,
                                    bias_present=bias is not None)  # fmt: skip
            agreement.block, agreement.targets = weight, (targets, valid)
    except Exception as exc:
        exc = checks.earlier(exc)  # a value check made before it that fails speaks first, as before
        if agreement is None:
            raise exc
        agreement.failed(exc)
    layout = _vocab_layout(agreement, 0 if agreement is None or agreement.failure else weight.shape[0])
    if layout is not None:
        vocab = layout.vocab_total
        layout.check_targets(lambda: chk.check_targets("targets", targets, vocab, valid))
    impl = _lm_impl(resolved, layout, batch_invariant, softcap, logit_scale)

    flat_hidden = hidden.reshape(-1, hidden_size)
    flat_targets = targets.reshape(-1)
    flat_valid = valid.reshape(-1)
    all_valid = n_valid == flat_valid.numel()
    # the valid rows, their count known: no second read
    rows = None if all_valid else torch.nonzero_static(flat_valid, size=n_valid).squeeze(-1)
    # compact the valid rows: masked tokens are never multiplied
    h = flat_hidden if all_valid else flat_hidden.index_select(0, rows)
    y = (flat_targets if all_valid else flat_targets.index_select(0, rows)).long()
    logprobs, entropy = LMHeadFunction.apply(h, weight, bias, y, float(temperature), impl, compute_entropy)

    def scatter(x):
        if x is None:
            return None
        if all_valid:
            return x.reshape(targets.shape)
        full = torch.zeros(flat_targets.shape[0], dtype=x.dtype, device=x.device)
        return full.index_put((rows,), x).reshape(targets.shape)

    return LogProbsOutput(scatter(logprobs), scatter(entropy))


@dataclass
class _VocabLayout:
    group: object
    sizes: list  # every rank's block size, in group order
    rank: int
    agreement: _agreement.Agreement
    rows: list  # every rank's row of the exchange (grpo_kernels/_agreement.py)

    @property
    def vocab_total(self) -> int:
        return sum(self.sizes)

    def check_targets(self, check) -> None:
        """Target ids against the whole vocabulary, known only after the exchange: every rank sees every
        rank's smallest and largest id, so all raise together (the first failing rank's message)."""
        total = self.vocab_total
        if any(row["target_min"] < 0 or row["target_max"] >= total for row in self.rows):
            self.agreement.fail_together(check)


def _check_group(name: str, group):
    """A process group argument: None, or a ProcessGroup of an initialised torch.distributed; returns None
    for a 1-rank group (the same as none)."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        chk.fail(f"{name} was given but torch.distributed is not initialised (init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        chk.fail(f"{name} must be a torch.distributed ProcessGroup (or None), got {type(group).__name__}")
    return None if dist.get_world_size(group) == 1 else group


def _vocab_layout(agreement: _agreement.Agreement | None, local_vocab: int) -> _VocabLayout | None:
    """None without vocabulary parallelism (also for a 1-rank group); else every rank's block size from
    the call's first collective, which also carries the ranks' agreement (raises the same error on every
    rank when a rank failed its checks or the ranks disagree)."""
    if agreement is None:
        return None
    import torch.distributed as dist

    rows = agreement.exchange(local_vocab)
    sizes = [row["size"] for row in rows]
    return _VocabLayout(agreement.group, sizes, dist.get_rank(agreement.group), agreement, rows)


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        chk.fail(f"{name} must be True or False (a bool), got {type(value).__name__}")


def _type_name(x) -> str:  # builtins.list, numpy.ndarray, torch.Tensor: where the type comes from
    return f"{type(x).__module__}.{type(x).__name__}"


def _check_argument_types(*, tensors=None, optional_tensors=None, floats=None, optional_floats=None, ints=None,
                          optional_bytes=None, counts=None, optional_counts=None, flags=None,
                          strings=None) -> None:  # fmt: skip
    """The arguments' Python types, before anything converts them, named in the error. The same function
    runs eager and while torch.compile traces (where a failure becomes grpo_kernels::refuse, raising this
    ValueError when the graph runs): types only, so no message formats a number (a traced one may be
    symbolic); the values' ranges are checked by the eager code, which the compiled op runs."""
    for name, x in (tensors or {}).items():
        if not isinstance(x, torch.Tensor):
            chk.fail(f"{name} must be a torch.Tensor, got {_type_name(x)}")
    for name, x in (optional_tensors or {}).items():
        if x is not None and not isinstance(x, torch.Tensor):
            chk.fail(f"{name} must be a torch.Tensor, got {_type_name(x)}")
    for optional, group in ((False, floats), (True, optional_floats)):
        for name, x in (group or {}).items():
            if (x is None and optional) or (isinstance(x, (int, float)) and not isinstance(x, bool)):
                continue
            per_call = " (one per call)" if isinstance(x, torch.Tensor) else ""
            chk.fail(f"{name} must be a Python float{' or None' if optional else ''}{per_call}, got {_type_name(x)}")
    for name, x in (ints or {}).items():
        if isinstance(x, bool) or not isinstance(x, int):
            chk.fail(f"{name} must be a Python int, got {_type_name(x)}")
    for name, x in (optional_bytes or {}).items():  # a number of bytes: an int (its range checked later)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
            chk.fail(f"{name} must be None or a number of bytes (a Python int), got {_type_name(x)}")
    for name, x in (counts or {}).items():
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            chk.fail(f"{name} must be a number, got {_type_name(x)}")
    for name, x in (optional_counts or {}).items():
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                chk.fail(f"{name} must be a number or a 1-element tensor, got shape {tuple(x.shape)}")
            if torch.compiler.is_compiling():  # its value would be a data-dependent graph break
                chk.fail(f"{name} as a tensor is not supported inside torch.compile: pass a Python number")
        elif not (x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))):
            chk.fail(f"{name} must be a number, a 1-element tensor or None, got {_type_name(x)}")
    for name, x in (flags or {}).items():
        _check_flag(name, x)
    for name, x in (strings or {}).items():
        if not isinstance(x, str):
            chk.fail(f"{name} must be a str, got {_type_name(x)}")


def _refused(message: str, like) -> torch.Tensor:
    """Under torch.compile: the op that raises ValueError(message) when the graph runs, as an output of the
    shape of `like` (when it is a tensor) so that the traced step around the call still traces."""
    out = _custom_ops.refuse_op(message)
    return out.expand(like.shape) if isinstance(like, torch.Tensor) else out


def _refused_loss(message: str, like, config, ref_logprobs, entropy, is_weights) -> GRPOLossOutput:
    from .ops.loss_head.reference import metric_names

    refused = _refused(message, like)
    loss = refused.sum()
    names = ()
    if isinstance(config, PolicyLossConfig) or config is None:
        names = metric_names(config or _DEFAULT_CONFIG, has_ref=ref_logprobs is not None,
                             has_entropy=entropy is not None, has_is_weights=is_weights is not None)  # fmt: skip
    return GRPOLossOutput(loss, {n: loss for n in names}, refused, refused)


def _check_transform(softcap, logit_scale) -> None:
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale)):
        if value is None and name == "softcap":
            continue
        if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)):
            chk.fail(f"{name} must be a Python float{' or None' if name == 'softcap' else ''}, got {type(value).__name__}")
        if not (value > 0 and value != float("inf")):
            chk.fail(f"{name} must be a finite number > 0, got {value!r}")


# The largest logit magnitude the backends take: their sentinels (a forbidden token -2^102, a padding column
# -2^104, ops/lm_head/triton_common.py) sit at least 2^101 below every logit and all their differences stay finite.
LOGIT_LIMIT = 2.0**100
FLOAT32_TINY = 2.0**-126  # float32's smallest normal number
# logit_scale / temperature above which the logits' bound is computed (one pass over hidden and weight, a
# host sync): below it a logit reaches LOGIT_LIMIT only if |hidden @ weight.T + bias| exceeds 2^84
SCALE_BOUND_CHECKED_ABOVE = 2.0**16


def _check_logit_limits(softcap, logit_scale, temperature, hidden, weight, bias) -> None:
    """Scalars near the float32 limit refused before any work (README.md, "Numbers at the edges"): with a
    soft cap the logits lie in [-softcap / T, softcap / T] and the kernels use logit_scale / softcap; without
    one a large logit_scale / T is refused when the bound on the logits (max row norm of hidden x max row
    norm of weight + max |bias|) times it exceeds LOGIT_LIMIT."""
    limit = f"2^100 = {LOGIT_LIMIT:.3g}, the largest logit magnitude the kernels take"
    if softcap is not None:
        cap_out, cap_in = softcap / temperature, logit_scale / softcap
        if cap_out > LOGIT_LIMIT:
            chk.fail(f"softcap / temperature = {cap_out:.3g} exceeds {limit} (softcap={softcap:g}, "
                     f"temperature={temperature:g})")  # fmt: skip
        if not FLOAT32_TINY <= cap_in <= LOGIT_LIMIT:
            chk.fail(f"logit_scale / softcap = {cap_in:.3g} is outside [2^-126, 2^100] = [{FLOAT32_TINY:.3g}, "
                     f"{LOGIT_LIMIT:.3g}] (float32's normal range, bounded as the logits): logit_scale="
                     f"{logit_scale:g}, softcap={softcap:g}")  # fmt: skip
        return
    scale = logit_scale / temperature
    if scale > LOGIT_LIMIT:
        chk.fail(f"logit_scale / temperature = {scale:.3g} exceeds {limit} (logit_scale={logit_scale:g}, "
                 f"temperature={temperature:g})")  # fmt: skip
    if scale > SCALE_BOUND_CHECKED_ABOVE:
        flat = hidden.reshape(-1, hidden.shape[-1])
        bound = float(flat.double().norm(dim=-1).max()) * float(weight.double().norm(dim=-1).max())
        if bias is not None:
            finite = bias[torch.isfinite(bias)]
            bound += float(finite.double().abs().max()) if finite.numel() else 0.0
        if bound * scale > LOGIT_LIMIT:
            chk.fail(f"logit_scale / temperature = {scale:.3g} times the bound {bound:.3g} on |hidden @ weight.T + "
                     f"bias| (max row norms) exceeds {limit}: the logits could overflow")  # fmt: skip


def _check_bias_allows_a_token(bias, softcap, vocab_parallel: bool, checks: chk.DeviceChecks | None = None) -> None:
    """A bias of -inf everywhere (no soft cap) leaves no token to sample: the softmax is undefined; refused
    (with check_finite). Without the check both backends give the same defined values: every logit is the
    forbidden-token sentinel, so the row is uniform over V (log-prob -log V, entropy log V). With `checks`:
    in the call's one read."""
    if bias is None or softcap is not None or vocab_parallel:  # capped: -softcap / T each, a uniform row
        return
    if checks is not None:
        checks.add((bias == float("-inf")).all(), lambda: _check_bias_allows_a_token(bias, softcap, vocab_parallel))
    elif bool((bias == float("-inf")).all()):
        chk.fail(f"bias is -inf for all {bias.numel()} tokens: every token is forbidden, so softmax(z) is "
                 "undefined (leave at least one token finite)")  # fmt: skip


def _lm_impl(resolved: str, layout: _VocabLayout | None, batch_invariant: bool = False, softcap=None,
             logit_scale: float = 1.0):  # fmt: skip
    """The backend module, wrapped (innermost first) for the batch-invariant mode, the logit transform and
    the vocabulary-parallel head."""
    impl = lm_head_ops.get_impl(resolved)
    if batch_invariant:
        from .ops.lm_head.batch_invariant import BatchInvariant

        impl = BatchInvariant(impl)
    if softcap is not None or logit_scale != 1.0:
        from .ops.lm_head.transform import LogitTransform

        impl = LogitTransform(impl, softcap, logit_scale)
    if layout is None:
        return impl
    from .ops.lm_head.vocab_parallel import VocabParallel

    return VocabParallel(impl, layout.group, layout.sizes, layout.rank)


class DistributedNormalizerWarning(UserWarning):
    """A loss ran on several data-parallel processes with its local token / sequence counts.

    Each rank then normalises by its own count and the averaged gradient is not the gradient of the
    global batch's loss (unless every rank has the same count). Pass ``num_tokens=`` /
    ``num_sequences=`` (the whole optimizer step's counts, all ranks) and ``dp_size=K``. Warned once per
    process; a valid choice when intended (silence it with ``warnings.filterwarnings``)."""


_warned_local_normalizers = False


def _warn_local_normalizers(cfg: PolicyLossConfig, normalizers: dict, tp_group) -> None:
    """Once per process: torch.distributed has several ranks but the loss normalises by this rank's
    counts (DDP / FSDP then average per-rank means: not the single-process loss)."""
    global _warned_local_normalizers
    if _warned_local_normalizers or normalizers["dp_size"] != 1:
        return
    if normalizers["num_tokens"] is not None or normalizers["num_sequences"] is not None:
        return
    if "length-pow" in (cfg.loss_agg_mode, cfg.entropy_agg_mode, cfg.kl_agg_mode) or cfg.loss_type == "group_dpo":
        return  # these normalise by local counts by definition (num_tokens / num_sequences are refused)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if tp_group is not None:
        world //= max(1, dist.get_world_size(tp_group))
    if world <= 1:
        return
    _warned_local_normalizers = True
    warnings.warn(
        f"grpo_kernels: torch.distributed runs {world} data-parallel ranks but this loss "
        f"(loss_agg_mode={cfg.loss_agg_mode!r}) normalises by this rank's own token / sequence counts, and "
        "DDP / FSDP average the ranks' gradients: that is not the loss of the whole batch. Pass "
        "num_tokens= (valid tokens of the optimizer step over all ranks and micro-batches), num_sequences= "
        f"and dp_size={world} (the ranks whose gradients are averaged). Said once per process; filter "
        "grpo_kernels.DistributedNormalizerWarning if local normalisation is what you want.",
        DistributedNormalizerWarning,
        stacklevel=3,
    )


# ------------------------------------------------------------------------------------------------
# grpo_loss and fused_linear_grpo_loss
# ------------------------------------------------------------------------------------------------


@dataclass
class _FlatBatch:
    """Loss-head inputs as flat tokens [N] with their sequence ids (validated)."""

    token_shape: tuple  # the caller's token layout, to reshape per-token outputs back
    valid: torch.Tensor  # [N] bool
    seq_index: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [S + 1] int64 token offsets of the sequences
    num_seqs: int
    advantages: torch.Tensor  # [N] fp32
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    is_weights: torch.Tensor | None
    token_weights: torch.Tensor | None
    normalizers: dict  # Python numbers after read_checks (a 1-element tensor given is read there)
    checks: chk.DeviceChecks  # the value checks, read once by _read_checks
    nonempty: torch.Tensor | None = None  # 0-d: sequences with a valid token (num_sequences given), read there
    host: object = None  # ops.fused.function.HostIndex: the layout read with the checks (fused schedules)


def _check_temperature(temperature) -> None:
    if isinstance(temperature, torch.Tensor) or isinstance(temperature, bool):
        chk.fail(f"temperature must be a Python float (one temperature per call), got {type(temperature).__name__}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or temperature == float("inf"):
        chk.fail(f"temperature must be a finite number > 0, got {temperature!r}")


_DEFAULT_CONFIG = PolicyLossConfig()  # frozen: one shared instance (built outside any compiled region)


def _check_config(config) -> PolicyLossConfig:
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, PolicyLossConfig):
        chk.fail(f"config must be a grpo_kernels.PolicyLossConfig, got {type(config).__name__}")
    return config


def _flatten_batch(
    token_shape: tuple,
    mask,
    advantages,
    cu_seqlens,
    per_token: dict,
    config: PolicyLossConfig,
    normalizers: dict,
    check_finite: bool,
    device,
    checks: chk.DeviceChecks,
    token_name: str = "logprobs",
) -> _FlatBatch:
    """Validate the loss-head inputs of either layout and flatten them (see module docstring)."""
    packed = cu_seqlens is not None
    if packed and len(token_shape) != 1:
        chk.fail(f"with cu_seqlens (packed layout) token tensors must be 1-D [N]: {token_name} has shape {token_shape}")
    if not packed and len(token_shape) != 2:
        chk.fail(
            f"token tensors must be [B, T] (padded layout) or [N] with cu_seqlens (packed): {token_name} has shape "
            f"{token_shape}"
        )
    n_tokens = 1
    for d in token_shape:
        n_tokens *= d
    if n_tokens == 0:
        chk.fail(f"empty batch: token tensors have shape {token_shape}")
    chk.check_tensor("mask", mask)
    chk.check_shape("mask", mask, token_shape, token_name)
    valid = chk.check_mask("mask", mask, checks).reshape(-1)
    if packed:
        seq_index = chk.cu_seqlens_to_index(cu_seqlens.to(device), n_tokens, checks)
        num_seqs = cu_seqlens.numel() - 1
        offsets = cu_seqlens.to(device=device, dtype=torch.int64)
    else:
        batch, length = token_shape
        seq_index = torch.arange(batch, device=device).repeat_interleave(length)
        num_seqs = batch
        offsets = torch.arange(batch + 1, device=device, dtype=torch.int64) * length

    chk.check_tensor("advantages", advantages, dtypes=chk.FLOAT_DTYPES)
    if tuple(advantages.shape) == (num_seqs,):
        adv = advantages.float()[seq_index]
    elif tuple(advantages.shape) == tuple(token_shape):
        adv = advantages.float().reshape(-1)
    else:
        chk.fail(
            f"advantages must be per sequence {(num_seqs,)} or per token {tuple(token_shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if check_finite:
        chk.check_finite("advantages", adv, valid, checks=checks)

    flat = {}
    for name, x in per_token.items():
        if x is None:
            flat[name] = None
            continue
        chk.check_tensor(name, x, dtypes=chk.FLOAT_DTYPES)
        chk.check_shape(name, x, token_shape, token_name)
        flat[name] = x.reshape(-1)
        if check_finite:
            # NaN sampler log-probs mean "could not score this token" (TRL): allowed, handled; not where the
            # ratio is measured against them (ratio_anchor="rollout": no ratio without the sampler's log-prob)
            unscored_ok = name == "rollout_logprobs" and config.ratio_anchor != "rollout"
            where = valid & ~torch.isnan(flat[name]) if unscored_ok else valid
            chk.check_finite(name, flat[name], where, checks=checks)

    # global normalizers: any finite value > 0 taken as given (no clamp), the rest refused (a tensor's value
    # in _read_checks, with the call's one host read)
    for name in ("num_tokens", "num_sequences"):
        if isinstance(normalizers[name], torch.Tensor):
            if normalizers[name].numel() != 1:
                chk.fail(f"{name} must be a number or a 1-element tensor, got shape {tuple(normalizers[name].shape)}")
        else:
            _check_normalizer(name, normalizers[name])
    chk.check_count("dp_size", normalizers["dp_size"], integer=True, meaning=" (data-parallel ranks)")
    local_only = ("length-pow" in (config.loss_agg_mode, config.entropy_agg_mode, config.kl_agg_mode)
                  or config.loss_type == "group_dpo")  # fmt: skip
    if local_only and (normalizers["num_tokens"] is not None or normalizers["num_sequences"] is not None):
        chk.fail(
            "num_tokens / num_sequences are not defined for loss_agg_mode='length-pow' or loss_type='group_dpo': "
            "they normalise by local counts (times grad_accum_steps)"
        )
    if config.loss_type == "group_dpo" and num_seqs % config.group_size != 0:
        chk.fail(
            f"group_dpo: the batch holds {num_seqs} sequences, not a multiple of group_size={config.group_size} "
            "(groups must be laid out consecutively)"
        )
    chk.check_count("grad_accum_steps", normalizers["grad_accum_steps"], integer=True,
                    meaning=" (micro-batches per optimizer step)")
    # num_tokens is not bounded below by this call's count: an estimate of the step's count is a normaliser
    # too (TRL scales the generation batch's count by GA / steps_per_generation, which can fall below one
    # micro-batch's own count when GA < steps_per_generation)
    nonempty = None  # checked against num_sequences in _read_checks
    if normalizers["num_sequences"] is not None:
        nonempty = (torch.zeros(num_seqs, device=device).index_add(0, seq_index, valid.float()) > 0).sum()
    _check_inputs_used(config, flat)
    return _FlatBatch(
        token_shape=tuple(token_shape),
        valid=valid,
        seq_index=seq_index,
        cu_seqlens=offsets,
        num_seqs=num_seqs,
        advantages=adv,
        old_logprobs=flat.get("old_logprobs"),
        ref_logprobs=flat.get("ref_logprobs"),
        rollout_logprobs=flat.get("rollout_logprobs"),
        is_weights=flat.get("is_weights"),
        token_weights=flat.get("token_weights"),
        normalizers=normalizers,
        checks=checks,
        nonempty=nonempty,
    )


def _check_normalizer(name: str, value) -> None:
    meaning = {"num_tokens": " (the valid tokens of the whole optimizer step, or an estimate of them)",
               "num_sequences": " (the sequences of the whole optimizer step)"}[name]  # fmt: skip
    chk.check_count(name, value, minimum=None, meaning=meaning)


def _read_checks(batch: _FlatBatch, layout: bool = False) -> None:
    """The call's one host read (chk.DeviceChecks.read): the value checks' flags, the normalizers given as
    tensors, the count of non-empty sequences (num_sequences given) and, with `layout`, the batch's layout for
    the fused schedules' planners (cu_seqlens and the valid tokens before each position: batch.host). Raises
    a failing check's error (its message as before: the eager check runs on failure); the normalizers become
    Python numbers, checked here."""
    n = batch.normalizers
    given = [name for name in ("num_tokens", "num_sequences") if isinstance(n[name], torch.Tensor)]
    values = [n[name] for name in given] + ([] if batch.nonempty is None else [batch.nonempty])
    if layout:
        values += [batch.cu_seqlens, batch.valid.long().cumsum(0)]
    read = batch.checks.read(*values)
    for name, value in zip(given, read):
        n[name] = value[0]
        _check_normalizer(name, n[name])
    if batch.nonempty is not None:
        nonempty = read[len(given)][0]
        chk.check_global_count("num_sequences", n["num_sequences"], nonempty, "sequences with a valid token")
    if layout:
        from .ops.fused.function import HostIndex

        batch.host = HostIndex(read[-2], [0] + read[-1])


def _check_inputs_used(cfg: PolicyLossConfig, flat: dict) -> None:
    """Nothing silently ignored: inputs a configuration needs must be there, and inputs it would
    drop are refused."""
    if cfg.kl_coef > 0 and flat.get("ref_logprobs") is None:
        chk.fail(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    if cfg.loss_type == "group_dpo" and flat.get("ref_logprobs") is None:
        chk.fail("loss_type='group_dpo' needs ref_logprobs (DPO compares against the reference policy)")
    if cfg.is_level is not None and flat.get("rollout_logprobs") is None:
        chk.fail(f"is_level={cfg.is_level!r} needs rollout_logprobs (the sampler's log-probs)")
    if cfg.is_gate is not None and flat.get("rollout_logprobs") is None:
        chk.fail(f"is_gate={cfg.is_gate!r} needs rollout_logprobs (the sampler's log-probs)")
    if cfg.ratio_anchor == "rollout" and flat.get("rollout_logprobs") is None:
        chk.fail("ratio_anchor='rollout' needs rollout_logprobs (the ratio is measured against the sampler's log-probs)")
    if flat.get("rollout_logprobs") is not None and not cfg.uses_rollout_logprobs:
        chk.fail(
            "rollout_logprobs were given but nothing uses them: set is_level (TIS / MIS), is_gate, "
            "ratio_anchor='rollout' or off_policy_mask_threshold, or drop the argument"
        )
    if cfg.loss_type == "gmpo" and flat.get("token_weights") is not None:
        chk.fail("token_weights are not defined for gmpo (a sequence-level objective)")


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    config: PolicyLossConfig | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    dp_size: int = 1,
    grad_accum_steps: int = 1,
    check_finite: bool = True,
    backend: str = "auto",
    entropy_group: torch.distributed.ProcessGroup | None = None,
) -> GRPOLossOutput:
    """The GRPO-family policy loss on per-token log-probs (the loss head, without the LM head).

    The objective, its aggregation and its KL / entropy terms are set by ``config`` (formulas and
    gradients: grpo_kernels/ops/loss_head/README.md). Use it when you already have the log-probs;
    ``fused_linear_grpo_loss`` computes them from the hidden states in the same call. Its arguments
    advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, config, cu_seqlens, is_weights,
    token_weights, num_tokens, num_sequences, dp_size, grad_accum_steps, check_finite and entropy_group
    mean here what ``fused_linear_grpo_loss`` documents, the per-token ones in the layout of ``logprobs``.

    Args:
        logprobs: [B, T] (or [N] with cu_seqlens) fp32 / bf16 per-token log-probs of the current policy,
            differentiable.
        entropy: optional [B, T] per-token entropy; needed (and differentiable) when the config uses it
            (entropy_coef != 0 or top_entropy_quantile < 1); otherwise only reported as a metric.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns:
        GRPOLossOutput: ``loss`` (0-d, differentiable), ``metrics`` (see ``GRPOLossOutput``), the detached
        ``logprobs`` and ``entropy``.

    Raises:
        ValueError: on a bad shape, dtype, device or config, or a needed input missing, before any work.
    """
    type_error = None  # eager: raised inside the group's first check below, so that every rank raises it
    try:  # types first, the same check eager and compiled (grpo_kernels/_custom_ops.py)
        cfg = _check_config(config)
        _check_argument_types(
            tensors=dict(logprobs=logprobs, advantages=advantages, mask=mask),
            optional_tensors=dict(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                  rollout_logprobs=rollout_logprobs, entropy=entropy, cu_seqlens=cu_seqlens,
                                  is_weights=is_weights, token_weights=token_weights),
            counts=dict(dp_size=dp_size, grad_accum_steps=grad_accum_steps),
            optional_counts=dict(num_tokens=num_tokens, num_sequences=num_sequences),
            strings=dict(backend=backend), flags=dict(check_finite=check_finite),
        )  # fmt: skip
        if torch.compiler.is_compiling():
            _refuse_group_in_compile(entropy_group)
    except ValueError as error:
        if torch.compiler.is_compiling():  # raised when the compiled graph runs, as eager raises it
            return _refused_loss(str(error), logprobs, config, ref_logprobs, entropy, is_weights)
        type_error = error
    if torch.compiler.is_compiling():  # one custom op: no graph break (grpo_kernels/_custom_ops.py)
        loss, metrics = _custom_ops.compiled_grpo_loss(
            logprobs, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, entropy, cfg, cu_seqlens,
            is_weights, token_weights, num_tokens, num_sequences, dp_size, grad_accum_steps, check_finite,
            backend)  # fmt: skip
        return GRPOLossOutput(loss, metrics, logprobs.detach(), None if entropy is None else entropy.detach())
    entropy_agreement = _entropy_agreement(entropy_group, "grpo_loss")
    checks = chk.DeviceChecks()  # the value checks, read once by _read_checks (the call's one host read)
    try:  # with entropy_group a failure here is carried by its first collective: every rank raises it
        if type_error is not None:
            raise type_error
        chk.check_tensor("logprobs", logprobs, dtypes=chk.FLOAT_DTYPES)
        device = chk.check_same_device(
            logprobs=logprobs, advantages=advantages, mask=mask, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, entropy=entropy,
            cu_seqlens=cu_seqlens, is_weights=is_weights, token_weights=token_weights,
        )  # fmt: skip
        if cfg.needs_entropy and entropy is None:
            chk.fail(
                "this config needs the per-token entropy (entropy_coef != 0 or top_entropy_quantile < 1); pass entropy="
            )
        per_token = dict(
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
            entropy=entropy, is_weights=is_weights, token_weights=token_weights,
        )  # fmt: skip
        normalizers = dict(num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size,
                           grad_accum_steps=grad_accum_steps)  # fmt: skip
        batch = _flatten_batch(tuple(logprobs.shape), mask, advantages, cu_seqlens, per_token, cfg, normalizers,
                               check_finite, device, checks)  # fmt: skip
        flat_lp = logprobs.reshape(-1)
        if check_finite:
            chk.check_finite("logprobs", flat_lp, batch.valid, checks=batch.checks)
        _read_checks(batch)  # the call's one host read: raises a failing value check's error
        flat_entropy = None if entropy is None else entropy.reshape(-1)
        resolved = _loss_head_backend(cfg, backend, device, resolve_backend(backend, device, "grpo_loss"))
        _check_entropy_group(entropy_group, cfg)
        if entropy_agreement is not None:
            entropy_agreement.values.update(config=cfg, **_normalizer_values(normalizers))
    except Exception as exc:
        exc = checks.earlier(exc)  # a value check made before it that fails speaks first, as before
        if entropy_agreement is None:
            raise exc
        _agreement.join_failed(entropy_agreement, exc)
    _warn_local_normalizers(cfg, normalizers, None)
    out = _loss_head(flat_lp, flat_entropy, batch, cfg, resolved, entropy_agreement)
    return GRPOLossOutput(
        loss=out.loss,
        metrics=out.metrics,
        logprobs=logprobs.detach(),
        entropy=None if entropy is None else entropy.detach(),
    )


def _loss_head_backend(cfg: PolicyLossConfig, backend: str, device, resolved: str) -> str:
    """The loss head's backend: the resolved one, but PyTorch for the ratio levels the Triton kernel
    lacks (config.TORCH_ONLY_RATIO_LEVELS): said once under "auto", an error under "triton"."""
    if resolved == "triton" and cfg.ratio_level in TORCH_ONLY_RATIO_LEVELS:
        return resolve_backend(backend, device, f"the loss head with ratio_level={cfg.ratio_level!r}",
                               triton_implemented=False)  # fmt: skip
    return resolved


def _refuse_group_in_compile(entropy_group) -> None:
    if entropy_group is not None:
        chk.fail("entropy_group is not supported inside torch.compile (a process group is not an op argument): "
                 "call this function outside the compiled region")  # fmt: skip


def _entropy_agreement(entropy_group, function: str) -> _agreement.Agreement | None:
    """What this rank brings to entropy_group's first collective (the loss head's gather of the entropy
    counts): its config, normalizers and options must equal the other data-parallel ranks'."""
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(entropy_group, dist.ProcessGroup)):
        return None  # None, or not a group: refused by _check_entropy_group on this rank (no group to tell)
    group = _check_group("entropy_group", entropy_group)
    return None if group is None else _agreement.Agreement(group, "entropy_group", "the top-entropy quantile")


def _normalizer_values(normalizers: dict) -> dict:
    """The normalizers as plain numbers (a 1-element tensor is a number here): they must agree across ranks."""
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in normalizers.items()}


def _check_entropy_group(entropy_group, cfg: PolicyLossConfig) -> None:
    if entropy_group is None:
        return
    import torch.distributed as dist

    if cfg.top_entropy_quantile >= 1.0:
        chk.fail("entropy_group is only used with top_entropy_quantile < 1 (the quantile it takes over "
                 "processes); drop it or set the quantile")  # fmt: skip
    if not isinstance(entropy_group, dist.ProcessGroup):
        chk.fail(f"entropy_group must be a torch.distributed ProcessGroup, got {type(entropy_group).__name__}")


def _loss_head(flat_logprobs, flat_entropy, batch: _FlatBatch, cfg: PolicyLossConfig, backend: str,
               entropy_group=None):  # fmt: skip
    """The loss head on flat tokens: the fp32 reference (autograd) or the Triton kernel."""
    n = batch.normalizers
    if backend == "triton":
        from .ops.loss_head.function import LossHeadFunction
        from .ops.loss_head.reference import LossHeadOutput
        from .ops.loss_head.triton import loss_head_triton

        def run(need_grad_logprobs, need_grad_entropy):
            return loss_head_triton(
                flat_logprobs.detach(), batch.advantages, batch.valid, batch.cu_seqlens, batch.seq_index,
                batch.num_seqs, cfg, old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
                rollout_logprobs=batch.rollout_logprobs, is_weights=batch.is_weights,
                entropy=None if flat_entropy is None else flat_entropy.detach(), token_weights=batch.token_weights,
                num_tokens=n["num_tokens"], num_sequences=n["num_sequences"], dp_size=n["dp_size"],
                grad_accum_steps=n["grad_accum_steps"], need_grad_logprobs=need_grad_logprobs,
                need_grad_entropy=need_grad_entropy, entropy_group=entropy_group,
            )  # fmt: skip

        metrics: dict = {}
        loss = LossHeadFunction.apply(flat_logprobs, flat_entropy, run, metrics)
        return LossHeadOutput(loss, metrics)
    return policy_loss_reference(
        flat_logprobs, batch.advantages, batch.valid, batch.seq_index, batch.num_seqs, cfg,
        old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
        rollout_logprobs=batch.rollout_logprobs, is_weights=batch.is_weights, entropy=flat_entropy,
        token_weights=batch.token_weights, num_tokens=n["num_tokens"], num_sequences=n["num_sequences"],
        dp_size=n["dp_size"], grad_accum_steps=n["grad_accum_steps"], entropy_group=entropy_group,
    )  # fmt: skip


def _check_max_extra_memory(max_extra_memory, schedule: str) -> None:
    """max_extra_memory: None or an int number of bytes >= 0, with a schedule that plans with it."""
    if max_extra_memory is None:
        return
    if isinstance(max_extra_memory, bool) or not isinstance(max_extra_memory, int) or max_extra_memory < 0:
        chk.fail(f"max_extra_memory must be None or a number of bytes (an int >= 0, e.g. 3 * 2**30), got "
                 f"{max_extra_memory!r}")  # fmt: skip
    from .ops.fused.function import IN_PLACE_SCHEDULES

    if schedule != "auto" and schedule not in IN_PLACE_SCHEDULES:
        chk.fail(f"max_extra_memory is the goal schedule='auto' plans with (and the in-place schedules size "
                 f"their chunks to); schedule={schedule!r} does not use it")  # fmt: skip


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: PolicyLossConfig | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    dp_size: int = 1,
    grad_accum_steps: int = 1,
    check_finite: bool = True,
    tp_group: torch.distributed.ProcessGroup | None = None,
    batch_invariant: bool = False,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    backend: str = "auto",
    schedule: str = "auto",
    entropy_group: torch.distributed.ProcessGroup | None = None,
    max_extra_memory: int | None = None,
) -> GRPOLossOutput:
    """From the last hidden states to the GRPO-family loss in one call, without the [tokens, V] logits.

    LM-head statistics (log-probs, entropy from fp32 accumulators), the loss head (as ``grpo_loss``), and
    the LM-head gradients computed inside the forward (``backward`` scales them by grad_output).
    Differentiable w.r.t. hidden, weight and bias. The temperature is ``config.temperature``.

    Alignment with a causal LM: the hidden state at position t predicts token t + 1: for completion
    tokens ``completion_ids[:, j]`` pass ``hidden = last_hidden_state[:, P - 1 : -1]`` (P the prompt
    length) and ``targets = completion_ids`` (what TRL's and verl's log-prob paths compute).

    Args:
        hidden: [B, T, H] (or [N, H] with cu_seqlens) bf16 / fp16 / fp32 last hidden states (after the
            final norm), differentiable.
        weight: [V, H] LM-head weight, same dtype (an FSDP2 DTensor is gathered; a ZeRO-3 stub refused).
        targets: [B, T] int64 completion token ids (only positions with mask 1 are read).
        advantages: float [B] (one per sequence, broadcast over its tokens) or [B, T] per token
            (``gk.advantages.estimate``); [S] / [N] with cu_seqlens.
        mask: bool / 0-1 [B, T]: the completion tokens the loss counts (1) and the padding or
            tool-output tokens it skips (0). Skipped tokens contribute exactly 0 to loss and gradients.
        old_logprobs: [B, T] fp32 log-probs of the policy that sampled (or the previous update's), no grad;
            None means on-policy: ratio 1 in value, the gradient still flows (TRL / verl with one update).
        ref_logprobs: [B, T] the reference policy's log-probs; needed when ``config.kl_coef > 0`` (the KL
            term) or for ``loss_type="group_dpo"``; None otherwise.
        rollout_logprobs: [B, T] the inference engine's log-probs of the sampled tokens (vLLM / SGLang),
            for the sampler-mismatch corrections ``config.is_level`` / ``is_gate`` /
            ``off_policy_mask_threshold`` and the ratio with ``config.ratio_anchor="rollout"``; NaN marks a
            token the engine did not score (no correction for it; refused with the rollout anchor).
        config: a ``PolicyLossConfig`` (or a preset: ``PolicyLossConfig.dapo()``); default
            ``PolicyLossConfig()``: PPO clip 0.2, no KL, token-mean.
        cu_seqlens: int [S + 1] cumulative sequence lengths for packed inputs ([N] per-token tensors);
            None for padded [B, T] inputs.
        is_weights: optional [B, T] importance weights you computed (multiplied into the policy term).
        token_weights: optional [B, T] per-token weights of the policy term (process weights).
        num_tokens: the valid-token count of the whole optimizer step (all micro-batches and ranks), for
            the token-mean aggregations; None: this call's own count. Any finite value > 0 is taken as
            given (no clamp, so an estimate serves too: TRL's, the generation batch's count times GA /
            steps_per_generation, can fall below one micro-batch's own count, or below 1); 0, negative,
            inf and NaN are refused.
        num_sequences: the sequence count of the whole optimizer step, for the sequence-mean aggregations:
            finite, > 0, and at least this call's sequences with a valid token.
        dp_size: data-parallel ranks whose gradients are averaged (DDP / FSDP): the loss is multiplied by
            it so that the average is the gradient of the global loss. A whole number >= 1. Default 1.
        grad_accum_steps: micro-batches per optimizer step, used only when num_tokens / num_sequences
            are not given (local counts divided by it). A whole number >= 1. Default 1.
        check_finite: raise on NaN / inf in a valid token's input before any work (checked on the device,
            read with the call's one host read).
        bias: optional [V] LM-head bias.
        tp_group: vocabulary-parallel LM head, as in ``fused_linear_logprobs`` (weight / bias are this
            rank's block of rows, targets global ids, every per-token input the same on every rank); loss,
            metrics, log-probs and entropy are identical on every rank.
        entropy_group: with ``top_entropy_quantile < 1``, the data-parallel processes whose valid tokens the
            entropy quantile is taken over (TRL's ``get_high_entropy_mask`` gathers every process's);
            None: this call's tokens only. A collective: every rank of the group calls the function; the
            ranks check in its first all-gather that they agree on the config and the normalizers, and a
            rank whose inputs fail a check makes every rank raise its error.
        batch_invariant: as in ``fused_linear_logprobs``: each token's log-prob and entropy (so its ratio
            and per-token loss terms) bitwise independent of the rest of the batch and of the chunking; the
            aggregated loss depends on the batch by definition.
        softcap: the model's final logit soft-cap, as in ``fused_linear_logprobs``.
        logit_scale: the model's logit multiplier, as in ``fused_linear_logprobs``.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
        schedule: "auto", "one_pass" (per chunk of tokens, the logits kept between forward and
            backward: 3 GEMM units, an fp32 [V, H] grad_weight accumulator), "one_pass_inplace" (one pass,
            grad_weight accumulated in the weight's dtype in the gradient buffer itself, chunks sized to
            fill the memory goal), "one_pass_cublas" / "one_pass_cublas_inplace" (the same with the forward
            GEMM by cuBLAS into the chunk's fp32 logits and the statistics by a streaming kernel),
            "two_pass" (the backward recomputes the logits: 4 units), "low_memory" (two passes with the
            vocabulary outside in the backward: no fp32 [V, H] accumulator, grad_weight written once per
            block), "one_pass_dz" (one pass, dz formed inside the backward GEMMs: no [n, V] dz slab;
            opt-in until a GPU run has compared it) or "one_pass_dz_inplace" (the same with grad_weight
            summed in the weight's dtype as "one_pass_inplace": no fp32 [V, H] accumulator either; opt-in).
            "auto", when the weight needs a gradient on the Triton backend, takes the fastest schedule by
            the time model among those whose modelled peak extra memory fits ``max_extra_memory`` and,
            for the in-place ones, whose grad_weight error is no worse than plain PyTorch bf16 autograd's
            at that chunk count (the LM-head README, "What auto runs"); else one_pass where valid, else
            two_pass. The choice and its reason are logged at DEBUG on the "grpo_kernels" logger.
        max_extra_memory: the extra-memory goal in bytes (an int >= 0; beyond inputs and gradients) that
            ``schedule="auto"`` plans with and the in-place schedules size their chunks to; None: 1.5 GiB.

    Returns:
        GRPOLossOutput: ``loss`` (0-d, differentiable), ``metrics`` (see ``GRPOLossOutput``), and the
        detached per-token ``logprobs`` and ``entropy`` the loss used (fp32, the layout of targets).

    Raises:
        ValueError: on a bad shape, dtype, device, config or option, or a needed input missing, before any
            heavy work, naming the argument.
    """
    type_error = None  # eager: raised inside the group's first check below, so that every rank raises it
    try:  # types first, the same check eager and compiled (grpo_kernels/_custom_ops.py)
        cfg = _check_config(config)
        _check_argument_types(
            tensors=dict(hidden=hidden, weight=weight, targets=targets, advantages=advantages, mask=mask),
            optional_tensors=dict(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                  rollout_logprobs=rollout_logprobs, bias=bias, cu_seqlens=cu_seqlens,
                                  is_weights=is_weights, token_weights=token_weights),
            floats=dict(logit_scale=logit_scale), optional_floats=dict(softcap=softcap),
            counts=dict(dp_size=dp_size, grad_accum_steps=grad_accum_steps),
            optional_counts=dict(num_tokens=num_tokens, num_sequences=num_sequences),
            strings=dict(backend=backend, schedule=schedule), optional_bytes=dict(max_extra_memory=max_extra_memory),
            flags=dict(check_finite=check_finite, batch_invariant=batch_invariant),
        )  # fmt: skip
        if torch.compiler.is_compiling():
            _refuse_group_in_compile(entropy_group)
            _custom_ops.refuse_untraceable(tp_group, weight=weight, bias=bias)
    except ValueError as error:
        if torch.compiler.is_compiling():  # raised when the compiled graph runs, as eager raises it
            return _refused_loss(str(error), targets, config, ref_logprobs, True, is_weights)
        type_error = error
    if torch.compiler.is_compiling():  # one custom op: no graph break (grpo_kernels/_custom_ops.py)
        loss, metrics, logprobs, entropy = _custom_ops.compiled_fused_loss(
            hidden, weight, targets, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, bias, cfg,
            cu_seqlens, is_weights, token_weights, num_tokens, num_sequences, dp_size, grad_accum_steps,
            check_finite, batch_invariant, softcap, logit_scale, backend, schedule, max_extra_memory)  # fmt: skip
        return GRPOLossOutput(loss, metrics, logprobs, entropy)
    from .ops.fused.dispatch import SCHEDULES, run_fused

    group = _check_group("tp_group", tp_group)  # None also for a 1-rank group
    agreement = None if group is None else _agreement.Agreement(group, "tp_group", "fused_linear_grpo_loss")
    entropy_agreement = _entropy_agreement(entropy_group, "fused_linear_grpo_loss")
    checks = chk.DeviceChecks()  # the value checks, read with the layout by _read_checks (the call's one host read)
    try:  # with a group a failure here is carried by the first collective: every rank raises it
        if type_error is not None:
            raise type_error
        if schedule not in SCHEDULES:
            chk.fail(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        _check_max_extra_memory(max_extra_memory, schedule)
        if batch_invariant and "cublas" in schedule:
            chk.fail(f"schedule={schedule!r} is not available with batch_invariant=True (cuBLAS picks its "
                     "reduction order by shape); use 'auto', 'one_pass', 'one_pass_inplace' or 'two_pass'")  # fmt: skip
        weight = gather_lm_head_param("weight", weight, tp_group)  # FSDP2 DTensor / ZeRO-3 (see _params.py)
        bias = gather_lm_head_param("bias", bias, tp_group)
        vocab, hidden_size = _check_lm_head_operands(hidden, weight, targets, bias)
        device = chk.check_same_device(
            hidden=hidden, weight=weight, targets=targets, advantages=advantages, mask=mask,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, bias=bias,
            cu_seqlens=cu_seqlens, is_weights=is_weights, token_weights=token_weights,
        )  # fmt: skip
        per_token = dict(
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
            is_weights=is_weights, token_weights=token_weights,
        )  # fmt: skip
        normalizers = dict(num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size,
                           grad_accum_steps=grad_accum_steps)  # fmt: skip
        batch = _flatten_batch(tuple(targets.shape), mask, advantages, cu_seqlens, per_token, cfg, normalizers,
                               check_finite, device, checks, token_name="targets")  # fmt: skip
        if tp_group is not None and schedule == "low_memory":
            chk.fail("schedule='low_memory' is not available with tp_group (its vocabulary slabs would differ "
                     "across ranks); use 'auto', 'one_pass' or 'two_pass'")  # fmt: skip
        flat_targets = targets.reshape(-1)
        # with tp_group: the ids against the whole vocabulary after the exchange; the dtype now
        chk.check_targets("targets", flat_targets if group is None else flat_targets[:0],
                          vocab if group is None else 0, batch.valid if group is None else batch.valid[:0],
                          batch.checks)  # fmt: skip
        flat_hidden = hidden.reshape(-1, hidden_size)
        if check_finite:
            chk.check_finite("hidden", flat_hidden, batch.valid[:, None], checks=batch.checks)
            chk.check_finite("weight", weight, checks=batch.checks)
            if bias is not None:  # -inf forbids a token (p = 0 for it), a common use: allowed
                chk.check_finite("bias", bias, allow_neg_inf=True, checks=batch.checks)
                _check_bias_allows_a_token(bias, softcap, vocab_parallel=group is not None, checks=batch.checks)
        resolved = resolve_backend(backend, device, "fused_linear_grpo_loss")
        _check_flag("batch_invariant", batch_invariant)
        _check_transform(softcap, logit_scale)
        _check_logit_limits(softcap, logit_scale, cfg.temperature, hidden, weight, bias)
        head_backend = _loss_head_backend(cfg, backend, device, resolved)
        _check_entropy_group(entropy_group, cfg)
        # the call's one host read: the value checks (raising a failing one's error) and the batch's layout
        _read_checks(batch, layout=True)
        scalars = dict(config=cfg, temperature=cfg.temperature, softcap=softcap, logit_scale=logit_scale,
                       check_finite=check_finite, batch_invariant=batch_invariant, backend=resolved,
                       schedule=schedule, max_extra_memory=max_extra_memory,
                       **_normalizer_values(normalizers))  # fmt: skip
        if agreement is not None:
            agreement.tensors.update(hidden=hidden, targets=targets, mask=batch.valid, advantages=advantages,
                                     cu_seqlens=cu_seqlens, **per_token)  # fmt: skip
            agreement.values.update(bias_present=bias is not None, **scalars)
            agreement.block, agreement.targets = weight, (flat_targets, batch.valid)
        if entropy_agreement is not None:  # data-parallel ranks: the same model and step, their own tokens
            entropy_agreement.values.update(config=cfg, softcap=softcap, logit_scale=logit_scale,
                                            **_normalizer_values(normalizers))  # fmt: skip
    except Exception as exc:
        exc = checks.earlier(exc)  # a value check made before it that fails speaks first, as before
        if agreement is None and entropy_agreement is None:
            raise exc
        if agreement is None:
            _agreement.join_failed(entropy_agreement, exc)
        agreement.failed(exc)
    try:
        layout = _vocab_layout(agreement, 0 if agreement is None or agreement.failure else weight.shape[0])
        if layout is not None:
            vocab = layout.vocab_total
            layout.check_targets(lambda: chk.check_targets("targets", flat_targets, vocab, batch.valid))
    except Exception as exc:  # the tp group failed together; data-parallel peers in entropy_group join it
        if entropy_agreement is not None:
            _agreement.join_failed(entropy_agreement, exc)
        raise
    _warn_local_normalizers(cfg, normalizers, tp_group)
    try:
        loss, metrics, logprobs, entropy = run_fused(
            flat_hidden, weight, bias, flat_targets, batch, cfg,
            _lm_impl(resolved, layout, batch_invariant, softcap, logit_scale),
            lambda lp, ent: _loss_head(lp, ent, batch, cfg, head_backend, entropy_agreement), resolved, schedule,
            max_extra_memory=max_extra_memory,
        )  # fmt: skip
    except Exception as exc:  # e.g. a schedule refused on this rank only: its data-parallel peers still wait
        if entropy_agreement is not None and not entropy_agreement.exchanged:
            _agreement.join_failed(entropy_agreement, exc)
        raise
    shape = batch.token_shape
    return GRPOLossOutput(loss, metrics, logprobs.reshape(shape), entropy.reshape(shape))


_custom_ops.register_eager(fused_linear_logprobs=fused_linear_logprobs, grpo_loss=grpo_loss,
                           fused_linear_grpo_loss=fused_linear_grpo_loss)  # fmt: skip
