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


def run_case_script(name: str, timeout: int = 900) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
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
