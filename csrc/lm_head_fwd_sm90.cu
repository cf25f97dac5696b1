// Kernel A on Hopper (sm_90a): the logits GEMM hidden [N, H] x weight [V, H]^T with the softmax statistics in
// its epilogue, written as CUTLASS 3.x collectives (TMA loads, WGMMA, warp-specialized persistent schedule)
// and a register-only epilogue; no [N, V] tensor is written unless the caller asks for the fp16 store below.
//
// Per row and per vocabulary tile t of the CTA tile (BLOCK_N columns) the epilogue writes, in fp32,
//     part_max[t, row] = m_t = max_j z_j
//     part_sum[t, row] = sum_j exp(z_j - m_t)
//     part_dev[t, row] = sum_j exp(z_j - m_t) (z_j - m_t)          (<= 0)
// and target_logit[row] = z_y from the one tile that holds y; `grpo_csrc_lm_head_fwd_merge` folds the tiles
// exactly as the Triton merge kernel folds its splits (grpo_kernels/ops/lm_head/README.md §1; the layout
// [num_tiles, N] is the Triton partials' [num_splits, N]). The logit transform is the Triton epilogue's:
//     no soft cap:  z = acc * (1/T) + max(b * (1/T), NEG_BIG)       (a -inf bias is a forbidden token)
//     soft cap:     z = cap_out tanh(cap_in (acc + b))               (README "Soft-capping"; unclamped bias)
// and PAD_LOGIT for the columns of the last tile past V. exp is ex2.approx.f32 of x * log2 e, as tl.exp.
//
// Training (the fused one-pass schedules, 16-bit inputs): with `diff` given the epilogue also stores the chunk's
// logits in the Triton kernels' HalfLogits form (grpo_kernels/ops/lm_head/README.md §5, "Stored logits in
// fp16"): diff[row, col] = fp16(max(z - m_t, -65504)) and offset[row, g] = m_t for each 64-column group g of
// the tile, m_t the row's max over its tile (any m with z <= m <= lse keeps the format's bound; the Triton
// kernel A uses its running max). The backward reads z = offset + diff.
//
// Only a plain C ABI is exported (raw device pointers, sizes, strides, the stream as an integer): Python loads
// the library with ctypes, no torch headers, no coupling to the GPU machine's torch build.

#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "common.cuh"
#include "tiles_sm90.cuh"

#ifndef GRPO_CSRC_STAMP
#define GRPO_CSRC_STAMP "unstamped"
#endif

namespace grpo_csrc {

// The Triton kernels' sentinels (triton.py, README "Numbers at the edges").
constexpr float NEG_BIG = -0x1p102f;     // a forbidden token (a -inf bias, no soft cap)
constexpr float PAD_LOGIT = -0x1p104f;   // a column past V
constexpr float RUN_MAX_INIT = -0x1p105f;
constexpr float TANH_C1 = -1.0f / 3.0f, TANH_C2 = 2.0f / 15.0f, TANH_C3 = -17.0f / 315.0f;
constexpr float TANH_C4 = 62.0f / 2835.0f, TANH_C5 = -1382.0f / 155925.0f;

struct StatsArgs {
  float* part_max = nullptr;        // [num_tiles_n, N]
  float* part_sum = nullptr;        // [num_tiles_n, N]
  float* part_dev = nullptr;        // [num_tiles_n, N]
  float* target_logit = nullptr;    // [N], written by the tile holding the target (caller fills NaN first)
  int64_t const* targets = nullptr; // [N]
  void const* bias = nullptr;       // [V] or null
  int bias_dtype = 0;               // 0 fp32, 1 bf16, 2 fp16
  int n_tokens = 0;
  int vocab = 0;
  float inv_temperature = 1.f;
  float cap_in = 0.f, cap_out = 0.f;
  int has_softcap = 0;
  cutlass::half_t* diff = nullptr;  // [N, ld_diff] fp16 z - m_t, or null: statistics only
  int64_t ld_diff = 0;
  float* offset = nullptr;          // [N, ld_offset] fp32 m_t per 64-column group
  int64_t ld_offset = 0;
};

constexpr float HALF_DIFF_MIN = -65504.f;  // fp16's most negative finite value

CUTLASS_DEVICE float softcap(float x, float cap_in, float cap_out) {  // triton.py _softcap, same operation order
  float u = fminf(fmaxf(x * cap_in, -16.f), 16.f);
  float a = fabsf(u);
  float s = u * u;
  float r = TANH_C3 + s * (TANH_C4 + s * TANH_C5);
  r = 1.f + s * (TANH_C1 + s * (TANH_C2 + s * r));
  float e = ex2_approx(a * (-2.f * LOG2E));
  // the divisor (1 + e) a lies in [1/4, 33] (a in [1/4, 16], e in (0, 0.61]): Triton's div.full.f32, exactly
  float q = a < 0.25f ? r : div_approx(1.f - e, (1.f + e) * a);
  return u * q * cap_out;
}

CUTLASS_DEVICE float load_bias(StatsArgs const& p, int col) {
  if (p.bias_dtype == 1) return float(reinterpret_cast<cutlass::bfloat16_t const*>(p.bias)[col]);
  if (p.bias_dtype == 2) return float(reinterpret_cast<cutlass::half_t const*>(p.bias)[col]);
  return reinterpret_cast<float const*>(p.bias)[col];
}

// An operator-style collective epilogue (the interface of cutlass::epilogue::collective::DefaultEpilogue), used
// in the sm90 warp-specialized kernels through Sm90TmaWarpSpecializedAdapter: it needs no shared memory, so
// the mainloop keeps all of it for its pipeline stages.
template <class StrideCD_>
class StatsEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<float, 1, float, float>;  // a name only
  using ElementOutput = float;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = float;
  using ElementD = float;
  using StrideC = StrideCD_;
  using StrideD = StrideCD_;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = StatsArgs;
  using Params = StatsArgs;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    // the fp16 store writes column pairs as 4-byte words: 8-element aligned rows (HalfLogits pads to 16 bytes)
    bool const store_ok = args.diff == nullptr || (args.offset != nullptr && args.ld_diff % 8 == 0 &&
                                                   reinterpret_cast<uintptr_t>(args.diff) % 16 == 0);
    return args.part_max && args.part_sum && args.part_dev && args.target_logit && args.targets && store_ok;
  }

  CUTLASS_HOST_DEVICE StatsEpilogue(Params const& params_, SharedStorage const& = SharedStorage()) : p(params_) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // accumulators: this thread's part of the CTA tile, the sm90 WGMMA C fragment ((2, 2, BN/8), MMA_M, MMA_N):
  // element (v0, r, v2) of an m64nBNk16 atom sits at row lane/4 + 8 r + 16 warp, column 2 (lane % 4) + v0 + 8 v2,
  // so a thread holds 2 * MMA_M rows and the four lanes of a quad share each row (reduced by two xor shuffles).
  // Coordinates come from the identity tensor partitioned like the accumulators, never from that formula.
  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    auto M = get<0>(problem_shape_mnkl);
    auto N = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    Tensor cD_mn = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                              make_coord(m_coord, n_coord));  // (BLK_M, BLK_N) -> (row, col)
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD_mn);  // (V, MMA_M, MMA_N), like acc
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected the sm90 WGMMA C fragment");
    constexpr int V0 = size<0, 0>(FrgLayout{}), R = size<0, 1>(FrgLayout{}), V2 = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{}), MN = size<2>(FrgLayout{});
    static_assert(V0 == 2 && R == 2, "expected the sm90 WGMMA C fragment");

    // The adapter hands this epilogue its own copy of the accumulators: z overwrites them in place, so the
    // epilogue needs no registers beyond the fragment (a separate z array spilled at 168 registers).
    auto& z = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(acc);
#ifdef GRPO_CSRC_TRIVIAL_EPI  // register baseline of the bare mainloop (development only)
    { float t = 0.f; for (int i = 0; i < size(z); ++i) t += z(i); p.part_max[thread_idx] = t; return; }
#endif
    // the transform's mode is uniform over the call: branch once, not per element
#ifdef GRPO_MODE_ONLY  // development: one transform mode, to read its registers alone
    stats_tile<GRPO_MODE_ONLY>(z, tCcD, int(n_coord), thread_idx);
#else
    if (p.has_softcap) stats_tile<2>(z, tCcD, int(n_coord), thread_idx);
    else if (p.bias) stats_tile<1>(z, tCcD, int(n_coord), thread_idx);
    else stats_tile<0>(z, tCcD, int(n_coord), thread_idx);
#endif
  }

  // MODE 0: z = acc / T; 1: z = acc / T + max(b / T, NEG_BIG); 2: z = cap_out tanh(cap_in (acc + b)), b = 0 if null
  template <int MODE, class ZTensor, class CTensor>
  CUTLASS_DEVICE void stats_tile(ZTensor& z, CTensor const& tCcD, int tile_n, int thread_idx) {
    using namespace cute;
    using FrgLayout = typename ZTensor::layout_type;
    constexpr int V0 = size<0, 0>(FrgLayout{}), R = size<0, 1>(FrgLayout{}), V2 = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{}), MN = size<2>(FrgLayout{});
    // pass 1, columns outer (one bias load per column serves all of this thread's rows): z in place, row maxima
    float mx[MM][R];
    int64_t target[MM][R];
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < MM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        int const row = int(get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0))));
        target[mi][r] = row < p.n_tokens ? p.targets[row] : -1;
        mx[mi][r] = RUN_MAX_INIT;
      }
    }
    // This thread's columns c = (ni V2 + v2) V0 + v0, in the order of the loops they replaced. With a bias, its
    // values are loaded BIAS_BATCH columns at a time before their elements are formed: loaded column by column,
    // each load waited behind the previous column's (possible) target-logit store, its latency paid 64 times in
    // sequence per thread (the SASS: loads and stores alternating one by one).
    constexpr int COLS = MN * V2 * V0;
    constexpr int BIAS_BATCH = 8;
    static_assert(COLS % BIAS_BATCH == 0, "whole batches");
    CUTLASS_PRAGMA_UNROLL
    for (int c0 = 0; c0 < COLS; c0 += BIAS_BATCH) {
      float bias_batch[BIAS_BATCH];
      if constexpr (MODE != 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < BIAS_BATCH; ++j) {
          int const c = c0 + j;
          int const col = int(get<1>(tCcD(make_coord(make_coord(c % V0, 0, (c / V0) % V2), 0, c / (V0 * V2)))));
          bool const col_ok = col < p.vocab;
          if constexpr (MODE == 1) bias_batch[j] = col_ok ? fmaxf(load_bias(p, col) * p.inv_temperature, NEG_BIG) : 0.f;
          if constexpr (MODE == 2) bias_batch[j] = (p.bias && col_ok) ? load_bias(p, col) : 0.f;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < BIAS_BATCH; ++j) {
        int const c = c0 + j;
        int const v0 = c % V0, v2 = (c / V0) % V2, ni = c / (V0 * V2);
        int const col = int(get<1>(tCcD(make_coord(make_coord(v0, 0, v2), 0, ni))));
        bool const col_ok = col < p.vocab;
        float const b = MODE == 0 ? 0.f : bias_batch[j];
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < MM; ++mi) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < R; ++r) {
            auto idx = make_coord(make_coord(v0, r, v2), mi, ni);
            float zz;
            if constexpr (MODE == 2) zz = softcap(z(idx) + b, p.cap_in, p.cap_out);
            else if constexpr (MODE == 1) zz = fmaf(z(idx), p.inv_temperature, b);
            else zz = z(idx) * p.inv_temperature;
            zz = col_ok ? zz : PAD_LOGIT;
            if (col_ok && col == target[mi][r]) p.target_logit[get<0>(tCcD(idx))] = zz;  // one element of the grid
            z(idx) = zz;
            mx[mi][r] = fmaxf(mx[mi][r], zz);
          }
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < MM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        float m = mx[mi][r];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        float s = 0.f, u = 0.f;
        int const row = int(get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0))));
        bool const store = p.diff != nullptr && row < p.n_tokens;  // uniform over the call but the row test
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < MN; ++ni) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            float d2[V0];
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < V0; ++v0) {
              float const d = z(make_coord(make_coord(v0, r, v2), mi, ni)) - m;  // <= 0
              float const e = ex2_approx(d * LOG2E);
              s += e;
              u = fmaf(e, d, u);
              d2[v0] = fmaxf(d, HALF_DIFF_MIN);
            }
            if (store) {  // the pair (v0 = 0, 1) is two adjacent columns, the first even: one 4-byte store
              int const col = int(get<1>(tCcD(make_coord(make_coord(0, r, v2), mi, ni))));
              cutlass::half_t* out = p.diff + int64_t(row) * p.ld_diff + col;
              if (col + 1 < p.vocab) {
                *reinterpret_cast<__half2*>(out) = __floats2half2_rn(d2[0], d2[1]);
              } else if (col < p.vocab) {
                *out = cutlass::half_t(d2[0]);
              }
            }
          }
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        u += __shfl_xor_sync(0xffffffffu, u, 1);
        u += __shfl_xor_sync(0xffffffffu, u, 2);
        if (row < p.n_tokens && (thread_idx % 4) == 0) {
          int64_t const at = int64_t(tile_n) * p.n_tokens + row;
          p.part_max[at] = m;
          p.part_sum[at] = s;
          p.part_dev[at] = u;
          if (p.diff != nullptr) {  // the tile's max for each of its 64-column groups inside the vocabulary
            constexpr int GROUPS = MN * V2 * V0 * 4 / STORED_GROUP;  // tile columns / 64 (4 lanes per row)
            CUTLASS_PRAGMA_UNROLL
            for (int g = 0; g < GROUPS; ++g) {
              int const group = tile_n * GROUPS + g;
              if (group * STORED_GROUP < p.vocab) p.offset[int64_t(row) * p.ld_offset + group] = m;
            }
          }
        }
      }
    }
  }

 private:
  Params p;
};

// The GEMM: kernel A's mainloop (tiles_sm90.cuh: A = hidden [N, H] row-major, B = weight [V, H] K contiguous) with
// the statistics epilogue, on CUTLASS's persistent tile scheduler.
template <class Element, class TileShape, class KernelSchedule>
struct StatsGemm {
  using StrideCD = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<StatsEpilogue<StrideCD>>;
  using Mainloop = StatsMainloop<Element, TileShape, KernelSchedule>;  // tiles_sm90.cuh
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kBlockN = cute::size<1>(TileShape{});
};

template <class G>
int run_stats_gemm(void const* hidden, void const* weight, int64_t n_tokens, int64_t hidden_size, int64_t vocab,
                   int64_t ld_hidden, int64_t ld_weight, StatsArgs const& stats, int raster, int swizzle,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using Gemm = typename G::Gemm;
  using Element = typename Gemm::ElementA;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  // A: (M, K, L) with stride (ld_hidden, 1, 0); B: (N, K, L) with stride (ld_weight, 1, 0)
  StrideA stride_a = cute::make_stride(ld_hidden, cute::Int<1>{}, int64_t(0));
  StrideB stride_b = cute::make_stride(ld_weight, cute::Int<1>{}, int64_t(0));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(n_tokens), int(vocab), int(hidden_size), 1},
      {reinterpret_cast<Element const*>(hidden), stride_a, reinterpret_cast<Element const*>(weight), stride_b},
      stats};
  using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions;
  args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
  args.scheduler.max_swizzle_size = swizzle > 0 ? swizzle : 1;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return fail("cutlass can_implement refused (alignment: H and row strides must be multiples of 8 elements)");
  size_t need = Gemm::get_workspace_size(args);
  if (need > workspace_bytes) return fail("workspace too small (grpo_csrc_lm_head_fwd_workspace_bytes)");
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return fail("cutlass initialize failed");
  if (gemm.run(stream) != cutlass::Status::kSuccess) return fail("cutlass run failed");
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(cudaGetErrorString(err));
  return 0;
}

// The merge across tiles: lm_head_fwd_kernel_merge of triton.py, one thread per token.
__global__ void merge_kernel(float const* part_max, float const* part_sum, float const* part_dev,
                             float const* target_logit, float* logprobs, float* entropy, float* lse,
                             float* expected_logit, int n_tokens, int num_tiles) {
  int const t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tokens) return;
  float run_max = RUN_MAX_INIT, run_sum = 0.f, run_dev = 0.f;
  for (int k = 0; k < num_tiles; ++k) {
    int64_t const at = int64_t(k) * n_tokens + t;
    float const m_k = part_max[at], s_k = part_sum[at], d_k = part_dev[at];
    float const new_max = fmaxf(run_max, m_k);
    float const a = ex2_approx((run_max - new_max) * LOG2E);
    float const b = ex2_approx((m_k - new_max) * LOG2E);
    run_dev = a * (run_dev + (run_max - new_max) * run_sum) + b * (d_k + (m_k - new_max) * s_k);
    run_sum = a * run_sum + b * s_k;
    run_max = new_max;
  }
  float const log_sum = logf(run_sum);
  float const mean_dev = run_dev / run_sum;
  logprobs[t] = (target_logit[t] - run_max) - log_sum;
  entropy[t] = log_sum - mean_dev;
  lse[t] = run_max + log_sum;
  expected_logit[t] = run_max + mean_dev;
}

}  // namespace grpo_csrc

using namespace grpo_csrc;

// built with -fvisibility=hidden: only these functions are exported
#define GRPO_API __attribute__((visibility("default")))

extern "C" {

// Incremented when an exported signature changes; the Python loader refuses other values.
GRPO_API int grpo_csrc_abi_version() { return 7; }  // 3: kernel C (lm_head_bwd_sm90.cu); 4: its grad_weight in place;
                                                    // 5: its grad_weight overwritten where accumulate = 0;
                                                    // 6: its two GEMMs in one launch (grpo_csrc_lm_head_bwd_dz_gemms);
                                                    // 7: the soft cap's cap_in cap_out in token_coef's coef_factor
                                                    //    (dz_gemms takes cap_out alone)

// sha256 of the csrc sources this library was built from (csrc/build.sh); the loader compares it.
GRPO_API char const* grpo_csrc_build_stamp() { return GRPO_CSRC_STAMP; }

GRPO_API char const* grpo_csrc_last_error() { return g_error; }

// variant: 0 = cooperative 128x256x64, 1 = ping-pong 64x256x64. Vocabulary tile width of a variant.
GRPO_API int grpo_csrc_lm_head_fwd_block_n(int variant) {
  return variant == 0 ? StatsGemm<cutlass::bfloat16_t, Coop128x256, CoopSched>::kBlockN
                      : StatsGemm<cutlass::bfloat16_t, Ping64x256, PingSched>::kBlockN;
}

// Partials of kernel A. dtype: 1 bf16, 2 fp16 (hidden and weight alike). Pointers are device pointers; stream
// is a cudaStream_t as an integer. diff / offset (ABI 2): the chunk's logits in the HalfLogits form (fp16
// [N, ld_diff], 16-byte aligned rows; fp32 [N, ld_offset]), or null. Returns 0, or nonzero with
// grpo_csrc_last_error() set.
GRPO_API int grpo_csrc_lm_head_fwd_partials(int variant, int dtype, void const* hidden, void const* weight, int64_t n_tokens,
                                   int64_t hidden_size, int64_t vocab, int64_t ld_hidden, int64_t ld_weight,
                                   void const* bias, int bias_dtype, int64_t const* targets, float inv_temperature,
                                   int has_softcap, float cap_in, float cap_out, float* part_max, float* part_sum,
                                   float* part_dev, float* target_logit, void* diff, int64_t ld_diff, float* offset,
                                   int64_t ld_offset, int raster, int swizzle, void* workspace,
                                   size_t workspace_bytes, uint64_t stream) {
  if (check_problem_size(n_tokens, vocab, hidden_size)) return 1;
  StatsArgs stats;
  stats.part_max = part_max;
  stats.part_sum = part_sum;
  stats.part_dev = part_dev;
  stats.target_logit = target_logit;
  stats.targets = targets;
  stats.bias = bias;
  stats.bias_dtype = bias_dtype;
  stats.n_tokens = int(n_tokens);
  stats.vocab = int(vocab);
  stats.inv_temperature = inv_temperature;
  stats.has_softcap = has_softcap;
  stats.cap_in = cap_in;
  stats.cap_out = cap_out;
  stats.diff = reinterpret_cast<cutlass::half_t*>(diff);  // null: statistics only (v1's behaviour)
  stats.ld_diff = ld_diff;
  stats.offset = offset;
  stats.ld_offset = ld_offset;
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define GRPO_RUN(E, T, K)                                                                                     \
  return run_stats_gemm<StatsGemm<E, T, K>>(hidden, weight, n_tokens, hidden_size, vocab, ld_hidden, ld_weight, \
                                            stats, raster, swizzle, workspace, workspace_bytes, s)
  if (dtype == 1 && variant == 0) GRPO_RUN(cutlass::bfloat16_t, Coop128x256, CoopSched);
#ifndef GRPO_CSRC_ONE_VARIANT
  if (dtype == 1 && variant == 1) GRPO_RUN(cutlass::bfloat16_t, Ping64x256, PingSched);
  if (dtype == 2 && variant == 0) GRPO_RUN(cutlass::half_t, Coop128x256, CoopSched);
  if (dtype == 2 && variant == 1) GRPO_RUN(cutlass::half_t, Ping64x256, PingSched);
#endif
#undef GRPO_RUN
  return fail("unsupported dtype / variant (dtype 1 bf16, 2 fp16; variant 0 cooperative, 1 ping-pong)");
}

// Bytes of scratch the persistent tile scheduler asks for (queried from CUTLASS, not assumed).
GRPO_API size_t grpo_csrc_lm_head_fwd_workspace_bytes(int variant, int dtype, int64_t n_tokens, int64_t hidden_size,
                                             int64_t vocab) {
  StatsArgs stats;
#define GRPO_WS(E, T, K)                                                                         \
  {                                                                                              \
    using Gemm = typename StatsGemm<E, T, K>::Gemm;                                             \
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,                       \
                                  {int(n_tokens), int(vocab), int(hidden_size), 1}, {}, stats}; \
    return Gemm::get_workspace_size(args);                                                      \
  }
  if (dtype == 1 && variant == 0) GRPO_WS(cutlass::bfloat16_t, Coop128x256, CoopSched);
#ifndef GRPO_CSRC_ONE_VARIANT
  if (dtype == 1 && variant == 1) GRPO_WS(cutlass::bfloat16_t, Ping64x256, PingSched);
  if (dtype == 2 && variant == 0) GRPO_WS(cutlass::half_t, Coop128x256, CoopSched);
  if (dtype == 2 && variant == 1) GRPO_WS(cutlass::half_t, Ping64x256, PingSched);
#endif
#undef GRPO_WS
  return 0;
}

// Dynamic shared memory of a GEMM variant's CTA (its pipeline stages), for the host-side check against sm_90's
// 227 KB; -1 for an unknown variant. Host code only: callable without a GPU.
GRPO_API int grpo_csrc_lm_head_fwd_smem_bytes(int variant, int dtype) {
  if (dtype == 1 && variant == 0) return int(StatsGemm<cutlass::bfloat16_t, Coop128x256, CoopSched>::Kernel::SharedStorageSize);
  if (dtype == 1 && variant == 1) return int(StatsGemm<cutlass::bfloat16_t, Ping64x256, PingSched>::Kernel::SharedStorageSize);
  if (dtype == 2 && variant == 0) return int(StatsGemm<cutlass::half_t, Coop128x256, CoopSched>::Kernel::SharedStorageSize);
  if (dtype == 2 && variant == 1) return int(StatsGemm<cutlass::half_t, Ping64x256, PingSched>::Kernel::SharedStorageSize);
  return -1;
}

GRPO_API int grpo_csrc_lm_head_fwd_merge(float const* part_max, float const* part_sum, float const* part_dev,
                                float const* target_logit, float* logprobs, float* entropy, float* lse,
                                float* expected_logit, int64_t n_tokens, int64_t num_tiles, uint64_t stream) {
  if (n_tokens <= 0) return fail("empty problem");
  int const threads = 256;
  int const blocks = int((n_tokens + threads - 1) / threads);
  merge_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      part_max, part_sum, part_dev, target_logit, logprobs, entropy, lse, expected_logit, int(n_tokens),
      int(num_tiles));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(cudaGetErrorString(err));
  return 0;
}

}  // extern "C"
