// The tiles of kernels A and C as types, and the map of kernel C's consumer threads onto its shared-memory tiles:
// what lm_head_fwd_sm90.cu and lm_head_bwd_sm90.cu compile, and what csrc/tests/tile_layouts.cu checks on a machine
// without a GPU (the accumulator fragments the epilogues reduce and store, the 16-byte chunks kernel C's consumers
// read and write, and which warpgroup's WGMMA reads them). Types and host-device functions only: no kernel here.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"

#include "common.cuh"

namespace grpo_csrc {

// Kernel A's mainloop: A = hidden [N, H] (row-major, K contiguous), B = weight [V, H] (K contiguous: "column-major"
// K x N), fp32 accumulators. Its TiledMma is the accumulator fragment StatsEpilogue reduces per row (the four lanes
// of a quad share a row) and stores in column pairs.
template <class Element, class TileShape, class KernelSchedule>
using StatsMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 16 / sizeof(Element),
    Element, cutlass::layout::ColumnMajor, 16 / sizeof(Element), float, TileShape,
    cute::Shape<cute::_1, cute::_1, cute::_1>, cutlass::gemm::collective::StageCountAutoCarveout<0>,
    KernelSchedule>::CollectiveOp;

using Coop128x256 = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Ping64x256 = cute::Shape<cute::_64, cute::_256, cute::_64>;
using CoopSched = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using PingSched = cutlass::gemm::KernelTmaWarpSpecializedPingpong;

}  // namespace grpo_csrc

namespace grpo_csrc_bwd {

using namespace cute;
using grpo_csrc::STORED_GROUP;

enum class Op { GradHidden = 0, GradWeight = 1 };

template <class Element_, Op OP_, int BN_, int STAGES_, bool IN_PLACE_ = false>
struct DzConfig {
  using Element = Element_;          // cutlass::bfloat16_t or cutlass::half_t: the operands and dz
  using Stored = cutlass::half_t;    // the fp16 differences
  static constexpr Op OP = OP_;
  // grad_weight only: the output is the gradient buffer in Element, summed into in place (a compile-time path:
  // a runtime branch in the epilogue costs the 168-register kernel a spill)
  static constexpr bool IN_PLACE = IN_PLACE_;
  static_assert(!IN_PLACE || OP == Op::GradWeight, "grad_hidden is always fp32");
  // BK is the fp16 store's offset group: one offset per row per grad_hidden K tile (load_rows relies on it)
  static constexpr int BM = 128, BN = BN_, BK = STORED_GROUP, STAGES = STAGES_, DZ_BUFFERS = 2;
  static constexpr int THREADS = 384;
  // grad_hidden: A = dz [tokens, vocab], K (vocabulary) contiguous in the stored rows -> K-major.
  // grad_weight: A = dz^T [vocab, tokens], M (vocabulary) contiguous -> MN-major. B is MN-major in both:
  // W [V, H] and X [N, H] have H (the GEMM's N) contiguous.
  static constexpr bool A_K_MAJOR = OP == Op::GradHidden;
  template <class T>
  using AtomA = cute::conditional_t<A_K_MAJOR, GMMA::Layout_K_SW128_Atom<T>, GMMA::Layout_MN_SW128_Atom<T>>;
  // MN-major atoms (64 x 8) are stacked along K first: a TMA box is then 64 x BK (8 KB), not 64 x 8
  using OrderA = cute::conditional_t<A_K_MAJOR, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using SmemLayoutL = decltype(tile_to_shape(AtomA<Stored>{}, make_shape(Int<BM>{}, Int<BK>{}, Int<STAGES>{}),
                                             OrderA{}));
  using SmemLayoutA = decltype(tile_to_shape(AtomA<Element>{}, make_shape(Int<BM>{}, Int<BK>{}, Int<DZ_BUFFERS>{}),
                                             OrderA{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                             make_shape(Int<BN>{}, Int<BK>{}, Int<STAGES>{}), Step<_2, _1, _3>{}));
  static constexpr GMMA::Major MAJOR_A = A_K_MAJOR ? GMMA::Major::K : GMMA::Major::MN;
  // two consumer warpgroups along M, each a 64 x BN x 16 WGMMA per k step
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BN>, Int<BK>>, MAJOR_A, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // one stage of the fp16 logits ring, one dz buffer: the stage (buffer) stride of SmemLayoutL (SmemLayoutA)
  static constexpr uint32_t LOGITS_TILE_BYTES = BM * BK * sizeof(Stored), DZ_TILE_BYTES = BM * BK * sizeof(Element);
  static constexpr uint32_t TMA_BYTES = LOGITS_TILE_BYTES + BN * BK * sizeof(Element);
  // a consumer thread's chunk i + 1 lies this many bytes after its chunk i, in the logits and the dz tiles alike
  // (16 tokens on: two 1 KB swizzle atoms of 8 rows of 128 bytes; checked by csrc/tests/tile_layouts.cu)
  static constexpr uint32_t CHUNK_STRIDE_BYTES = 16 * 128;

  struct SharedStorage {
    cute::array_aligned<Stored, cosize_v<SmemLayoutL>, 1024> logits;
    cute::array_aligned<Element, cosize_v<SmemLayoutA>, 1024> dz;
    cute::array_aligned<Element, cosize_v<SmemLayoutB>, 1024> b;
    alignas(16) uint64_t full[STAGES];
    uint64_t empty[STAGES];
  };
};

// What a consumer thread transforms per K tile: thread wt (0..127) of consumer warpgroup cw (0, 1) serves four
// tokens, chunk_token(wt, i) for i < 4, among the 64 of its part of the tile (grad_hidden: the warpgroup's 64 token
// rows; grad_weight: the K tile's 64 tokens), and for each of them one 16-byte chunk, 8 adjacent vocabulary
// columns from chunk_column(wt) within the tile's 64-column group. Rows 16 apart keep a warp's 32 threads on 4
// tokens x 8 chunks: each of its 16-byte loads and stores covers whole 128-byte rows of the swizzled tiles.
CUTE_HOST_DEVICE constexpr int chunk_token(int wt, int i) { return wt / 8 + 16 * i; }
CUTE_HOST_DEVICE constexpr int chunk_column(int wt) { return 8 * (wt % 8); }

// (m, k) in the (BM, BK) tile of chunk i's first element: grad_hidden (token row, vocabulary column), K contiguous;
// grad_weight (vocabulary row, token), M contiguous. The chunk's 8 elements run along the contiguous mode.
struct ChunkCoord {
  int m, k;
};
template <class Cfg>
CUTE_HOST_DEVICE constexpr ChunkCoord consumer_chunk(int cw, int wt, int i) {
  return Cfg::OP == Op::GradHidden ? ChunkCoord{64 * cw + chunk_token(wt, i), chunk_column(wt)}
                                   : ChunkCoord{64 * cw + chunk_column(wt), chunk_token(wt, i)};
}

}  // namespace grpo_csrc_bwd
