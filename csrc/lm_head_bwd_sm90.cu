// Kernel C on Hopper (sm_90a): the LM-head backward GEMMs with dL/dlogit (dz) formed in their A-operand load
// from the logits kernel A stored in fp16 (the HalfLogits form), so the [N, V] dz slab is never written:
//
//     grad_hidden[n, h]  = sum_v dz[n, v] W[v, h]        (M = tokens, N = H, K = vocabulary)
//     grad_weight[v, h] += sum_n dz[n, v] X[n, h]        (M = vocabulary, N = H, K = tokens)
//
// with, per token n (grpo_kernels/ops/lm_head/README.md derives it; triton_backward.py `_dz_tile`):
//     z = offset[n, v / 64] + diff[n, v]            (the stored logit, fp32)
//     p = exp(z - lse_n)
//     dz = p (c_H (E_p[z] - z) - c_lp) + c_lp 1[v = y_n]      c_lp = g_lp / T, c_H = g_H / T
//     soft cap: dz *= cap_in cap_out (1 - t^2), t = clamp(z / cap_out, -1, 1)   (then T = 1)
// and dz rounded to the operand dtype before the MMA (the slab path's rounding). A token without an upstream
// gradient contributes exactly 0 (its lse is replaced by DEAD_LSE so p = 0). The per-token coefficients are
// packed once per call by `token_coef_kernel` (fp16: the dz scale S folded in; the epilogue multiplies by 1/S;
// soft cap: the constant cap_in cap_out folded in), in the form that makes an element two FMAs, one MUFU.EX2 and
// one product (TokenCoef, RowShift, dz_chunk), and the soft cap's 1 - t^2 three more and a product.
//
// The CTA (384 threads) is warp-specialized: warpgroup 0 is the producer (one thread issues the TMA loads of
// the fp16 logits tile and the B tile into a ring of STAGES buffers, mbarrier full / empty), warpgroups 1 and 2
// are consumers, each owning 64 rows of the 128-row tile: per K tile each consumer thread reads four 16-byte
// chunks of fp16 logits from shared memory, forms 32 dz values, writes them as 16-bit chunks into the
// warpgroup's part of a double-buffered swizzled A tile, fences the generic-proxy stores for the async proxy,
// syncs its warpgroup, and issues the WGMMAs (A and B from shared memory). One WGMMA batch stays in flight
// while the next tile is transformed. The epilogue adds the fp32 accumulators into the output directly from
// registers (grad_weight: read-add-write of the caller's accumulator, fp32 or, in place, the gradient buffer in
// the operands' dtype with one rounding of the fp32 sum; one CTA owns each output tile).
//
// Tiles: 128 x 256 x 64 (BM x BN x BK); BK = 64 is the fp16 store's offset group, so a K tile of grad_hidden
// has one offset per row and an M tile half of grad_weight one offset per token.

#include <cstdint>
#include <cstdio>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

#include "common.cuh"
#include "tiles_sm90.cuh"

namespace grpo_csrc_bwd {

using namespace cute;
using grpo_csrc::ex2_approx;
using grpo_csrc::check_problem_size;
using grpo_csrc::fail;
using grpo_csrc::LOG2E;

constexpr float DEAD_LSE = 0x1p105f;  // triton_common.py DEAD_LSE: p = exp(z - DEAD_LSE) = 0 for every stored z

// One token's coefficients of dz, packed by token_coef_kernel (16 bytes: one vector load per token), in the form the
// transform uses (dz_chunk): with c_lp = F S g_lp and c_H = F S g_H (F, the host's coef_factor: 1 / T, or with a soft
// cap cap_in cap_out, where T = 1),
//     dz = p (c_H (E_p[z] - z) - c_lp) = p (neg_c_h z + k),   p = 2^(z log2 e - lse_log2)
// A token without upstream gradient has lse_log2 = DEAD_LSE log2 e (p = 0) and neg_c_h = k = 0 (its dz exactly 0,
// whatever its E_p[z]).
struct alignas(16) TokenCoef {
  float lse_log2;  // lse log2 e
  float c_lp;      // F S g_lp (0 without grad_logprobs): the target column's term
  float neg_c_h;   // -F S g_H (0 without grad_entropy)
  float k;         // c_H E_p[z] - c_lp
};

// Two adjacent 16-bit outputs as one 4-byte access: the in-place grad_weight epilogue's load and rounded store.
template <class Element> struct Pair16;
template <> struct Pair16<cutlass::bfloat16_t> {
  using T = __nv_bfloat162;
  static CUTLASS_DEVICE float2 widen(T v) { return __bfloat1622float2(v); }
  static CUTLASS_DEVICE T round(float2 v) { return __float22bfloat162_rn(v); }
};
template <> struct Pair16<cutlass::half_t> {
  using T = __half2;
  static CUTLASS_DEVICE float2 widen(T v) { return __half22float2(v); }
  static CUTLASS_DEVICE T round(float2 v) { return __float22half2_rn(v); }
};

struct DzArgs {
  float const* offset = nullptr;    // [N, ld_offset] fp32 offsets of the fp16 differences
  int ld_offset = 0;                // N ld_offset < 2^31 (the entry point checks): 32-bit index arithmetic
  TokenCoef const* coef = nullptr;  // [N]
  int const* target = nullptr;      // [N], -1: no target term
  float const* inv_scale = nullptr; // [1] device scalar 1 / S multiplying the sums, or null (1)
  void* out = nullptr;              // grad_hidden [N, ld_out] fp32, or grad_weight [V, ld_out] fp32 / Element
  int64_t ld_out = 0;
  int accumulate = 0;               // add into out; 0: out's content is ignored (ABI 5: grad_weight too)
  int n_tokens = 0, vocab = 0, hidden = 0;
  int has_softcap = 0;
  float cap_out = 1.f;              // with a soft cap (its cap_in cap_out is in the coefficients)
  int group_m = 8;                  // tile raster: GROUP_M M tiles per column band, for L2 reuse of B
};

// 16-byte shared-memory accesses by shared-window address (a generic pointer into the swizzled tile compiles to
// LD.E / ST.E). volatile + "memory": ordered after the mbarrier wait that makes the TMA's bytes visible, and before
// the fence.
CUTLASS_DEVICE uint4 load_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

CUTLASS_DEVICE void store_shared_16(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// One token's shifts for one K tile: the offset m of the tile's 64-column group of the fp16 store (z = m + d) folded
// into its TokenCoef, so that an element takes one FFMA for p's exponent and one for its coefficient:
//     p = 2^(d log2 e + exp_shift)         exp_shift = m log2 e - lse_log2
//     dz = p (neg_c_h d + coef_shift)      coef_shift = neg_c_h m + k
struct RowShift {
  float exp_shift, coef_shift;
};

CUTLASS_DEVICE RowShift row_shift(TokenCoef const& c, float offset) {
  return RowShift{fmaf(offset, LOG2E, -c.lse_log2), fmaf(c.neg_c_h, offset, c.k)};
}

// The soft cap's factor of dz at logit z = m + d, without its constant cap_in cap_out (folded into the token's
// coefficients by the host: token_coef_kernel's coef_factor): 1 - t^2 with t = clamp(z / cap_out, -1, 1), as
// 1 - t^2 of the unclamped t saturated to [0, 1] (the same value: |t| >= 1 gives 0 either way, and 1 - t^2 <= 1).
// Per element one FFMA for t (offset / cap_out is formed once per chunk) and one FFMA.SAT (`fma.rn.sat`: the clamp
// in the same instruction; NaN gives +0, as fmaxf(NaN, 0) does): 2 instructions and the product, where the clamp
// and the constant took 7 (counted in the SASS).
CUTLASS_DEVICE float softcap_factor(float offset, float d, float inv_cap_out) {
  float const t = fmaf(d, inv_cap_out, offset * inv_cap_out);
  float s;
  asm("fma.rn.sat.f32 %0, %1, %2, 0f3F800000;" : "=f"(s) : "f"(-t), "f"(t));  // sat(1 - t^2)
  return s;
}

// dz of 8 adjacent vocabulary columns col0.. of one token, from their fp16 differences, as 16-bit values packed into
// a 16-byte chunk. Per element (no soft cap): the fp16 widening, two FFMAs, MUFU.EX2, one FMUL, half a pack. The
// target term (this chunk holds the token's target: one chunk in V / 8 of a row) and the mask past V (`edge`: the
// tile's columns reach past V, only in the last vocabulary tile) are branches the other chunks skip.
template <bool SOFTCAP, class Element>
CUTLASS_DEVICE uint4 dz_chunk(uint4 stored, RowShift const& shift, TokenCoef const& c, int target, float offset,
                              int col0, bool edge, int vocab, float inv_cap_out) {
  __half2 const* d2 = reinterpret_cast<__half2 const*>(&stored);
  float g[8];
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < 4; ++q) {
    float2 const d = __half22float2(d2[q]);
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      float const dd = h == 0 ? d.x : d.y;
      float const p = ex2_approx(fmaf(dd, LOG2E, shift.exp_shift));
      float v = p * fmaf(dd, c.neg_c_h, shift.coef_shift);
      if constexpr (SOFTCAP) v *= softcap_factor(offset, dd, inv_cap_out);
      g[2 * q + h] = v;
    }
  }
  int const rel = target - col0;  // the target's place in the chunk; -1 (no target term) is never in [0, 8)
  if (static_cast<unsigned>(rel) < 8u) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) {
      if (j == rel) {
        float add = c.c_lp;
        if constexpr (SOFTCAP) {
          float const dj = __half2float(reinterpret_cast<__half const*>(&stored)[j]);
          add *= softcap_factor(offset, dj, inv_cap_out);
        }
        g[j] += add;
      }
    }
  }
  if (edge) {  // TMA fills columns past V with 0 differences: not probabilities
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) g[j] = col0 + j < vocab ? g[j] : 0.f;
  }
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < 4; ++q) {
    if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
      __nv_bfloat162 const b = __floats2bfloat162_rn(g[2 * q], g[2 * q + 1]);
      o[q] = *reinterpret_cast<uint32_t const*>(&b);
    } else {
      __half2 const b = __floats2half2_rn(g[2 * q], g[2 * q + 1]);
      o[q] = *reinterpret_cast<uint32_t const*>(&b);
    }
  }
  return out;
}

// The per-token data of the four tokens a consumer thread serves in one K tile (tiles_sm90.cuh: chunk_token(wt, i)):
// their coefficients, targets and fp16-store offsets. Tokens past N are dead (p = 0, no target).
struct TokenRows {
  TokenCoef coef[4];
  int target[4];
  float offset[4];
};

// Loads them: grad_hidden (first_token: the warpgroup's first row, fixed) one offset per row for the K tile's 64-column
// group; grad_weight (first_token: the K tile's first token, group: the warpgroup's 64 vocabulary columns) also the
// coefficients and targets. 32-bit index arithmetic (the entry point checks N ld_offset < 2^31): the 64-bit products
// took 108 instructions per K tile of grad_weight's loop (read in the SASS).
CUTLASS_DEVICE void load_rows(TokenRows& r, DzArgs const& a, int first_token, int wt, int group, bool load_coef) {
  // a group past the vocabulary (grad_weight's last M tile, its second warpgroup when V % 128 <= 64) has no
  // offset: its columns are all >= V and masked, so 0 is read instead of the next row's first offset
  bool const group_ok = group * STORED_GROUP < a.vocab;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) {
    int const token = first_token + chunk_token(wt, i);
    bool const ok = token < a.n_tokens;
    if (load_coef) {
      r.coef[i] = ok ? a.coef[token] : TokenCoef{DEAD_LSE * LOG2E, 0.f, 0.f, 0.f};
      r.target[i] = ok ? a.target[token] : -1;
    }
    r.offset[i] = ok && group_ok ? a.offset[token * a.ld_offset + group] : 0.f;
  }
}

// One output tile (`tile`: its index in the GEMM's grouped raster) of one dz GEMM, by the whole CTA. SOFTCAP: the
// call's soft-cap mode, a template argument so that the K loop holds one transform (branching per chunk put both in
// the loop body; one loop per mode feeding a shared epilogue made ptxas serialize the WGMMAs, C7515).
template <class Cfg, bool SOFTCAP, class TmaL, class TmaB>
CUTLASS_DEVICE void dz_gemm_tile(TmaL const& tma_l, TmaB const& tma_b, DzArgs const& a, int const tile,
                                 char* smem_raw) {
  using Element = typename Cfg::Element;
  using SS = typename Cfg::SharedStorage;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  constexpr bool GRAD_HIDDEN = Cfg::OP == Op::GradHidden;
  SS& ss = *reinterpret_cast<SS*>(smem_raw);

  int const M = GRAD_HIDDEN ? a.n_tokens : a.vocab;
  int const K = GRAD_HIDDEN ? a.vocab : a.n_tokens;
  int const N = a.hidden;
  // grouped raster: group_m M tiles share each band of N tiles (consecutive CTAs reuse B tiles in L2)
  int const tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  int const per_group = a.group_m * tiles_n;
  int const group = tile / per_group;
  int const first_m = group * a.group_m;
  int const group_size = min(tiles_m - first_m, a.group_m);
  int const m_blk = first_m + (tile % per_group) % group_size;
  int const n_blk = (tile % per_group) / group_size;
  int const k_tiles = (K + BK - 1) / BK;

  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  if (threadIdx.x == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < STAGES; ++s) {
      FullBarrier::init(&ss.full[s], 1);   // the producer's arrive (+ the TMA bytes)
      EmptyBarrier::init(&ss.empty[s], 2); // one arrive per consumer warpgroup
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  int const warpgroup = int(threadIdx.x) / 128;
  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(tma_l.get_tma_descriptor());
      cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
      Tensor mL = tma_l.get_tma_tensor(make_shape(M, K));  // (M, K) coordinates of the stored logits
      Tensor mB = tma_b.get_tma_tensor(make_shape(N, K));
      Tensor gL = local_tile(mL, make_shape(Int<BM>{}, Int<BK>{}), make_coord(m_blk, _));  // (BM, BK, k)
      Tensor gB = local_tile(mB, make_shape(Int<BN>{}, Int<BK>{}), make_coord(n_blk, _));  // (BN, BK, k)
      Tensor sL = make_tensor(make_smem_ptr(ss.logits.data()), typename Cfg::SmemLayoutL{});
      Tensor sB = make_tensor(make_smem_ptr(ss.b.data()), typename Cfg::SmemLayoutB{});
      auto [tLgL, tLsL] = tma_partition(tma_l, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sL), group_modes<0, 2>(gL));
      auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
      int stage = 0;
      uint32_t phase = 0;
      for (int k = 0; k < k_tiles; ++k) {
        EmptyBarrier::wait(&ss.empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        FullBarrier::arrive_and_expect_tx(&ss.full[stage], Cfg::TMA_BYTES);
        copy(tma_l.with(ss.full[stage]), tLgL(_, k), tLsL(_, stage));
        copy(tma_b.with(ss.full[stage]), tBgB(_, k), tBsB(_, stage));
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
    }
    return;
  }

  // consumers
  cutlass::arch::warpgroup_reg_alloc<232>();
  int const cw = warpgroup - 1;              // rows [64 cw, 64 cw + 64) of the tile
  int const ct = int(threadIdx.x) - 128;     // 0..255, the tiled MMA's thread index
  int const wt = ct % 128;                   // thread in the warpgroup: its tokens and columns (tiles_sm90.cuh)

  typename Cfg::TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  Tensor sL = make_tensor(make_smem_ptr(ss.logits.data()), typename Cfg::SmemLayoutL{});  // (BM, BK, STAGES)
  Tensor sA = make_tensor(make_smem_ptr(ss.dz.data()), typename Cfg::SmemLayoutA{});      // (BM, BK, 2)
  Tensor sB = make_tensor(make_smem_ptr(ss.b.data()), typename Cfg::SmemLayoutB{});       // (BN, BK, STAGES)
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // WGMMA descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  float const inv_cap_out = 1.f / a.cap_out;
  // Which tokens / columns this thread transforms. grad_hidden: tokens fixed per tile, columns move with k;
  // grad_weight: columns fixed (the tile's vocabulary rows), tokens move with k.
  int const tile_row0 = m_blk * BM + 64 * cw;  // first M index of this warpgroup
  TokenRows rows, next;
  if constexpr (GRAD_HIDDEN) {
    load_rows(rows, a, tile_row0, wt, 0, true);  // offsets of K tile 0 (group 0)
  } else {
    load_rows(rows, a, 0, wt, tile_row0 / STORED_GROUP, true);
  }

  // The shared-window addresses of this thread's chunk 0 in stage 0 of the logits ring and in dz buffer 0, computed
  // once: chunk i is CHUNK_STRIDE i bytes further (16 rows / tokens on: two 1 KB swizzle atoms, the same swizzle) and
  // stage (buffer) s a whole tile's bytes further (a multiple of the swizzle's 1 KB period). csrc/tests/tile_layouts.cu
  // checks both for every element; the loop's addresses are then a register plus constants.
  constexpr uint32_t L_TILE_BYTES = Cfg::LOGITS_TILE_BYTES, A_TILE_BYTES = Cfg::DZ_TILE_BYTES;
  constexpr uint32_t CHUNK_STRIDE = Cfg::CHUNK_STRIDE_BYTES;
  ChunkCoord const c0 = consumer_chunk<Cfg>(cw, wt, 0);
  uint32_t const l_addr = cute::cast_smem_ptr_to_uint(&sL(c0.m, c0.k, 0));
  uint32_t const a_addr = cute::cast_smem_ptr_to_uint(&sA(c0.m, c0.k, 0));

  // the rows' shifts for K tile 0; each K tile forms those of the next from the offsets (grad_weight: the tokens) it
  // loads while it transforms
  RowShift shift[4];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) shift[i] = row_shift(rows.coef[i], rows.offset[i]);

  Tensor acc = partition_fragment_C(mma, make_shape(Int<BM>{}, Int<BN>{}));  // (MMA, MMA_M, MMA_N) fp32
  clear(acc);
  int stage = 0;
  uint32_t phase = 0;
  int prev_stage = -1;
  for (int k = 0; k < k_tiles; ++k) {
    // the next K tile's per-token data, loaded while this one is transformed
    if (k + 1 < k_tiles) {
      if constexpr (GRAD_HIDDEN) load_rows(next, a, tile_row0, wt, k + 1, false);
      else load_rows(next, a, (k + 1) * BK, wt, tile_row0 / STORED_GROUP, true);
    }
    int const col_base = (GRAD_HIDDEN ? k * BK : tile_row0);  // the tile's 64 vocabulary columns start here
    bool const edge = col_base + BK > a.vocab;                 // uniform: only the last vocabulary tile
    int const buf = k & 1;  // the dz buffer: the WGMMA that read it (k - 2) has completed (wait<1> below)
    FullBarrier::wait(&ss.full[stage], phase);
    // each chunk's load issued one chunk ahead of its arithmetic (two in flight: all four at once held 16 more
    // registers than the 232 of a consumer thread had room for beside the accumulators, and spilled)
    uint4 stored[4];
    stored[0] = load_shared_16(l_addr + stage * L_TILE_BYTES);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      if (i + 1 < 4) stored[i + 1] = load_shared_16(l_addr + stage * L_TILE_BYTES + (i + 1) * CHUNK_STRIDE);
      uint4 const dz = dz_chunk<SOFTCAP, Element>(stored[i], shift[i], rows.coef[i], rows.target[i], rows.offset[i],
                                                  col_base + chunk_column(wt), edge, a.vocab, inv_cap_out);
      store_shared_16(a_addr + buf * A_TILE_BYTES + i * CHUNK_STRIDE, dz);
    }
    cutlass::arch::fence_view_async_shared();             // generic-proxy stores -> visible to WGMMA
    cutlass::arch::NamedBarrier::sync(128, 1 + cw);       // the warpgroup's 64 rows are all written
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA(_, _, _, buf), tCrB(_, _, _, stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous K tile's WGMMAs are done: its stage and dz buffer are free
    warpgroup_fence_operand(acc);
    if (prev_stage >= 0 && wt == 0) EmptyBarrier::arrive(&ss.empty[prev_stage]);
    prev_stage = stage;
    if (++stage == STAGES) { stage = 0; phase ^= 1; }
    if (k + 1 < k_tiles) {  // grad_hidden: the tile's tokens with the next group's offsets; grad_weight: the next tokens
      if constexpr (GRAD_HIDDEN) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 4; ++i) rows.offset[i] = next.offset[i];
      } else {
        rows = next;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) shift[i] = row_shift(rows.coef[i], rows.offset[i]);
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // epilogue: out[row, col] (+)= acc / S; element (v0, r, v2) pairs are two adjacent columns (v0 = 0, 1).
  // grad_weight in place (Cfg::IN_PLACE): the fp32 sum old + acc / S rounded once to Element (cuBLAS beta = 1's)
  float const inv_s = a.inv_scale != nullptr ? *a.inv_scale : 1.f;
  Tensor cC = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
  Tensor tCcC = thr.partition_C(cC);  // (MMA, MMA_M, MMA_N) -> (row, col) in the tile, like acc
  static_assert(size<0, 0>(decltype(acc.layout()){}) == 2, "expected the sm90 WGMMA C fragment");
  constexpr int R = size<0, 1>(decltype(acc.layout()){}), V2 = size<0, 2>(decltype(acc.layout()){});
  constexpr int MM = size<1>(decltype(acc.layout()){}), MN = size<2>(decltype(acc.layout()){});
  using Out = cute::conditional_t<Cfg::IN_PLACE, Element, float>;
  using P16 = Pair16<Element>;
  // One output row's pairs as stored: two fp32 values, or two 16-bit ones in place.
  using StoredPair = cute::conditional_t<Cfg::IN_PLACE, typename P16::T, float2>;
  auto widen = [](StoredPair p) {
    if constexpr (Cfg::IN_PLACE) return P16::widen(p);
    else return p;
  };
  // ADD_OLD (a.accumulate): add into out, or overwrite it (the first chunk: no zero-fill, no read). Chosen once
  // around two copies of the unrolled stores: a run-time test per element made ptxas spill 4 bytes in every
  // grad_weight kernel at the 168-register cap (csrc/README.md, "Register budget")
  auto store_tile = [&](auto add_old) {
    constexpr bool ADD_OLD = decltype(add_old)::value;
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < MM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        int const row = m_blk * BM + int(get<0>(tCcC(make_coord(make_coord(0, r, 0), mi, 0))));
        if (row >= M) continue;
        StoredPair* out_row = reinterpret_cast<StoredPair*>(static_cast<Out*>(a.out) + int64_t(row) * a.ld_out);
        auto col_of = [&](int ni, int v2) {
          return n_blk * BN + int(get<1>(tCcC(make_coord(make_coord(0, r, v2), mi, ni))));
        };
        // ADD_OLD: the old pairs are loaded in batches of BATCH before the batch's first store, so BATCH loads are in
        // flight together. Loaded and stored pair by pair, each load waited behind the previous store (ptxas cannot
        // prove two rows' addresses apart: ld_out is a run-time value): 64 memory round trips in sequence per
        // thread, about as long as a 38-step grad_weight main loop. BATCH: as many as the 168-register allocation
        // holds beside the fp32 accumulators without a spill (a whole row, 32 fp32 pairs, spilled 28 bytes)
        constexpr int PAIRS = MN * V2;
        constexpr int BATCH = Cfg::IN_PLACE ? 32 : 16;
        static_assert(PAIRS % BATCH == 0 || PAIRS < BATCH, "whole batches");
        CUTLASS_PRAGMA_UNROLL
        for (int b0 = 0; b0 < PAIRS; b0 += BATCH) {
          StoredPair old[BATCH];
          if constexpr (ADD_OLD) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < BATCH && b0 + j < PAIRS; ++j) {
              int const col = col_of((b0 + j) / V2, (b0 + j) % V2);
              if (col < N) old[j] = out_row[col / 2];
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < BATCH && b0 + j < PAIRS; ++j) {
            int const ni = (b0 + j) / V2, v2 = (b0 + j) % V2;
            int const col = col_of(ni, v2);
            if (col >= N) continue;  // N is a multiple of 8: the pair (col, col + 1) is inside or outside together
            float2 v = make_float2(acc(make_coord(make_coord(0, r, v2), mi, ni)) * inv_s,
                                   acc(make_coord(make_coord(1, r, v2), mi, ni)) * inv_s);
            if constexpr (ADD_OLD) {
              float2 const o = widen(old[j]);
              v.x += o.x;
              v.y += o.y;
            }
            if constexpr (Cfg::IN_PLACE) out_row[col / 2] = P16::round(v);
            else out_row[col / 2] = v;
          }
        }
      }
    }
  };
  if (a.accumulate != 0) {
    store_tile(cute::true_type{});
  } else {
    store_tile(cute::false_type{});
  }
}

// Both dz GEMMs of a call in one launch: CTAs [0, hidden_tiles) compute grad_hidden's tiles, the rest grad_weight's.
// A grad_hidden tile runs over the whole vocabulary (K = V: 2,374 K tiles at V = 151,936) and there are few of them
// (ceil(N / 128) x H / 256: 304 for a 2,432-token chunk at H = 4,096), so launched alone they end in a partial wave
// (304 CTAs, one per SM, on 132 SMs: a third wave on 40 SMs while 92 wait); grad_weight's tiles are many and short
// (K = N: 38 K tiles). CTAs are dispatched in index order, so with grad_hidden's first, the SMs its last wave leaves
// free take grad_weight's tiles: longest first, then the short ones fill (cutlass.dz_gemms_makespan counts it).
template <class CfgH, class CfgW, class TmaLH, class TmaBH, class TmaLW, class TmaBW>
__global__ void __launch_bounds__(CfgH::THREADS, 1)
    dz_gemms_kernel(CUTE_GRID_CONSTANT TmaLH const tma_lh, CUTE_GRID_CONSTANT TmaBH const tma_bh,
                    CUTE_GRID_CONSTANT DzArgs const ah, int const hidden_tiles,
                    CUTE_GRID_CONSTANT TmaLW const tma_lw, CUTE_GRID_CONSTANT TmaBW const tma_bw,
                    CUTE_GRID_CONSTANT DzArgs const aw) {
  static_assert(CfgH::OP == Op::GradHidden && CfgW::OP == Op::GradWeight, "grad_hidden's tiles, then grad_weight's");
  static_assert(CfgH::THREADS == CfgW::THREADS, "one CTA shape");
  extern __shared__ __align__(1024) char smem_raw[];
  int const tile = int(blockIdx.x);  // uniform over the CTA: the branch splits no warp
  bool const softcap = ah.has_softcap != 0;  // the same in both GEMMs' arguments
  if (tile < hidden_tiles) {
    if (softcap) dz_gemm_tile<CfgH, true>(tma_lh, tma_bh, ah, tile, smem_raw);
    else dz_gemm_tile<CfgH, false>(tma_lh, tma_bh, ah, tile, smem_raw);
  } else {
    if (softcap) dz_gemm_tile<CfgW, true>(tma_lw, tma_bw, aw, tile - hidden_tiles, smem_raw);
    else dz_gemm_tile<CfgW, false>(tma_lw, tma_bw, aw, tile - hidden_tiles, smem_raw);
  }
}

// Per-token coefficients of dz, one thread per token (O(N), once per backward call).
__global__ void token_coef_kernel(float const* lse, float const* expected_logit, float const* grad_logprobs,
                                  float const* grad_entropy, int64_t const* targets, float coef_factor,
                                  float const* dz_scale, int n_tokens, TokenCoef* coef, int* target) {
  int const t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tokens) return;
  float const s = dz_scale != nullptr ? dz_scale[0] : 1.f;  // fp16: the power of two that keeps dz in range
  float const c_lp = grad_logprobs != nullptr ? grad_logprobs[t] * coef_factor : 0.f;
  float const c_h = grad_entropy != nullptr ? grad_entropy[t] * coef_factor : 0.f;
  bool const live = c_lp != 0.f || c_h != 0.f;
  float const c_lp_s = c_lp * s, c_h_s = c_h * s;
  // k = c_H E_p[z] - c_lp: only where the token has an entropy gradient (E_p[z] is not read otherwise)
  float const k = c_h != 0.f ? fmaf(c_h_s, expected_logit[t], -c_lp_s) : -c_lp_s;
  coef[t] = live ? TokenCoef{lse[t] * LOG2E, c_lp_s, -c_h_s, k} : TokenCoef{DEAD_LSE * LOG2E, 0.f, 0.f, 0.f};
  int64_t const y = targets[t];
  target[t] = (grad_logprobs != nullptr && y >= 0 && y < (int64_t(1) << 31)) ? int(y) : -1;
}

// The TMA descriptors of one dz GEMM: the stored fp16 differences as its (M, K) operand (rows are tokens, V
// contiguous) and B (N = H, K): W [V, H] or X [N, H], H contiguous.
template <class Cfg>
auto dz_gemm_tmas(void const* diff, int64_t ld_diff, void const* operand, int64_t ld_operand, DzArgs const& args) {
  using Element = typename Cfg::Element;
  using Stored = typename Cfg::Stored;
  constexpr bool GRAD_HIDDEN = Cfg::OP == Op::GradHidden;
  int const M = GRAD_HIDDEN ? args.n_tokens : args.vocab;
  int const K = GRAD_HIDDEN ? args.vocab : args.n_tokens;
  int const N = args.hidden;
  auto layout_l = [&] {
    if constexpr (GRAD_HIDDEN) return make_layout(make_shape(M, K), make_stride(ld_diff, Int<1>{}));
    else return make_layout(make_shape(M, K), make_stride(Int<1>{}, ld_diff));
  }();
  Tensor gL = make_tensor(make_gmem_ptr(reinterpret_cast<Stored const*>(diff)), layout_l);
  Tensor gB = make_tensor(make_gmem_ptr(reinterpret_cast<Element const*>(operand)),
                          make_layout(make_shape(N, K), make_stride(Int<1>{}, ld_operand)));
  auto tma_l = make_tma_atom(SM90_TMA_LOAD{}, gL, typename Cfg::SmemLayoutL{}(_, _, 0),
                             make_shape(Int<Cfg::BM>{}, Int<Cfg::BK>{}));
  auto tma_b = make_tma_atom(SM90_TMA_LOAD{}, gB, typename Cfg::SmemLayoutB{}(_, _, 0),
                             make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}));
  return cute::make_tuple(tma_l, tma_b);
}

template <class Cfg>
int dz_gemm_tiles(DzArgs const& args) {
  int const M = Cfg::OP == Op::GradHidden ? args.n_tokens : args.vocab;
  return ((M + Cfg::BM - 1) / Cfg::BM) * ((args.hidden + Cfg::BN - 1) / Cfg::BN);
}

// One launch of dz_gemms_kernel: grad_hidden's tiles where want_hidden, then grad_weight's where want_weight. The
// descriptors of a GEMM not wanted are still built (from real operands: the kernel never uses them).
template <class CfgH, class CfgW>
int run_dz_gemms(void const* diff, int64_t ld_diff, void const* weight, int64_t ld_weight, void const* hidden,
                 int64_t ld_hidden, DzArgs const& args_h, bool want_hidden, DzArgs const& args_w, bool want_weight,
                 cudaStream_t stream) {
  auto [tma_lh, tma_bh] = dz_gemm_tmas<CfgH>(diff, ld_diff, weight, ld_weight, args_h);
  auto [tma_lw, tma_bw] = dz_gemm_tmas<CfgW>(diff, ld_diff, hidden, ld_hidden, args_w);
  auto kernel = &dz_gemms_kernel<CfgH, CfgW, decltype(tma_lh), decltype(tma_bh), decltype(tma_lw), decltype(tma_bw)>;
  int const smem = int(cute::max(sizeof(typename CfgH::SharedStorage), sizeof(typename CfgW::SharedStorage)));
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return fail(cudaGetErrorString(err));
  int const hidden_tiles = want_hidden ? dz_gemm_tiles<CfgH>(args_h) : 0;
  int const weight_tiles = want_weight ? dz_gemm_tiles<CfgW>(args_w) : 0;
  kernel<<<hidden_tiles + weight_tiles, CfgH::THREADS, smem, stream>>>(tma_lh, tma_bh, args_h, hidden_tiles, tma_lw,
                                                                       tma_bw, args_w);
  err = cudaGetLastError();
  if (err != cudaSuccess) return fail(cudaGetErrorString(err));
  return 0;
}

using GradHiddenBf16 = DzConfig<cutlass::bfloat16_t, Op::GradHidden, 256, 4>;
using GradWeightBf16 = DzConfig<cutlass::bfloat16_t, Op::GradWeight, 256, 4>;
using GradHiddenFp16 = DzConfig<cutlass::half_t, Op::GradHidden, 256, 4>;
using GradWeightFp16 = DzConfig<cutlass::half_t, Op::GradWeight, 256, 4>;
using GradWeightBf16InPlace = DzConfig<cutlass::bfloat16_t, Op::GradWeight, 256, 4, true>;
using GradWeightFp16InPlace = DzConfig<cutlass::half_t, Op::GradWeight, 256, 4, true>;

}  // namespace grpo_csrc_bwd

using namespace grpo_csrc_bwd;

#define GRPO_API __attribute__((visibility("default")))

extern "C" {

// Shared memory of a dz GEMM's CTA. op: 0 grad_hidden, 1 grad_weight; dtype: 1 bf16, 2 fp16. Host only.
GRPO_API int grpo_csrc_lm_head_bwd_smem_bytes(int op, int dtype) {
  if (dtype == 1 && op == 0) return int(sizeof(GradHiddenBf16::SharedStorage));
  if (dtype == 1 && op == 1) return int(sizeof(GradWeightBf16::SharedStorage));
  if (dtype == 2 && op == 0) return int(sizeof(GradHiddenFp16::SharedStorage));
  if (dtype == 2 && op == 1) return int(sizeof(GradWeightFp16::SharedStorage));
  return -1;
}

// Tile of a dz GEMM (BM, BN, BK) into out[3]. Host only.
GRPO_API void grpo_csrc_lm_head_bwd_tile(int* out) {
  out[0] = GradHiddenBf16::BM;
  out[1] = GradHiddenBf16::BN;
  out[2] = GradHiddenBf16::BK;
}

// The per-token coefficients (coef: [N] 16-byte records, target: [N] int32). Device pointers; grad_logprobs /
// grad_entropy / dz_scale may be null. coef_factor (ABI 7): what multiplies the upstream gradients, 1 / T, or with a
// soft cap (T = 1 there) cap_in cap_out, the constant of its factor, which the dz GEMMs then leave out.
GRPO_API int grpo_csrc_lm_head_bwd_token_coef(float const* lse, float const* expected_logit,
                                              float const* grad_logprobs, float const* grad_entropy,
                                              int64_t const* targets, float coef_factor, float const* dz_scale,
                                              int64_t n_tokens, void* coef, int* target, uint64_t stream) {
  if (n_tokens <= 0 || n_tokens >= (int64_t(1) << 31)) return fail("n_tokens must be in [1, 2^31)");
  int const threads = 256;
  token_coef_kernel<<<int((n_tokens + threads - 1) / threads), threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      lse, expected_logit, grad_logprobs, grad_entropy, targets, coef_factor, dz_scale, int(n_tokens),
      reinterpret_cast<TokenCoef*>(coef), target);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(cudaGetErrorString(err));
  return 0;
}

// Both dz GEMMs of a call in one launch (ABI 6; before, one call per GEMM): grad_hidden [N, H] fp32 = dz W
// (+= when accumulate_hidden), or null; grad_weight [V, H] = dz^T X (+= when accumulate_weight, else written over
// without being read), or null: fp32, or with grad_weight_16bit the gradient buffer in the operands' dtype, each
// element's fp32 sum rounded into it once. diff / offset: the HalfLogits store of these N rows (fp16 [N, ld_diff],
// fp32 [N, ld_offset]); weight [V, H] and hidden [N, H] the operands (both always given: each GEMM's descriptors are
// built); coef / target from grpo_csrc_lm_head_bwd_token_coef (its coef_factor holding a soft cap's cap_in cap_out,
// ABI 7: has_softcap here applies 1 - t^2 alone, t = z / cap_out); inv_scale: device fp32 1 / S or null. Strides in
// elements; H, ld_diff, ld_weight and ld_hidden multiples of 8 and 16-byte aligned bases (TMA). Returns 0, or
// nonzero with grpo_csrc_last_error() set.
GRPO_API int grpo_csrc_lm_head_bwd_dz_gemms(int dtype, void const* diff, int64_t ld_diff, float const* offset,
                                            int64_t ld_offset, void const* weight, int64_t ld_weight,
                                            void const* hidden, int64_t ld_hidden, float* grad_hidden,
                                            int64_t ld_grad_hidden, int accumulate_hidden, void* grad_weight,
                                            int64_t ld_grad_weight, int grad_weight_16bit, int accumulate_weight,
                                            void const* coef, int const* target, float const* inv_scale,
                                            int64_t n_tokens, int64_t vocab, int64_t hidden_size, int has_softcap,
                                            float cap_out, int group_m, uint64_t stream) {
  if (check_problem_size(n_tokens, vocab, hidden_size)) return 1;
  if (grad_hidden == nullptr && grad_weight == nullptr) return fail("no output: grad_hidden and grad_weight are null");
  if (hidden_size % 8 || ld_diff % 8 || ld_weight % 8 || ld_hidden % 8 || ld_grad_hidden % 2 || ld_grad_weight % 2)
    return fail("H, ld_diff, ld_weight and ld_hidden must be multiples of 8 elements, the outputs' strides even (TMA, "
                "paired stores)");
  if (ld_offset <= 0 || n_tokens * ld_offset >= (int64_t(1) << 31))
    return fail("the offsets [N, ld_offset] must have N ld_offset < 2^31 elements (32-bit indices)");
  if (reinterpret_cast<uintptr_t>(diff) % 16 || reinterpret_cast<uintptr_t>(weight) % 16 ||
      reinterpret_cast<uintptr_t>(hidden) % 16 || reinterpret_cast<uintptr_t>(grad_hidden) % 8 ||
      reinterpret_cast<uintptr_t>(grad_weight) % (grad_weight_16bit ? 4 : 8) ||
      reinterpret_cast<uintptr_t>(coef) % 16)
    return fail("misaligned pointer (diff / weight / hidden / coef 16 bytes, grad_hidden 8 bytes, grad_weight 8 bytes "
                "fp32 or 4 bytes 16-bit)");
  DzArgs h;
  h.offset = offset;
  h.ld_offset = int(ld_offset);
  h.coef = reinterpret_cast<TokenCoef const*>(coef);
  h.target = target;
  h.inv_scale = inv_scale;
  h.n_tokens = int(n_tokens);
  h.vocab = int(vocab);
  h.hidden = int(hidden_size);
  h.has_softcap = has_softcap;
  h.cap_out = has_softcap ? cap_out : 1.f;
  h.group_m = group_m > 0 ? group_m : 8;
  DzArgs w = h;
  h.out = grad_hidden;
  h.ld_out = ld_grad_hidden;
  h.accumulate = accumulate_hidden;
  w.out = grad_weight;
  w.ld_out = ld_grad_weight;
  w.accumulate = accumulate_weight;
  bool const want_h = grad_hidden != nullptr, want_w = grad_weight != nullptr;
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define GRPO_DZ_GEMMS(CfgH, CfgW) \
  run_dz_gemms<CfgH, CfgW>(diff, ld_diff, weight, ld_weight, hidden, ld_hidden, h, want_h, w, want_w, s)
  if (dtype == 1) {
    return grad_weight_16bit ? GRPO_DZ_GEMMS(GradHiddenBf16, GradWeightBf16InPlace)
                             : GRPO_DZ_GEMMS(GradHiddenBf16, GradWeightBf16);
  }
#ifndef GRPO_CSRC_ONE_VARIANT
  if (dtype == 2) {
    return grad_weight_16bit ? GRPO_DZ_GEMMS(GradHiddenFp16, GradWeightFp16InPlace)
                             : GRPO_DZ_GEMMS(GradHiddenFp16, GradWeightFp16);
  }
#endif
#undef GRPO_DZ_GEMMS
  return fail("unsupported dtype (1 bf16, 2 fp16)");
}

}  // extern "C"
