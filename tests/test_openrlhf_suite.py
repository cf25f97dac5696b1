"""tools/suites/openrlhf_suite.py, the harness that runs OpenRLHF's own loss tests (shipped in its
wheel) stock and with the adapter swapped in: on the installed OpenRLHF 0.11.2 every test passes stock, and
the swapped run differs exactly on the tests the harness explains (a model without an LM head); OpenRLHF's
tests of its train/rollout corrections (ratio, sequence ratio, binary KL and TV gating) pass through the
adapter's PolicyLoss. The recorded run is docs/records/openrlhf_suite.json (its README sentence:
test_readme_records.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from checkout import CHECKOUT

sys.path.insert(0, str(CHECKOUT / "tests"))
import _openrlhf_support  # noqa: E402

_openrlhf_support.require_openrlhf()

pytestmark = [pytest.mark.parity, pytest.mark.slow]
HARNESS = CHECKOUT / "tools" / "suites" / "openrlhf_suite.py"
sys.path.insert(0, str(HARNESS.parent))
import openrlhf_suite  # noqa: E402


def _env():
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    )


def test_openrlhf_own_tests_with_the_adapter_swapped_in(tmp_path):
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
        check=False,
    )
    logs = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, logs
    record = json.loads((tmp_path / "openrlhf_suite.json").read_text())
    assert record["counts"]["stock"] == {"passed": 28, "failed": 0, "skipped": 0}, logs
    assert {d["test"] for d in record["differ"]} == set(openrlhf_suite.EXPECTED_DIFFERENCES), logs
    assert all(d["stock"] == "passed" and d["swapped"] == "failed" for d in record["differ"]), record[
        "differ"
    ]
    assert record["passed_both"] == 28 - len(openrlhf_suite.EXPECTED_DIFFERENCES)
    # the swap reached the tests: PolicyLoss in the loss tests, Actor.forward in the actor test
    assert record["swapped_names"]["tests.test_loss_aggregation"] == ["PolicyLoss"], record["swapped_names"]
    assert record["swapped_names"]["tests.test_actor_entropy_temperature"] == ["Actor.forward"]
    assert record["passed_both_through_the_adapter"] >= 9, record["adapter_calls"]
    for test in (
        "test_seq_mask_gates_on_the_per_sequence_geometric_mean_ratio",
        "test_binary_kl_trust_region_masks_tokens_and_sequences",
        "test_tv_trust_region_masks_by_sampled_token_probability_gap",
    ):  # the corrections mapped onto grpo_kernels' sampler gate, through the adapter
        assert record["adapter_calls"].get(f"test_loss_aggregation.py::{test}"), record["adapter_calls"]
    for d in record["differ"]:  # each fails on the adapter's refusal, not on a number
        assert "grpo_kernels" in (d["swapped_error"] or ""), d


def test_harness_refuses_a_folder_without_the_tests(tmp_path):
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--openrlhf-tests", str(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert run.returncode == 2 and "must be OpenRLHF's tests/ folder" in run.stderr, run.stderr
