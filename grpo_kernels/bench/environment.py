"""What a result was measured on: device, driver, versions, git sha, date, settings."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from . import ops, parity
from .providers import PINS, RunSettings

SCHEMA = "grpo_kernels.bench/1"
CPU_NOTE = (
    "CPU run: these timings show that the suite works end to end; they are NOT grpo_kernels' performance "
    "numbers, which are measured on H100 / H200 GPUs (docs/design.md §7)."
)
CPU_PRESET_NOTE = (
    "CPU run of the `cpu` preset: the PyTorch backend, the path of every machine without CUDA, against TRL's on "
    "the same inputs; GPU performance is measured on H100 / H200 (docs/design.md §7)."
)
VERSIONED = ("torch", "triton", "numpy", "transformers", *PINS)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info() -> dict:
    import grpo_kernels

    root = Path(grpo_kernels.__file__).resolve().parents[1]
    if os.environ.get("GRPO_KERNELS_GIT_SHA"):
        # set by the GPU session from the source it verified (a GPU machine's own git, if any, knows only an
        # older commit of the copied tree: its HEAD would be wrong)
        dirty = os.environ.get("GRPO_KERNELS_GIT_DIRTY")
        return {"sha": os.environ["GRPO_KERNELS_GIT_SHA"], "dirty": None if dirty is None else dirty == "1"}
    sha = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if sha is None:
        return {"sha": None, "dirty": None}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {"sha": sha, "dirty": bool(dirty)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = _run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"]
        )
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "driver": driver,
            "cuda_runtime": torch.version.cuda,
        }
    info = {
        "type": device.type,
        "name": _cpu_name(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):  # a shared machine's load at the start of the run (1, 5, 15 minutes)
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def device_slug(info: dict) -> str:
    name = info["name"] if info["type"] == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def describe(settings: RunSettings, op_names, provider_names, presets) -> dict:
    """The header of a results file; run_suite appends `results` and `skipped`."""
    import grpo_kernels

    now = dt.datetime.now(dt.timezone.utc)
    device = device_info(settings.device)
    dtype_name = {v: k for k, v in ops.DTYPES.items()}[settings.dtype]
    return {
        "schema": SCHEMA,
        "date": now.isoformat(timespec="seconds"),
        "device": device,
        "versions": {
            "python": platform.python_version(),
            "grpo_kernels": grpo_kernels.__version__,
            **{dist: _version(dist) for dist in VERSIONED},
        },
        "git": git_info(),
        "settings": {
            "dtype": dtype_name,
            "warmup": settings.warmup,
            "iters": settings.iters,
            "presets": list(presets),
            "ops": list(op_names),
            "providers": list(provider_names),
            "compile_backend": settings.compile_backend,
            "seed": settings.seed,
            "interleaved": settings.interleave,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "loss": ops.BENCH_LOSS_SUMMARY,
            "loss_config": dataclasses.asdict(ops.BENCH_LOSS_CONFIG),
            "inputs": {
                "logit_std": ops.LOGIT_STD,
                "policy_drift": ops.POLICY_DRIFT,
                "mask": "all tokens valid (every provider does the same GEMM work)",
                "targets": "uniform random token ids",
            },
            "parity": {
                "error": "relative L2 error against the fp32 reference",
                "factor": parity.ERROR_FACTOR,
                "floor": {str(k).removeprefix("torch."): v for k, v in parity.ERROR_FLOOR.items()},
            },
            "timing": "cuda-events" if settings.device.type == "cuda" else "perf_counter",
            "memory": "peak allocated during one call minus allocated before it"
            + ("" if settings.device.type == "cuda" else " (torch CPU allocations, from the profiler's record)")
            if settings.device.type in ("cuda", "cpu")
            else "not measured on this device",
        },
        "notes": [] if settings.device.type == "cuda" else [
            CPU_PRESET_NOTE if list(presets) == ["cpu"] else CPU_NOTE],
        "skipped": [],
        "results": [],
        "stem": f"{device_slug(device)}_{now.strftime('%Y-%m-%d_%H%M%S')}",
    }
