"""Triton kernels for the LM-head statistics (kernel A of docs/design.md §1) and their backward (kernel C).

Forward, two launches:
  lm_head_fwd_kernel_partial  tiled GEMM z = (hidden @ weight.T + bias) / T into fp32 accumulators; each
                              program owns BLOCK_M tokens x one vocabulary split and folds its logits tiles
                              into online (max, sum-exp, sum-exp * deviation) statistics; the split that
                              holds a token's target also writes that target's logit.
  lm_head_fwd_kernel_merge    combines the splits into logprob, entropy, lse and E_p[z] per token.
Backward, per chunk of tokens:
  lm_head_bwd_kernel_dlogits  recomputes each logits tile and writes dL/dlogit into a bounded
                              [token_chunk, V] workspace (input dtype), optionally with fp32 column sums
                              for grad_bias; cuBLAS then contracts the workspace into grad_hidden
                              (fp32 out, cast once) and the fp32 grad_weight accumulator.

lm_head_forward / lm_head_backward share their signatures with chunked.py (extra arguments are
keyword-only). Derivations, tile choices and workspace formulas: README.md beside this file.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._backend import SlowPathWarning, interpreter_enabled
from .reference import LMHeadStats

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

# Backward workspace budget (plan_backward): mostly the [token_chunk, V] dL/dlogit slab in the input dtype.
# 1 GiB holds 3328 tokens at V = 151936, H = 4096 in bf16, enough that re-reading the fp32 grad_weight
# accumulator once per chunk costs well under 10 % of the chunk's GEMM time on H100/H200 (README.md).
DEFAULT_WORKSPACE_BYTES = 1 << 30
# Forward split planning: assumed SM count when the device has none (interpreter, AOT planning).
DEFAULT_NUM_SMS = 132
MERGE_BLOCK_T = 256
# Workspace rows are padded to a multiple of this many elements (128 bytes in bf16), so every row of the
# slab cuBLAS reads is 16-byte aligned whatever V is.
WORKSPACE_ROW_ALIGN = 64


# ---------------------------------------------------------------------------------------------------
# Tile configurations and the dispatcher
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tokens per tile
    block_n: int  # vocabulary entries per tile
    block_k: int  # hidden-size slice per pipeline stage
    group_m: int  # token tiles per rasterisation group (L2 reuse of the weight tiles)
    num_warps: int
    num_stages: int
    # registers per thread the compiler may use (maxnreg), where a cap is what lets two CTAs share an SM
    max_registers: int | None = None

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory of the operand pipeline: num_stages x ([BM, BK] + [BN, BK]) tiles."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size


@dataclass(frozen=True)
class LMHeadTritonConfig:
    name: str
    forward: TileConfig
    backward: TileConfig
    # the forward that also stores the fp32 logits (fused one-pass schedule), when `forward` has no
    # registers left for the store's addresses
    forward_stored: TileConfig | None = None
    # kernel A with TMA operands (lm_head_fwd_kernel_partial_tma, forward_kernel("tma")): without and with
    # the logits store; None where the architecture has no TMA (the cp.async kernel runs)
    forward_tma: TileConfig | None = None
    forward_tma_stored: TileConfig | None = None
    # kernel A's logits tile as per-element sums of products instead of tl.dot (the interpreter in the
    # batch-invariant mode only): the interpreter's tl.dot is np.matmul, and CPU BLAS (OpenBLAS 0.3.29 on
    # AMD EPYC) sums a row's products in an order that depends on the row's place in the [BM, BK] tile
    # (its micro-kernel's row blocking), so a token's logits changed with its offset in the batch; an MMA
    # on a GPU computes every row alike
    row_independent_dot: bool = False


# Every configuration the dispatcher can return. The compile tier (tests/test_lm_head_compile.py) AOT-compiles
# the ones picked for each architecture it targets (sm_90, sm_80, sm_100a, sm_120) in every code path and
# asserts no spills, the shared memory within the architecture's limit and its MMA instruction; README.md
# §6 explains the numbers. Keys: (architecture class, operand class).
CONFIGS: dict[tuple[str, str], LMHeadTritonConfig] = {
    # Hopper (H100/H200, 228 KiB smem, wgmma). Forward: a 128x256 fp32 accumulator over two warpgroups
    # (wgmma m64n256k16), 3 stages x 48 KiB = 144 KiB of operand pipeline, one CTA per SM. Backward:
    # 128x256 leaves no registers for the dL/dlogit epilogue (255 + spills), so 128x128 with 3 x 32 KiB
    # stages: 128 registers and 96 KiB, two CTAs per SM, one's epilogue overlapping the other's GEMM.
    ("sm90", "16bit"): LMHeadTritonConfig(
        "sm90-16bit",
        forward=TileConfig(128, 256, 64, 16, num_warps=8, num_stages=3),
        backward=TileConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
        # storing the 128x256 fp32 tile as well spills (255 registers + 152 B stack): 128x128 for it
        forward_stored=TileConfig(128, 128, 64, 16, num_warps=8, num_stages=3),
        # TMA kernel A: tiles at <= 128 registers x 256 threads (or 4 warps) and <= 113 KiB of shared memory,
        # so two CTAs share an SM and one's softmax epilogue runs while the other's wgmma pipeline is busy
        # (README §6). 128x128 needs 128 registers without bias, 135 with (the cap holds it at 128 without
        # spills); the soft-cap's tanh needs 155 (report) and would spill under the cap, so it runs uncapped, one
        # CTA per SM. Storing the fp32 tile adds 64 KiB of TMA staging: 64x128 tiles on one warpgroup.
        forward_tma=TileConfig(128, 128, 64, 16, num_warps=8, num_stages=3, max_registers=128),
        forward_tma_stored=TileConfig(64, 128, 64, 16, num_warps=4, num_stages=3),
    ),
    # fp32 operands (tf32x3, or tf32 where torch allows it): 4-byte elements, so half-width tiles.
    ("sm90", "fp32"): LMHeadTritonConfig(
        "sm90-fp32",
        forward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=3),
        backward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=3),
    ),
    # Data-centre Blackwell (B200/GB200, sm_100a: tcgen05.mma, the accumulator in tensor memory, 228 KiB
    # smem). Hopper's tiles except where they spill there: the 128x256 forward reads its accumulator out of
    # tensor memory into 128 fp32 registers per thread and spills with a bias (255 + 128 B with triton 3.6,
    # + 192 B with 3.9), so the forward is 128x128x64 (165-191 registers); the TMA kernel A spills under the
    # 128-register cap (and with triton 3.9's ptxas even uncapped, with the soft-cap), so it runs 64x128
    # tiles on one warpgroup, uncapped (96-168 registers, 72 KiB, three CTAs per SM by registers, shared
    # memory and tensor memory), as its stored-logits variant already does on Hopper.
    ("sm100", "16bit"): LMHeadTritonConfig(
        "sm100-16bit",
        forward=TileConfig(128, 128, 64, 16, num_warps=8, num_stages=3),
        backward=TileConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
        forward_tma=TileConfig(64, 128, 64, 16, num_warps=4, num_stages=3),
        forward_tma_stored=TileConfig(64, 128, 64, 16, num_warps=4, num_stages=3),
    ),
    # fp32 operands: Hopper's 128x128x32 forward compiles to an empty kernel (4 registers, no store) on
    # sm_100a with triton 3.6 when H is not a multiple of 32 (the ragged-K path, tf32x3); 128x128x16 does not
    ("sm100", "fp32"): LMHeadTritonConfig(
        "sm100-fp32",
        forward=TileConfig(128, 128, 16, 8, num_warps=8, num_stages=3),
        backward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=3),
    ),
    # Ampere and Ada (sm_80 / sm_86 / sm_89: mma.sync, >= 99 KiB smem): 128x128x32 tiles, 8 warps,
    # 4 stages (Triton keeps 3 buffers: 48 KiB, fits the 99 KiB parts too).
    ("sm80", "16bit"): LMHeadTritonConfig(
        "sm80-16bit",
        forward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=4),
        backward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=4),
    ),
    # tf32x3 on mma.sync splits both register operands into high and low parts: 128x128 tiles spill
    # hundreds of bytes; 64x64x16 needs 125 registers.
    ("sm80", "fp32"): LMHeadTritonConfig(
        "sm80-fp32",
        forward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=4),
        backward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=4),
    ),
    # Consumer / workstation Blackwell (RTX 50xx, RTX PRO 6000; sm_120 / sm_121: mma.sync like Ampere, no
    # wgmma or tcgen05, 99 KiB smem per block). Ampere's tiles, except the forward's K slice: 128x128x32
    # with bias and soft-cap spills there with triton 3.6 (its ptxas for sm_100+ is not sm_80's: 255
    # registers + 32 B), 128x128x16 does not (164-252 registers, 24 KiB).
    ("sm120", "16bit"): LMHeadTritonConfig(
        "sm120-16bit",
        forward=TileConfig(128, 128, 16, 8, num_warps=8, num_stages=4),
        backward=TileConfig(128, 128, 32, 8, num_warps=8, num_stages=4),
    ),
    ("sm120", "fp32"): LMHeadTritonConfig(
        "sm120-fp32",
        forward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=4),
        backward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=4),
    ),
    # Inputs Triton cannot prove 16-element aligned (H or a row stride not a multiple of 16, or a base
    # pointer off 16 bytes): no vectorised cp.async, so no software pipeline and scalar pointer registers.
    # 64x64x16 keeps that slow path spill-free on sm_90 and sm_80 with triton 3.6 and 3.9 (64x64x32 spills
    # on sm_90 with 3.9). No LLM head has such an H.
    ("unaligned", "16bit"): LMHeadTritonConfig(
        "unaligned-16bit",
        forward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=1),
        backward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=1),
    ),
    ("unaligned", "fp32"): LMHeadTritonConfig(
        "unaligned-fp32",
        forward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=1),
        backward=TileConfig(64, 64, 16, 8, num_warps=4, num_stages=1),
    ),
    # TRITON_INTERPRET=1 on CPU: small tiles so odd test shapes cross many tile edges quickly.
    ("interpreter", "16bit"): LMHeadTritonConfig(
        "interpreter",
        forward=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        backward=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        forward_tma=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        forward_tma_stored=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
    ),
    ("interpreter", "fp32"): LMHeadTritonConfig(
        "interpreter",
        forward=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        backward=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        forward_tma=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
        forward_tma_stored=TileConfig(32, 64, 32, 2, num_warps=4, num_stages=1),
    ),
}


def arch_class(capability: tuple[int, int]) -> str:
    """Map a CUDA compute capability to the architecture key of CONFIGS."""
    major, minor = capability
    if major < 8:
        raise RuntimeError(
            f"lm_head Triton kernels need an Ampere-or-newer GPU (sm_80+), got sm_{major}{minor}; "
            "use backend='torch'"
        )
    if major == 9:  # H100/H200/GH200: wgmma, 228 KiB smem
        return "sm90"
    if major == 10:  # B200/GB200/B300 (sm_100 / sm_103): tcgen05 and tensor memory, 228 KiB smem
        return "sm100"
    if major == 12:  # RTX 50xx / RTX PRO 6000 / GB10 (sm_120 / sm_121): mma.sync, 99 KiB smem per block
        return "sm120"
    return "sm80"  # Ampere, Ada, and any other part: mma.sync tiles that fit 99 KiB


def is_aligned(*tensors: torch.Tensor) -> bool:
    """What Triton's specialisation must see for vectorised, pipelined loads of [rows, H] operands: base
    pointers 16-byte aligned, row strides and H multiples of 16 elements."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.shape[-1] % 16 == 0 for t in tensors)


def pick_config(device: torch.device, dtype: torch.dtype, aligned: bool = True) -> LMHeadTritonConfig:
    """The tile configuration for [rows, H] operands of `dtype` on `device` (README.md §6)."""
    operands = "fp32" if dtype == torch.float32 else "16bit"
    if device.type != "cuda":
        return CONFIGS[("interpreter", operands)]
    if not aligned:
        return CONFIGS[("unaligned", operands)]
    return CONFIGS[(arch_class(torch.cuda.get_device_capability(device)), operands)]


# The streaming statistics kernel of the cuBLAS-forward schedules (lm_head_fwd_kernel_stats_from_logits):
# no GEMM, so no operand pipeline; BLOCK_M rows x BLOCK_N columns of fp32 per step (16 KiB at 16 x 256 with
# 4 warps: 32 values per thread per live array), GROUP_M only orders the programs (nothing to share in L2).
# Keys: "gpu" (every CUDA architecture), "interpreter" (small tiles so test shapes cross tile edges).
STREAM_TILES: dict[str, TileConfig] = {
    "gpu": TileConfig(16, 256, 1, 8, num_warps=4, num_stages=1),
    "interpreter": TileConfig(8, 64, 1, 2, num_warps=4, num_stages=1),
}
FORWARD_GEMMS = ("kernel_a", "cublas")


def _forward_gemm_cublas(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    """out[n, V] (fp32, row-major) = alpha * hidden @ weight.T: cuBLAS with an fp32 output straight into the
    logits buffer (torch.addmm(out_dtype=float32), beta = 0), no temporary. Where torch has no out_dtype GEMM
    for the device (CPU, torch < 2.8) the operands are upcast _UPCAST_SLAB vocabulary rows at a time (the
    operands' products are exact in fp32 either way; the interpreter tier runs this path)."""
    if hidden.dtype == torch.float32:  # fp32 operands: TF32 where torch allows it, as kernel A's dot does
        torch.addmm(out, hidden, weight.T, beta=0.0, alpha=alpha, out=out)
        return
    if _MM_OUT_DTYPE_OK.get(hidden.device.type, True):
        try:
            torch.addmm(out, hidden, weight.T, beta=0.0, alpha=alpha, out_dtype=torch.float32, out=out)
            _MM_OUT_DTYPE_OK[hidden.device.type] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[hidden.device.type] = False
    hidden32 = hidden.float()
    for v0 in range(0, weight.shape[0], _UPCAST_SLAB):
        cols = slice(v0, v0 + _UPCAST_SLAB)
        torch.addmm(out[:, cols], hidden32, weight[cols].float().T, beta=0.0, alpha=alpha, out=out[:, cols])


# fused_linear_logprobs' logits GEMM (its forward and its backward's recompute; README.md, "Logits GEMM of
# fused_linear_logprobs"): "triton" (kernel A; the recomputing dlogits kernel) or "cublas" (cuBLAS with an
# fp32 output into a chunk of logits, then the streaming statistics kernel / the dlogits kernel reading that
# chunk). The fused loss's schedules choose their own (ops/fused). GRPO_KERNELS_LOGITS_GEMM sets it for the
# process, use_logits_gemm for a block.
LOGITS_GEMMS = ("triton", "cublas")
_logits_gemm_override: str | None = None


def logits_gemm() -> str:
    """The GEMM fused_linear_logprobs runs next: use_logits_gemm's choice inside its block, else the
    GRPO_KERNELS_LOGITS_GEMM environment variable, else "triton"."""
    if _logits_gemm_override is not None:
        return _logits_gemm_override
    name = os.environ.get("GRPO_KERNELS_LOGITS_GEMM", "triton")
    _check(name in LOGITS_GEMMS, f"GRPO_KERNELS_LOGITS_GEMM must be one of {LOGITS_GEMMS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_logits_gemm(name: str):
    """Within the block, fused_linear_logprobs (Triton backend) runs its logits GEMM by `name`."""
    global _logits_gemm_override
    _check(name in LOGITS_GEMMS, f"logits GEMM must be one of {LOGITS_GEMMS}, got {name!r}")
    previous, _logits_gemm_override = _logits_gemm_override, name
    try:
        yield
    finally:
        _logits_gemm_override = previous


def logits_chunk_rows(n_tokens: int, vocab: int, hidden_size: int, element_size: int,
                      budget: int | None = None) -> int:  # fmt: skip
    """Tokens per chunk of the cuBLAS logits path, the same in the forward and the backward (so that both
    see the logits of GEMMs of the same shape, summed in the same order): the most whose backward buffers
    fit `budget` (default DEFAULT_WORKSPACE_BYTES): fp32 logits, the dz slab in the operands' dtype, and the
    fp32 grad_hidden rows of half-precision operands; in whole 64-token tiles when one fits, never fewer
    than 1 or more than N. 1 GiB: 1152 tokens at V = 151936, H = 4096 in bf16 (a 668 MiB forward buffer)."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else budget
    slab = math.ceil(vocab / WORKSPACE_ROW_ALIGN) * WORKSPACE_ROW_ALIGN * element_size
    per_row = 4 * vocab + slab + (hidden_size * 4 if element_size < 4 else 0)
    rows = budget // per_row
    if rows >= 64:
        rows = rows // 64 * 64
    return max(1, min(rows, n_tokens))

# Which kernel A runs (README.md §6, "TMA kernel A"): "cp.async" (the default until a GPU run has timed
# the two) or "tma". GRPO_KERNELS_FORWARD_KERNEL sets it for the process, use_forward_kernel for a block.
FORWARD_KERNELS = ("cp.async", "tma")
_forward_kernel_override: str | None = None


def forward_kernel() -> str:
    """The kernel A the next lm_head_forward asks for: use_forward_kernel's choice inside its block, else
    the GRPO_KERNELS_FORWARD_KERNEL environment variable, else "cp.async"."""
    if _forward_kernel_override is not None:
        return _forward_kernel_override
    name = os.environ.get("GRPO_KERNELS_FORWARD_KERNEL", "cp.async")
    _check(name in FORWARD_KERNELS, f"GRPO_KERNELS_FORWARD_KERNEL must be one of {FORWARD_KERNELS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_forward_kernel(name: str):
    """Within the block, lm_head_forward runs kernel A `name` ("cp.async" or "tma") where it can; "tma"
    needs sm_90+ (or the interpreter), 16-byte aligned operand rows and a tile configuration with TMA
    entries, else the cp.async kernel runs and a TMAFallbackWarning says why (once per reason)."""
    global _forward_kernel_override
    _check(name in FORWARD_KERNELS, f"forward kernel must be one of {FORWARD_KERNELS}, got {name!r}")
    previous, _forward_kernel_override = _forward_kernel_override, name
    try:
        yield
    finally:
        _forward_kernel_override = previous


class TMAFallbackWarning(UserWarning):
    """The TMA kernel A was asked for but cannot run here; the cp.async kernel ran instead."""


_tma_fallbacks_warned: set[str] = set()


def _tma_blocker(device: torch.device, cfg: LMHeadTritonConfig, tensors: list[torch.Tensor]) -> str | None:
    """Why the TMA kernel A cannot run on these operands (None: it can)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))} has no TMA"
    if cfg.forward_tma is None:
        return f"the {cfg.name} tile configuration has no TMA entry"
    if device.type == "meta":  # AOT planning: alignment is what the recorded specialisation assumes
        return None
    for t in tensors:  # TMA descriptors: 16-byte aligned base and row strides, unit stride along the row
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or t.stride(1) != 1:
            return "an operand's base or row stride is not 16-byte aligned"
    return None


def _warn_tma_fallback(reason: str) -> None:
    """One line per reason (the warnings machinery, so filters apply; no source line, as notify_once)."""
    if reason not in _tma_fallbacks_warned:
        _tma_fallbacks_warned.add(reason)
        warnings.warn_explicit(f"grpo_kernels lm_head: the TMA kernel A was asked for but {reason}; the cp.async "
                               "kernel ran", TMAFallbackWarning, "grpo_kernels", 0, module="grpo_kernels")  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for fp32 operands: TF32 only where torch itself allows it for matmuls."""
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


# ---------------------------------------------------------------------------------------------------
# Host-side planning (pure Python ints: unit-tested at N = 65536, V = 256000 without any allocation)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardPlan:
    num_m_tiles: int
    num_vocab_tiles: int
    tiles_per_split: int
    num_splits: int

    @property
    def num_programs(self) -> int:
        return self.num_m_tiles * self.num_splits

    def partial_bytes(self, n_tokens: int) -> int:
        """fp32 workspace of the forward: (max, sum, deviation) per split and token, plus the target logit."""
        return 4 * n_tokens * (3 * self.num_splits + 1)


@functools.lru_cache(maxsize=4096)
def plan_forward(
    n_tokens: int, vocab: int, block_m: int, block_n: int, num_sms: int, group_m: int
) -> ForwardPlan:
    """Split the vocabulary so that (token tiles x splits) programs fill the SMs with little tail.

    Program p runs tiles_per_split vocabulary tiles; with P programs on S SMs the makespan is about
    ceil(P / S) * tiles_per_split tile-times. Pick the split length with the best utilisation
    (total tiles / (S * makespan)), preferring longer splits (fewer partials to merge) among near-ties,
    with at least ceil(S / group_m) splits: the programs running at once are then group_m token tiles x
    S / group_m splits, which share hidden and weight tiles in L2 (README.md, "Forward schedule").
    """
    num_m_tiles = max(1, math.ceil(n_tokens / block_m))
    num_vocab_tiles = math.ceil(vocab / block_n)
    min_splits = min(num_vocab_tiles, math.ceil(num_sms / group_m))
    total = num_m_tiles * num_vocab_tiles
    best_tps, best_util = 1, -1.0
    for tps in range(num_vocab_tiles // min_splits, 0, -1):
        splits = math.ceil(num_vocab_tiles / tps)
        makespan = math.ceil(num_m_tiles * splits / num_sms) * tps
        util = total / (num_sms * makespan)
        if util > best_util + 0.01:
            best_tps, best_util = tps, util
    num_splits = math.ceil(num_vocab_tiles / best_tps)
    return ForwardPlan(num_m_tiles, num_vocab_tiles, best_tps, num_splits)


@dataclass(frozen=True)
class BackwardPlan:
    rows_per_chunk: int  # tokens per chunk (a multiple of block_m unless it is all of N)
    num_chunks: int
    workspace_row_stride: int  # V rounded up to WORKSPACE_ROW_ALIGN
    workspace_bytes: int  # everything the backward allocates besides its outputs, per the formula below


def plan_backward(
    n_tokens: int,
    vocab: int,
    hidden_size: int,
    element_size: int,
    block_m: int,
    workspace_bytes: int,
    *,
    store_dlogits: bool,
    need_bias_grad: bool,
    need_hidden_grad: bool,
) -> BackwardPlan:
    """Chunk the tokens so the backward's transient memory fits the budget (never less than one tile row).

    Per chunk of r rows it allocates (README.md, "Workspace"):
      r * V_pad * element_size        dL/dlogit slab in the input dtype      (when grad_hidden/grad_weight)
      ceil(r / block_m) * V * 4       fp32 column sums for grad_bias         (when grad_bias)
      r * H * 4                       fp32 grad_hidden of the chunk before its single cast (half precision)
    """
    row_stride = math.ceil(vocab / WORKSPACE_ROW_ALIGN) * WORKSPACE_ROW_ALIGN
    per_row = (row_stride * element_size if store_dlogits else 0) + (
        hidden_size * 4 if need_hidden_grad and element_size < 4 else 0
    )
    per_tile = block_m * per_row + (vocab * 4 if need_bias_grad else 0)  # per block_m rows
    rows = max(1, workspace_bytes // max(per_tile, 1)) * block_m
    rows = max(1, min(rows, n_tokens))
    num_chunks = math.ceil(n_tokens / rows) if n_tokens else 0
    used = rows * per_row + (math.ceil(rows / block_m) * vocab * 4 if need_bias_grad else 0)
    return BackwardPlan(rows, num_chunks, row_stride, used)


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


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
    logits_ptr,  # [N, V] fp32 (row stride stride_logits): z kept for the one-pass backward, or None
    n_tokens,
    vocab,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_logits,
    tiles_per_split,
    num_splits,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ROW_INDEPENDENT_DOT: tl.constexpr = False,  # LMHeadTritonConfig.row_independent_dot (interpreter only)
):
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    pid_m, pid_split = _grouped_tile(pid, num_m_tiles, num_splits, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_tokens
    rows = tl.minimum(offs_m, n_tokens - 1).to(tl.int64)  # clamped: the K loop needs no row mask
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + rows[:, None] * stride_hidden + offs_k[None, :]  # [BM, BK]
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)  # V < 2^31

    num_vocab_tiles = tl.cdiv(vocab, BLOCK_N)
    first_tile = pid_split * tiles_per_split
    split_lo = first_tile * BLOCK_N
    n_tiles = tl.minimum(tiles_per_split, num_vocab_tiles - first_tile)

    run_max = tl.full((BLOCK_M,), RUN_MAX_INIT, dtype=tl.float32)  # finite: (run_max - new_max) * 0 is 0
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    run_dev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_z = tl.zeros((BLOCK_M,), dtype=tl.float32)
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
        if STORE_LOGITS:  # the fp32 tile itself, so the one-pass backward needs no second GEMM
            z_out = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_logits + cols[None, :]
            tl.store(z_out, z, mask=row_ok[:, None] & (cols < vocab)[None, :])
        run_max, run_sum, run_dev, target_z = _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z,
                                                         BLOCK_N)  # fmt: skip
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
    logits_desc,  # TMA descriptor over the fp32 logits [N, V] (row stride of the buffer), block [BM, BN]; or None
    bias_ptr,  # [V] or None
    targets_ptr,  # [N] int
    part_max_ptr,  # [num_splits, N] fp32, as lm_head_fwd_kernel_partial
    part_sum_ptr,
    part_dev_ptr,
    target_logit_ptr,  # [N] fp32
    n_tokens,
    vocab,
    hidden_size,
    tiles_per_split,
    num_splits,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
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
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    pid_m, pid_split = _grouped_tile(pid, num_m_tiles, num_splits, GROUP_M)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_tokens
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)  # V < 2^31

    num_vocab_tiles = tl.cdiv(vocab, BLOCK_N)
    first_tile = pid_split * tiles_per_split
    split_lo = first_tile * BLOCK_N
    n_tiles = tl.minimum(tiles_per_split, num_vocab_tiles - first_tile)
    k_tiles = tl.cdiv(hidden_size, BLOCK_K)

    run_max = tl.full((BLOCK_M,), RUN_MAX_INIT, dtype=tl.float32)  # finite: (run_max - new_max) * 0 is 0
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    run_dev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_z = tl.zeros((BLOCK_M,), dtype=tl.float32)
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
        if STORE_LOGITS:  # the fp32 tile through shared memory, one bulk store clipped to [N, V]
            logits_desc.store([m0, n0], z)
        run_max, run_sum, run_dev, target_z = _fold_tile(z, cols, n0, target, run_max, run_sum, run_dev, target_z,
                                                         BLOCK_N)  # fmt: skip
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
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    pid_m, pid_split = _grouped_tile(pid, num_m_tiles, num_splits, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_tokens
    target = tl.load(targets_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)
    row_ptrs = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_logits
    num_vocab_tiles = tl.cdiv(vocab, BLOCK_N)
    first_tile = pid_split * tiles_per_split
    split_lo = first_tile * BLOCK_N
    n_tiles = tl.minimum(tiles_per_split, num_vocab_tiles - first_tile)
    run_max = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    run_dev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_z = tl.zeros((BLOCK_M,), dtype=tl.float32)
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
    stored_ptr,  # [n, V] fp32 z stored by the forward (row stride stride_stored), or None: recompute
    dz_scale_ptr,  # [2] fp32 (S, 1 / S): the slab holds S dz (fp16: README.md, "dz precision"), or None
    n_rows,
    vocab,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_dlogits,
    stride_stored,
    inv_temperature,
    cap_in,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FROM_STORED: tl.constexpr,
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
    if FROM_STORED:  # the forward kept the fp32 logits of these rows: no GEMM here (one-pass schedule)
        z_in = stored_ptr + offs_m.to(tl.int64)[:, None] * stride_stored + cols[None, :]
        z = tl.load(z_in, mask=tile_ok, other=PAD_LOGIT)
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
    stored_ptr,  # [n, V] fp32 logits stored by the forward (row stride stride_stored)
    weight_ptr,  # [V, H], unit stride along H
    targets_ptr, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr,  # [n] each
    out_ptr,  # [n, H] fp32: grad_hidden (added into when ACCUMULATE)
    dz_scale_ptr,  # [2] fp32 (S, 1 / S) when SCALE_DZ: the operand is S dz, the sum divided by S
    n_rows, vocab, hidden_size, stride_stored, stride_weight, stride_out,
    inv_temperature, cap_in, cap_out,
    HAS_SOFTCAP: tl.constexpr, HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
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
    z_rows = stored_ptr + offs_m.to(tl.int64)[:, None] * stride_stored
    for k0 in range(0, vocab, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < vocab
        tile_ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_rows + cols[None, :], mask=tile_ok, other=PAD_LOGIT)
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


@triton.jit(do_not_specialize=["n_rows"])
def lm_head_bwd_kernel_grad_weight_dz(
    stored_ptr,  # [n, V] fp32 logits stored by the forward (row stride stride_stored)
    hidden_ptr,  # [n, H], unit stride along H
    targets_ptr, lse_ptr, expected_logit_ptr, grad_logprobs_ptr, grad_entropy_ptr,  # [n] each
    acc_ptr,  # [V, H] fp32 grad_weight accumulator (read, added to, written)
    dz_scale_ptr,  # [2] fp32 (S, 1 / S) when SCALE_DZ
    n_rows, vocab, hidden_size, stride_stored, stride_hidden, stride_acc,
    inv_temperature, cap_in, cap_out,
    HAS_SOFTCAP: tl.constexpr, HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE_DZ: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """grad_weight[v, h] += sum_rows dz[rows, v] X[rows, h]: BLOCK_M vocabulary rows x BLOCK_N hidden
    columns, the token rows as the K loop, dz formed from the stored logits and transposed in registers."""
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
        z = tl.load(stored_ptr + rows.to(tl.int64)[:, None] * stride_stored + offs_v[None, :], mask=tile_ok,
                    other=PAD_LOGIT)  # fmt: skip  [BK rows, BM vocab]
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
    tl.store(out, acc + tl.load(out, mask=out_ok, other=0.0), mask=out_ok)


# ---------------------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------------------


def _launch(kernel, grid, args: dict, num_warps: int, num_stages: int, max_registers: int | None = None) -> None:
    """Every launch goes through here; grpo_kernels.testing.aot swaps it to record launches instead."""
    # FP fusion explicitly on: the statistics and dz are written as FMAs (Triton 3.10 turns the default off)
    options = {} if max_registers is None else {"maxnreg": max_registers}
    kernel[grid](**args, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True, **options)


def _check(ok: bool, message: str) -> None:
    # Not `assert`: these guard memory safety of the launches and must survive `python -O`.
    if not ok:
        raise ValueError(f"lm_head (triton): {message}")


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_device(t: torch.Tensor, device: torch.device, name: str) -> None:
    _check(t.device == device, f"{name} is on {t.device}, hidden is on {device}")


def _check_common(hidden, weight, bias, targets, temperature) -> None:
    _check(hidden.dim() == 2, f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    _check(weight.dim() == 2, f"weight must be [V, H], got shape {tuple(weight.shape)}")
    _check(
        hidden.shape[1] == weight.shape[1],
        f"hidden [N, H] = {tuple(hidden.shape)} and weight [V, H] = {tuple(weight.shape)} disagree on H",
    )
    _check(hidden.dtype in _FLOAT_DTYPES, f"hidden dtype must be fp16/bf16/fp32, got {hidden.dtype}")
    _check(weight.dtype == hidden.dtype, f"weight dtype {weight.dtype} != hidden dtype {hidden.dtype}")
    _check(hidden.shape[1] > 0 and weight.shape[0] > 0, "H and V must be positive")
    # token / vocabulary indices (plus one tile of overhang) are int32 inside the kernels
    _check(weight.shape[0] < 2**31 - 2**16, f"V = {weight.shape[0]} must fit in int32")
    _check(hidden.shape[0] < 2**31 - 2**16, f"N = {hidden.shape[0]} must fit in int32")
    _check(
        targets.shape == (hidden.shape[0],),
        f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}",
    )
    _check(
        targets.dtype in (torch.int64, torch.int32), f"targets must be int64 or int32, got {targets.dtype}"
    )
    device = hidden.device
    _check(
        device.type in ("cuda", "meta") or interpreter_enabled(),  # meta: launch planning / AOT compiles only
        f"tensors must be on a CUDA device (got {device}); on CPU, set TRITON_INTERPRET=1 before importing "
        "triton",
    )
    _check_device(weight, device, "weight")
    _check_device(targets, device, "targets")
    if bias is not None:
        _check(
            bias.shape == (weight.shape[0],),
            f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}",
        )
        _check(bias.dtype in _FLOAT_DTYPES, f"bias dtype must be fp16/bf16/fp32, got {bias.dtype}")
        _check_device(bias, device, "bias")
    t = float(temperature)
    _check(math.isfinite(t) and t > 0.0, f"temperature must be finite and > 0, got {temperature}")


def _check_per_token(t: torch.Tensor | None, n: int, device: torch.device, name: str) -> None:
    if t is None:
        return
    _check(t.shape == (n,), f"{name} must be [N] = [{n}], got {tuple(t.shape)}")
    _check(t.dtype.is_floating_point, f"{name} must be floating point, got {t.dtype}")
    _check_device(t, device, name)


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows with unit stride along the last dim (any row stride); copies only when that is not already so."""
    if t.stride(-1) != 1 or t.stride(0) < t.shape[1]:
        t = t.contiguous()
    return t


def _device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else _NullCtx()


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _kernel_flags(hidden: torch.Tensor, tile: TileConfig) -> dict:
    return dict(
        EVEN_K=hidden.shape[1] % tile.block_k == 0,
        UPCAST_OPERANDS=interpreter_enabled() and hidden.dtype == torch.bfloat16,
        DOT_PRECISION=_dot_precision(hidden.dtype),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
    )


@torch.no_grad()
def lm_head_forward(
    hidden: torch.Tensor,  # [N, H] fp16/bf16/fp32
    weight: torch.Tensor,  # [V, H], same dtype
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] int64/int32 in [0, V)
    temperature: float,
    *,
    config: LMHeadTritonConfig | None = None,
    num_sms: int | None = None,
    logits_out: torch.Tensor | None = None,
    tiles_per_split: int | None = None,
    softcap: tuple[float, float] | None = None,
    forward_gemm: str = "kernel_a",
) -> LMHeadStats:
    """Per-token logprob, entropy, lse and E_p[z] (fp32 [N]) of z = (hidden @ weight.T + bias) / temperature.

    Statistics come from the fp32 GEMM accumulators; no [N, V] tensor exists. Extra memory: the fp32
    split partials, 4 * N * (3 * num_splits + 1) bytes (plan_forward; < 1 MiB at N = 16384 on an H100).
    A target outside [0, V) gives a NaN logprob. `config` overrides the dispatcher, `num_sms` the SM count
    used to size the vocabulary splits, `tiles_per_split` fixes the split instead. `logits_out` (fp32 [N, >= V], unit stride along V): the fp32
    logits z are also written there, for a backward that reads them instead of recomputing them (the
    fused one-pass schedule: 3 GEMM units instead of 4, at 4 bytes per logit of workspace).
    `forward_gemm="cublas"` (with `logits_out`, row-major [N, V]): the GEMM by cuBLAS with its fp32 output
    straight into `logits_out`, then the statistics by lm_head_fwd_kernel_stats_from_logits streaming over it
    (one more read of the logits; where a bias or soft-cap changes them, z is written back in place).
    """
    _check_common(hidden, weight, bias, targets, temperature)
    _check(forward_gemm in FORWARD_GEMMS, f"forward_gemm must be one of {FORWARD_GEMMS}, got {forward_gemm!r}")
    device = hidden.device
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    out = torch.empty((4, n_tokens), dtype=torch.float32, device=device)
    stats = LMHeadStats(out[0], out[1], out[2], out[3])
    if n_tokens == 0:
        return stats
    hidden = _unit_stride_rows(hidden)
    weight = _unit_stride_rows(weight)
    targets = targets.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if forward_gemm == "cublas":
        _check(tiles_per_split is None and config is None,
               "forward_gemm='cublas' has no fixed tiles or split (the batch-invariant mode needs kernel A)")  # fmt: skip
        return _forward_cublas(hidden, weight, bias, targets, temperature, logits_out, softcap, stats, num_sms)
    cfg = config or pick_config(device, hidden.dtype, is_aligned(hidden, weight))
    use_tma = False
    if forward_kernel() == "tma":
        blocker = _tma_blocker(device, cfg, [hidden, weight] + ([logits_out] if logits_out is not None else []))
        if blocker is not None:
            _warn_tma_fallback(blocker)
        use_tma = blocker is None
    if use_tma:
        tile = cfg.forward_tma_stored if (logits_out is not None and cfg.forward_tma_stored is not None) \
            else cfg.forward_tma  # fmt: skip
    else:
        tile = cfg.forward_stored if (logits_out is not None and cfg.forward_stored is not None) else cfg.forward
    if num_sms is None:
        num_sms = (
            _num_sms(device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda"
            else DEFAULT_NUM_SMS
        )
    if tiles_per_split is None:
        plan = plan_forward(n_tokens, vocab, tile.block_m, tile.block_n, num_sms, tile.group_m)
    else:  # a fixed split of the vocabulary, whatever N and the SM count (the batch-invariant mode)
        vocab_tiles = triton.cdiv(vocab, tile.block_n)
        tps = max(1, min(int(tiles_per_split), vocab_tiles))
        plan = ForwardPlan(triton.cdiv(n_tokens, tile.block_m), vocab_tiles, tps, triton.cdiv(vocab_tiles, tps))
    if logits_out is not None:
        _check(
            logits_out.dtype == torch.float32 and logits_out.dim() == 2 and logits_out.shape[0] == n_tokens
            and logits_out.shape[1] >= vocab and logits_out.stride(1) == 1,
            f"logits_out must be fp32 [{n_tokens}, >= {vocab}] with unit stride along V, got {logits_out.dtype} "
            f"{tuple(logits_out.shape)} strides {logits_out.stride()}",
        )  # fmt: skip
        _check_device(logits_out, device, "logits_out")
    partials = torch.empty((3, plan.num_splits, n_tokens), dtype=torch.float32, device=device)
    target_logit = torch.full((n_tokens,), float("nan"), dtype=torch.float32, device=device)
    inv_t = 1.0 / float(temperature)
    shared = dict(  # the arguments both kernels A take
        bias_ptr=bias,
        targets_ptr=targets,
        part_max_ptr=partials[0],
        part_sum_ptr=partials[1],
        part_dev_ptr=partials[2],
        target_logit_ptr=target_logit,
        n_tokens=n_tokens,
        vocab=vocab,
        hidden_size=hidden_size,
        tiles_per_split=plan.tiles_per_split,
        num_splits=plan.num_splits,
        inv_temperature=inv_t,
        cap_in=1.0 if softcap is None else float(softcap[0]),
        cap_out=1.0 if softcap is None else float(softcap[1]),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        STORE_LOGITS=logits_out is not None,
        ROW_INDEPENDENT_DOT=cfg.row_independent_dot,
    )
    with _device_ctx(device):
        launch_forward = _launch_forward_tma if use_tma else _launch_forward_cp_async
        launch_forward(hidden, weight, logits_out, plan, tile, shared)
        _launch_merge(partials, target_logit, stats, n_tokens, plan.num_splits)
    return stats


def _forward_cublas(hidden, weight, bias, targets, temperature, logits_out, softcap, stats: LMHeadStats,
                    num_sms: int | None) -> LMHeadStats:
    """lm_head_forward(forward_gemm="cublas"): the GEMM into logits_out by cuBLAS, then the streaming
    statistics kernel and the split merge."""
    device = hidden.device
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    _check(
        logits_out is not None and logits_out.dtype == torch.float32 and logits_out.dim() == 2
        and logits_out.shape == (n_tokens, vocab) and logits_out.stride(1) == 1 and logits_out.stride(0) == vocab,
        f"forward_gemm='cublas' needs logits_out: fp32 [{n_tokens}, {vocab}] row-major (cuBLAS writes it), got "
        + ("None" if logits_out is None else f"{logits_out.dtype} {tuple(logits_out.shape)} strides {logits_out.stride()}"),
    )  # fmt: skip
    _check_device(logits_out, device, "logits_out")
    tile = STREAM_TILES["interpreter" if device.type == "cpu" else "gpu"]  # meta: AOT planning of a GPU launch
    if num_sms is None:
        num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else DEFAULT_NUM_SMS  # fmt: skip
    plan = plan_forward(n_tokens, vocab, tile.block_m, tile.block_n, num_sms, tile.group_m)
    inv_t = 1.0 / float(temperature)
    # without a soft-cap cuBLAS applies 1 / T in its epilogue (alpha); the soft-cap needs the unscaled x
    _forward_gemm_cublas(hidden, weight, logits_out, 1.0 if softcap is not None else inv_t)
    partials = torch.empty((3, plan.num_splits, n_tokens), dtype=torch.float32, device=device)
    target_logit = torch.full((n_tokens,), float("nan"), dtype=torch.float32, device=device)
    with _device_ctx(device):
        _launch(
            lm_head_fwd_kernel_stats_from_logits,
            (plan.num_programs,),
            dict(
                logits_ptr=logits_out, bias_ptr=bias, targets_ptr=targets, part_max_ptr=partials[0],
                part_sum_ptr=partials[1], part_dev_ptr=partials[2], target_logit_ptr=target_logit,
                n_tokens=n_tokens, vocab=vocab, stride_logits=logits_out.stride(0),
                tiles_per_split=plan.tiles_per_split, num_splits=plan.num_splits, inv_temperature=inv_t,
                cap_in=1.0 if softcap is None else float(softcap[0]),
                cap_out=1.0 if softcap is None else float(softcap[1]),
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, GROUP_M=tile.group_m,
            ),
            tile.num_warps,
            tile.num_stages,
        )  # fmt: skip
        _launch_merge(partials, target_logit, stats, n_tokens, plan.num_splits)
    return stats


def _launch_merge(partials, target_logit, stats: LMHeadStats, n_tokens: int, num_splits: int) -> None:
    _launch(
        lm_head_fwd_kernel_merge,
        (triton.cdiv(n_tokens, MERGE_BLOCK_T),),
        dict(
            part_max_ptr=partials[0],
            part_sum_ptr=partials[1],
            part_dev_ptr=partials[2],
            target_logit_ptr=target_logit,
            logprobs_ptr=stats.logprobs,
            entropy_ptr=stats.entropy,
            lse_ptr=stats.lse,
            expected_logit_ptr=stats.expected_logit,
            n_tokens=n_tokens,
            num_splits=num_splits,
            BLOCK_T=MERGE_BLOCK_T,
        ),
        4,
        1,
    )


def _launch_forward_cp_async(hidden, weight, logits_out, plan, tile, shared: dict):
    """Kernel A with pointer loads (cp.async pipeline on sm_80 / sm_90). `shared`: the arguments both
    kernels A take (bias, targets, partials, sizes, split, logit transform)."""
    _launch(
        lm_head_fwd_kernel_partial,
        (plan.num_programs,),
        dict(
            hidden_ptr=hidden,
            weight_ptr=weight,
            logits_ptr=logits_out,
            stride_hidden=hidden.stride(0),
            stride_weight=weight.stride(0),
            stride_logits=logits_out.stride(0) if logits_out is not None else 0,
            **shared,
            **_kernel_flags(hidden, tile),
        ),
        tile.num_warps,
        tile.num_stages,
    )


def _launch_forward_tma(hidden, weight, logits_out, plan, tile, shared: dict):
    """Kernel A with TMA descriptors: the operands' tiles and the stored logits tiles move by TMA."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def descriptor(t, shape, block):  # rows of `t` with unit stride along the last dimension
        return TensorDescriptor(t, list(shape), [t.stride(0), 1], block)

    flags = _kernel_flags(hidden, tile)
    del flags["EVEN_K"]  # the descriptor zero-fills the ragged last K slice
    _launch(
        lm_head_fwd_kernel_partial_tma,
        (plan.num_programs,),
        dict(
            hidden_desc=descriptor(hidden, hidden.shape, [tile.block_m, tile.block_k]),
            weight_desc=descriptor(weight, weight.shape, [tile.block_n, tile.block_k]),
            # [N, V] of the logits buffer: its padding columns are never written
            logits_desc=None if logits_out is None else descriptor(logits_out, (hidden.shape[0], weight.shape[0]),
                                                                   [tile.block_m, tile.block_n]),  # fmt: skip
            **shared,
            **flags,
            WARP_SPECIALIZE=False,  # the compile tier's probe sets it (Triton ignores it here: README §6)
        ),
        tile.num_warps,
        tile.num_stages,
        # the register cap of two CTAs per SM, except for the soft-cap's tanh (spills under it)
        None if shared["HAS_SOFTCAP"] else tile.max_registers,
    )


_MM_OUT_DTYPE_OK: dict[str, bool] = {}
# Fallback GEMMs (no out_dtype): operands are upcast this many vocabulary entries at a time, so the
# extra fp32 memory stays rows x 8192 x 4 bytes.
_UPCAST_SLAB = 8192


def _mm_out_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor | None:
    """a @ b (added into `acc` when given) by cuBLAS with an fp32 output from half-precision operands;
    None where torch has no out_dtype for this device (CPU, torch < 2.8)."""
    key = a.device.type
    if not _MM_OUT_DTYPE_OK.get(key, True):
        return None
    try:
        if acc is None:
            out = torch.mm(a, b, out_dtype=torch.float32)
        else:
            out = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        _MM_OUT_DTYPE_OK[key] = False
        if key == "cuda":
            warnings.warn(
                f"grpo_kernels lm_head: torch.mm(out_dtype=float32) is unavailable ({exc}); the backward "
                "GEMMs upcast their operands instead (several times slower, bounded extra memory)",
                SlowPathWarning,
                stacklevel=3,
            )
        return None
    _MM_OUT_DTYPE_OK[key] = True
    return out


def gemm_path(device_type: str = "cuda") -> str:
    """Which GEMMs the backward has used on this device type: "fp32-out" (half-precision operands,
    fp32 accumulation and output by cuBLAS), "upcast" (the fallback) or "untried" (no backward yet)."""
    ok = _MM_OUT_DTYPE_OK.get(device_type)
    return "untried" if ok is None else ("fp32-out" if ok else "upcast")


# fp16 dz is scaled by a power of two S before it is rounded (README.md, "dz precision"): S |dz| <= 2^14.
DZ_SCALED_MAX = 2.0**14
DZ_SCALE_RANGE = (2.0**-24, 2.0**64)


def dz_scale(lse, expected_logit, grad_logprobs, grad_entropy, factor: float) -> torch.Tensor:
    """[2] fp32 (S, 1 / S) on the device, no host sync: S = 2^k with S max_j |dz_j| <= DZ_SCALED_MAX over the
    call's rows. |dz_j| <= factor (|g_lp| + |g_H| max(H, 1)), H = lse - E_p[z] the row's entropy (README.md:
    p_j |E[z] - z_j| <= H where z_j >= E[z], <= 1/e below), factor 1 / T or cap_in cap_out."""
    bound = torch.zeros_like(lse)
    if grad_logprobs is not None:
        bound += grad_logprobs.abs()
    if grad_entropy is not None:
        bound += grad_entropy.abs() * (lse - expected_logit).clamp(min=1.0)
    largest = bound.max() * factor
    scale = torch.exp2(torch.floor(torch.log2(DZ_SCALED_MAX / largest))).clamp(*DZ_SCALE_RANGE)
    return torch.stack([scale, 1.0 / scale]).float()


def _grad_weight_accumulate(acc: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor,
                            alpha: float = 1.0) -> None:  # fmt: skip
    """acc[V, H] += alpha dlogits[n, V].T @ hidden[n, H]: the GEMM sums in fp32; an fp32 acc is never rounded
    to the inputs' dtype, an acc in the inputs' dtype (the in-place schedules' gradient buffer) is rounded
    once per call (cuBLAS: fp32 epilogue alpha A B + beta C, one rounding to C's dtype). alpha != 1 only
    for that in-place buffer (1 / S of a scaled fp16 slab, a power of two: exact)."""
    if dlogits.dtype == torch.float32 or acc.dtype == dlogits.dtype:
        acc.addmm_(dlogits.T, hidden, alpha=alpha)
        return
    assert alpha == 1.0, "alpha is for an accumulator in the inputs' dtype"
    if _mm_out_fp32(dlogits.T, hidden, acc) is not None:
        return
    hidden32 = hidden.float()
    for v0 in range(0, dlogits.shape[1], _UPCAST_SLAB):
        cols = slice(v0, v0 + _UPCAST_SLAB)
        acc[cols].addmm_(dlogits[:, cols].T.float(), hidden32)


def _grad_hidden_chunk(dlogits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dlogits[n, V] @ weight[V, H] in fp32 ([n, H] fp32): one GEMM over the whole vocabulary."""
    if dlogits.dtype == torch.float32:
        return dlogits @ weight
    out = _mm_out_fp32(dlogits, weight)
    if out is not None:
        return out
    out = torch.zeros((dlogits.shape[0], weight.shape[1]), dtype=torch.float32, device=dlogits.device)
    for v0 in range(0, dlogits.shape[1], _UPCAST_SLAB):
        cols = slice(v0, v0 + _UPCAST_SLAB)
        out.addmm_(dlogits[:, cols].float(), weight[cols].float())
    return out


def _grad_hidden_accumulate(acc: torch.Tensor, dlogits: torch.Tensor, weight: torch.Tensor) -> None:
    """acc[n, H] (fp32) += dlogits[n, V] @ weight[V, H], by cuBLAS into acc when it can (no temporary)."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits, weight)
    elif _mm_out_fp32(dlogits, weight, acc) is None:
        acc += _grad_hidden_chunk(dlogits, weight)


@torch.no_grad()
def lm_head_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N]
    temperature: float,
    lse: torch.Tensor,  # [N] fp32, from the forward
    expected_logit: torch.Tensor,  # [N] fp32, from the forward
    grad_logprobs: torch.Tensor | None,  # [N], dL/dlogprob
    grad_entropy: torch.Tensor | None,  # [N], dL/dentropy
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
    grad_weight_acc: torch.Tensor | None = None,  # [V, H] fp32 or weight's dtype, accumulated into when given
    grad_bias_acc: torch.Tensor | None = None,  # [V] fp32, accumulated into when given
    *,
    config: LMHeadTritonConfig | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    stored_logits: torch.Tensor | None = None,
    grad_hidden_acc: torch.Tensor | None = None,
    softcap: tuple[float, float] | None = None,
    dz_in_gemm: bool = False,
):
    """dL/dlogit_j = [g_lp (1[j=y] - p_j) + g_H p_j (E_p[z] - z_j)] / T, streamed through tile by tile:

      grad_hidden = dlogit @ W,  grad_weight_acc += dlogit.T @ hidden,  grad_bias_acc += sum_rows dlogit

    Tokens are processed in chunks whose [chunk, V] dL/dlogit slab (input dtype) fits `workspace_bytes`
    (plan_backward); each slab is written by lm_head_bwd_kernel_dlogits from the recomputed fp32 logits
    and contracted by cuBLAS with fp32 accumulation. Returns (grad_hidden in hidden's dtype or None,
    grad_weight_acc fp32 or None, grad_bias_acc fp32 or None), the conventions of chunked.py; with
    `grad_hidden_acc` (fp32 [N, H]) the fp32 grad_hidden is added into it and returned in its place.
    dz_in_gemm (with `stored_logits`, opt-in): no dL/dlogit slab; two Triton GEMMs form dz from the stored
    logits in their operand loads (lm_head_bwd_kernel_grad_hidden_dz / _grad_weight_dz).
    """
    _check_common(hidden, weight, bias, targets, temperature)
    device = hidden.device
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    for name, t in (("lse", lse), ("expected_logit", expected_logit)):
        _check_per_token(t, n_tokens, device, name)
        _check(t.dtype == torch.float32, f"{name} must be fp32, got {t.dtype}")
    _check_per_token(grad_logprobs, n_tokens, device, "grad_logprobs")
    _check_per_token(grad_entropy, n_tokens, device, "grad_entropy")
    need_grad_bias = need_grad_bias and bias is not None
    if need_grad_weight and grad_weight_acc is not None:
        # fp32, or the weight's dtype: the gradient buffer itself, summed into once per call (in place)
        _check(
            grad_weight_acc.shape == weight.shape and grad_weight_acc.dtype in (torch.float32, weight.dtype),
            f"grad_weight_acc must be fp32 or {weight.dtype} {tuple(weight.shape)}, got {grad_weight_acc.dtype} "
            f"{tuple(grad_weight_acc.shape)}",
        )
        _check_device(grad_weight_acc, device, "grad_weight_acc")
        _check(not (dz_in_gemm and grad_weight_acc.dtype != torch.float32),
               "dz_in_gemm accumulates grad_weight in fp32: grad_weight_acc must be fp32")  # fmt: skip
    if need_grad_bias and grad_bias_acc is not None:
        _check(
            grad_bias_acc.shape == (vocab,) and grad_bias_acc.dtype == torch.float32,
            f"grad_bias_acc must be fp32 [{vocab}], got {grad_bias_acc.dtype} {tuple(grad_bias_acc.shape)}",
        )
        _check_device(grad_bias_acc, device, "grad_bias_acc")
    _check(workspace_bytes > 0, f"workspace_bytes must be positive, got {workspace_bytes}")
    if stored_logits is not None:  # written by lm_head_forward(logits_out=...) for these rows
        _check(
            stored_logits.dtype == torch.float32 and stored_logits.dim() == 2
            and stored_logits.shape[0] == n_tokens and stored_logits.shape[1] >= vocab
            and stored_logits.stride(1) == 1,
            f"stored_logits must be fp32 [{n_tokens}, >= {vocab}] with unit stride along V, got "
            f"{stored_logits.dtype} {tuple(stored_logits.shape)}",
        )  # fmt: skip
        _check_device(stored_logits, device, "stored_logits")

    if grad_hidden_acc is not None and need_grad_hidden:
        _check(
            grad_hidden_acc.shape == hidden.shape and grad_hidden_acc.dtype == torch.float32,
            f"grad_hidden_acc must be fp32 {tuple(hidden.shape)}, got {grad_hidden_acc.dtype} "
            f"{tuple(grad_hidden_acc.shape)}",
        )
        _check_device(grad_hidden_acc, device, "grad_hidden_acc")
        grad_hidden = grad_hidden_acc
    else:
        grad_hidden_acc = None
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need_grad_hidden else None
    if need_grad_weight and grad_weight_acc is None:
        grad_weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    if need_grad_bias and grad_bias_acc is None:
        grad_bias_acc = torch.zeros(vocab, dtype=torch.float32, device=device)
    result = (grad_hidden, grad_weight_acc if need_grad_weight else None, grad_bias_acc)
    no_upstream = grad_logprobs is None and grad_entropy is None
    if no_upstream or n_tokens == 0 or not (need_grad_hidden or need_grad_weight or need_grad_bias):
        if grad_hidden is not None and grad_hidden_acc is None:
            grad_hidden.zero_()
        return result

    hidden = _unit_stride_rows(hidden)
    weight = _unit_stride_rows(weight)
    targets = targets.contiguous()
    bias = bias.contiguous() if bias is not None else None
    lse = lse.contiguous()
    expected_logit = expected_logit.contiguous()
    grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
    grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
    cfg = config or pick_config(device, hidden.dtype, is_aligned(hidden, weight))
    tile = cfg.backward
    store_dlogits = (need_grad_hidden or need_grad_weight) and not dz_in_gemm  # dz_in_gemm: no slab
    plan = plan_backward(
        n_tokens,
        vocab,
        hidden_size,
        hidden.element_size(),
        tile.block_m,
        workspace_bytes,
        store_dlogits=store_dlogits,
        need_bias_grad=need_grad_bias,
        need_hidden_grad=need_grad_hidden,
    )
    rows = plan.rows_per_chunk
    workspace = (
        torch.empty((rows, plan.workspace_row_stride), dtype=hidden.dtype, device=device)
        if store_dlogits
        else None
    )
    bias_part = (
        torch.empty((triton.cdiv(rows, tile.block_m), vocab), dtype=torch.float32, device=device)
        if need_grad_bias
        else None
    )
    inv_t = 1.0 / float(temperature)
    flags = _kernel_flags(hidden, tile)
    # fp16 dz: scaled by a power of two before its rounding so entries below fp16's range are kept (bf16 and
    # fp32 have float32's exponent range: nothing to keep)
    scale_dz = hidden.dtype == torch.float16 and (need_grad_hidden or need_grad_weight)
    scales = None
    if scale_dz:
        factor = inv_t if softcap is None else float(softcap[0]) * float(softcap[1])
        scales = dz_scale(lse, expected_logit, grad_logprobs, grad_entropy, factor)
    if dz_in_gemm:
        _check(stored_logits is not None, "dz_in_gemm needs the forward's stored logits (stored_logits=)")
        per_row = dict(
            targets_ptr=targets, lse_ptr=lse, expected_logit_ptr=expected_logit, grad_logprobs_ptr=grad_logprobs,
            grad_entropy_ptr=grad_entropy, n_rows=n_tokens, vocab=vocab, hidden_size=hidden_size,
            stride_stored=stored_logits.stride(0), inv_temperature=inv_t if softcap is None else 1.0,
            cap_in=1.0 if softcap is None else float(softcap[0]), cap_out=1.0 if softcap is None else float(softcap[1]),
            HAS_SOFTCAP=softcap is not None, HAS_GRAD_LOGPROBS=grad_logprobs is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None, dz_scale_ptr=scales, SCALE_DZ=scale_dz,
            UPCAST_OPERANDS=flags["UPCAST_OPERANDS"],
            DOT_PRECISION=flags["DOT_PRECISION"], BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        )  # fmt: skip
        with _device_ctx(device):
            if need_grad_hidden:
                out = grad_hidden_acc if grad_hidden_acc is not None else torch.empty(
                    hidden.shape, dtype=torch.float32, device=device)  # fmt: skip
                grid = (triton.cdiv(n_tokens, tile.block_m) * triton.cdiv(hidden_size, tile.block_n),)
                _launch(lm_head_bwd_kernel_grad_hidden_dz, grid,
                        dict(stored_ptr=stored_logits, weight_ptr=weight, out_ptr=out, stride_weight=weight.stride(0),
                             stride_out=out.stride(0), ACCUMULATE=grad_hidden_acc is not None, **per_row),
                        tile.num_warps, tile.num_stages)  # fmt: skip
                if grad_hidden_acc is None:
                    grad_hidden.copy_(out)
            if need_grad_weight:
                grid = (triton.cdiv(vocab, tile.block_m) * triton.cdiv(hidden_size, tile.block_n),)
                _launch(lm_head_bwd_kernel_grad_weight_dz, grid,
                        dict(stored_ptr=stored_logits, hidden_ptr=hidden, acc_ptr=grad_weight_acc,
                             stride_hidden=hidden.stride(0), stride_acc=grad_weight_acc.stride(0), **per_row),
                        tile.num_warps, tile.num_stages)  # fmt: skip
        if not need_grad_bias:  # else the loop below adds the bias sums (its kernel stores no slab here)
            return result
    slab_scaled = scale_dz and store_dlogits
    # an fp32 accumulator is taken to the slab's units for this call's GEMMs and back (exact: 2^k); the
    # in-place schedules' fp16 gradient buffer cannot be (S times its sums may overflow fp16): its GEMM
    # takes alpha = 1 / S instead, read once per call (fp16 in place is opt-in: auto never picks it)
    acc_rescaled = slab_scaled and need_grad_weight and grad_weight_acc.dtype == torch.float32
    weight_alpha = float(scales[1]) if slab_scaled and need_grad_weight and not acc_rescaled else 1.0
    if acc_rescaled:
        grad_weight_acc.mul_(scales[0])
    with _device_ctx(device):
        for r0 in range(0, n_tokens, rows):
            n = min(rows, n_tokens - r0)
            chunk = slice(r0, r0 + n)
            grid = (triton.cdiv(n, tile.block_m) * triton.cdiv(vocab, tile.block_n),)
            _launch(
                lm_head_bwd_kernel_dlogits,
                grid,
                dict(
                    hidden_ptr=hidden[chunk],
                    weight_ptr=weight,
                    bias_ptr=bias,
                    targets_ptr=targets[chunk],
                    lse_ptr=lse[chunk],
                    expected_logit_ptr=expected_logit[chunk],
                    grad_logprobs_ptr=grad_logprobs[chunk] if grad_logprobs is not None else None,
                    grad_entropy_ptr=grad_entropy[chunk] if grad_entropy is not None else None,
                    dlogits_ptr=workspace,
                    bias_grad_part_ptr=bias_part,
                    stored_ptr=stored_logits[chunk] if stored_logits is not None else None,
                    dz_scale_ptr=scales,
                    n_rows=n,
                    vocab=vocab,
                    hidden_size=hidden_size,
                    stride_hidden=hidden.stride(0),
                    stride_weight=weight.stride(0),
                    stride_dlogits=plan.workspace_row_stride if store_dlogits else 0,
                    stride_stored=stored_logits.stride(0) if stored_logits is not None else 0,
                    inv_temperature=inv_t if softcap is None else 1.0,  # soft-capped: the factor is per element
                    cap_in=1.0 if softcap is None else float(softcap[0]),
                    cap_out=1.0 if softcap is None else float(softcap[1]),
                    HAS_BIAS=bias is not None,
                    HAS_SOFTCAP=softcap is not None,
                    FROM_STORED=stored_logits is not None,
                    HAS_GRAD_LOGPROBS=grad_logprobs is not None,
                    HAS_GRAD_ENTROPY=grad_entropy is not None,
                    STORE_DLOGITS=store_dlogits,
                    STORE_BIAS_GRAD=need_grad_bias,
                    SCALE_DZ=scale_dz and store_dlogits,
                    **flags,
                ),
                tile.num_warps,
                tile.num_stages,
            )
            if store_dlogits:
                dlogits = workspace[:n, :vocab]  # [n, V]
                if need_grad_hidden:
                    # [n, V] @ [V, H] -> [n, H]: fp32 over the whole vocabulary, rounded once
                    if slab_scaled:  # back from the slab's units (fp32, exact)
                        chunk_grad = _grad_hidden_chunk(dlogits, weight).mul_(scales[1])
                        if grad_hidden_acc is not None:
                            grad_hidden_acc[chunk] += chunk_grad
                        else:
                            grad_hidden[chunk] = chunk_grad
                    elif grad_hidden_acc is not None:  # fp32, summed over the caller's vocabulary slabs
                        _grad_hidden_accumulate(grad_hidden_acc[chunk], dlogits, weight)
                    else:
                        grad_hidden[chunk] = _grad_hidden_chunk(dlogits, weight)
                if need_grad_weight:
                    # [V, n] @ [n, H] added into the fp32 [V, H] accumulator
                    _grad_weight_accumulate(grad_weight_acc, dlogits, hidden[chunk], alpha=weight_alpha)
            if need_grad_bias:
                grad_bias_acc += bias_part[: triton.cdiv(n, tile.block_m)].sum(0)
    if acc_rescaled:
        grad_weight_acc.mul_(scales[1])
    return result


# ---------------------------------------------------------------------------------------------------
# fused_linear_logprobs' entry points (ops/lm_head/function.py): the logits GEMM by logits_gemm()
# ---------------------------------------------------------------------------------------------------


def _cublas_logits(hidden: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether fused_linear_logprobs takes the cuBLAS logits path: logits_gemm() is "cublas", no bias (the
    stored-logits backward would need z with the bias written back) and bf16 / fp32 operands (fp16's dz scale
    is per call: per chunk it would rescale the fp32 accumulator twice). Forward and backward decide alike."""
    return logits_gemm() == "cublas" and bias is None and hidden.dtype != torch.float16


def logprobs_forward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N]
    temperature: float,
) -> LMHeadStats:
    """lm_head_forward for fused_linear_logprobs. logits_gemm() "triton": kernel A over all N tokens (no
    logits kept). "cublas": per chunk of logits_chunk_rows tokens, cuBLAS writes the chunk's fp32 logits into
    one reused [chunk, V] buffer and the streaming statistics kernel reads them once: one GEMM unit by cuBLAS
    plus 8 bytes per logit (written, read), at 4 V bytes per chunk row of extra memory.
    Only where the backward takes the cuBLAS path too (_cublas_logits): the backward's p = exp(z - lse) then
    sees the logits of the same GEMM the forward's lse came from (a kernel-A recompute differs from them by a
    few ulp of summation order, which the float64 tests see as a 4x larger grad_weight error)."""
    if not _cublas_logits(hidden, bias):
        return lm_head_forward(hidden, weight, bias, targets, temperature)
    _check_common(hidden, weight, bias, targets, temperature)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    out = torch.empty((4, n_tokens), dtype=torch.float32, device=hidden.device)
    if n_tokens > 0:
        rows = logits_chunk_rows(n_tokens, vocab, hidden.shape[1], hidden.element_size())
        logits = torch.empty((rows, vocab), dtype=torch.float32, device=hidden.device)
        for r0 in range(0, n_tokens, rows):
            r1 = min(n_tokens, r0 + rows)
            part = lm_head_forward(hidden[r0:r1], weight, bias, targets[r0:r1], temperature,
                                   logits_out=logits[: r1 - r0], forward_gemm="cublas")  # fmt: skip
            for i, value in enumerate(part):  # the LMHeadStats fields, in out's row order
                out[i, r0:r1] = value
    return LMHeadStats(out[0], out[1], out[2], out[3])


def logprobs_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N]
    temperature: float,
    lse: torch.Tensor,  # [N] fp32
    expected_logit: torch.Tensor,  # [N] fp32
    grad_logprobs: torch.Tensor | None,  # [N]
    grad_entropy: torch.Tensor | None,  # [N]
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
):
    """lm_head_backward for fused_linear_logprobs (same returns). logits_gemm() "cublas" (no bias, bf16 or
    fp32 operands): per chunk, cuBLAS recomputes the chunk's fp32 logits into a reused buffer and
    lm_head_backward streams dz from them (its stored-logits mode) into the dz slab for the two cuBLAS
    GEMMs: three GEMM units by cuBLAS instead of one by the recomputing Triton kernel plus two. The chunk's
    logits, dz slab and fp32 grad_hidden rows share DEFAULT_WORKSPACE_BYTES, the Triton path's budget.
    Everything else (_cublas_logits) takes the Triton path, forward and backward alike."""
    args = (hidden, weight, bias, targets, temperature, lse, expected_logit, grad_logprobs, grad_entropy)
    flags = dict(need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, need_grad_bias=need_grad_bias)
    n_tokens, hidden_size = hidden.shape
    if (not _cublas_logits(hidden, bias) or n_tokens == 0 or (grad_logprobs is None and grad_entropy is None)
            or not (need_grad_hidden or need_grad_weight)):
        return lm_head_backward(*args, **flags)  # fmt: skip
    _check_common(hidden, weight, bias, targets, temperature)
    vocab = weight.shape[0]
    rows = logits_chunk_rows(n_tokens, vocab, hidden_size, hidden.element_size())
    logits = torch.empty((rows, vocab), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_grad_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if need_grad_weight else None
    inv_t = 1.0 / float(temperature)
    weight_rows = _unit_stride_rows(weight)
    for r0 in range(0, n_tokens, rows):
        r1 = min(n_tokens, r0 + rows)
        chunk = slice(r0, r1)
        z = logits[: r1 - r0]
        _forward_gemm_cublas(_unit_stride_rows(hidden[chunk]), weight_rows, z, inv_t)  # z = x / T, fp32
        gh, _, _ = lm_head_backward(
            hidden[chunk], weight, None, targets[chunk], temperature, lse[chunk], expected_logit[chunk],
            None if grad_logprobs is None else grad_logprobs[chunk],
            None if grad_entropy is None else grad_entropy[chunk],
            need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, need_grad_bias=False,
            grad_weight_acc=grad_weight, workspace_bytes=max(1, DEFAULT_WORKSPACE_BYTES - 4 * rows * vocab),
            stored_logits=z,
        )  # fmt: skip
        if need_grad_hidden:
            grad_hidden[chunk] = gh
    return grad_hidden, grad_weight, None
