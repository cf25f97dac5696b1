"""Tier 2: the Triton loss head (grpo_loss(backend="triton")) under TRITON_INTERPRET=1 on CPU equals
the fp32 reference for every configuration and both layouts: loss, metrics and both gradients.

The cases run in one subprocess (tests/_loss_head_interpreter_cases.py) because the interpreter must
be on before triton is imported; each test here asserts on its JSON report. Inputs are fp32, so the
only differences are fp32 summation order: |diff| <= 1e-5 (1 + |expected|).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

import interpreter_runner  # noqa: E402
from interpreter_runner import run_case_script, selected_cases  # noqa: E402
from test_loss_head import CONFIGS, UNSCORED_CASES  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.interpreter
TOL = 1e-5


@pytest.fixture(scope="module")
def report(request):
    return run_case_script("_loss_head_interpreter_cases.py", cases=selected_cases(request))


def close(got, expected):
    return interpreter_runner.close(got, expected, TOL)


CASES = [f"{name}-{layout}" for name in sorted(CONFIGS) for layout in ("padded", "packed")] + [
    f"{name}-nan-rollout" for name in UNSCORED_CASES
]


@pytest.mark.parametrize("case", CASES)
def test_triton_loss_head_matches_reference(case, report):
    r = report[case]
    assert "error" not in r, r.get("error")
    got, expected = r["loss"]
    assert close(got, expected), f"loss: triton {got!r}, reference {expected!r}"
    for label in ("dL/dlogp", "dL/dentropy"):
        got, expected, index = r[label]
        assert close(got, expected), f"{label}: worst element at flat index {index}: triton {got!r}, reference {expected!r}"
    for key, (got, expected) in r["metrics"].items():
        assert close(got, expected), f"metric {key}: triton {got!r}, reference {expected!r}"
    assert not r["extra_metrics"], f"metrics the reference does not have: {r['extra_metrics']}"
