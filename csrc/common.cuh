// What kernels A (lm_head_fwd_sm90.cu) and C (lm_head_bwd_sm90.cu) share: the exp they use, the fp16 store's
// group width, and the library's one error buffer behind grpo_csrc_last_error().
#pragma once

#include <cstdio>

#include "cutlass/cutlass.h"

namespace grpo_csrc {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int STORED_GROUP = 64;  // columns per fp32 offset of the fp16 store (half_logits_format.STORED_GROUP)

CUTLASS_DEVICE float ex2_approx(float x) {  // what tl.exp2 lowers to
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The last refusal or CUDA error of this thread's call into the library (one buffer for every entry point: C++17
// inline variable, a single instance across the translation units).
inline thread_local char g_error[512] = "";

inline int fail(char const* what) {
  std::snprintf(g_error, sizeof(g_error), "%s", what);
  return 1;
}

}  // namespace grpo_csrc
