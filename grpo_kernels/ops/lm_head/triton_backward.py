"""Kernel C of docs/design.md §1, the LM-head backward (launched by triton.py's lm_head_backward):
  lm_head_bwd_kernel_dlogits          recomputes each logits tile (or reads the stored one) and writes
                                      dL/dlogit into a bounded workspace, optionally with column sums
  lm_head_bwd_kernel_grad_hidden_dz   grad_hidden with dz formed inside the GEMM from stored logits
  lm_head_bwd_kernel_grad_weight_dz   grad_weight likewise (schedule="one_pass_dz", "one_pass_dz_inplace")
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    DEAD_LSE,
    LOG2E,
    _grouped_tile,
    _load_stored_logits,
    _logits_tile_acc,
    _transform_logits,
)


@triton.jit
def _row_stats(offs_m, row_ok, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr, targets_ptr,
               inv_temperature, HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):  # fmt: skip
    """Per-row coefficients of dz (c_lp = g_lp / T, c_H = g_H / T), E[z], target, and which rows are live
    (a nonzero upstream gradient). A row that is not contributes exactly 0: its lse is replaced by DEAD_LSE so
    p = 0 (its logits may be unrelated to lse: exp could overflow), and every coefficient multiplying p is 0."""
    lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
    live = tl.zeros(offs_m.shape, dtype=tl.int1)
    c_lp = tl.zeros(offs_m.shape, dtype=tl.float32)
    c_h = tl.zeros(offs_m.shape, dtype=tl.float32)
    mean_z = tl.zeros(offs_m.shape, dtype=tl.float32)
    target = tl.full(offs_m.shape, -1, dtype=tl.int32)
    if HAS_GRAD_LOGPROBS:
        c_lp = tl.load(grad_logprobs_ptr + offs_m, mask=row_ok, other=0.0) * inv_temperature
        target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)
        live = live | (c_lp != 0.0)
    if HAS_GRAD_ENTROPY:
        c_h = tl.load(grad_entropy_ptr + offs_m, mask=row_ok, other=0.0) * inv_temperature
        mean_z = tl.load(expected_logit_ptr + offs_m, mask=row_ok, other=0.0)
        live = live | (c_h != 0.0)
    lse = tl.where(live, lse, DEAD_LSE)
    return lse, c_lp, c_h, mean_z, target, live


@triton.jit
def _dz_tile(z, cols, lse, c_lp, c_h, mean_z, target, cap_in, cap_out, HAS_GRAD_LOGPROBS: tl.constexpr,
             HAS_GRAD_ENTROPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr):  # fmt: skip
    """dL/dlogit of a [rows, cols] tile of logits z (rows on axis 0):
    dz_j = p_j (c_H (E[z] - z_j) - c_lp) + c_lp 1[j = y]  (README.md derives it); with a soft-cap times
    dz/dx = cap_in cap_out (1 - tanh^2), tanh = z / cap_out (the host then passes inv_temperature 1)."""
    p = tl.exp2((z - lse[:, None]) * LOG2E)  # softmax probabilities
    if HAS_GRAD_ENTROPY:
        if HAS_GRAD_LOGPROBS:
            dz = p * (c_h[:, None] * (mean_z[:, None] - z) - c_lp[:, None])
        else:
            dz = p * (c_h[:, None] * (mean_z[:, None] - z))
    else:
        dz = p * (-c_lp[:, None])
    if HAS_GRAD_LOGPROBS:
        dz += tl.where(cols[None, :] == target[:, None], c_lp[:, None], 0.0)
    if HAS_SOFTCAP:
        t = tl.minimum(tl.maximum(z / cap_out, -1.0), 1.0)
        dz = dz * (cap_in * cap_out) * (1.0 - t * t)
    return dz


@triton.jit(do_not_specialize=["n_rows"])
def lm_head_bwd_kernel_dlogits(
    hidden_ptr,  # [n, H], unit stride along H
    weight_ptr,  # [V, H], unit stride along H
    bias_ptr,  # [V] or None
    targets_ptr,  # [n] int
    lse_ptr,  # [n] fp32
    expected_logit_ptr,  # [n] fp32, E_p[z]
    grad_logprobs_ptr,  # [n] fp32 or None
    grad_entropy_ptr,  # [n] fp32 or None
    dlogits_ptr,  # [n, V] (row stride stride_dlogits), input dtype: dL/d(hidden @ W.T + b)
    bias_grad_part_ptr,  # [cdiv(n, BM), V] fp32 column sums of dL/dlogit, or None
    stored_ptr,  # [n, V] z stored by the forward (row stride stride_stored; fp32, or fp16 z - m), or None: recompute
    offset_ptr,  # [n, cdiv(V, STORED_GROUP)] fp32 m of the fp16 differences (HALF_LOGITS), or None
    dz_scale_ptr,  # [2] fp32 (S, 1 / S): the slab holds S dz (fp16: README.md, "dz precision"), or None
    n_rows,
    vocab,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_dlogits,
    stride_stored,
    stride_offset,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FROM_STORED: tl.constexpr,
    HALF_LOGITS: tl.constexpr,
    HAS_GRAD_LOGPROBS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    STORE_DLOGITS: tl.constexpr,
    STORE_BIAS_GRAD: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(n_rows, BLOCK_M)
    pid_m, pid_n = _grouped_tile(pid, num_m_tiles, tl.cdiv(vocab, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < vocab

    lse, c_lp, c_h, mean_z, target, live = _row_stats(
        offs_m, row_ok, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr, targets_ptr,
        inv_temperature, HAS_GRAD_LOGPROBS, HAS_GRAD_ENTROPY,
    )  # fmt: skip
    any_live = tl.sum(live.to(tl.int32), axis=0) > 0  # a tile whose rows have no upstream gradient: no GEMM

    tile_ok = row_ok[:, None] & col_ok[None, :]
    if FROM_STORED:  # the forward kept the logits of these rows: no GEMM here (one-pass schedule)
        z = _load_stored_logits(stored_ptr, offset_ptr, offs_m, row_ok, cols, pid_n * BLOCK_N, vocab, tile_ok,
                                stride_stored, stride_offset, HALF_LOGITS)  # fmt: skip
    else:
        rows = tl.minimum(offs_m, n_rows - 1).to(tl.int64)
        w_rows = tl.minimum(cols, vocab - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        acc = _logits_tile_acc(
            hidden_ptr + rows[:, None] * stride_hidden + offs_k[None, :],
            weight_ptr + w_rows[:, None] * stride_weight + offs_k[None, :],
            hidden_size,
            any_live,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST_OPERANDS,
            DOT_PRECISION,
            False,  # the recompute for the gradients (repeatable, not batch-invariant)
        )
        z = _transform_logits(acc, bias_ptr, cols, vocab, inv_temperature, cap_in, cap_out, HAS_BIAS, HAS_SOFTCAP)
    dz = _dz_tile(z, cols, lse, c_lp, c_h, mean_z, target, cap_in, cap_out, HAS_GRAD_LOGPROBS, HAS_GRAD_ENTROPY,
                  HAS_SOFTCAP)  # fmt: skip

    if STORE_DLOGITS:
        out = dlogits_ptr + offs_m.to(tl.int64)[:, None] * stride_dlogits + cols[None, :]
        if SCALE_DZ:  # a power of two: exact, and the slab's fp16 keeps the small entries (host divides back)
            tl.store(out, (dz * tl.load(dz_scale_ptr)).to(dlogits_ptr.dtype.element_ty), mask=tile_ok)
        else:
            tl.store(out, dz.to(dlogits_ptr.dtype.element_ty), mask=tile_ok)
    if STORE_BIAS_GRAD:
        col_sum = tl.sum(tl.where(tile_ok, dz, 0.0), axis=0)  # [BN] fp32, before any rounding
        tl.store(bias_grad_part_ptr + pid_m.to(tl.int64) * vocab + cols, col_sum, mask=col_ok)


# ---- dz inside the backward GEMMs (opt-in: schedule="one_pass_dz") -----------------------------------
# With the forward's fp32 logits stored (one-pass schedule), dz = dL/dlogit is formed in the operand load of
# the two backward GEMMs instead of being written to an [n, V] slab and read back by cuBLAS: per token row
# the statistics (lse, E_p[z], g_lp, g_H, target) come from O(n) vectors, the logits from the stored tile.
# dz is rounded to the operand dtype before the dot, as the slab path rounds it when it writes the slab.


@triton.jit(do_not_specialize=["n_rows"])
def lm_head_bwd_kernel_grad_hidden_dz(
    stored_ptr,  # [n, V] logits stored by the forward (row stride stride_stored; fp32, or fp16 z - m)
    offset_ptr,  # [n, cdiv(V, STORED_GROUP)] fp32 m of the fp16 differences (HALF_LOGITS), or None
    weight_ptr,  # [V, H], unit stride along H
    targets_ptr, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr,  # [n] each
    out_ptr,  # [n, H] fp32: grad_hidden (added into when ACCUMULATE)
    dz_scale_ptr,  # [2] fp32 (S, 1 / S) when SCALE_DZ: the operand is S dz, the sum divided by S
    n_rows, vocab, hidden_size, stride_stored, stride_offset, stride_weight, stride_out,
    inv_temperature, cap_in, cap_out,
    HAS_SOFTCAP: tl.constexpr, HALF_LOGITS: tl.constexpr, HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    ACCUMULATE: tl.constexpr, SCALE_DZ: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """grad_hidden[rows, h] = sum_v dz[rows, v] W[v, h]: BLOCK_M token rows x BLOCK_N hidden columns, the
    vocabulary as the K loop, dz formed from the stored logits in the A-operand load."""
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(n_rows, BLOCK_M), tl.cdiv(hidden_size, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < hidden_size
    lse, c_lp, c_h, mean_z, target, _ = _row_stats(
        offs_m, row_ok, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr, targets_ptr,
        inv_temperature, HAS_GRAD_LOGPROBS, HAS_GRAD_ENTROPY,
    )  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, vocab, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < vocab
        tile_ok = row_ok[:, None] & col_ok[None, :]
        z = _load_stored_logits(stored_ptr, offset_ptr, offs_m, row_ok, cols, k0, vocab, tile_ok, stride_stored,
                                stride_offset, HALF_LOGITS)  # fmt: skip
        dz = _dz_tile(z, cols, lse, c_lp, c_h, mean_z, target, cap_in, cap_out, HAS_GRAD_LOGPROBS,
                      HAS_GRAD_ENTROPY, HAS_SOFTCAP)  # fmt: skip
        dz = tl.where(tile_ok, dz, 0.0)
        w = tl.load(weight_ptr + cols.to(tl.int64)[:, None] * stride_weight + offs_h[None, :],
                    mask=col_ok[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
        if SCALE_DZ:
            dz = dz * tl.load(dz_scale_ptr)
        a = dz.to(w.dtype)  # the operand dtype: the slab path's rounding of dz
        if UPCAST_OPERANDS:  # interpreter only (its bf16 dot is wrong; products of bf16 are exact in fp32)
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if SCALE_DZ:
        acc = acc * tl.load(dz_scale_ptr + 1)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_h[None, :]
    out_ok = row_ok[:, None] & h_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=out_ok, other=0.0)
    tl.store(out, acc, mask=out_ok)


@triton.jit(do_not_specialize=["n_rows", "accumulate"])
def lm_head_bwd_kernel_grad_weight_dz(
    stored_ptr,  # [n, V] logits stored by the forward (row stride stride_stored; fp32, or fp16 z - m)
    offset_ptr,  # [n, cdiv(V, STORED_GROUP)] fp32 m of the fp16 differences (HALF_LOGITS), or None
    hidden_ptr,  # [n, H], unit stride along H
    targets_ptr, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr,  # [n] each
    acc_ptr,  # [V, H] grad_weight accumulator, fp32 or (in place) the weight's dtype: (read, added to,) written
    dz_scale_ptr,  # [2] fp32 (S, 1 / S) when SCALE_DZ
    n_rows, vocab, hidden_size, stride_stored, stride_offset, stride_hidden, stride_acc, accumulate,
    inv_temperature, cap_in, cap_out,
    HAS_SOFTCAP: tl.constexpr, HALF_LOGITS: tl.constexpr, HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE_DZ: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """grad_weight[v, h] (+)= sum_rows dz[rows, v] X[rows, h]: BLOCK_M vocabulary rows x BLOCK_N hidden
    columns, the token rows as the K loop, dz formed from the stored logits and transposed in registers.
    The accumulator is fp32, or for schedule="one_pass_dz_inplace" the gradient buffer in the weight's dtype;
    accumulate = 0: its content is neither read nor kept (the first chunk's call: no zero-fill before it)."""
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(vocab, BLOCK_M), tl.cdiv(hidden_size, BLOCK_N), GROUP_M)
    offs_v = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    v_ok = offs_v < vocab
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < hidden_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        row_ok = rows < n_rows
        lse, c_lp, c_h, mean_z, target, _ = _row_stats(
            rows, row_ok, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr, targets_ptr,
            inv_temperature, HAS_GRAD_LOGPROBS, HAS_GRAD_ENTROPY,
        )  # fmt: skip
        tile_ok = row_ok[:, None] & v_ok[None, :]
        z = _load_stored_logits(stored_ptr, offset_ptr, rows, row_ok, offs_v, pid_m * BLOCK_M, vocab, tile_ok,
                                stride_stored, stride_offset, HALF_LOGITS)  # fmt: skip  [BK rows, BM vocab]
        dz = _dz_tile(z, offs_v, lse, c_lp, c_h, mean_z, target, cap_in, cap_out, HAS_GRAD_LOGPROBS,
                      HAS_GRAD_ENTROPY, HAS_SOFTCAP)  # fmt: skip
        dz = tl.where(tile_ok, dz, 0.0)
        x = tl.load(hidden_ptr + rows.to(tl.int64)[:, None] * stride_hidden + offs_h[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0)  # fmt: skip  [BK rows, BN]
        if SCALE_DZ:
            dz = dz * tl.load(dz_scale_ptr)
        a = tl.trans(dz.to(x.dtype))  # [BM vocab, BK rows] in the operand dtype
        if UPCAST_OPERANDS:
            acc = tl.dot(a.to(tl.float32), x.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, x, acc, input_precision=DOT_PRECISION)
    if SCALE_DZ:
        acc = acc * tl.load(dz_scale_ptr + 1)
    out = acc_ptr + offs_v.to(tl.int64)[:, None] * stride_acc + offs_h[None, :]
    out_ok = v_ok[:, None] & h_ok[None, :]
    # the sum in fp32, rounded once to the accumulator's dtype (in place: as cuBLAS's beta = 1 addmm rounds).
    # `accumulate` is a run-time predicate on the load (0: no byte read, acc + 0 stored), not a constexpr: one
    # compiled kernel for every chunk, and the same code as the accumulating one (on sm_100 a constexpr branch
    # without the load compiled to 128 registers with an 8-byte stack). Splat to the tile before the compare:
    # Triton 3.9's interpreter refuses a mask made with a scalar comparison
    add_old = tl.full((BLOCK_M, BLOCK_N), accumulate, tl.int32) != 0
    total = acc + tl.load(out, mask=out_ok & add_old, other=0.0).to(tl.float32)
    tl.store(out, total.to(acc_ptr.dtype.element_ty), mask=out_ok)
