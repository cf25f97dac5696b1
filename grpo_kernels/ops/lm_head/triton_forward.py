"""Kernel A of docs/design.md §1, the LM-head forward statistics (launched by triton.py's lm_head_forward):
  lm_head_fwd_kernel_partial            tiled GEMM z = (hidden @ weight.T + bias) / T into fp32 accumulators,
                                        folded per vocabulary split into online (max, sum-exp, deviation)
                                        statistics (cp.async operands, clamped indices, peeled K tail)
  lm_head_fwd_kernel_partial_tma        the same programs and fold with TMA operands (Hopper and newer)
  lm_head_fwd_kernel_stats_from_logits  the same fold over logits cuBLAS already wrote (no GEMM)
  lm_head_fwd_kernel_merge              combines the splits into logprob, entropy, lse and E_p[z] per token
The three partial kernels share their fold (_fold_tile) and their epilogue (_store_partials).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    LOG2E,
    RUN_MAX_INIT,
    _column_term,
    _grouped_tile,
    _half_difference,
    _logits_tile_acc,
    _store_group_offsets,
    _tile_dot,
    _transform_logits,
)


# The three partial kernels (GEMM by cp.async loads, GEMM by TMA, no GEMM: cuBLAS's logits) share everything
# but where a [BM, BN] fp32 tile comes from: the program's tokens and split (_split_program, _split_tiles),
# the running statistics (_fold_init, _fold_tile) and their store (_store_partials).


@triton.jit
def _split_program(n_tokens, num_splits, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's token tile pid_m (BLOCK_M rows offs_m, row_ok inside N) and its vocabulary split
    pid_split, rasterised by _grouped_tile. (The targets are loaded by the kernel: where, changes its PTX.)"""
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    pid_m, pid_split = _grouped_tile(pid, num_m_tiles, num_splits, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_tokens
    return pid_m, pid_split, offs_m, row_ok


@triton.jit
def _split_tiles(pid_split, tiles_per_split, vocab, BLOCK_N: tl.constexpr):
    """First column of the split and its number of BLOCK_N vocabulary tiles (the last split may hold fewer)."""
    num_vocab_tiles = tl.cdiv(vocab, BLOCK_N)
    first_tile = pid_split * tiles_per_split
    split_lo = first_tile * BLOCK_N
    n_tiles = tl.minimum(tiles_per_split, num_vocab_tiles - first_tile)
    return split_lo, n_tiles


@triton.jit
def _fold_init(BLOCK_M: tl.constexpr, MAX_INIT: tl.constexpr):
    """Running (max, sum-exp, deviation sum, target logit) of BLOCK_M rows before their first tile; MAX_INIT
    is finite, so (run_max - new_max) * 0 is 0."""
    run_max = tl.full((BLOCK_M,), MAX_INIT, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    run_dev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_z = tl.zeros((BLOCK_M,), dtype=tl.float32)
    return run_max, run_sum, run_dev, target_z


@triton.jit(do_not_specialize=["n_tokens", "tiles_per_split", "num_splits"])
def lm_head_fwd_kernel_partial(
    hidden_ptr,  # [N, H], unit stride along H
    weight_ptr,  # [V, H], unit stride along H
    bias_ptr,  # [V] or None
    targets_ptr,  # [N] int
    part_max_ptr,  # [num_splits, N] fp32: m = max_j z_j over the split
    part_sum_ptr,  # [num_splits, N] fp32: sum_j exp(z_j - m)
    part_dev_ptr,  # [num_splits, N] fp32: sum_j exp(z_j - m) * (z_j - m)
    target_logit_ptr,  # [N] fp32: z_y, written by the split that holds y
    logits_ptr,  # [N, V] (row stride stride_logits): z kept for the one-pass backward (fp32, or fp16 z - m), or None
    offset_ptr,  # [N, cdiv(V, STORED_GROUP)] fp32 m of the fp16 differences (HALF_LOGITS), or None
    n_tokens,
    vocab,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_logits,
    stride_offset,
    num_groups,
    tiles_per_split,
    num_splits,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    HALF_LOGITS: tl.constexpr,  # with STORE_LOGITS: fp16 z - m and fp32 m per group (2 bytes per logit, not 4)
    EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ROW_INDEPENDENT_DOT: tl.constexpr = False,  # LMHeadTritonConfig.row_independent_dot (interpreter only)
):
    pid_m, pid_split, offs_m, row_ok = _split_program(n_tokens, num_splits, BLOCK_M, GROUP_M)
    rows = tl.minimum(offs_m, n_tokens - 1).to(tl.int64)  # clamped: the K loop needs no row mask
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + rows[:, None] * stride_hidden + offs_k[None, :]  # [BM, BK]
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)  # V < 2^31
    split_lo, n_tiles = _split_tiles(pid_split, tiles_per_split, vocab, BLOCK_N)
    run_max, run_sum, run_dev, target_z = _fold_init(BLOCK_M, RUN_MAX_INIT)
    for t in range(0, n_tiles):
        n0 = split_lo + t * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(cols, vocab - 1).to(tl.int64)
        w_ptrs = weight_ptr + w_rows[:, None] * stride_weight + offs_k[None, :]  # [BN, BK]
        acc = _logits_tile_acc(
            x_ptrs,
            w_ptrs,
            hidden_size,
            True,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST_OPERANDS,
            DOT_PRECISION,
            ROW_INDEPENDENT_DOT,
        )
        # z = acc / T + bias / T, one FMA (or soft-capped); PAD_LOGIT outside the vocabulary
        z = _transform_logits(acc, bias_ptr, cols, vocab, inv_temperature, cap_in, cap_out, HAS_BIAS, HAS_SOFTCAP)
        if STORE_LOGITS and not HALF_LOGITS:  # the fp32 tile itself, so the one-pass backward needs no second GEMM
            z_out = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_logits + cols[None, :]
            tl.store(z_out, z, mask=row_ok[:, None] & (cols < vocab)[None, :])
        run_max, run_sum, run_dev, target_z = _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z,
                                                         BLOCK_N)  # fmt: skip
        if STORE_LOGITS and HALF_LOGITS:  # z - m against the running max just folded (the fold's own shift)
            z_out = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_logits + cols[None, :]
            tl.store(z_out, _half_difference(z, run_max), mask=row_ok[:, None] & (cols < vocab)[None, :])
            _store_group_offsets(offset_ptr, run_max, offs_m, row_ok, n0, num_groups, stride_offset, BLOCK_N)
    _store_partials(part_max_ptr, part_sum_ptr, part_dev_ptr, target_logit_ptr, pid_split, n_tokens, vocab, offs_m,
                    row_ok, target, split_lo, n_tiles, run_max, run_sum, run_dev, target_z, BLOCK_N)  # fmt: skip


@triton.jit
def _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z, BLOCK_N: tl.constexpr):
    """Fold one [BM, BN] fp32 logits tile (columns n0 + arange(BN)) into the running statistics of its rows:
    max, sum exp(z - max), sum exp(z - max) (z - max), and the target's logit where it lies in the tile."""
    # the target logit first: afterwards z is only needed through z - new_max (fewer live registers)
    in_tile = (target >= n0) & (target < n0 + BLOCK_N)
    if tl.sum(in_tile.to(tl.int32), axis=0) > 0:
        target_z += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
    new_max = tl.maximum(run_max, tl.max(z, axis=1))
    rescale = tl.exp2((run_max - new_max) * LOG2E)
    shifted = z - new_max[:, None]  # [BM, BN], <= 0
    e = tl.exp2(shifted * LOG2E)
    # re-centre the deviation sum on new_max: (z - old) = (z - new) + (new - old)
    run_dev = rescale * (run_dev + (run_max - new_max) * run_sum) + tl.sum(e * shifted, axis=1)
    run_sum = rescale * run_sum + tl.sum(e, axis=1)
    return new_max, run_sum, run_dev, target_z


@triton.jit
def _store_partials(part_max_ptr, part_sum_ptr, part_dev_ptr, target_logit_ptr, pid_split, n_tokens, vocab, offs_m,
                    row_ok, target, split_lo, n_tiles, run_max, run_sum, run_dev, target_z, BLOCK_N: tl.constexpr):  # fmt: skip
    """A split's statistics of its BLOCK_M tokens, and the target logit of the tokens whose target it holds."""
    part = pid_split.to(tl.int64) * n_tokens + offs_m
    tl.store(part_max_ptr + part, run_max, mask=row_ok)
    tl.store(part_sum_ptr + part, run_sum, mask=row_ok)
    tl.store(part_dev_ptr + part, run_dev, mask=row_ok)
    owns_target = row_ok & (target >= split_lo) & (target < split_lo + n_tiles * BLOCK_N) & (target < vocab)
    tl.store(target_logit_ptr + offs_m, target_z, mask=owns_target)


@triton.jit(do_not_specialize=["n_tokens", "tiles_per_split", "num_splits"])
def lm_head_fwd_kernel_partial_tma(
    hidden_desc,  # TMA descriptor over hidden [N, H], block [BLOCK_M, BLOCK_K]
    weight_desc,  # TMA descriptor over weight [V, H], block [BLOCK_N, BLOCK_K]
    logits_desc,  # TMA descriptor over the logits [N, V] (fp32, or fp16 z - m; row stride of the buffer), block [BM, BN]; or None
    offset_ptr,  # [N, cdiv(V, STORED_GROUP)] fp32 m of the fp16 differences (HALF_LOGITS), or None
    bias_ptr,  # [V] or None
    targets_ptr,  # [N] int
    part_max_ptr,  # [num_splits, N] fp32, as lm_head_fwd_kernel_partial
    part_sum_ptr,
    part_dev_ptr,
    target_logit_ptr,  # [N] fp32
    n_tokens,
    vocab,
    hidden_size,
    stride_offset,
    num_groups,
    tiles_per_split,
    num_splits,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    HALF_LOGITS: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    ROW_INDEPENDENT_DOT: tl.constexpr = False,  # LMHeadTritonConfig.row_independent_dot (interpreter only)
):
    """lm_head_fwd_kernel_partial with its operands brought by the tensor memory accelerator (Hopper and
    newer): same programs, same partials, same fold. The descriptors bound every access: rows past N or V
    and the ragged last K slice load as zeros and the logits store is clipped to [N, V], so no index is
    clamped and no K tail is peeled. WARP_SPECIALIZE asks Triton to split the vocabulary-tile loop into
    producer and consumer warps (the compile report records whether the PTX changes; README §6)."""
    pid_m, pid_split, offs_m, row_ok = _split_program(n_tokens, num_splits, BLOCK_M, GROUP_M)
    m0 = pid_m * BLOCK_M
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)  # V < 2^31
    split_lo, n_tiles = _split_tiles(pid_split, tiles_per_split, vocab, BLOCK_N)
    k_tiles = tl.cdiv(hidden_size, BLOCK_K)
    run_max, run_sum, run_dev, target_z = _fold_init(BLOCK_M, RUN_MAX_INIT)
    for t in tl.range(0, n_tiles, warp_specialize=WARP_SPECIALIZE):
        n0 = split_lo + t * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_tiles):  # pipelined by the launch's num_stages
            x = hidden_desc.load([m0, kk * BLOCK_K])
            w = weight_desc.load([n0, kk * BLOCK_K])
            if UPCAST_OPERANDS:  # interpreter only: its bf16 tl.dot is wrong, fp32 products of bf16 are exact
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = _tile_dot(x, w, acc, DOT_PRECISION, ROW_INDEPENDENT_DOT)
        z = _transform_logits(acc, bias_ptr, cols, vocab, inv_temperature, cap_in, cap_out, HAS_BIAS, HAS_SOFTCAP)
        if STORE_LOGITS and not HALF_LOGITS:  # the fp32 tile through shared memory, one bulk store clipped to [N, V]
            logits_desc.store([m0, n0], z)
        run_max, run_sum, run_dev, target_z = _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z,
                                                         BLOCK_N)  # fmt: skip
        if STORE_LOGITS and HALF_LOGITS:
            logits_desc.store([m0, n0], _half_difference(z, run_max))
            _store_group_offsets(offset_ptr, run_max, offs_m, row_ok, n0, num_groups, stride_offset, BLOCK_N)
    _store_partials(part_max_ptr, part_sum_ptr, part_dev_ptr, target_logit_ptr, pid_split, n_tokens, vocab, offs_m,
                    row_ok, target, split_lo, n_tiles, run_max, run_sum, run_dev, target_z, BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["n_tokens", "num_splits"])
def lm_head_fwd_kernel_merge(
    part_max_ptr,  # [num_splits, N] fp32
    part_sum_ptr,  # [num_splits, N] fp32
    part_dev_ptr,  # [num_splits, N] fp32
    target_logit_ptr,  # [N] fp32, z_y (NaN when no split held the target)
    logprobs_ptr,  # [N] fp32 out
    entropy_ptr,  # [N] fp32 out
    lse_ptr,  # [N] fp32 out
    expected_logit_ptr,  # [N] fp32 out
    n_tokens,
    num_splits,
    BLOCK_T: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = offs < n_tokens
    run_max = tl.full((BLOCK_T,), RUN_MAX_INIT, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    run_dev = tl.zeros((BLOCK_T,), dtype=tl.float32)
    part = offs.to(tl.int64)  # split k of token t lives at k * N + t
    for _ in range(0, num_splits):
        m_k = tl.load(part_max_ptr + part, mask=ok, other=0.0)
        s_k = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
        d_k = tl.load(part_dev_ptr + part, mask=ok, other=0.0)
        new_max = tl.maximum(run_max, m_k)
        a = tl.exp2((run_max - new_max) * LOG2E)
        b = tl.exp2((m_k - new_max) * LOG2E)
        run_dev = a * (run_dev + (run_max - new_max) * run_sum) + b * (d_k + (m_k - new_max) * s_k)
        run_sum = a * run_sum + b * s_k
        run_max = new_max
        part += n_tokens
    log_sum = tl.log(run_sum)  # >= 0: the max term contributes exp(0) = 1
    mean_dev = run_dev / run_sum  # E_p[z] - max, <= 0
    target_z = tl.load(target_logit_ptr + offs, mask=ok, other=0.0)
    # logp = (z_y - max) - log(sum): <= 0 exactly, since z_y is one of the terms of the max
    tl.store(logprobs_ptr + offs, (target_z - run_max) - log_sum, mask=ok)
    tl.store(entropy_ptr + offs, log_sum - mean_dev, mask=ok)
    tl.store(lse_ptr + offs, run_max + log_sum, mask=ok)
    tl.store(expected_logit_ptr + offs, run_max + mean_dev, mask=ok)


@triton.jit(do_not_specialize=["n_tokens", "tiles_per_split", "num_splits"])
def lm_head_fwd_kernel_stats_from_logits(
    logits_ptr,  # [N, V] fp32 (row stride stride_logits): x = hidden @ W^T (/ T without a soft-cap) by cuBLAS
    bias_ptr,  # [V] or None
    targets_ptr,  # [N] int
    part_max_ptr,  # [num_splits, N] fp32, as lm_head_fwd_kernel_partial
    part_sum_ptr,
    part_dev_ptr,
    target_logit_ptr,  # [N] fp32
    n_tokens,
    vocab,
    stride_logits,
    tiles_per_split,
    num_splits,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Kernel A's statistics without its GEMM (schedule="one_pass_cublas*"): cuBLAS has written the chunk's
    fp32 GEMM output into the logits buffer; each program streams BLOCK_M rows x one vocabulary split of it,
    forms z (the bias / T added, or the soft-cap applied, to the fp32 value, as kernel A's epilogue does)
    and folds it into the same split partials (_fold_tile), merged by lm_head_fwd_kernel_merge. Where z
    differs from what the buffer holds (a bias or a soft-cap), z is written back in place (same tile, no
    other program reads it), so the backward reads z as from kernel A's stored logits."""
    pid_m, pid_split, offs_m, row_ok = _split_program(n_tokens, num_splits, BLOCK_M, GROUP_M)
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)
    row_ptrs = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_logits
    split_lo, n_tiles = _split_tiles(pid_split, tiles_per_split, vocab, BLOCK_N)
    # -1e30, not RUN_MAX_INIT as kernel A: both lie below every logit (|z| <= 2^100) and PAD_LOGIT is never
    # the max of a live row, so the statistics agree; kept so this kernel's code is unchanged
    run_max, run_sum, run_dev, target_z = _fold_init(BLOCK_M, -1.0e30)
    for t in range(0, n_tiles):
        n0 = split_lo + t * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        tile_ok = row_ok[:, None] & (cols < vocab)[None, :]
        x = tl.load(row_ptrs + cols[None, :], mask=tile_ok, other=0.0)
        if HAS_SOFTCAP:  # x = hidden @ W^T unscaled: z = cap_out tanh(cap_in (x + b))
            z = _transform_logits(x, bias_ptr, cols, vocab, 1.0, cap_in, cap_out, HAS_BIAS, HAS_SOFTCAP)
        else:  # x = (hidden @ W^T) / T already (cuBLAS alpha): z = x + b / T; NEG_BIG outside the vocabulary
            z = x + _column_term(bias_ptr, cols, vocab, inv_temperature, HAS_BIAS)[None, :]
        if HAS_BIAS or HAS_SOFTCAP:
            tl.store(row_ptrs + cols[None, :], z, mask=tile_ok)
        run_max, run_sum, run_dev, target_z = _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z,
                                                         BLOCK_N)  # fmt: skip
    _store_partials(part_max_ptr, part_sum_ptr, part_dev_ptr, target_logit_ptr, pid_split, n_tokens, vocab, offs_m,
                    row_ok, target, split_lo, n_tiles, run_max, run_sum, run_dev, target_z, BLOCK_N)  # fmt: skip
