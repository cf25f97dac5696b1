"""The loss's upstream gradient applied to gradients the forward computed, without a host read (Triton).

fused_linear_grpo_loss computes its LM-head gradients inside the forward; its backward multiplies them by
grad_output, a 0-d device tensor (1 for loss.backward()). Reading it on the host to skip the multiply at 1
waits for the device to drain (a GPU idle gap per step). Here the kernel reads it instead: every program
loads the scalar, and returns at once where it is 1 (no gradient byte moves: the launch is the whole cost);
otherwise it scales its blocks in place, x = (fp32(x) * fp32(grad_output)) rounded to x's dtype, the same
bits as PyTorch's `(x.float() * grad_output.float()).to(x.dtype)` (round to nearest even), with no
temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program and step (32 per thread at 4 warps)
MAX_PROGRAMS = 1024  # a grid-stride loop: at 1 the launch is ~1k programs that each load one scalar


@triton.jit
def scale_by_device_scalar_kernel(x_ptr, s_ptr, n, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:  # NaN scales (NaN != 1), as the PyTorch formula does
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        start = tl.program_id(0).to(tl.int64) * BLOCK
        for off in range(start, n, step):  # int64 offsets: V x H may exceed 2^31 elements
            idx = off + tl.arange(0, BLOCK)
            keep = idx < n
            x = tl.load(x_ptr + idx, mask=keep)
            tl.store(x_ptr + idx, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)


def scale_(x: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor | None:
    """x *= scale in place (x contiguous, float; scale a 1-element tensor on x's device); returns x."""
    if x is None or x.numel() == 0:
        return x
    assert x.is_contiguous(), "gradients made by the fused forward are contiguous"
    s = scale.reshape(1)
    if s.device != x.device:  # a CPU scalar (a caller's torch.autograd.backward(grad_tensors=...)): no read
        s = s.to(x.device, non_blocking=True)
    grid = (min(triton.cdiv(x.numel(), BLOCK), MAX_PROGRAMS),)
    _launch(scale_by_device_scalar_kernel, grid, dict(x_ptr=x, s_ptr=s, n=x.numel(), BLOCK=BLOCK), 4, 1)
    return x


def _launch(kernel, grid, args, num_warps, num_stages):
    """The one place the kernel is launched (the AOT compile test records the launch here)."""
    kernel[grid](**args, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
