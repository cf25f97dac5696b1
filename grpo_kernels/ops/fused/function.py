"""fused_linear_grpo_loss: gradients computed inside the forward, backward only scales them.

Three stages (docs/design.md §1) on the valid rows (masked tokens are never multiplied):
  A  LM-head statistics (log-prob, entropy, lse, E_p[z]; no logits kept)
  B  the loss head -> loss, metrics, g_lp = dL/dlogp, g_H = dL/dH per token
  C  LM-head gradients from (g_lp, g_H); grad_weight accumulated in fp32 and cast once (in the
     weight's dtype, once per chunk, in the in-place schedules)
The schedules give the same result (the in-place ones up to their per-chunk rounding):
  two-pass  A over the whole batch, B over the whole batch, C over the whole batch. Exact for every
            variant, including those whose loss needs statistics of the whole batch (top-entropy
            quantile, Clip-Cov / KL-Cov, group DPO). The PyTorch backend always uses it, keeping A's fp32
            logits of the valid rows for C (3 GEMM units instead of 4) when they fit TORCH_LOGITS_BYTES.
  one-pass  chunks of tokens, A -> B -> C per chunk with the batch's normalizers; A keeps the
            chunk's fp32 logits and C reads them instead of recomputing them, so the work is 3 GEMM
            units (logits, grad_hidden, grad_weight) instead of 4; the loss head's per-sequence
            partial sums of every chunk are reduced once at the end. For token-local objectives
            (PolicyLossConfig.token_local: token-level ratios, token IS) every chunk is filled to
            capacity and a sequence may be cut across chunks (the loss head gets each piece's
            whole-sequence length; the pieces' partial sums are merged), so completions of any length
            take it; other objectives need whole sequences in a chunk. Valid without batch-global
            statistics and, for objectives that are not token-local, when every sequence fits in a
            chunk whose logits fit ONE_PASS_LOGITS_BYTES.
  one-pass-dz (opt-in, schedule="one_pass_dz") the one-pass schedule whose C forms dz from the stored
            logits inside the operand loads of two Triton GEMMs (grad_hidden, grad_weight) instead of
            writing an [n, V] dz slab for cuBLAS: the slab's write and two reads disappear. Off by default
            until a GPU run has compared it with the cuBLAS path. "one_pass_dz_inplace": the same with
            grad_weight summed into the gradient buffer in the weight's dtype (as one-pass-inplace: the
            grad_weight GEMM's epilogue rounds each chunk's fp32 sum into it once; chunks sized to the goal).
  one-pass-inplace (schedule="one_pass_inplace") the one-pass schedule with grad_weight accumulated in the
            weight's dtype in the gradient buffer itself (cuBLAS addmm into it per chunk: the chunk's sum
            in fp32, one rounding per chunk): no fp32 [V, H] accumulator. Its chunks are sized to fill the
            extra-memory goal (fewer chunks, fewer roundings; memory.inplace_chunk_rows). Its error against
            float64 is measured in docs/records/grad_weight_error.json (ops/fused/accuracy.py).
  one-pass-cublas (schedule="one_pass_cublas", "one_pass_cublas_inplace") the one-pass schedules with A's
            GEMM done by cuBLAS (fp32 output straight into the chunk's logits buffer) and the statistics
            taken by a streaming Triton kernel over that buffer (one more read of the chunk's logits);
            C as in one pass.
  low-memory  two passes with the vocabulary outside in C: per slab of columns, every token's dz,
            the slab's grad_weight block written once in its final dtype, grad_hidden summed in fp32
            [N, H]. No fp32 [V, H] accumulator (README.md beside ops/lm_head, "Memory and bytes moved
            per schedule"); 4 GEMM units.
What "auto" runs is decided in dispatch.py (run_fused), from the memory model (memory.py), the time model
(cost.py) and the accumulation error bound (accuracy.py); this module imports none of them.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from ..lm_head import half_logits_format

logger = logging.getLogger("grpo_kernels")


class _Saved:
    """What the forward leaves for the backward: the gradients, already computed."""

    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None
    # grad_output applied by a Triton kernel that reads it on the device (scale.py), not by a host read
    scale_on_device: bool = False


# Valid tokens per one-pass chunk: large enough that re-reading W and the fp32 grad_weight
# read-modify-write per chunk stay far below the chunk's GEMM time (perf-state-of-the-art.md §4.2:
# C >= ~1024 on an H200), small enough that the per-chunk loss-head launch is cheap.
ONE_PASS_CHUNK_TOKENS = 8192
# The chunk's logits kept between A and C: 4 V bytes per token in fp32 (V = 151936: 2 GiB for 3.5k tokens),
# ~2 V where kernel A stores fp16 differences (16-bit inputs: half_logits). This budget, not
# ONE_PASS_CHUNK_TOKENS, bounds the chunk at real vocabularies (~1290 fp32 / ~2560 fp16 tokens at V = 152k):
# longer completions are cut across chunks for token-local objectives, other objectives take the two-pass
# schedule.
ONE_PASS_LOGITS_BYTES = 768 * 2**20
SCHEDULES = ("auto", "one_pass", "two_pass", "low_memory", "one_pass_dz", "one_pass_dz_inplace", "one_pass_inplace",
             "one_pass_cublas", "one_pass_cublas_inplace")
# The one-pass family: (forward GEMM, grad_weight accumulated in the weight's dtype, dz inside the GEMMs)
ONE_PASS_VARIANTS = {
    "one_pass": ("kernel_a", False, False),
    "one_pass_dz": ("kernel_a", False, True),
    "one_pass_dz_inplace": ("kernel_a", True, True),
    "one_pass_inplace": ("kernel_a", True, False),
    "one_pass_cublas": ("cublas", False, False),
    "one_pass_cublas_inplace": ("cublas", True, False),
}
# by those flags: the schedules that sum grad_weight in place (their chunks sized to fill the memory goal) and
# those whose backward forms dz inside its GEMMs
IN_PLACE_SCHEDULES = tuple(s for s, (_, in_place, _) in ONE_PASS_VARIANTS.items() if in_place)
DZ_IN_GEMM_SCHEDULES = tuple(s for s, (_, _, dz_in_gemm) in ONE_PASS_VARIANTS.items() if dz_in_gemm)
# The low-memory schedule ("auto" where the others' peak exceeds the memory goal): two passes with
# the vocabulary outside in C, so grad_weight is written once per block in its final dtype and no
# V x H fp32 accumulator exists. Per slab of columns: a dz workspace of LOW_MEMORY_DZ_ROWS token rows
# and the slab's fp32 grad_weight block, within LOW_MEMORY_SLAB_BYTES; plus grad_hidden in fp32 [N, H].
LOW_MEMORY_SLAB_BYTES = 256 * 2**20
LOW_MEMORY_DZ_ROWS = 8192
# The PyTorch backend's two-pass schedule keeps A's fp32 logits of the valid rows for C when they take at
# most this many bytes (4 N V: 768 MiB is 1290 tokens at V = 151936, 6291 at V = 32000), the one-pass
# chunk's budget; above it C recomputes them. The bf16 backward forms dz in their place and frees half of
# them before its GEMMs (ops/lm_head/chunked.py, LogitsStore).
TORCH_LOGITS_BYTES = ONE_PASS_LOGITS_BYTES


def stored_logits_row_stride(vocab: int) -> int:
    """Row stride (fp32 elements) of the one-pass schedule's logits buffer: V rounded up to 16 bytes."""
    return -(-vocab // 4) * 4


def half_logits(dtype: torch.dtype) -> bool:
    """Whether kernel A stores a one-pass chunk's logits as fp16 differences from the running row max
    (ops/lm_head/triton.py HalfLogits, 2 bytes per logit) rather than fp32: for bf16 / fp16 inputs, whose
    gradients keep their float64 error with it (the dz slab's rounding to the input dtype dominates;
    tests/test_half_logits_interpreter.py); fp32 inputs keep fp32 logits (their gradients would not)."""
    return dtype in (torch.bfloat16, torch.float16)


def stored_logits_bytes(schedule: str, rows: int, vocab: int, element_size: int) -> int:
    """Bytes of a one-pass chunk's stored logits for `rows` tokens: cuBLAS writes fp32 [rows, V]; kernel A
    fp32 rows padded to 16 bytes, or for 16-bit inputs fp16 differences (rows padded to 16 bytes) and an
    fp32 offset per 64 columns (half_logits)."""
    if ONE_PASS_VARIANTS[schedule][0] == "cublas":
        return 4 * rows * vocab
    if element_size == 2:
        return rows * half_logits_format.row_bytes(vocab)
    return 4 * rows * stored_logits_row_stride(vocab)


def one_pass_capacity(vocab: int, logits_bytes: int | None = None, schedule: str = "one_pass_cublas",
                      element_size: int = 4) -> int:  # fmt: skip
    """Valid tokens per one-pass chunk of `schedule`: the logits budget (default ONE_PASS_LOGITS_BYTES) over
    the bytes of one token's stored logits (4 V for fp32, the default; kernel A with 16-bit inputs stores
    2 V + 4 V / 64: twice the tokens), in whole 64-token tiles, capped at ONE_PASS_CHUNK_TOKENS."""
    # unpadded (the buffers' rows are padded to 16 bytes, a budget sized for whole rows keeps its tokens)
    half = ONE_PASS_VARIANTS[schedule][0] == "kernel_a" and element_size == 2
    row_bytes = half_logits_format.row_bytes(vocab, padded=False) if half else 4 * vocab
    rows = (ONE_PASS_LOGITS_BYTES if logits_bytes is None else logits_bytes) // row_bytes
    if rows >= 64:
        rows = rows // 64 * 64
    return max(0, min(ONE_PASS_CHUNK_TOKENS, rows))


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_rows, weight, bias, loss, saved: _Saved):
        # the loss was computed by fused_grpo_forward; this node only carries its gradients
        ctx.saved = saved
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_output):
        # Take the gradients out of the saved holder: the returned tensor is then referenced only by
        # autograd, which hands it to AccumulateGrad as the parameter's .grad without a copy (a
        # reference left here would make it clone grad_weight, another V x H tensor at the peak).
        s, ctx.saved = ctx.saved, None
        if s is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: backward ran twice through one call (retain_graph=True); its "
                "gradients are computed in the forward and handed to autograd once. Call it again instead."
            )

        if s.scale_on_device:  # Triton: grad_output read by the kernel, the gradients scaled in place (at 1:
            from .scale import scale_  # untouched); no host read, so the host never waits for the device here

            return scale_(s.grad_hidden, grad_output), scale_(s.grad_weight, grad_output), \
                scale_(s.grad_bias, grad_output), None, None  # fmt: skip
        # PyTorch backend: the loss's upstream gradient, read once (a scalar: one host read, not an equality
        # kernel and a read per gradient); 1 (loss.backward()) leaves the gradients as computed
        unit = grad_output.numel() == 1 and float(grad_output) == 1.0

        def scale(g):
            if g is None or unit:
                return g
            return (g.float() * grad_output.float()).to(g.dtype)

        return scale(s.grad_hidden), scale(s.grad_weight), scale(s.grad_bias), None, None


def _is_triton(lm_impl) -> bool:
    """The Triton backend (the name of a wrapped backend (batch-invariant, logit transform, vocabulary-parallel)
    starts with the backend module's), csrc's module included (GRPO_KERNELS_CSRC=1: its forward where it
    applies, Triton's backward and everything else)."""
    return lm_impl.__name__.split(" ")[0].endswith((".triton", ".cutlass"))


def vocab_slab_columns(n_rows: int, hidden_size: int, element_size: int, vocab: int) -> int:
    """Vocabulary columns per slab of the low-memory schedule: the slab's dz rows (input dtype) and its
    fp32 grad_weight block within LOW_MEMORY_SLAB_BYTES, in whole 128-column tiles."""
    per_column = min(n_rows, LOW_MEMORY_DZ_ROWS) * element_size + hidden_size * 4
    columns = max(128, LOW_MEMORY_SLAB_BYTES // max(per_column, 1) // 128 * 128)
    return min(vocab, columns)


def lm_head_grads_vocab_outer(lm_impl, hidden_rows, weight, bias, targets_rows, temperature, stats, g_lp, g_ent,
                              need_h, need_w, need_b):  # fmt: skip
    """C with the vocabulary outside (the low-memory schedule): per slab of columns, every token's dz,
    then the slab's grad_weight block (contracted over all tokens in fp32, written once in the weight's
    dtype) and its share of grad_hidden (added into one fp32 [N, H] accumulator, cast once at the end).
    A target outside the slab never matches a column id there, so the one-hot term of dz stays in the
    slab that holds it. Returns (grad_hidden, grad_weight, grad_bias) in the inputs' dtypes."""
    n_rows, hidden_size = hidden_rows.shape
    vocab = weight.shape[0]
    device = hidden_rows.device
    grad_hidden_acc = torch.zeros((n_rows, hidden_size), dtype=torch.float32, device=device) if need_h else None
    grad_weight = torch.empty_like(weight) if need_w else None  # the gradient itself: no V x H fp32 copy
    grad_bias = torch.empty_like(bias) if need_b else None
    columns = vocab_slab_columns(n_rows, hidden_size, hidden_rows.element_size(), vocab)
    extra = {}
    # the dz workspace of one token chunk of the slab (Triton backend; the name of a wrapped backend
    # (batch-invariant, logit transform) starts with the backend module's)
    if _is_triton(lm_impl):
        extra["workspace_bytes"] = LOW_MEMORY_DZ_ROWS * ((columns + 64) * hidden_rows.element_size() + 4 * hidden_size)
    for v0 in range(0, vocab, columns):
        v1 = min(vocab, v0 + columns)
        _, slab_grad_weight, slab_grad_bias = lm_impl.lm_head_backward(
            hidden_rows, weight[v0:v1], None if bias is None else bias[v0:v1], targets_rows - v0, temperature,
            stats.lse, stats.expected_logit, g_lp, g_ent, need_grad_hidden=need_h, need_grad_weight=need_w,
            need_grad_bias=need_b, grad_hidden_acc=grad_hidden_acc, **extra,
        )  # fmt: skip
        if need_w:
            grad_weight[v0:v1] = slab_grad_weight  # fp32 over all tokens, rounded once
        if need_b:
            grad_bias[v0:v1] = slab_grad_bias
        del slab_grad_weight, slab_grad_bias
    grad_hidden = grad_hidden_acc.to(hidden_rows.dtype) if need_h else None
    return grad_hidden, grad_weight, grad_bias


def fused_grpo_forward(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl, loss_head, low_memory=False,
                       logits_store=None, host: HostIndex | None = None):  # fmt: skip
    """Returns (loss, metrics, logprobs [N], entropy [N]); loss is differentiable w.r.t. hidden,
    weight and bias when they require grad and grad mode is on. `logits_store(n_valid_rows)`: a buffer
    for A's logits that C reads instead of recomputing them (the PyTorch backend's LogitsStore), or None
    where they are recomputed. `host`: the batch's layout on the host (its valid-token count sizes the
    compaction, so no read here); None: read here."""
    valid = batch.valid
    n_tokens = valid.shape[0]
    n_valid = host.n_valid if host is not None else int(valid.sum())
    all_valid = n_valid == n_tokens
    rows = None if all_valid else torch.nonzero_static(valid, size=n_valid).squeeze(-1)
    hidden_rows = flat_hidden if all_valid else flat_hidden.index_select(0, rows)  # [Nv, H]
    targets_rows = (flat_targets if all_valid else flat_targets.index_select(0, rows)).long()
    temperature = float(cfg.temperature)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (flat_hidden, weight, bias)
    )
    keep = logits_store is not None and needs_grad and not low_memory
    store = logits_store(hidden_rows.shape[0]) if keep else None
    kept = {} if store is None else {"logits_out": store}
    # A: statistics of the valid rows
    stats = lm_impl.lm_head_forward(hidden_rows.detach(), weight.detach(),
                                    None if bias is None else bias.detach(), targets_rows, temperature, **kept)  # fmt: skip

    def to_tokens(x):  # [Nv] -> [N], 0 on masked tokens
        if all_valid:
            return x
        return torch.zeros(n_tokens, dtype=x.dtype, device=x.device).index_put((rows,), x)

    logprobs = to_tokens(stats.logprobs)
    entropy = to_tokens(stats.entropy)

    # B: the loss head on leaves, so autograd gives dL/dlogp and dL/dH per token
    lp_leaf = logprobs.clone().requires_grad_(needs_grad)
    ent_leaf = entropy.clone().requires_grad_(needs_grad and cfg.entropy_coef != 0)
    with torch.enable_grad():
        out = loss_head(lp_leaf, ent_leaf)
    if not needs_grad:
        return out.loss.detach(), out.metrics, logprobs, entropy

    leaves = [lp_leaf] + ([ent_leaf] if ent_leaf.requires_grad else [])
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    g_lp = grads[0]
    g_ent = grads[1] if len(grads) > 1 else None

    def to_rows(g):
        if g is None:
            return None
        return g if all_valid else g.index_select(0, rows)

    # C: LM-head gradients, logits recomputed
    saved = _Saved()
    saved.scale_on_device = _is_triton(lm_impl)
    if low_memory:
        grad_hidden, grad_weight, grad_bias = lm_head_grads_vocab_outer(
            lm_impl, hidden_rows.detach(), weight.detach(), None if bias is None else bias.detach(), targets_rows,
            temperature, stats, to_rows(g_lp), to_rows(g_ent), flat_hidden.requires_grad, weight.requires_grad,
            bias is not None and bias.requires_grad,
        )  # fmt: skip
        saved.grad_hidden, saved.grad_weight, saved.grad_bias = grad_hidden, grad_weight, grad_bias
        loss = FusedLinearGRPOLossFunction.apply(hidden_rows, weight, bias, out.loss.detach(), saved)
        return loss, out.metrics, logprobs, entropy
    kept = {} if store is None else {"stored_logits": store}
    grad_hidden, grad_weight, grad_bias = lm_impl.lm_head_backward(
        hidden_rows.detach(), weight.detach(), None if bias is None else bias.detach(), targets_rows, temperature,
        stats.lse, stats.expected_logit, to_rows(g_lp), to_rows(g_ent),
        need_grad_hidden=flat_hidden.requires_grad, need_grad_weight=weight.requires_grad,
        need_grad_bias=bias is not None and bias.requires_grad, **kept,
    )  # fmt: skip
    del store, kept  # the logits (dz by now) go before the gradients' casts below
    saved.grad_hidden = grad_hidden
    saved.grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    saved.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
    loss = FusedLinearGRPOLossFunction.apply(hidden_rows, weight, bias, out.loss.detach(), saved)
    return loss, out.metrics, logprobs, entropy


@dataclass(frozen=True)
class HostIndex:
    """What the chunk planners read of the batch, on the host: made by ONE device read per call (each
    read waits for the device to drain, and the planners run once per candidate schedule)."""

    cu: list  # [S + 1] cu_seqlens
    valid_before: list  # [N + 1] valid tokens before each token position (the last: the valid count)

    @property
    def n_valid(self) -> int:
        return self.valid_before[-1]


def host_index(cu_seqlens: torch.Tensor, valid: torch.Tensor) -> HostIndex:
    both = torch.cat([cu_seqlens.long(), valid.long().cumsum(0)]).tolist()
    return HostIndex(both[: cu_seqlens.numel()], [0] + both[cu_seqlens.numel():])


# Balanced chunks align to this many tokens: the M tile of kernel C's grad_hidden GEMM and of cuBLAS's big tiles,
# so that only the last chunk has a partly filled row tile.
CHUNK_ALIGN_TOKENS = 128


def balanced_chunk_tokens(total: int, chunk_tokens: int) -> int:
    """The chunk size that covers `total` valid tokens in the fewest chunks of at most `chunk_tokens` (as many
    as chunks of exactly `chunk_tokens` would take) with the chunks as even as whole 128-token tiles allow
    (64 where 128 would not fit, none below 64 tokens): never more than `chunk_tokens`, never more chunks.
    Filling every chunk but a short last one keeps buffers of the full size and runs the last chunk's GEMMs
    mostly empty; at 16,384 tokens in chunks of at most 4,608, four chunks of 4,096 instead of 3 x 4,608 +
    2,560: 11 % less chunk memory, and kernel C's grad_hidden (128 x 256 tiles, H = 4096, 132 SMs) in 16
    waves of CTAs instead of 18 (docs/design.md §1)."""
    if total <= chunk_tokens or chunk_tokens <= 0:
        return chunk_tokens
    n_chunks = -(-total // chunk_tokens)
    even = -(-total // n_chunks)  # >= this keeps the count at n_chunks; <= chunk_tokens keeps it there too
    for align in (CHUNK_ALIGN_TOKENS, 64):
        aligned = -(-even // align) * align
        if aligned <= chunk_tokens:
            return aligned
    return even


def _greedy_sequence_starts(bounds: list, budget: int) -> list:
    """Sequence indices where each chunk starts when whole sequences are packed in order, as many as fit
    `budget` valid tokens: bounds[i] = valid tokens before sequence i (len S + 1); each chunk ends at the
    last sequence boundary within budget of its start (sequences without valid tokens join the chunk)."""
    starts, i, n_seqs = [0], 0, len(bounds) - 1
    while True:
        i = max(i + 1, bisect.bisect_right(bounds, bounds[i] + budget) - 1)
        if i >= n_seqs:
            return starts
        starts.append(i)


def plan_chunks(cu_seqlens: torch.Tensor, valid: torch.Tensor, chunk_tokens: int, *, host: HostIndex | None = None):
    """Consecutive runs of whole sequences with at most `chunk_tokens` valid tokens each, as
    (first_seq, end_seq, first_token, end_token); None if one sequence alone exceeds the budget. As few
    chunks as packing greedily takes (the fewest possible), with the largest chunk as small as that count
    allows (the smallest budget that packs into as many chunks: a bisection over budgets)."""
    host = host or host_index(cu_seqlens, valid)
    cu, prefix = host.cu, host.valid_before
    n_seqs = len(cu) - 1
    if n_seqs == 0:
        return []
    bounds = [prefix[t] for t in cu]  # valid tokens before each sequence, [S + 1]
    largest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if largest > chunk_tokens:
        return None
    starts = _greedy_sequence_starts(bounds, chunk_tokens)
    lo, hi = max(largest, -(-bounds[-1] // len(starts))), chunk_tokens
    while lo < hi:  # the chunk count only falls as the budget grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_greedy_sequence_starts(bounds, mid)) <= len(starts) else (mid + 1, hi)
    starts = _greedy_sequence_starts(bounds, lo) + [n_seqs]
    return [(s0, s1, cu[s0], cu[s1]) for s0, s1 in zip(starts[:-1], starts[1:])]


def plan_token_chunks(cu_seqlens: torch.Tensor, valid: torch.Tensor, chunk_tokens: int, *,
                      host: HostIndex | None = None):  # fmt: skip
    """Consecutive token ranges of at most `chunk_tokens` valid tokens, as few as that allows and as even
    as whole tiles allow (balanced_chunk_tokens: every range holds the same number of valid tokens but the
    last, which holds fewer), cutting sequences where a range ends, as (first_seq, end_seq, first_token,
    end_token): the sequences first_seq..end_seq-1 each contribute the part of them inside [first_token,
    end_token). For token-local objectives only (PolicyLossConfig.token_local): the fewest chunks, whatever
    the completion lengths."""
    host = host or host_index(cu_seqlens, valid)
    cu, valid_before = host.cu, host.valid_before  # valid tokens before each token position
    n_tokens, total = len(valid_before) - 1, valid_before[-1]
    chunk_tokens = balanced_chunk_tokens(total, chunk_tokens)
    # chunk k starts at the token holding valid token number k * chunk_tokens
    starts = [0] + [bisect.bisect_left(valid_before, k * chunk_tokens + 1) - 1
                    for k in range(1, -(-total // chunk_tokens))]  # fmt: skip
    ends = starts[1:] + [n_tokens]
    chunks = []
    for t0, t1 in zip(starts, ends):
        s0 = bisect.bisect_right(cu, t0) - 1  # the sequence holding token t0
        s1 = bisect.bisect_left(cu, t1)  # one past the sequence holding token t1 - 1
        chunks.append((s0, s1, t0, t1))
    return chunks


def largest_chunk(chunks, host: HostIndex) -> int:
    """Valid tokens in the largest of `chunks` (as the planners return them)."""
    return max((host.valid_before[t1] - host.valid_before[t0] for _, _, t0, t1 in chunks), default=0)


def choose_schedule(requested: str, backend: str, cfg, batch, chunk_tokens: int, host: HostIndex | None = None):
    """(schedule, chunks or None, reason). `host`: the batch's HostIndex when the caller has made it."""
    if requested not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {requested!r}")
    if requested in ("two_pass", "low_memory"):
        return requested, None, "requested"
    if requested in ONE_PASS_VARIANTS and requested != "one_pass":  # same validity as one_pass
        try:
            _, chunks, reason = choose_schedule("one_pass", backend, cfg, batch, chunk_tokens, host)
        except ValueError as exc:
            raise ValueError(str(exc).replace("schedule='one_pass'", f"schedule={requested!r}")) from None
        return requested, chunks, reason + " (requested)"
    why_not = None
    if backend != "triton":
        why_not = "the PyTorch backend computes the loss head with the reference"
    elif cfg.needs_global_statistics:
        which = f"top_entropy_quantile={cfg.top_entropy_quantile}" if cfg.top_entropy_quantile < 1.0 \
            else f"loss_type={cfg.loss_type!r}"  # fmt: skip
        why_not = f"{which} needs statistics of the whole batch"
    chunks = None
    if why_not is None and chunk_tokens <= 0:
        why_not = "no chunk of logits fits the one-pass budget at this vocabulary size"
    elif why_not is None and cfg.token_local:
        host = host or host_index(batch.cu_seqlens, batch.valid)
        chunks = plan_token_chunks(batch.cu_seqlens, batch.valid, chunk_tokens, host=host)
        return "one_pass", chunks, (f"{len(chunks)} chunk(s) of {largest_chunk(chunks, host)} valid tokens (at "
                                    f"most {chunk_tokens}), sequences cut across chunks where one ends "
                                    "(token-local objective)")  # fmt: skip
    elif why_not is None:
        host = host or host_index(batch.cu_seqlens, batch.valid)
        chunks = plan_chunks(batch.cu_seqlens, batch.valid, chunk_tokens, host=host)
        if chunks is None:
            why_not = (f"a sequence has more valid tokens than a chunk holds ({chunk_tokens}) and this objective "
                       "is not token-local (ratio_level, sequence IS, off-policy masking or loss_type need "
                       "whole sequences)")  # fmt: skip
    if why_not is not None:
        if requested == "one_pass":
            raise ValueError(f"schedule='one_pass' is not valid here: {why_not}")
        return "two_pass", None, why_not
    return "one_pass", chunks, (f"{len(chunks)} chunk(s) of at most {largest_chunk(chunks, host)} valid tokens "
                                f"(budget {chunk_tokens})")  # fmt: skip


def fused_grpo_forward_one_pass(flat_hidden, weight, bias, flat_targets, batch, cfg, lm_impl, chunks,
                                variant="one_pass", host: HostIndex | None = None):  # fmt: skip
    """A -> B -> C per chunk (Triton backend). Returns what fused_grpo_forward does. A chunk holds whole
    sequences, or, for token-local objectives, pieces of them (plan_token_chunks): the loss head then
    gets each piece's whole-sequence length and the pieces' partial sums are merged per sequence.
    `variant` (ONE_PASS_VARIANTS): A by kernel A or by cuBLAS + the streaming statistics kernel; grad_weight
    accumulated in fp32 (cast once) or in the weight's dtype in the gradient buffer itself; dz in the GEMMs."""
    forward_gemm, in_place, dz_in_gemm = ONE_PASS_VARIANTS[variant]
    from ..lm_head import triton as lm_triton
    from ..lm_head.triton import HalfLogits
    from ..loss_head import triton as loss_head

    cut = cfg.token_local  # chunks from plan_token_chunks: sequences may be cut

    valid = batch.valid
    n_tokens = valid.shape[0]
    device = flat_hidden.device
    temperature = float(cfg.temperature)
    norm = batch.normalizers
    m = valid.float()
    seq_len = torch.zeros(batch.num_seqs, device=device).index_add(0, batch.seq_index, m)
    norms = loss_head.normalizer_tensor(valid, seq_len, cfg, norm["num_tokens"], norm["num_sequences"],
                                        norm["grad_accum_steps"], None)  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat_hidden, weight, bias))
    need_h = needs_grad and flat_hidden.requires_grad
    need_w = needs_grad and weight.requires_grad
    need_b = needs_grad and bias is not None and bias.requires_grad
    grad_hidden = torch.zeros_like(flat_hidden) if need_h else None
    # in place: the gradient buffer itself, in the weight's dtype, summed into chunk by chunk; else an fp32
    # [V, H] accumulator cast once at the end. Not zero-filled: the first chunk's GEMM overwrites it (beta = 0),
    # which saves a write and a read of V x H elements (cost.schedule_time); zeroed where no chunk runs C
    acc_dtype = weight.dtype if in_place else torch.float32
    grad_weight_acc = lm_triton.uninitialized(weight.shape, acc_dtype, device) if need_w else None
    grad_weight_written = False
    grad_bias_acc = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_b else None
    logprobs = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    entropy = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    partials = []
    hidden_d, weight_d = flat_hidden.detach(), weight.detach()
    bias_d = None if bias is None else bias.detach()

    def part(x, t0, t1):
        return None if x is None else x[t0:t1]

    vocab = weight.shape[0]
    # The valid rows of every chunk from the planners' host index (no device read here) and one nonzero of
    # the size the index gives (all valid: an arange): no read, not a sync per chunk (each would stall the GPU).
    host = host or host_index(batch.cu_seqlens, valid)
    n_valid = host.n_valid
    valid_rows = (torch.arange(n_valid, device=device) if n_valid == valid.shape[0]
                  else torch.nonzero_static(valid, size=n_valid).squeeze(-1))  # [Nv] flat indices, ascending  # fmt: skip
    edges = [t0 for _, _, t0, _ in chunks] + ([chunks[-1][3]] if chunks else [])
    row_edges = [host.valid_before[e] for e in edges]
    logits = None  # A's logits of the current chunk, read by C (only when gradients are needed)
    if (needs_grad or forward_gemm == "cublas") and chunks:  # cuBLAS writes its GEMM output there in any case
        capacity = largest_chunk(chunks, host)  # the buffers' rows: the balanced planners' largest chunk
        if forward_gemm == "cublas":  # fp32 [n, V] row-major (cuBLAS's ldc = V): each chunk's rows contiguous
            logits = torch.empty((capacity, vocab), dtype=torch.float32, device=device)
        elif half_logits(flat_hidden.dtype):  # kernel A, 16-bit inputs: fp16 differences from the running row
            logits = HalfLogits.empty(capacity, vocab, device)  # max, 2 bytes per logit (lm_head README §5)
        else:  # fp32 inputs keep fp32 logits; rows padded to 16 bytes for the TMA kernel A's store
            logits = torch.empty((capacity, stored_logits_row_stride(vocab)), dtype=torch.float32,
                                 device=device)[:, :vocab]  # fmt: skip
    for i, (s0, s1, t0, t1) in enumerate(chunks):
        chunk_valid = valid[t0:t1]
        rows = valid_rows[row_edges[i]:row_edges[i + 1]]  # the valid rows of this chunk, flat indices
        chunk_logits = None if logits is None else logits[: rows.numel()]
        chunk_hidden = hidden_d.index_select(0, rows)  # [n, H], shared by A and C
        chunk_targets = flat_targets.index_select(0, rows).long()
        stats = lm_impl.lm_head_forward(chunk_hidden, weight_d, bias_d, chunk_targets, temperature,
                                        logits_out=chunk_logits,
                                        **({"forward_gemm": "cublas"} if forward_gemm == "cublas" else {}))  # fmt: skip
        logprobs[rows] = stats.logprobs
        entropy[rows] = stats.entropy
        use_ent = cfg.entropy_coef != 0
        # segment boundaries of this chunk's (pieces of) sequences s0..s1-1, chunk-local
        chunk_cu = batch.cu_seqlens[s0:s1 + 1].clamp(t0, t1) - t0 if cut else batch.cu_seqlens[s0:s1 + 1] - t0
        _, _, g_lp, g_ent, chunk_partials = loss_head.loss_head_triton(
            logprobs[t0:t1], batch.advantages[t0:t1], chunk_valid, chunk_cu,
            batch.seq_index[t0:t1] - s0, s1 - s0, cfg, seq_lengths=seq_len[s0:s1] if cut else None,
            old_logprobs=part(batch.old_logprobs, t0, t1), ref_logprobs=part(batch.ref_logprobs, t0, t1),
            rollout_logprobs=part(batch.rollout_logprobs, t0, t1), is_weights=part(batch.is_weights, t0, t1),
            entropy=entropy[t0:t1], token_weights=part(batch.token_weights, t0, t1),
            dp_size=norm["dp_size"], grad_accum_steps=norm["grad_accum_steps"],
            need_grad_logprobs=needs_grad, need_grad_entropy=needs_grad and use_ent, norms=norms, finalize=False,
        )  # fmt: skip
        partials.append(chunk_partials)
        if not needs_grad or rows.numel() == 0:
            continue
        local = rows - t0
        gh, grad_weight_acc, grad_bias_acc = lm_impl.lm_head_backward(
            chunk_hidden, weight_d, bias_d, chunk_targets, temperature, stats.lse, stats.expected_logit,
            g_lp.index_select(0, local), None if g_ent is None else g_ent.index_select(0, local),
            need_grad_hidden=need_h, need_grad_weight=need_w, need_grad_bias=need_b,
            grad_weight_acc=grad_weight_acc, grad_bias_acc=grad_bias_acc, stored_logits=chunk_logits,
            accumulate_grad_weight=grad_weight_written, **({"dz_in_gemm": True} if dz_in_gemm else {}),
        )  # fmt: skip
        grad_weight_written = True
        if need_h:
            grad_hidden.index_copy_(0, rows, gh)
    del logits  # released before the accumulator's cast below: never logits + fp32 + cast copy at once
    if need_w and not grad_weight_written:  # every chunk's rows masked: no GEMM wrote the gradient
        grad_weight_acc.zero_()
    if cut:  # a sequence cut across chunks has one partial row per piece: merge them per sequence
        owners = torch.cat([torch.arange(s0, s1, device=device) for s0, s1, _, _ in chunks])
        all_partials = loss_head.merge_segment_partials(torch.cat(partials), owners, batch.num_seqs)
    else:
        all_partials = torch.cat(partials)
    loss, metrics = loss_head.finalize_partials(
        all_partials, seq_len, cfg, dp_size=norm["dp_size"], grad_accum_steps=norm["grad_accum_steps"],
        has_entropy=True, has_ref=batch.ref_logprobs is not None, has_is_weights=batch.is_weights is not None,
    )  # fmt: skip
    if not needs_grad:
        return loss, metrics, logprobs, entropy
    saved = _Saved()
    saved.scale_on_device = True  # the one-pass schedules run on the Triton backend
    saved.grad_hidden = grad_hidden
    saved.grad_weight = None if grad_weight_acc is None else grad_weight_acc.to(weight.dtype)
    saved.grad_bias = None if grad_bias_acc is None else grad_bias_acc.to(bias.dtype)
    loss = FusedLinearGRPOLossFunction.apply(flat_hidden, weight, bias, loss, saved)
    return loss, metrics, logprobs, entropy
