"""Which schedule a fused_linear_grpo_loss call runs, and running it (docs/design.md §1).

Imports run one way: dispatch -> {memory, cost, accuracy} -> function (the schedules themselves).

"auto" on the Triton backend, when the weight needs a gradient and the head is neither vocabulary-parallel
nor batch-invariant: among the schedules valid for the call (the one-pass family where one pass is valid,
else two_pass; low_memory always),

  1. keep those whose modelled peak extra memory (memory.py) fits the goal (`max_extra_memory`, default
     memory.EXTRA_MEMORY_GOAL = 1.5 GiB); the in-place schedules size their chunks to fill it;
  2. keep the in-place schedules only where their grad_weight error is no worse than plain PyTorch bf16
     autograd's at that shape: at most accuracy.max_inplace_chunks(dtype) chunks (bf16; fp32 weights
     accumulate in fp32 anyway; never fp16);
  3. take the fastest by the time model (cost.py: GEMM FLOPs at cuBLAS or Triton speed + bytes moved).

If nothing fits the goal, the schedule with the smallest modelled peak runs (low_memory where it is
smaller than the one- or two-pass schedule). Without a weight gradient, or for a vocabulary-parallel or
batch-invariant head, "auto" is one_pass where valid, else two_pass, its chunks sized in kernel A's stored
format (fp16 for 16-bit inputs: twice the fp32 logits' tokens). The choice and its reason are logged at DEBUG
on the "grpo_kernels" logger.
"""

from __future__ import annotations

import logging

import torch

from . import accuracy, cost, memory
from ..lm_head.chunked import LogitsStore
from .function import (
    DZ_IN_GEMM_SCHEDULES,
    IN_PLACE_SCHEDULES,
    ONE_PASS_VARIANTS,
    SCHEDULES,
    TORCH_LOGITS_BYTES,
    choose_schedule,
    fused_grpo_forward,
    fused_grpo_forward_one_pass,
    host_index,
    one_pass_capacity,
    stored_logits_bytes,
    vocab_slab_columns,
)

__all__ = ["SCHEDULES", "run_fused", "resolve_auto"]

logger = logging.getLogger("grpo_kernels")
# the in-place schedules: chunks sized to fill the goal (run_fused). "auto" weighs those whose backward is the dz
# slab's: the dz schedules (opt-in) have no time model until a GPU run has timed them.
IN_PLACE = IN_PLACE_SCHEDULES
AUTO_IN_PLACE = tuple(s for s in IN_PLACE if s not in DZ_IN_GEMM_SCHEDULES)


def _is_batch_invariant(lm_impl) -> bool:
    return "(batch-invariant)" in lm_impl.__name__


def resolve_auto(plan, dtype: torch.dtype, n_valid: int, hidden: int, vocab: int, element_size: int, *, bias: bool,
                 masked: bool, goal: int, chunk_tokens: int, cublas_ok: bool = True, transform_writes: bool = False,
                 base_reason: str = "", kernel_a_chunk_tokens: int | None = None):  # fmt: skip
    """"auto" with a weight gradient (module docstring): (schedule, chunks or None, reason). `plan(rows)`: the
    one-pass chunks of at most `rows` valid tokens, or None where one pass is not valid for the call.
    `kernel_a_chunk_tokens`: one_pass's chunk when it differs from `chunk_tokens` (the default budget holds
    twice the tokens in kernel A's fp16 logits)."""
    base_chunks = plan(chunk_tokens)
    base = "one_pass" if base_chunks is not None else "two_pass"
    options = {}  # schedule -> (chunks, chunk rows)
    if base == "one_pass":
        # a chunk that holds every sequence of chunk_tokens holds them in more rows too: plan() is not None
        rows = kernel_a_chunk_tokens or chunk_tokens
        options["one_pass"] = (base_chunks if rows == chunk_tokens else plan(rows), rows)
        if cublas_ok:
            options["one_pass_cublas"] = (base_chunks, chunk_tokens)
        limit = accuracy.max_inplace_chunks(dtype) if dtype != torch.float32 else None
        for name in AUTO_IN_PLACE:
            if name == "one_pass_cublas_inplace" and not cublas_ok:
                continue
            rows = memory.inplace_chunk_rows(n_valid, hidden, vocab, element_size, goal, bias=bias, schedule=name)
            if rows <= 0 or limit == 0:
                continue
            chunks = plan(rows)
            if chunks is None or (limit is not None and len(chunks) > limit):
                continue
            options[name] = (chunks, rows)
    else:
        options["two_pass"] = (None, chunk_tokens)
    options["low_memory"] = (None, chunk_tokens)

    def peak(name: str, rows: int) -> int:
        logits = stored_logits_bytes(name, rows, vocab, element_size) if name in ONE_PASS_VARIANTS else \
            memory.ONE_PASS_LOGITS_BYTES  # fmt: skip
        return memory.schedule_memory(name, n_valid, hidden, vocab, element_size, bias=bias, masked=masked,
                                      logits_bytes=logits).peak_extra  # fmt: skip

    def seconds(name: str, rows: int) -> float:
        return cost.schedule_time(name, n_valid, hidden, vocab, element_size, chunk_rows=rows,
                                  slab_columns=vocab_slab_columns(n_valid, hidden, element_size, vocab),
                                  transform_writes=transform_writes).seconds  # fmt: skip

    peaks = {name: peak(name, rows) for name, (_, rows) in options.items()}
    fitting = [name for name in options if peaks[name] <= goal]
    where = f"V = {vocab}, H = {hidden}, {n_valid} valid tokens"
    if fitting:
        best = min(fitting, key=lambda name: seconds(name, options[name][1]))
        chunks, rows = options[best]
        reason = (f"fastest by the time model ({seconds(best, rows) * 1e3:.3g} ms) of {fitting} within the "
                  f"{goal / 2**30:.2f} GiB extra-memory goal (modelled peak {peaks[best] / 2**30:.2f} GiB) at {where}")  # fmt: skip
        if best in ONE_PASS_VARIANTS:
            reason += f"; {len(chunks)} chunk(s) of at most {rows} valid tokens"
        return best, chunks, reason
    best = min(options, key=lambda name: peaks[name])
    reason = (f"no schedule fits the {goal / 2**30:.2f} GiB extra-memory goal at {where}: the smallest modelled "
              f"peak ({peaks[best] / 2**30:.2f} GiB; {base} would hold {peaks[base] / 2**30:.2f} GiB{': ' + base_reason if base_reason else ''})")  # fmt: skip
    return best, options[best][0], reason


def run_fused(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl, loss_head, backend, schedule,
              chunk_tokens=None, max_extra_memory=None):  # fmt: skip
    """Pick the schedule (module docstring), say which at DEBUG, run it. `max_extra_memory`: the goal in
    bytes (None: memory.EXTRA_MEMORY_GOAL), validated by the functional layer."""
    # plan from the vocabulary every rank agrees on (vocabulary-parallel: the largest block), so every
    # rank makes the same calls in the same order
    vocab = getattr(lm_impl, "planning_vocab", weight.shape[0])
    goal = memory.EXTRA_MEMORY_GOAL if max_extra_memory is None else int(max_extra_memory)
    element_size = flat_hidden.element_size()
    bias_grad = bias is not None and bias.requires_grad
    # the batch's layout on the host: read by the functional layer with the value checks (the call's one host
    # read), else read here once
    host = getattr(batch, "host", None) or host_index(batch.cu_seqlens, batch.valid)
    chosen_chunks = chunk_tokens is not None  # the caller's chunk size, for every schedule
    if schedule in IN_PLACE and chunk_tokens is None:  # chunks sized to fill the goal
        n_valid = host.n_valid
        rows = memory.inplace_chunk_rows(n_valid, weight.shape[1], vocab, element_size, goal, bias=bias_grad,
                                         schedule=schedule)  # fmt: skip
        chunk_tokens = rows if rows > 0 else one_pass_capacity(vocab)
    # kernel A's one-pass chunk: the logits budget in its stored format (fp16 for 16-bit inputs: 2x the tokens)
    kernel_a_tokens = None if chosen_chunks else one_pass_capacity(vocab, schedule="one_pass",
                                                                    element_size=element_size)  # fmt: skip
    if schedule in ("one_pass", "one_pass_dz") and not chosen_chunks:
        chunk_tokens = kernel_a_tokens
    chunk_tokens = chunk_tokens or one_pass_capacity(vocab)
    # "auto" where the time model below does not decide (a frozen head as under LoRA, the vocabulary-parallel
    # and batch-invariant heads, no grad) runs "one_pass", kernel A's: its chunk in kernel A's stored format
    auto_tokens = kernel_a_tokens if schedule == "auto" and backend == "triton" and not chosen_chunks else None
    chosen, chunks, reason = choose_schedule(schedule, backend, cfg, batch, auto_tokens or chunk_tokens, host)
    if (schedule == "auto" and backend == "triton" and not hasattr(lm_impl, "planning_vocab")
            and weight.requires_grad and torch.is_grad_enabled()):  # fmt: skip
        n_valid = host.n_valid
        transform = "softcap" in lm_impl.__name__ and "softcap None" not in lm_impl.__name__
        def plan(rows):
            one, planned, _ = choose_schedule("auto", "triton", cfg, batch, rows, host)
            return planned if one == "one_pass" else None

        chosen, chunks, reason = resolve_auto(
            plan, weight.dtype, n_valid, weight.shape[1], vocab, element_size, bias=bias_grad,
            masked=n_valid < batch.valid.shape[0], goal=goal, chunk_tokens=chunk_tokens,
            cublas_ok=not _is_batch_invariant(lm_impl), transform_writes=bias is not None or transform,
            base_reason=reason, kernel_a_chunk_tokens=kernel_a_tokens,
        )  # fmt: skip
    logits_store = None
    if backend == "torch" and chosen == "two_pass" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (flat_hidden, weight, bias)):  # fmt: skip
        # C reads A's fp32 logits instead of recomputing them where they fit the budget (3 GEMM units, not 4)
        n_valid = host.n_valid
        kept = LogitsStore.nbytes(n_valid, weight.shape[0])
        if kept <= TORCH_LOGITS_BYTES:
            def logits_store(rows):
                return LogitsStore(rows, weight.shape[0], flat_hidden.dtype, flat_hidden.device)

            reason += f"; A's logits kept for C ({kept / 2**20:.1f} MiB)"
        else:
            reason += (f"; C recomputes the logits (keeping them would take {kept / 2**20:.0f} MiB, over "
                       f"{TORCH_LOGITS_BYTES / 2**20:.0f} MiB)")  # fmt: skip
    logger.debug("fused_linear_grpo_loss: %s schedule (%s; LM head %s)", chosen, reason, lm_impl.__name__)
    # autocast off: the LM-head tiles accumulate in fp32 by construction (an active autocast would
    # round them to half precision); the loss head is fp32 O(N) work
    with torch.autocast(flat_hidden.device.type, enabled=False):
        if chosen in ONE_PASS_VARIANTS:
            return fused_grpo_forward_one_pass(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl,
                                               chunks, variant=chosen, host=host)  # fmt: skip
        return fused_grpo_forward(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl, loss_head,
                                  low_memory=chosen == "low_memory", logits_store=logits_store, host=host)  # fmt: skip


def auto_schedule_at(n_valid: int, hidden: int, vocab: int, dtype: torch.dtype = torch.bfloat16, *,
                     goal: int | None = None, masked: bool = False, bias: bool = False,
                     one_pass_valid: bool = True) -> tuple[str, str]:  # fmt: skip
    """What "auto" runs (with a weight gradient, a token-local objective where `one_pass_valid`) for
    `n_valid` valid tokens of a head: (schedule, reason). For the README, the tests and the benchmarks."""
    element_size = torch.empty((), dtype=dtype).element_size()
    chunk_tokens = one_pass_capacity(vocab)
    kernel_a_tokens = one_pass_capacity(vocab, schedule="one_pass", element_size=element_size)

    def plan(rows):
        return [None] * -(-n_valid // rows) if one_pass_valid and rows > 0 else None

    chosen, _, reason = resolve_auto(plan, dtype, n_valid, hidden, vocab, element_size, bias=bias, masked=masked,
                                     goal=memory.EXTRA_MEMORY_GOAL if goal is None else goal,
                                     chunk_tokens=chunk_tokens, kernel_a_chunk_tokens=kernel_a_tokens)  # fmt: skip
    return chosen, reason
