"""Tier 2: fused_linear_grpo_loss on the Triton backend (LM-head kernels + loss-head kernel) under
TRITON_INTERPRET=1, for every configuration of test_loss_head.CONFIGS, both layouts and both
schedules, against the PyTorch backend: loss, metrics and the gradients w.r.t. hidden, weight and
bias. One-pass is refused (a clear error) exactly for the variants whose loss needs statistics of
the whole batch, and when it runs its backward reads the logits the forward kept. fp32 inputs:
differences are fp32 rounding of sums over V = 203 and H = 24 terms (|diff| <= 2e-5 (1 + |expected|),
gradients relative to their largest element).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import interpreter_runner  # noqa: E402
from interpreter_runner import run_case_script, selected_cases  # noqa: E402
from test_loss_head import CONFIGS  # noqa: E402

pytestmark = pytest.mark.interpreter
TOL = 2e-5


@pytest.fixture(scope="module")
def report(request):
    # a selection of these tests (the quick tier) runs the cases of the configurations it names
    return run_case_script("_fused_interpreter_cases.py", timeout=1200, cases=selected_cases(request, ("name",)))


def close(got, expected, scale=None):
    return interpreter_runner.close(got, expected, TOL, scale)


def assert_matches_torch(r: dict, logprobs: bool = True) -> None:
    """A report entry of the Triton run equals the PyTorch backend: loss, gradients, log-probs, metrics."""
    assert "error" not in r and "refused" not in r, r
    got, expected = r["loss"]
    assert close(got, expected), f"loss: triton {got!r}, torch {expected!r}"
    for label, (got, expected, index, scale) in r["grads"].items():
        assert close(got, expected, scale), f"grad_{label}: worst at flat index {index}: triton {got}, torch {expected}"
    if logprobs:
        got, expected, index, scale = r["logprobs"]
        assert close(got, expected), f"logprobs at {index}: triton {got}, torch {expected}"
    for key, (got, expected) in r["metrics"].items():
        assert close(got, expected), f"metric {key}: triton {got!r}, torch {expected!r}"


@pytest.mark.parametrize("schedule", ["one_pass", "two_pass"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_triton_matches_torch(name, layout, schedule, report):
    r = report[f"{name}-{layout}-{schedule}"]
    if schedule == "one_pass" and CONFIGS[name].needs_global_statistics:
        assert "needs statistics of the whole batch" in r.get("refused", ""), r
        return
    assert_matches_torch(r)
    calls = r["backward_calls"]
    if schedule == "one_pass":  # C reads the logits A kept: 3 GEMM units, no recomputation
        assert calls["stored"] >= 2 and calls["recomputed"] == 0 and calls["dz_in_gemm"] == 0, calls
    else:
        assert calls["stored"] == 0 and calls["recomputed"] >= 1, calls


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_pass_dz_in_gemm_matches_torch(name, report):
    """schedule="one_pass_dz": the one-pass schedule whose backward forms dz inside two Triton GEMMs from
    the stored logits (no dz slab) equals the PyTorch backend wherever one_pass runs, and is refused with
    one_pass's reason elsewhere."""
    r = report[f"{name}-packed-one_pass_dz"]
    if CONFIGS[name].needs_global_statistics:
        assert "schedule='one_pass_dz' is not valid here" in r.get("refused", ""), r
        return
    assert_matches_torch(r)
    calls = r["backward_calls"]
    assert calls["stored"] >= 2 and calls["dz_in_gemm"] == calls["stored"] and calls["recomputed"] == 0, calls


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_pass_cuts_long_completions_of_token_local_objectives(name, report):
    """Chunks of 3 valid tokens, completions of up to 7: a token-local objective runs one pass with
    sequences cut across chunks (22 valid tokens: 8 full chunks) and equals the PyTorch backend; any
    other objective refuses one_pass and says why."""
    cfg = CONFIGS[name]
    r = report[f"{name}-packed-one_pass-long"]
    if cfg.needs_global_statistics:
        assert "needs statistics of the whole batch" in r.get("refused", ""), r
        return
    if not cfg.token_local:
        assert "is not token-local" in r.get("refused", ""), r
        return
    assert_matches_torch(r, logprobs=False)
    assert r["backward_calls"] == {"stored": 8, "recomputed": 0, "dz_in_gemm": 0}, r["backward_calls"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_low_memory_schedule_matches_torch(name, report):
    """The vocabulary-outer backward on the Triton kernels (two 128-column slabs of V = 203: dz per slab
    with the targets shifted into it, grad_weight blocks written once, grad_hidden accumulated in fp32)
    equals the PyTorch backend for every configuration."""
    r = report[f"{name}-packed-low_memory"]
    assert "error" not in r, r
    got, expected = r["loss"]
    assert close(got, expected), f"loss: triton {got!r}, torch {expected!r}"
    for label, (got, expected, index, scale) in r["grads"].items():
        assert close(got, expected, scale), f"grad_{label}: worst at flat index {index}: triton {got}, torch {expected}"
    for key, (got, expected) in r["metrics"].items():
        assert close(got, expected), f"metric {key}: triton {got!r}, torch {expected!r}"
    assert r["backward_calls"] == {"stored": 0, "recomputed": 2, "dz_in_gemm": 0}, r["backward_calls"]  # per slab


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo"])
def test_auto_takes_the_low_memory_schedule_over_the_memory_goal(name, report):
    """schedule="auto" where the one- or two-pass schedule's modelled peak exceeds the extra-memory goal
    (set to 0 bytes for the test): the low-memory schedule runs (vocabulary slabs, logits recomputed),
    equals the PyTorch backend, and the DEBUG line says why."""
    r = report[f"{name}-packed-auto-over-goal"]
    assert_matches_torch(r)
    assert "extra-memory goal" in r["said"] and "low_memory" in r["said"], r["said"]
    calls = r["backward_calls"]
    assert calls["stored"] == 0 and calls["recomputed"] >= 2, calls  # one backward call per vocabulary slab


def test_auto_within_the_memory_goal_takes_the_fastest_fitting_schedule(report):
    """Within the goal "auto" ranks the schedules that fit by the time model (ops/fused/dispatch.py) and says so."""
    r = report["grpo-packed-auto-within-goal"]
    assert_matches_torch(r)
    assert "fastest by the time model" in r["said"] and "within the 1.50 GiB extra-memory goal" in r["said"], r["said"]


@pytest.mark.parametrize("schedule", ["one_pass", "two_pass"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo"])
def test_tma_kernel_a_matches_torch(name, schedule, report):
    """use_forward_kernel("tma"): the TMA kernel A ran (and only it), and the fused loss equals the PyTorch
    backend; in one pass the backward reads the logits the TMA stores wrote."""
    r = report[f"{name}-packed-{schedule}-tma"]
    assert_matches_torch(r)
    assert r["forward_kernels"] == ["lm_head_fwd_kernel_partial_tma"], r["forward_kernels"]
    if schedule == "one_pass":
        assert r["backward_calls"]["stored"] >= 2 and r["backward_calls"]["recomputed"] == 0, r["backward_calls"]
