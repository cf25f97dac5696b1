// Host checks of the tiles the kernels compile (csrc/tiles_sm90.cuh), on a machine without a GPU: the index maps
// that a GPU would otherwise only show as wrong numbers, a hang or a slow kernel. Built with csrc/build.sh's nvcc and
// run on the CPU by tests/test_csrc.py (marker `compile`); nothing here launches a kernel or calls the driver. The
// layouts are CuTe's, evaluated on the host at 1024-byte aligned buffers, as the kernels' shared memory is.
//
// Accumulator fragments (kernel A's two variants, kernel C), for every thread of the tiled MMA, element (v0, r, v2)
// of MMA tile (mi, ni) as the epilogues index it:
//   cover   every (row, col) of the tile is held by exactly one thread, once;
//   row     the row depends on (mi, r) only (the epilogues compute it once per (mi, r), from v0 = v2 = ni = 0);
//   column  the column depends on (v0, v2, ni) only (kernel A's bias batch computes it from mi = r = 0);
//   pair    (v0 = 0, 1) are two adjacent columns of one row, the first even (the 8-byte and 4-byte paired stores);
//   quad    the threads holding a row are the four lanes of one quad (kernel A reduces a row with xor shuffles 1, 2).
// Kernel C's consumers (each GEMM, bf16 / fp16), thread wt of warpgroup cw, chunk i (consumer_chunk):
//   chunk   8 elements along the contiguous mode at 8 consecutive addresses, 16-byte aligned, in the tile;
//   stride  chunk i of stage (buffer) s lies at chunk 0 of stage 0 plus i CHUNK_STRIDE_BYTES plus s tiles' bytes
//           (the kernel forms its addresses so, once per thread);
//   cover   the 256 threads' 4 chunks are every element of a stage of the fp16 logits tile and of a dz buffer, once;
//   banks   each quarter-warp's 8 16-byte accesses (one shared-memory phase) fall in 8 different 16-byte bank groups;
//   group   grad_weight: a warpgroup's columns are one 64-column group of the fp16 store (one offset per token);
//   owner   the dz elements a warpgroup writes are exactly those its own WGMMAs read (partition_A), so the
//           warpgroup's named barrier orders every write before the read;
//   B       each warpgroup's WGMMAs read the whole B stage, what the TMA writes;
//   bytes   a stage's TMA transaction count equals the bytes of its logits and B tiles (else the full barrier never
//           completes: a hang), and the CTA's shared memory fits sm_90's 227 KB.
// Exit status 1 on the first violation of any check (printed with its coordinates), 0 when all hold.

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../tiles_sm90.cuh"

using namespace cute;

namespace {

int g_failures = 0;

#define EXPECT(cond, ...)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      if (g_failures < 20) {                                \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
        std::printf(__VA_ARGS__);                           \
        std::printf("\n");                                  \
      }                                                     \
      ++g_failures;                                         \
      return false;                                         \
    }                                                       \
  } while (0)

// The accumulator fragment of TiledMma over a BM x BN tile, as the epilogues index it.
template <class TiledMma, int BM, int BN>
bool check_fragment(char const* name) {
  TiledMma mma;
  Tensor cC = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
  using Frag = decltype(partition_fragment_C(mma, make_shape(Int<BM>{}, Int<BN>{})));
  using L = typename Frag::layout_type;
  static_assert(rank(L{}) == 3 && rank<0>(L{}) == 3, "the sm90 WGMMA C fragment");
  constexpr int V0 = size<0, 0>(L{}), R = size<0, 1>(L{}), V2 = size<0, 2>(L{});
  constexpr int MM = size<1>(L{}), MN = size<2>(L{});
  int const threads = int(size(mma));
  EXPECT(V0 == 2, "%s: %d values per column pair, expected 2", name, V0);
  std::vector<int> owner(BM * BN, -1);
  std::vector<std::set<int>> row_threads(BM);
  for (int t = 0; t < threads; ++t) {
    Tensor tCcC = mma.get_thread_slice(t).partition_C(cC);
    for (int mi = 0; mi < MM; ++mi)
      for (int r = 0; r < R; ++r) {
        int const row = int(get<0>(tCcC(make_coord(make_coord(0, r, 0), mi, 0))));
        for (int ni = 0; ni < MN; ++ni)
          for (int v2 = 0; v2 < V2; ++v2)
            for (int v0 = 0; v0 < V0; ++v0) {
              auto rc = tCcC(make_coord(make_coord(v0, r, v2), mi, ni));
              int const m = int(get<0>(rc)), n = int(get<1>(rc));
              EXPECT(m >= 0 && m < BM && n >= 0 && n < BN, "%s: thread %d element (%d,%d,%d),%d,%d at (%d, %d) is "
                     "outside the %d x %d tile", name, t, v0, r, v2, mi, ni, m, n, BM, BN);
              EXPECT(owner[m * BN + n] == -1, "%s cover: (%d, %d) held by thread %d and thread %d", name, m, n,
                     owner[m * BN + n], t);
              owner[m * BN + n] = t;
              EXPECT(m == row, "%s row: thread %d element (%d,%d,%d),%d,%d in row %d, its (0,%d,0),%d,0 in row %d",
                     name, t, v0, r, v2, mi, ni, m, r, mi, row);
              int const n00 = int(get<1>(tCcC(make_coord(make_coord(v0, 0, v2), 0, ni))));
              EXPECT(n == n00, "%s column: thread %d element (%d,%d,%d),%d,%d in column %d, with mi = r = 0 %d", name,
                     t, v0, r, v2, mi, ni, n, n00);
              int const first = int(get<1>(tCcC(make_coord(make_coord(0, r, v2), mi, ni))));
              EXPECT(n == first + v0 && first % 2 == 0, "%s pair: thread %d (%d,%d,%d),%d,%d in column %d, its pair "
                     "starts at %d", name, t, v0, r, v2, mi, ni, n, first);
              row_threads[m].insert(t);
            }
      }
  }
  for (int i = 0; i < BM * BN; ++i) EXPECT(owner[i] >= 0, "%s cover: (%d, %d) held by no thread", name, i / BN, i % BN);
  for (int m = 0; m < BM; ++m) {
    auto const& ts = row_threads[m];
    int const quad = *ts.begin() / 4;
    EXPECT(ts.size() == 4 && *ts.begin() == 4 * quad && *ts.rbegin() == 4 * quad + 3,
           "%s quad: row %d is held by %zu threads from %d to %d, not the four lanes of one quad", name, m, ts.size(),
           *ts.begin(), *ts.rbegin());
  }
  std::printf("ok  %s: %d threads x (%d x %d x %d) x %d x %d fp32 cover %d x %d once; rows per (mi, r), columns per "
              "(v0, v2, ni), even-odd column pairs, each row in one quad\n", name, threads, V0, R, V2, MM, MN, BM, BN);
  return true;
}

// Kernel C: the chunks the consumers read from a (BM, BK, stages) tile of 16-bit elements and write to one.
template <class Cfg, class T, class SmemLayout>
bool check_chunk_tile(char const* name, char const* what, long tile_bytes) {
  constexpr int BM = Cfg::BM, BK = Cfg::BK;
  constexpr int STAGES = size<2>(SmemLayout{});
  alignas(1024) static T buffer[cosize_v<SmemLayout>];
  Tensor s = make_tensor(make_smem_ptr(buffer), SmemLayout{});
  for (int stage = 0; stage < STAGES; ++stage) {
    std::map<long, int> written;
    for (int m = 0; m < BM; ++m)
      for (int k = 0; k < BK; ++k) written[long(&s(m, k, stage) - buffer)] = 0;
    EXPECT(int(written.size()) == BM * BK, "%s %s: stage %d has %zu distinct addresses, not %d", name, what, stage,
           written.size(), BM * BK);
    for (int cw = 0; cw < 2; ++cw)
      for (int wt = 0; wt < 128; ++wt)
        for (int i = 0; i < 4; ++i) {
          grpo_csrc_bwd::ChunkCoord const c = grpo_csrc_bwd::consumer_chunk<Cfg>(cw, wt, i);
          bool const k_major = Cfg::A_K_MAJOR;
          EXPECT(c.m >= 0 && c.k >= 0 && c.m + (k_major ? 0 : 7) < BM && c.k + (k_major ? 7 : 0) < BK,
                 "%s %s chunk: warpgroup %d thread %d chunk %d at (%d, %d) leaves the %d x %d tile", name, what, cw, wt,
                 i, c.m, c.k, BM, BK);
          long const base = long(&s(c.m, c.k, stage) - buffer);
          grpo_csrc_bwd::ChunkCoord const c0 = grpo_csrc_bwd::consumer_chunk<Cfg>(cw, wt, 0);
          long const formed_bytes = long(i) * Cfg::CHUNK_STRIDE_BYTES + long(stage) * tile_bytes;
          long const formed = long(&s(c0.m, c0.k, 0) - buffer) + formed_bytes / long(sizeof(T));
          EXPECT(base == formed, "%s %s stride: warpgroup %d thread %d chunk %d stage %d at element %ld, the kernel "
                 "forms %ld", name, what, cw, wt, i, stage, base, formed);
          EXPECT(base % 8 == 0, "%s %s chunk: warpgroup %d thread %d chunk %d at element %ld, not 16-byte aligned",
                 name, what, cw, wt, i, base);
          for (int j = 0; j < 8; ++j) {
            int const m = c.m + (k_major ? 0 : j), k = c.k + (k_major ? j : 0);
            long const at = long(&s(m, k, stage) - buffer);
            EXPECT(at == base + j, "%s %s chunk: warpgroup %d thread %d chunk %d element %d (%d, %d) at %ld, not %ld",
                   name, what, cw, wt, i, j, m, k, at, base + j);
            EXPECT(written.count(at) && written[at] == 0, "%s %s cover: (%d, %d) stage %d reached twice or outside",
                   name, what, m, k, stage);
            written[at] = 1;
          }
          if (Cfg::OP == grpo_csrc_bwd::Op::GradWeight)
            EXPECT(c.m / grpo_csrc::STORED_GROUP == cw, "%s group: warpgroup %d thread %d chunk %d in column %d, "
                   "outside the warpgroup's 64-column group", name, cw, wt, i, c.m);
        }
    for (auto const& [at, n] : written)
      EXPECT(n == 1, "%s %s cover: element %ld of stage %d never reached", name, what, at, stage);
    // one shared-memory phase of a 16-byte access: 8 consecutive lanes, conflict-free when their 16-byte bank groups
    // (address / 16 mod 8) differ
    for (int cw = 0; cw < 2; ++cw)
      for (int lane0 = 0; lane0 < 128; lane0 += 8)
        for (int i = 0; i < 4; ++i) {
          std::set<long> groups;
          for (int wt = lane0; wt < lane0 + 8; ++wt) {
            grpo_csrc_bwd::ChunkCoord const c = grpo_csrc_bwd::consumer_chunk<Cfg>(cw, wt, i);
            groups.insert((long(&s(c.m, c.k, stage) - buffer) * long(sizeof(T)) / 16) % 8);
          }
          EXPECT(groups.size() == 8, "%s %s banks: warpgroup %d lanes %d-%d chunk %d use %zu of 8 bank groups", name,
                 what, cw, lane0, lane0 + 7, i, groups.size());
        }
  }
  return true;
}

template <class Cfg>
bool check_kernel_c(char const* name) {
  using Element = typename Cfg::Element;
  bool ok = check_chunk_tile<Cfg, typename Cfg::Stored, typename Cfg::SmemLayoutL>(name, "logits read",
                                                                                   Cfg::LOGITS_TILE_BYTES) &&
            check_chunk_tile<Cfg, Element, typename Cfg::SmemLayoutA>(name, "dz written", Cfg::DZ_TILE_BYTES);
  if (!ok) return false;
  // owner: what warpgroup cw writes into dz buffer b is what its WGMMAs read from it
  alignas(1024) static Element dz[cosize_v<typename Cfg::SmemLayoutA>];
  alignas(1024) static Element b_tile[cosize_v<typename Cfg::SmemLayoutB>];
  Tensor sA = make_tensor(make_smem_ptr(dz), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(b_tile), typename Cfg::SmemLayoutB{});
  typename Cfg::TiledMma mma;
  for (int buf = 0; buf < Cfg::DZ_BUFFERS; ++buf)
    for (int cw = 0; cw < 2; ++cw) {
      std::set<long> written;
      for (int wt = 0; wt < 128; ++wt)
        for (int i = 0; i < 4; ++i) {
          grpo_csrc_bwd::ChunkCoord const c = grpo_csrc_bwd::consumer_chunk<Cfg>(cw, wt, i);
          for (int j = 0; j < 8; ++j)
            written.insert(long(&sA(c.m + (Cfg::A_K_MAJOR ? 0 : j), c.k + (Cfg::A_K_MAJOR ? j : 0), buf) - dz));
        }
      for (int wt : {0, 1, 63, 127}) {
        Tensor tA = mma.get_thread_slice(128 * cw + wt).partition_A(sA)(_, _, _, buf);
        std::set<long> read;
        for (int e = 0; e < size(tA); ++e) read.insert(long(&tA(e) - dz));
        EXPECT(read == written, "%s owner: dz buffer %d: warpgroup %d writes %zu elements, its thread %d's WGMMAs read "
               "%zu, not the same", name, buf, cw, written.size(), wt, read.size());
      }
    }
  for (int stage = 0; stage < Cfg::STAGES; ++stage) {
    std::set<long> whole;
    for (int n = 0; n < Cfg::BN; ++n)
      for (int k = 0; k < Cfg::BK; ++k) whole.insert(long(&sB(n, k, stage) - b_tile));
    for (int ct : {0, 127, 128, 255}) {
      Tensor tB = mma.get_thread_slice(ct).partition_B(sB)(_, _, _, stage);
      std::set<long> read;
      for (int e = 0; e < size(tB); ++e) read.insert(long(&tB(e) - b_tile));
      EXPECT(read == whole, "%s B: stage %d: thread %d's WGMMAs read %zu elements of the %zu the TMA writes", name,
             stage, ct, read.size(), whole.size());
    }
  }
  // bytes: one stage of the logits and B tiles is what the producer's arrive_and_expect_tx announces
  constexpr long logits_stage =
      long(cosize_v<typename Cfg::SmemLayoutL>) / Cfg::STAGES * long(sizeof(typename Cfg::Stored));
  constexpr long b_stage = long(cosize_v<typename Cfg::SmemLayoutB>) / Cfg::STAGES * long(sizeof(Element));
  constexpr long stage_bytes = logits_stage + b_stage;
  EXPECT(stage_bytes == long(Cfg::TMA_BYTES), "%s bytes: a stage holds %ld bytes, the TMA transaction counts %u", name,
         stage_bytes, Cfg::TMA_BYTES);
  constexpr long smem = long(sizeof(typename Cfg::SharedStorage));
  EXPECT(smem <= 232448, "%s bytes: %ld bytes of shared memory, sm_90 allows 232448", name, smem);
  std::printf("ok  %s: 256 threads x 4 chunks of 8 read each fp16 logits stage (%d) and write each dz buffer (%d) "
              "once, 16-byte aligned, at the addresses the kernel forms, 8 bank groups per phase; each warpgroup's "
              "WGMMAs read what it wrote and the whole B stage; %ld-byte TMA stage, %ld bytes of shared memory\n",
              name, Cfg::STAGES, Cfg::DZ_BUFFERS, stage_bytes, smem);
  return true;
}

}  // namespace

int main() {
  using namespace grpo_csrc;
  using namespace grpo_csrc_bwd;
  check_fragment<typename StatsMainloop<cutlass::bfloat16_t, Coop128x256, CoopSched>::TiledMma, 128, 256>(
      "kernel A cooperative 128x256 (bf16)");
  check_fragment<typename StatsMainloop<cutlass::half_t, Coop128x256, CoopSched>::TiledMma, 128, 256>(
      "kernel A cooperative 128x256 (fp16)");
  check_fragment<typename StatsMainloop<cutlass::bfloat16_t, Ping64x256, PingSched>::TiledMma, 64, 256>(
      "kernel A ping-pong 64x256 (bf16)");
  check_fragment<typename StatsMainloop<cutlass::half_t, Ping64x256, PingSched>::TiledMma, 64, 256>(
      "kernel A ping-pong 64x256 (fp16)");
  using GH = DzConfig<cutlass::bfloat16_t, Op::GradHidden, 256, 4>;
  using GW = DzConfig<cutlass::bfloat16_t, Op::GradWeight, 256, 4>;
  using GHh = DzConfig<cutlass::half_t, Op::GradHidden, 256, 4>;
  using GWh = DzConfig<cutlass::half_t, Op::GradWeight, 256, 4>;
  check_fragment<typename GH::TiledMma, GH::BM, GH::BN>("kernel C epilogue 128x256 (grad_hidden bf16)");
  check_fragment<typename GW::TiledMma, GW::BM, GW::BN>("kernel C epilogue 128x256 (grad_weight bf16)");
  check_kernel_c<GH>("kernel C grad_hidden bf16 (A K-major)");
  check_kernel_c<GW>("kernel C grad_weight bf16 (A MN-major)");
  check_kernel_c<GHh>("kernel C grad_hidden fp16 (A K-major)");
  check_kernel_c<GWh>("kernel C grad_weight fp16 (A MN-major)");
  if (g_failures) std::printf("%d check(s) failed\n", g_failures);
  return g_failures ? 1 : 0;
}
