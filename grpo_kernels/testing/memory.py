"""Counting the bytes a CPU run allocates: the peak of live torch allocations during a call.

Uses the autograd profiler's memory events (each op's own allocations when it starts, each free as a
"[memory]" event), replayed in time order. Only torch allocations count: the Triton interpreter's
numpy temporaries do not, which is what is wanted (on a GPU they are registers and shared memory).
"""

from __future__ import annotations


def peak_allocated_bytes(fn):
    """(result of fn(), peak bytes alive at once during it, bytes still alive at its end), counting only
    what fn allocates."""
    from torch.autograd.profiler import profile

    with profile(profile_memory=True) as prof:
        result = fn()
    events = []
    for e in prof.function_events:
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            events.append((e.time_range.start, delta))
    events.sort(key=lambda x: x[0])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return result, peak, live


def peak_bytes_from_allocations(fn):
    """(result of fn(), peak bytes alive at once during it): every torch allocation and free the profiler
    records while fn runs (its `[memory]` events, each with its size: + allocated, - freed), replayed in time
    order. Unlike peak_allocated_bytes it sees the temporaries an op allocates and frees inside itself (a
    GEMM's workspace, an autograd Function's backward), so it is the figure to compare implementations by."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")  # fmt: skip
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return result, peak
