"""pytest-benchmark front end of the suite: `python -m pytest benchmarks/ [--bench-* options]`.

Same registry, inputs, parity gate and call as the CLI (grpo_kernels/bench); one test per
(op, shape, provider), the floor included. Not collected by the default `python -m pytest`
(pyproject testpaths = ["tests"]).
"""

from __future__ import annotations

import pytest
import torch

from grpo_kernels.bench.ops import DTYPES, OPS
from grpo_kernels.bench.providers import REGISTRY, RunSettings
from grpo_kernels.bench.runner import FLOOR, prepare_shape
from grpo_kernels.bench.shapes import resolve_presets


def pytest_addoption(parser):
    group = parser.getgroup("grpo_kernels benchmarks")
    group.addoption(
        "--bench-shapes", default=None, help="shape presets (default: tiny off CUDA, qwen3-8b on CUDA)"
    )
    group.addoption("--bench-ops", default="all", help=f"comma-separated ops: {', '.join(OPS)}")
    group.addoption("--bench-providers", default="all", help="comma-separated provider names")
    group.addoption("--bench-dtype", default="bf16", choices=list(DTYPES))
    group.addoption("--bench-compile-backend", default="inductor")


def _csv(value: str, everything) -> list[str]:
    return list(everything) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_generate_tests(metafunc):
    if not {"bench_op", "bench_shape", "bench_provider"} <= set(metafunc.fixturenames):
        return
    opt = metafunc.config.getoption
    presets = opt("--bench-shapes") or ("qwen3-8b" if _device().type == "cuda" else "tiny")
    shapes = resolve_presets(_csv(presets, ()))
    wanted = _csv(opt("--bench-providers"), REGISTRY.providers)
    params, ids = [], []
    for op in _csv(opt("--bench-ops"), OPS):
        limit = OPS[op].max_tokens
        for shape in shapes:
            if limit is not None and shape.tokens > limit:
                continue
            for name in [FLOOR] + [p.name for p in REGISTRY.for_op(op) if p.name in wanted]:
                params.append((op, shape, name))
                ids.append(f"{op}-{shape.model}-N{shape.tokens}-{name}")
    metafunc.parametrize(("bench_op", "bench_shape", "bench_provider"), params, ids=ids)


@pytest.fixture(scope="session")
def bench_settings(request) -> RunSettings:
    opt = request.config.getoption
    cuda = _device().type == "cuda"
    named = opt("--bench-providers")
    if not cuda:
        torch.set_num_threads(1)  # as the CLI: tiny CPU shapes gain nothing from threads
    return RunSettings(
        dtype=DTYPES[opt("--bench-dtype")],
        device=_device(),
        warmup=3 if cuda else 1,
        iters=10 if cuda else 3,
        compile_backend=opt("--bench-compile-backend"),
        explicit=frozenset(_csv(named, ())) if named != "all" else frozenset(),
    )


@pytest.fixture(scope="session")
def shape_contexts():
    """The inputs and references of the current (op, shape), built once for all its providers; only
    the latest one is kept (tests run op by op, shape by shape)."""
    cache: dict = {}

    def get(op, shape, settings):
        key = (op, shape)
        if key not in cache:
            cache.clear()
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()
            cache[key] = prepare_shape(op, shape, settings)
        return cache[key]

    return get
