"""tools/suites/unsloth_suite.py, the harness that runs Unsloth's own tests with Unsloth's log-prob kernel
and with grpo_kernels' in its place and compares every outcome.

unsloth-zoo's tests are not in its wheel and cannot be committed here (AGPL), so CI runs the harness on a small
folder in their style written below: a test that scores through Unsloth's GRPO scorer (passes both ways, the
swapped run through grpo_kernels' kernel), one that only the swap changes (the harness must name it and exit 1),
and a skipped one. The recorded run on unsloth-zoo's real tests is docs/records/unsloth_suite.json.
Runs in the Unsloth environment (.ci/steps/unsloth.sh); skips elsewhere, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from checkout import CHECKOUT
from parity_helpers import installed_version


def _skip_or_fail(reason: str, allow_module_level: bool = True) -> None:
    """Skip the module, or fail it where Unsloth must be there (GRPO_KERNELS_REQUIRE_UNSLOTH=1: the CI step)."""
    if os.environ.get("GRPO_KERNELS_REQUIRE_UNSLOTH") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


if installed_version("unsloth_zoo") is None:
    _skip_or_fail(
        "unsloth_zoo is not installed: these tests run in the Unsloth environment that .ci/steps/unsloth.sh builds "
        "(unsloth pins trl<=1.15.0, so it cannot share the parity environment's trl 1.16.0)",
        allow_module_level=True,
    )

HARNESS = CHECKOUT / "tools" / "suites" / "unsloth_suite.py"

CONFTEST = """
import os
os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
"""

TESTS = '''
import pathlib
import pytest
import torch


def test_grpo_scorer_matches_a_plain_log_softmax():
    from unsloth_zoo.rl_replacements import grpo_chunked_hidden_states_logprobs
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(2, 5, 8, generator=g), torch.randn(11, 8, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    got = grpo_chunked_hidden_states_logprobs(hidden, head, ids)
    want = torch.log_softmax(hidden @ head.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5)


def test_reads_the_installed_source():
    assert "def grpo_compute_loss" in pathlib.Path("unsloth_zoo/rl_replacements.py").read_text()


def test_kernel_is_unsloths_own():
    import unsloth_zoo.fused_losses.fused_linear as module
    assert getattr(module.fused_linear_logprobs, "__module__", "") == "unsloth_zoo.fused_losses.fused_linear"


@pytest.mark.skip(reason="needs a GPU")
def test_needs_a_gpu():
    raise AssertionError("skipped both ways")
'''


def test_harness_runs_both_ways_and_names_the_difference(tmp_path):
    tests = tmp_path / "unsloth_tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    (tests / "test_rl_style.py").write_text(textwrap.dedent(TESTS))
    (tests / "test_not_chosen.py").write_text("def test_never_runs():\n    raise AssertionError\n")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--tests", str(tests), "--ref", "written-in-this-test", "--out", str(out),
         "--files", "test_rl_style.py"],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    logs = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 1, f"exit {run.returncode} (1: one test differs)\n{logs}"
    record = json.loads((out / "unsloth_suite.json").read_text())
    name = "tests/test_rl_style.py::"
    assert [d["test"] for d in record["differ"]] == [name + "test_kernel_is_unsloths_own"], logs
    for side in ("stock", "swapped"):
        got = {t.removeprefix(name): e["outcome"] for t, e in record[side].items()}
        assert got["test_grpo_scorer_matches_a_plain_log_softmax"] == "passed", (side, record[side])
        assert got["test_reads_the_installed_source"] == "passed", (side, record[side])
        assert got["test_needs_a_gpu"] == "skipped", (side, record[side])
        assert not any("never_runs" in t for t in got), "only the chosen files run"
    assert record["stock"][name + "test_kernel_is_unsloths_own"]["outcome"] == "passed"
    assert record["swapped"][name + "test_kernel_is_unsloths_own"]["outcome"] == "failed"
    assert list(record["kernel_calls"]) == [name + "test_grpo_scorer_matches_a_plain_log_softmax"]
    assert record["passed_both"] == 2 and record["passed_both_through_kernel"] == 1
    assert record["tests_folder"]["ref"] == "written-in-this-test"
    assert f"DIFFERS {name}test_kernel_is_unsloths_own: passed -> failed" in run.stdout


def test_harness_refuses_a_folder_without_a_conftest(tmp_path):
    run = subprocess.run([sys.executable, str(HARNESS), "--tests", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert run.returncode == 2 and "must be Unsloth's tests/ folder" in run.stderr, run.stderr
