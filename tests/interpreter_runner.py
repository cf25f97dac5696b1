"""Shared by the interpreter-tier tests: run a case script in a subprocess with TRITON_INTERPRET=1
(the interpreter must be on before triton is imported, and the pytest process usually imported it
already) and read the JSON report it prints as its last line; compare scalars from such a report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def nan_fill_uninitialized() -> None:
    """In this process, the buffers lm_head.triton.uninitialized hands out (grad_weight accumulators the first GEMM
    overwrites) start NaN-filled: torch.empty's memory is whatever was there (on a CPU often zeros), so a path that
    read one before writing it would pass unseen; with NaN its gradient checks fail."""
    import torch

    from grpo_kernels.ops.lm_head import triton as tri

    tri.uninitialized = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)


def selected_params(request, name: str) -> list | None:
    """The values of parameter `name` of the requesting module's selected tests; None when the whole module is
    selected or a selected test has no such parameter (then a module fixture does all its work)."""
    from _selection import COLLECTED_IDS

    prefix = request.node.nodeid + "::"
    collected = [i for i in request.config.stash.get(COLLECTED_IDS, []) if i.startswith(prefix)]
    selected = [item for item in request.session.items if item.nodeid.startswith(prefix)]
    if not collected or len(selected) == len(collected):
        return None
    values = []
    for item in selected:
        if not hasattr(item, "callspec") or name not in item.callspec.params:
            return None
        if item.callspec.params[name] not in values:
            values.append(item.callspec.params[name])
    return values


def compile_report_rows(request, tmp_path_factory, run_matrix, write_report) -> dict:
    """A compile tier's rows by case id: `run_matrix(selected)` compiles the cases the selected tests read (the
    quick tier, -k: only those; None: all), `write_report(rows, folder)` writes its report, into
    benchmarks/results/ for a whole-module run with GRPO_KERNELS_WRITE_REPORTS=1, else a temporary folder."""
    selected = selected_params(request, "case")
    rows = run_matrix(selected)
    if os.environ.get("GRPO_KERNELS_WRITE_REPORTS") == "1" and selected is None:
        out = HERE.parent / "benchmarks" / "results"
    else:
        out = tmp_path_factory.mktemp("compile_report")
    write_report(rows, out)
    return {r["id"]: r for r in rows}


def selected_cases(request, params: tuple[str, ...] = ("case", "name")) -> list[str] | None:
    """The case keys the selected tests of the requesting module read: the value of its first parameter named
    in `params` (a dict case gives its "id"), for each selected test; None (every case) when the whole module
    is selected or a selected test has no such parameter. A case script runs a case when its key equals one of
    these or starts with one and a `-` (tests/_selection.py, `wanted` in the case scripts)."""
    from _selection import COLLECTED_IDS

    prefix = request.node.nodeid + "::"
    collected = [i for i in request.config.stash.get(COLLECTED_IDS, []) if i.startswith(prefix)]
    selected = [item for item in request.session.items if item.nodeid.startswith(prefix)]
    if not collected or len(selected) == len(collected):
        return None
    keys = set()
    for item in selected:
        values = [item.callspec.params[p] for p in params if hasattr(item, "callspec") and p in item.callspec.params]
        if not values:
            return None
        keys.add(values[0]["id"] if isinstance(values[0], dict) else str(values[0]))
    return sorted(keys)


def wanted(key: str) -> bool:
    """In a case script: whether to run case `key` (GRPO_KERNELS_CASES, set by run_case_script from the
    selected tests; absent: every case)."""
    only = os.environ.get("GRPO_KERNELS_CASES")
    return only is None or any(key == k or key.startswith(k + "-") for k in json.loads(only))


def run_case_script(name: str, timeout: int = 900, cases: list[str] | None = None) -> dict:
    """Run tests/<name> under the interpreter; `cases` (selected_cases): only those, else every case."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    env.pop("GRPO_KERNELS_CASES", None)
    if cases is not None:
        env["GRPO_KERNELS_CASES"] = json.dumps(cases)
    proc = subprocess.run([sys.executable, str(HERE / name)], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"interpreter subprocess {name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def close(got, expected, tol: float, scale: float | None = None) -> bool:
    """|got - expected| <= tol (1 + |scale or expected|); NaN matches only NaN; None never matches."""
    if got is None:
        return False
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return abs(got - expected) <= tol * (1.0 + abs(expected if scale is None else scale))
