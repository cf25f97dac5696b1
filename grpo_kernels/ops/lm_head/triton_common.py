"""Device constants and @triton.jit helpers shared by the LM-head forward (triton_forward.py) and backward
(triton_backward.py) kernels: tile rasterisation, the logits-tile GEMM, the soft-cap and the logits transform.
Triton inlines every helper into its kernel; host code lives in triton.py (README.md beside this file).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import half_logits_format


# exp(x) is computed as exp2(x * LOG2E), which is what tl.exp lowers to (mul + ex2.approx.f32); written out,
# it keeps the backward epilogue at 128 registers where tl.exp's lowering needed 192 (sm_90, 128x128 tile).
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Logit magnitudes (README.md, "Numbers at the edges"). The functional layer refuses a call whose logits
# could exceed LOGIT_LIMIT = 2^100 in magnitude (a soft cap / temperature above it, or a logit scale whose
# bound on |z| is), so every constant below is finite, ordered, and at least 2^101 from every logit:
#   a forbidden token (a -inf bias, no soft cap)   NEG_BIG = -2^102: p = 0 exactly, p * (z - max) = 0, not NaN
#   a column outside [0, V) (a tile's padding)    PAD_LOGIT = -2^104: below a forbidden token too, so a row
#                                                  whose every token is forbidden is uniform over V, as in
#                                                  chunked.py, and never counts the padding columns
#   the running max before the first tile         RUN_MAX_INIT = -2^105 (finite: (init - max) * 0 is 0)
#   the lse of a row without upstream gradient    DEAD_LSE = 2^105 (p = exp(z - it) = 0 for every logit)
# All differences of two of them stay below 2^106, finite in fp32; c_H (E[z] - z) next to a forbidden token
# stays finite for |c_H| < 2^25 (dz's p multiplies it afterwards: the register-lean order).
NEG_BIG: tl.constexpr = tl.constexpr(-(2.0**102))
PAD_LOGIT: tl.constexpr = tl.constexpr(-(2.0**104))
RUN_MAX_INIT: tl.constexpr = tl.constexpr(-(2.0**105))
DEAD_LSE: tl.constexpr = tl.constexpr(2.0**105)
# Kernel A's stored logits in half the bytes (README.md §5, "Stored logits in fp16"): each logit as the fp16
# difference d = z - m from its row's running maximum m after the logit's tile, m kept in fp32 once per
# STORED_GROUP columns (kernel A's tiles are multiples of it). d <= 0; d below fp16's most negative finite
# value is clamped there (HALF_DIFF_MIN): such a logit lies more than 65504 below its row's max, so p = 0
# with and without the clamp, and p (z - E[z]) stays 0, not 0 * inf.
STORED_GROUP: tl.constexpr = tl.constexpr(half_logits_format.STORED_GROUP)
HALF_DIFF_MIN: tl.constexpr = tl.constexpr(half_logits_format.HALF_DIFF_MIN)


@triton.jit
def _store_group_offsets(offset_ptr, run_max, offs_m, row_ok, n0, num_groups, stride_offset, BLOCK_N: tl.constexpr):
    """The fp32 offsets of one stored [BM, BN] logits tile: the rows' running max, once per STORED_GROUP
    columns (BN / STORED_GROUP copies of it: a consumer's tile need not match the forward's)."""
    groups = n0 // STORED_GROUP + tl.arange(0, BLOCK_N // STORED_GROUP)
    m = run_max[:, None] + tl.zeros((1, BLOCK_N // STORED_GROUP), dtype=tl.float32)
    ok = row_ok[:, None] & (groups < num_groups)[None, :]
    tl.store(offset_ptr + offs_m.to(tl.int64)[:, None] * stride_offset + groups[None, :], m, mask=ok)


@triton.jit
def _half_difference(z, run_max):
    """fp16 z - m of a [BM, BN] tile (m: the rows' running max including this tile, so d <= 0), clamped."""
    return tl.maximum(z - run_max[:, None], HALF_DIFF_MIN).to(tl.float16)


@triton.jit
def _load_stored_logits(stored_ptr, offset_ptr, rows, row_ok, cols, first_col, vocab, tile_ok, stride_stored,
                        stride_offset, HALF_LOGITS: tl.constexpr):  # fmt: skip
    """A [R, C] tile of the logits the forward stored (rows: [R] token indices, row_ok: those < n; cols =
    first_col + arange(C), first_col a multiple of min(C, STORED_GROUP); tile_ok: row_ok and cols < V): fp32
    z, or (HALF_LOGITS) z = m + d from the fp16 differences and the fp32 offset of each column's group,
    loaded once per row and group ([R] where the tile lies in one group, else [R, C / STORED_GROUP]) and
    broadcast over the group's columns; PAD_LOGIT where tile_ok is False."""
    at = rows.to(tl.int64)
    if HALF_LOGITS:
        R: tl.constexpr = rows.shape[0]
        C: tl.constexpr = cols.shape[0]
        d = tl.load(stored_ptr + at[:, None] * stride_stored + cols[None, :], mask=tile_ok, other=0.0)
        if C <= STORED_GROUP:  # first_col < V: the group exists for every row in range
            m = tl.load(offset_ptr + at * stride_offset + first_col // STORED_GROUP, mask=row_ok, other=0.0)
            z = m[:, None] + d.to(tl.float32)
        else:
            GROUPS: tl.constexpr = C // STORED_GROUP
            groups = first_col // STORED_GROUP + tl.arange(0, GROUPS)
            group_ok = row_ok[:, None] & (groups * STORED_GROUP < vocab)[None, :]
            m = tl.load(offset_ptr + at[:, None] * stride_offset + groups[None, :], mask=group_ok, other=0.0)
            m = tl.reshape(tl.broadcast_to(m[:, :, None], (R, GROUPS, STORED_GROUP)), (R, C))
            z = m + d.to(tl.float32)
        return tl.where(tile_ok, z, PAD_LOGIT)
    else:
        return tl.load(stored_ptr + at[:, None] * stride_stored + cols[None, :], mask=tile_ok, other=PAD_LOGIT)


@triton.jit
def _grouped_tile(pid, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    # Rasterise GROUP_M token tiles x all vocabulary tiles/splits together: programs running at the same
    # time share their hidden tiles and a short run of weight tiles in L2.
    programs_per_group = GROUP_M * num_n_tiles
    group = pid // programs_per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_in_group = pid % programs_per_group
    return first_m + pid_in_group % group_size, pid_in_group // group_size


@triton.jit
def _logits_tile_acc(
    x_ptrs,  # [BM, BK] pointers into hidden at k = 0
    w_ptrs,  # [BN, BK] pointers into weight at k = 0
    hidden_size,
    live,  # False: skip the GEMM, the tile stays 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_INDEPENDENT_DOT: tl.constexpr,
):
    # [BM, H] @ [H, BN] -> [BM, BN] fp32. Row and column indices are clamped by the caller, so the
    # pipelined loop runs unmasked over the whole BLOCK_K slices; a ragged last slice is peeled off
    # (masks inside the loop cost the registers that 128-wide tiles do not have).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_full = tl.where(live, hidden_size // BLOCK_K, 0)
    x_tail = x_ptrs + k_full * BLOCK_K
    w_tail = w_ptrs + k_full * BLOCK_K
    for _k in range(0, k_full):  # (a bare `_` as loop variable disables Triton's pipelining)
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
        if UPCAST_OPERANDS:  # interpreter only: its bf16 tl.dot is wrong, fp32 products of bf16 are exact
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = _tile_dot(x, w, acc, DOT_PRECISION, ROW_INDEPENDENT_DOT)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EVEN_K:
        # the ragged last K slice, from its own pointers so the pipelined loop above stays self-contained
        if live:
            k_ok = tl.arange(0, BLOCK_K) < hidden_size - k_full * BLOCK_K
            x = tl.load(x_tail, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_tail, mask=k_ok[None, :], other=0.0)
            if UPCAST_OPERANDS:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = _tile_dot(x, w, acc, DOT_PRECISION, ROW_INDEPENDENT_DOT)
    return acc


@triton.jit
def _tile_dot(x, w, acc, DOT_PRECISION: tl.constexpr, ROW_INDEPENDENT_DOT: tl.constexpr):
    # acc [BM, BN] + x [BM, BK] @ w [BN, BK]^T. ROW_INDEPENDENT_DOT (interpreter, batch-invariant mode):
    # each element its own sum over BK of a [BM, BN, BK] product, the same for a row wherever it sits in
    # the tile, which np.matmul's BLAS kernels are not (LMHeadTritonConfig.row_independent_dot)
    if ROW_INDEPENDENT_DOT:
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


# Taylor coefficients of tanh(u) / u in u^2 (2^2n (2^2n - 1) B_2n / (2n)!): for |u| < 1/4 the first term
# left out (21844/6081075 u^12) is below 2.2e-10 of the sum (README.md, "Soft-capping", derives the error)
TANH_C1: tl.constexpr = tl.constexpr(-1.0 / 3.0)
TANH_C2: tl.constexpr = tl.constexpr(2.0 / 15.0)
TANH_C3: tl.constexpr = tl.constexpr(-17.0 / 315.0)
TANH_C4: tl.constexpr = tl.constexpr(62.0 / 2835.0)
TANH_C5: tl.constexpr = tl.constexpr(-1382.0 / 155925.0)
TANH_SERIES_BELOW: tl.constexpr = tl.constexpr(0.25)


@triton.jit
def _softcap(x, cap_in, cap_out):
    """cap_out tanh(cap_in x) with an error relative to the result, for any cap (README.md, "Soft-capping"):
    z = u q cap_out, u = cap_in x, q = tanh(u) / u: for |u| >= 1/4 from e = exp2(-2|u| log2 e), (1 - e) /
    ((1 + e) |u|) (no cancellation: 1 - e >= 0.39), for |u| < 1/4 from its series in u^2, so a small logit
    keeps its relative precision even when cap_out is 1e30 (the old cap_out (1 - e) / (1 + e) had an error
    of cap_out x eps there). x = -inf (a forbidden token) gives -cap_out."""
    # u clamped to [-16, 16] (tanh(16) = 1 - 2.5e-14: 1 in fp32; x = -inf gives -1), then one ratio
    # q = tanh(u) / u from either branch, so z = u q cap_out: few values live at once (the 128x256 sm_90
    # forward stays at 255 registers without spills). A subnormal u (|x cap_in| < 2^-126) is off by at most
    # 2^-150 cap_out <= 2^-50 in z (cap_out <= 2^100 by the functional layer's limits)
    u = tl.minimum(tl.maximum(x * cap_in, -16.0), 16.0)
    a = tl.abs(u)
    s = u * u
    r = TANH_C3 + s * (TANH_C4 + s * TANH_C5)  # Horner, innermost first
    r = 1.0 + s * (TANH_C1 + s * (TANH_C2 + s * r))
    e = tl.exp2(a * (-2.0 * LOG2E))  # (this operand order: triton 3.9's interpreter rejects the other)
    q = tl.where(a < TANH_SERIES_BELOW, r, (1.0 - e) / ((1.0 + e) * a))
    return u * q * cap_out


@triton.jit
def _transform_logits(acc, bias_ptr, cols, vocab, inv_temperature, cap_in, cap_out, HAS_BIAS: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    """z from the fp32 GEMM tile acc = hidden @ W^T: (acc + b) / T, or soft-capped cap_out tanh(cap_in (acc + b))
    (cap_in = scale / cap, cap_out = cap / T); PAD_LOGIT outside the vocabulary."""
    if HAS_SOFTCAP:
        col_ok = cols < vocab
        if HAS_BIAS:  # unclamped: a -inf bias gives -cap_out, as transformers' capped forward
            x = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            x = acc
        return tl.where(col_ok[None, :], _softcap(x, cap_in, cap_out), PAD_LOGIT)
    else:
        return acc * inv_temperature + _column_term(bias_ptr, cols, vocab, inv_temperature, HAS_BIAS)[None, :]


@triton.jit
def _column_term(bias_ptr, cols, vocab, inv_temperature, HAS_BIAS: tl.constexpr):
    # [BN] additive term of z: bias / T inside the vocabulary, PAD_LOGIT outside it.
    col_ok = cols < vocab
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * inv_temperature
        # a -inf bias (a forbidden token) becomes NEG_BIG: p = 0 exactly, and p * (z - max) is 0, not NaN
        b = tl.maximum(b, NEG_BIG)
    else:
        b = tl.zeros(cols.shape, dtype=tl.float32)
    return tl.where(col_ok, b, PAD_LOGIT)
