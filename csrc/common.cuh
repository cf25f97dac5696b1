// What kernels A (lm_head_fwd_sm90.cu) and C (lm_head_bwd_sm90.cu) share: the exp and the division they use, the
// fp16 store's group width, the library's one error buffer behind grpo_csrc_last_error() and the entry points' size
// check.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cutlass/cutlass.h"

namespace grpo_csrc {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int STORED_GROUP = 64;  // columns per fp32 offset of the fp16 store (half_logits_format.STORED_GROUP)

// 2^x by the SFU (MUFU.EX2), results below 2^-126 flushed to 0: without .ftz ptxas wraps each MUFU in a range test
// and two predicated multiplies (4 instructions where 1 does). Every use sums or weights probabilities next to the
// row's largest (a term of 1 in a tile's sum, p >= 1 / V in dz), where a value below 2^-126 changes nothing an fp32
// sum or a 16-bit operand holds.
CUTLASS_DEVICE float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// a / b as a * rcp.approx(b) (div.approx.f32: MUFU.RCP and one FMUL), for |b| in [2^-126, 2^126]. There it is what
// Triton's fp32 `/` computes: Triton emits div.full.f32, which ptxas compiles to the same two instructions behind
// range tests that rescale both operands only for |b| outside that range. The IEEE `a / b` of CUDA C++ (div.rn.f32)
// compiled to the reciprocal, two Newton steps and a range check (FCHK) branching to a subroutine.
CUTLASS_DEVICE float div_approx(float a, float b) {
  float y;
  asm("div.approx.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// The last refusal or CUDA error of this thread's call into the library (one buffer for every entry point: C++17
// inline variable, a single instance across the translation units).
inline thread_local char g_error[512] = "";

inline int fail(char const* what) {
  std::snprintf(g_error, sizeof(g_error), "%s", what);
  return 1;
}

// The LM-head problem's sizes (tokens, vocabulary, hidden) as the kernels index them (int): nonzero, with the
// refusal recorded, unless each is in [1, 2^31).
inline int check_problem_size(int64_t n_tokens, int64_t vocab, int64_t hidden_size) {
  if (n_tokens <= 0 || vocab <= 0 || hidden_size <= 0) return fail("empty problem");
  if (n_tokens >= (int64_t(1) << 31) || vocab >= (int64_t(1) << 31) || hidden_size >= (int64_t(1) << 31))
    return fail("sizes must be below 2^31");
  return 0;
}

}  // namespace grpo_csrc
