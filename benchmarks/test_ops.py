"""Every op x shape x provider as a pytest-benchmark case (see conftest.py for the options).

Each case runs the parity gate first (a failure fails the test, nothing is timed), then
benchmark.pedantic with the gradients reset before every round. pytest-benchmark times with
perf_counter, so on CUDA each timed call ends with torch.cuda.synchronize(); the CLI's CUDA-event
numbers are the ones committed under benchmarks/results/.
"""

from __future__ import annotations

import functools

import pytest
import torch

from grpo_kernels.bench.ops import make_floor
from grpo_kernels.bench.providers import REGISTRY, ProviderSkip
from grpo_kernels.bench.runner import FLOOR, gate, reset_grads
from grpo_kernels.bench.timing import synchronize


def _synced(fn, device: torch.device):
    def call():
        out = fn()
        synchronize(device)
        return out

    return call


def test_op(benchmark, bench_op, bench_shape, bench_provider, bench_settings, shape_contexts):
    settings = bench_settings
    ctx = shape_contexts(bench_op, bench_shape, settings)
    rounds = dict(rounds=settings.iters, warmup_rounds=settings.warmup, iterations=1)
    if bench_provider == FLOOR:
        benchmark.extra_info["floor"] = ctx.inputs.op.floor_label
        benchmark.pedantic(_synced(make_floor(ctx.inputs), settings.device), **rounds)
        return
    provider = REGISTRY.providers[bench_provider]
    reason = provider.unavailable(settings, bench_op)
    if reason:
        pytest.skip(reason)
    try:
        call, forward, parity = gate(provider, ctx, settings)
    except ProviderSkip as exc:
        pytest.skip(str(exc))
    if not parity.passed:
        pytest.fail(
            f"{bench_provider} fails the parity gate on {bench_shape.label}:\n{parity.failure_message()}"
        )
    benchmark.extra_info.update(parity=parity.summary(), impl=forward.impl)
    reset = functools.partial(reset_grads, ctx.inputs)
    benchmark.pedantic(_synced(call, settings.device), setup=reset, **rounds)
    reset_grads(ctx.inputs)
