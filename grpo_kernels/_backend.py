"""Backend choice for every public function: "auto" | "triton" | "torch".

"auto" picks Triton on CUDA tensors when Triton imports and the PyTorch implementation elsewhere,
saying so once per reason (a fallback is never silent, and never repeated every step).
"""

from __future__ import annotations

import functools
import warnings

import torch

BACKENDS = ("auto", "triton", "torch")


class BackendFallbackWarning(UserWarning):
    """backend="auto" chose the PyTorch implementation; the message says why (once per reason).

    Raised as a warning, never an error: on CPU tensors or without a usable Triton the PyTorch
    implementation is exact, only slower. Silence it with
    ``warnings.filterwarnings("ignore", category=gk.BackendFallbackWarning)``; pass ``backend="torch"``
    to choose the PyTorch implementation explicitly (no notice)."""


class SlowPathWarning(RuntimeWarning):
    """A kernel took a slower fallback path on this device (e.g. fp32-upcast GEMMs where torch has no
    fp32 out_dtype for half-precision operands). The GPU tier turns it into an error; the benchmark
    results record which path ran."""


_notified: set[str] = set()


def notify_once(reason: str) -> None:
    """One line on stderr (through the warnings machinery, so filters apply), once per reason: warned
    from a pseudo-location without a source line, so Python prints no second line of code."""
    if reason not in _notified:
        _notified.add(reason)
        warnings.warn_explicit(reason, BackendFallbackWarning, "grpo_kernels", 0, module="grpo_kernels")


@functools.lru_cache(maxsize=None)
def triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def resolve_backend(backend: str, device: torch.device, op: str, triton_implemented: bool = True) -> str:
    """Return "triton" or "torch" for tensors on `device`, or raise on a backend that cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if not triton_implemented:
        if backend == "triton":
            raise NotImplementedError(f"{op}: the Triton backend is not implemented yet; use backend='torch'")
        notify_once(f"{op}: no Triton kernel yet, backend='auto' uses the PyTorch implementation")
        return "torch"
    ok, why = triton_available()
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"{op}: backend='triton' requested but {why}")
        if device.type != "cuda" and not interpreter_enabled():
            raise RuntimeError(
                f"{op}: backend='triton' needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 "
                "before importing triton to run the kernels on CPU for testing, or use backend='torch'"
            )
        return "triton"
    # auto
    if device.type == "cuda" and ok:
        return "triton"
    notify_once(
        f"backend='auto' uses the PyTorch implementation for {device.type} tensors"
        + (f" ({why})" if device.type == "cuda" else "")
    )
    return "torch"


def interpreter_enabled() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"
