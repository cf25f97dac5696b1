"""Host side of the LM-head Triton kernels: kernel A of docs/design.md §1 (the statistics) and kernel C (its backward).

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

This module holds the host side (tile configurations, planning, input checks, launchers); the kernels live in
triton_forward.py (kernel A, its TMA and cuBLAS-logits variants, the merge) and triton_backward.py (kernel C),
their shared device constants and @triton.jit helpers in triton_common.py. The kernels are re-exported here.
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

from ..._backend import SlowPathWarning, interpreter_enabled
from . import half_logits_format
from .half_logits_format import STORED_GROUP  # noqa: F401  (re-exported: the offsets' column group)
from .reference import LMHeadStats
from .transform import gradient_factor

# the kernels, re-exported: callers (the compile matrix, tests, benchmarks) name them as triton.<kernel>
from .triton_backward import (  # noqa: F401
    lm_head_bwd_kernel_dlogits,
    lm_head_bwd_kernel_grad_hidden_dz,
    lm_head_bwd_kernel_grad_weight_dz,
)
from .triton_forward import (  # noqa: F401
    lm_head_fwd_kernel_merge,
    lm_head_fwd_kernel_partial,
    lm_head_fwd_kernel_partial_tma,
    lm_head_fwd_kernel_stats_from_logits,
)


@dataclass(frozen=True)
class HalfLogits:
    """Kernel A's stored logits in 2 bytes per logit instead of 4 (README.md §5, "Stored logits in fp16"):
    `difference` fp16 [N, >= V] (unit stride along V) holds d = z - m, `offset` fp32 [N, >= cdiv(V,
    STORED_GROUP)] the m of each group of STORED_GROUP columns (the row's running max after the tile that
    holds the group). lm_head_forward(logits_out=) writes it (kernel A only: cuBLAS writes fp32),
    lm_head_backward(stored_logits=) reads z = m + d. Sliced by rows like a tensor."""

    difference: torch.Tensor
    offset: torch.Tensor

    @staticmethod
    def nbytes(rows: int, vocab: int) -> int:
        """Bytes of a buffer for `rows` tokens (half_logits_format.row_bytes: padded rows + offsets)."""
        return rows * half_logits_format.row_bytes(vocab)

    @staticmethod
    def empty(rows: int, vocab: int, device) -> HalfLogits:
        difference = torch.empty((rows, half_logits_format.row_stride(vocab)), dtype=torch.float16, device=device)
        offset = torch.empty((rows, half_logits_format.num_groups(vocab)), dtype=torch.float32, device=device)
        return HalfLogits(difference[:, :vocab], offset)

    def __getitem__(self, rows: slice) -> HalfLogits:
        return HalfLogits(self.difference[rows], self.offset[rows])

    def reconstruct(self) -> torch.Tensor:
        """z = m + d as the backward kernels form it, fp32 [N, V] (for checks: the kernels never build it)."""
        vocab = self.difference.shape[1]
        m = self.offset.repeat_interleave(STORED_GROUP, dim=1)[:, :vocab]
        return m + self.difference.float()


def _check_half_logits(logits: HalfLogits, n_tokens: int, vocab: int, device, name: str) -> None:
    d, m = logits.difference, logits.offset
    groups = half_logits_format.num_groups(vocab)
    _check(
        d.dtype == torch.float16 and d.dim() == 2 and d.shape[0] == n_tokens and d.shape[1] >= vocab
        and d.stride(1) == 1 and m.dtype == torch.float32 and m.dim() == 2 and m.shape[0] == n_tokens
        and m.shape[1] >= groups and m.stride(1) == 1,
        f"{name} (HalfLogits) must hold fp16 [{n_tokens}, >= {vocab}] differences and fp32 [{n_tokens}, >= {groups}] "
        f"offsets with unit stride along V, got {d.dtype} {tuple(d.shape)} and {m.dtype} {tuple(m.shape)}",
    )  # fmt: skip
    _check_device(d, device, f"{name}.difference")
    _check_device(m, device, f"{name}.offset")


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
    fused one-pass schedule: 3 GEMM units instead of 4, at 4 bytes per logit of workspace); a HalfLogits
    instead: kernel A writes them as fp16 differences from the running row max (2 bytes per logit).
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
    half = isinstance(logits_out, HalfLogits)
    if forward_gemm == "cublas":
        _check(not half, "forward_gemm='cublas' writes fp32 logits (cuBLAS's GEMM output); HalfLogits is kernel A's")
        _check(tiles_per_split is None and config is None,
               "forward_gemm='cublas' has no fixed tiles or split (the batch-invariant mode needs kernel A)")  # fmt: skip
        return _forward_cublas(hidden, weight, bias, targets, temperature, logits_out, softcap, stats, num_sms)
    cfg = config or pick_config(device, hidden.dtype, is_aligned(hidden, weight))
    use_tma = False
    if forward_kernel() == "tma":
        stored = logits_out.difference if half else logits_out
        blocker = _tma_blocker(device, cfg, [hidden, weight] + ([stored] if stored is not None else []))
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
    if half:
        _check_half_logits(logits_out, n_tokens, vocab, device, "logits_out")
        _check(tile.block_n % STORED_GROUP == 0,
               f"HalfLogits needs kernel A's vocabulary tile to be a multiple of {STORED_GROUP} columns, the "
               f"{cfg.name} configuration's is {tile.block_n}")  # fmt: skip
    elif logits_out is not None:
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
        HALF_LOGITS=half,
        offset_ptr=logits_out.offset if half else None,
        stride_offset=logits_out.offset.stride(0) if half else 0,
        num_groups=half_logits_format.num_groups(vocab),
        ROW_INDEPENDENT_DOT=cfg.row_independent_dot,
    )
    with _device_ctx(device):
        launch_forward = _launch_forward_tma if use_tma else _launch_forward_cp_async
        launch_forward(hidden, weight, logits_out.difference if half else logits_out, plan, tile, shared)
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


def uninitialized(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty, for a buffer whose first writer ignores its content (a grad_weight accumulator the first
    GEMM overwrites). Tests substitute NaN-filled buffers to show that nothing reads one before writing it."""
    return torch.empty(shape, dtype=dtype, device=device)


# Whether torch.mm(out_dtype=float32, out=...) has written into a given buffer on this device type (the overwrite
# of an fp32 grad_weight accumulator by half-precision operands); where it fails, the buffer is zeroed and added
# into instead, and the fp32-out GEMMs stay in use.
_MM_INTO_FP32_OK: dict[str, bool] = {}


def _grad_weight_accumulate(acc: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor,
                            alpha: float = 1.0, overwrite: bool = False) -> None:  # fmt: skip
    """acc[V, H] += alpha dlogits[n, V].T @ hidden[n, H]: the GEMM sums in fp32; an fp32 acc is never rounded
    to the inputs' dtype, an acc in the inputs' dtype (the in-place schedules' gradient buffer) is rounded
    once per call (cuBLAS: fp32 epilogue alpha A B + beta C, one rounding to C's dtype). alpha != 1 only
    for that in-place buffer (1 / S of a scaled fp16 slab, a power of two: exact). overwrite: acc = the
    product, acc's content ignored (beta = 0: cuBLAS neither reads it nor carries a NaN from it), so the
    caller's buffer needs no zero-fill."""
    beta = 0.0 if overwrite else 1.0
    if dlogits.dtype == torch.float32 or acc.dtype == dlogits.dtype:
        acc.addmm_(dlogits.T, hidden, beta=beta, alpha=alpha)
        return
    assert alpha == 1.0, "alpha is for an accumulator in the inputs' dtype"
    if overwrite:
        key = acc.device.type
        if _MM_INTO_FP32_OK.get(key, True) and _MM_OUT_DTYPE_OK.get(key, True):
            try:
                torch.mm(dlogits.T, hidden, out_dtype=torch.float32, out=acc)
                _MM_INTO_FP32_OK[key] = True
                return
            except (RuntimeError, TypeError, NotImplementedError):
                _MM_INTO_FP32_OK[key] = False
        acc.zero_()
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
    dz_gemms=None,
    accumulate_grad_weight: bool = True,
):
    """dL/dlogit_j = [g_lp (1[j=y] - p_j) + g_H p_j (E_p[z] - z_j)] / T, streamed through tile by tile:

      grad_hidden = dlogit @ W,  grad_weight_acc += dlogit.T @ hidden,  grad_bias_acc += sum_rows dlogit

    Tokens are processed in chunks whose [chunk, V] dL/dlogit slab (input dtype) fits `workspace_bytes`
    (plan_backward); each slab is written by lm_head_bwd_kernel_dlogits from the recomputed fp32 logits
    and contracted by cuBLAS with fp32 accumulation. Returns (grad_hidden in hidden's dtype or None,
    grad_weight_acc fp32 or None, grad_bias_acc fp32 or None), the conventions of chunked.py; with
    `grad_hidden_acc` (fp32 [N, H]) the fp32 grad_hidden is added into it and returned in its place.
    dz_in_gemm (with `stored_logits`, opt-in): no dL/dlogit slab; two Triton GEMMs form dz from the stored
    logits in their operand loads (lm_head_bwd_kernel_grad_hidden_dz / _grad_weight_dz; a grad_weight_acc in
    the weight's dtype gets each call's fp32 sum rounded into it once); `dz_gemms` (set by
    cutlass.lm_head_backward with the switch on) is offered those two GEMMs first, with cutlass.DZ_GEMMS_ARGS,
    and returns whether it ran them.
    accumulate_grad_weight=False: grad_weight_acc's content is ignored and overwritten (it may be uninitialised
    memory: the one-pass schedules' first chunk), so no zero-fill writes it and no GEMM reads it first; without
    a grad_weight_acc the call allocates one that way.
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
    if need_grad_bias and grad_bias_acc is not None:
        _check(
            grad_bias_acc.shape == (vocab,) and grad_bias_acc.dtype == torch.float32,
            f"grad_bias_acc must be fp32 [{vocab}], got {grad_bias_acc.dtype} {tuple(grad_bias_acc.shape)}",
        )
        _check_device(grad_bias_acc, device, "grad_bias_acc")
    _check(workspace_bytes > 0, f"workspace_bytes must be positive, got {workspace_bytes}")
    half = isinstance(stored_logits, HalfLogits)
    if half:  # written by lm_head_forward(logits_out=HalfLogits) for these rows
        _check_half_logits(stored_logits, n_tokens, vocab, device, "stored_logits")
    elif stored_logits is not None:  # written by lm_head_forward(logits_out=...) for these rows
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
    if need_grad_weight and grad_weight_acc is None:  # written by the call's first GEMM, not zero-filled
        grad_weight_acc = uninitialized(weight.shape, torch.float32, device)
        accumulate_grad_weight = False
    if need_grad_bias and grad_bias_acc is None:
        grad_bias_acc = torch.zeros(vocab, dtype=torch.float32, device=device)
    result = (grad_hidden, grad_weight_acc if need_grad_weight else None, grad_bias_acc)
    no_upstream = grad_logprobs is None and grad_entropy is None
    if no_upstream or n_tokens == 0 or not (need_grad_hidden or need_grad_weight or need_grad_bias):
        if grad_hidden is not None and grad_hidden_acc is None:
            grad_hidden.zero_()
        if need_grad_weight and not accumulate_grad_weight:  # no GEMM runs to write it
            grad_weight_acc.zero_()
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
        scales = dz_scale(lse, expected_logit, grad_logprobs, grad_entropy, gradient_factor(inv_t, softcap))
    # the stored logits as the kernels take them: fp32 z, or fp16 differences and their fp32 offsets
    stored_z, offsets = (stored_logits.difference, stored_logits.offset) if half else (stored_logits, None)
    if dz_in_gemm:
        _check(stored_logits is not None, "dz_in_gemm needs the forward's stored logits (stored_logits=)")
        per_row = dict(
            targets_ptr=targets, lse_ptr=lse, expected_logit_ptr=expected_logit, grad_logprobs_ptr=grad_logprobs,
            grad_entropy_ptr=grad_entropy, n_rows=n_tokens, vocab=vocab, hidden_size=hidden_size,
            stride_stored=stored_z.stride(0), offset_ptr=offsets, stride_offset=offsets.stride(0) if half else 0,
            HALF_LOGITS=half, inv_temperature=inv_t if softcap is None else 1.0,
            cap_in=1.0 if softcap is None else float(softcap[0]), cap_out=1.0 if softcap is None else float(softcap[1]),
            HAS_SOFTCAP=softcap is not None, HAS_GRAD_LOGPROBS=grad_logprobs is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None, dz_scale_ptr=scales, SCALE_DZ=scale_dz,
            UPCAST_OPERANDS=flags["UPCAST_OPERANDS"],
            DOT_PRECISION=flags["DOT_PRECISION"], BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        )  # fmt: skip
        with _device_ctx(device):
            out = None  # fp32 grad_hidden: the caller's accumulator, or a buffer cast into grad_hidden below
            if need_grad_hidden:
                out = grad_hidden_acc if grad_hidden_acc is not None else torch.empty(
                    hidden.shape, dtype=torch.float32, device=device)  # fmt: skip
            # csrc's kernels (cutlass.py) where they take the call (the hook says whether it ran): the same
            # operands, the same sums; else the two Triton kernels
            ran = dz_gemms is not None and dz_gemms(
                stored_logits=stored_logits, hidden=hidden, weight=weight, targets=targets, lse=lse,
                expected_logit=expected_logit, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy,
                inv_temperature=per_row["inv_temperature"], softcap=softcap, dz_scale=scales, grad_hidden_out=out,
                accumulate_hidden=grad_hidden_acc is not None, grad_weight_acc=grad_weight_acc if need_grad_weight else None,
                accumulate_weight=accumulate_grad_weight,
            )  # fmt: skip
            if need_grad_hidden and not ran:
                grid = (triton.cdiv(n_tokens, tile.block_m) * triton.cdiv(hidden_size, tile.block_n),)
                _launch(lm_head_bwd_kernel_grad_hidden_dz, grid,
                        dict(stored_ptr=stored_z, weight_ptr=weight, out_ptr=out, stride_weight=weight.stride(0),
                             stride_out=out.stride(0), ACCUMULATE=grad_hidden_acc is not None, **per_row),
                        tile.num_warps, tile.num_stages)  # fmt: skip
            if need_grad_hidden and grad_hidden_acc is None:
                grad_hidden.copy_(out)
            if need_grad_weight and not ran:
                grid = (triton.cdiv(vocab, tile.block_m) * triton.cdiv(hidden_size, tile.block_n),)
                _launch(lm_head_bwd_kernel_grad_weight_dz, grid,
                        dict(stored_ptr=stored_z, hidden_ptr=hidden, acc_ptr=grad_weight_acc,
                             stride_hidden=hidden.stride(0), stride_acc=grad_weight_acc.stride(0),
                             accumulate=int(accumulate_grad_weight), **per_row),
                        tile.num_warps, tile.num_stages)  # fmt: skip
        if not need_grad_bias:  # else the loop below adds the bias sums (its kernel stores no slab here)
            return result
    slab_scaled = scale_dz and store_dlogits
    # an fp32 accumulator is taken to the slab's units for this call's GEMMs and back (exact: 2^k); the
    # in-place schedules' fp16 gradient buffer cannot be (S times its sums may overflow fp16): its GEMM
    # takes alpha = 1 / S instead, read once per call (fp16 in place is opt-in: auto never picks it)
    acc_rescaled = slab_scaled and need_grad_weight and grad_weight_acc.dtype == torch.float32
    weight_alpha = float(scales[1]) if slab_scaled and need_grad_weight and not acc_rescaled else 1.0
    if acc_rescaled and accumulate_grad_weight:  # (an accumulator the first GEMM overwrites has nothing to scale)
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
                    stored_ptr=stored_z[chunk] if stored_z is not None else None,
                    offset_ptr=offsets[chunk] if half else None,
                    dz_scale_ptr=scales,
                    n_rows=n,
                    vocab=vocab,
                    hidden_size=hidden_size,
                    stride_hidden=hidden.stride(0),
                    stride_weight=weight.stride(0),
                    stride_dlogits=plan.workspace_row_stride if store_dlogits else 0,
                    stride_stored=stored_z.stride(0) if stored_z is not None else 0,
                    stride_offset=offsets.stride(0) if half else 0,
                    inv_temperature=inv_t if softcap is None else 1.0,  # soft-capped: the factor is per element
                    cap_in=1.0 if softcap is None else float(softcap[0]),
                    cap_out=1.0 if softcap is None else float(softcap[1]),
                    HAS_BIAS=bias is not None,
                    HAS_SOFTCAP=softcap is not None,
                    FROM_STORED=stored_logits is not None,
                    HALF_LOGITS=half,
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
                    _grad_weight_accumulate(grad_weight_acc, dlogits, hidden[chunk], alpha=weight_alpha,
                                            overwrite=r0 == 0 and not accumulate_grad_weight)  # fmt: skip
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
    # written by the first chunk's grad_weight GEMM (accumulate_grad_weight=False), added into by the others:
    # no zero-fill of the [V, H] accumulator and no read of one
    grad_weight = uninitialized(weight.shape, torch.float32, hidden.device) if need_grad_weight else None
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
            stored_logits=z, accumulate_grad_weight=r0 > 0,
        )  # fmt: skip
        if need_grad_hidden:
            grad_hidden[chunk] = gh
    return grad_hidden, grad_weight, None
