"""Timing and peak-memory measurement of one call.

Time: `warmup` untimed calls, then `iters` timed calls; median and 20th / 80th percentiles (Liger's
quantiles [0.5, 0.2, 0.8]). On CUDA each call is bracketed by CUDA events on the current stream (the
device time of the call, including any host syncs it makes); elsewhere by time.perf_counter.
`reset` (gradients set to None) runs before every call, outside the timed window.

Memory: one more call. On CUDA after torch.cuda.reset_peak_memory_stats; the peak is
max_memory_allocated minus the memory allocated before the call (inputs, reference tensors and
whatever else the process holds), so it is what the call itself adds, gradients included. On a CPU the
same quantity from the profiler's record of every torch allocation and free during the call, replayed in
time order (grpo_kernels.testing.memory.peak_bytes_from_allocations: torch's allocator only, a BLAS library's
own workspace is not seen).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch


@dataclass
class TimeStats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    iters: int
    warmup: int
    timer: str  # "cuda-events" | "perf_counter"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call, reset, device: torch.device, warmup: int, iters: int) -> TimeStats:
    for _ in range(warmup):
        reset()
        call()
    synchronize(device)
    samples: list[float] = []
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for start, end in events:
            reset()
            start.record()
            call()
            end.record()
        synchronize(device)
        samples = [start.elapsed_time(end) for start, end in events]
        timer = "cuda-events"
    else:
        for _ in range(iters):
            reset()
            t0 = time.perf_counter()
            call()
            samples.append((time.perf_counter() - t0) * 1e3)
        timer = "perf_counter"
    return stats_of(samples, warmup, timer)


def stats_of(samples: list[float], warmup: int, timer: str) -> TimeStats:
    """Median and 20th / 80th percentiles of the timed calls (ms)."""
    samples = sorted(samples)
    return TimeStats(
        _quantile(samples, 0.5), _quantile(samples, 0.2), _quantile(samples, 0.8), len(samples), warmup, timer
    )


def peak_extra_bytes(call, reset, device: torch.device) -> int | None:
    """Peak memory the call adds on top of what is allocated before it (CUDA and CPU; None elsewhere)."""
    if device.type == "cpu":
        from ..testing.memory import peak_bytes_from_allocations

        reset()
        gc.collect()
        out, peak = peak_bytes_from_allocations(call)
        del out
        return peak
    if device.type != "cuda":
        return None
    reset()
    gc.collect()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = call()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return peak - before


def free_memory(device: torch.device) -> None:
    """Return what the last provider left to the allocator (CUDA; a full gc pass costs ~0.5 s with
    the peers imported, so it is skipped where memory is not measured)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
