"""tools/suites/skyrl_suite.py, the harness that runs SkyRL's own loss tests with SkyRL's policy
losses and with grpo_kernels' swapped in, and compares every outcome.

SkyRL's test files are not in its wheel and are not committed here, so CI runs the harness on a small
SkyRL-style folder written below (the three file names it runs): a loss test that passes both ways (the
swapped run through grpo_kernels), a test only the swap changes (the harness must name it and exit 1), a
DPPO test (the adapter implements every SkyRL type: through grpo_kernels too), and a loss the test registers
itself under its own name (not a SkyRL type: its own function in both runs). The recorded run on SkyRL's
real tests is docs/records/skyrl_suite.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from checkout import CHECKOUT
from trainer_support import require_skyrl

require_skyrl()

LOSSES = '''
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
from skyrl.train.config import AlgorithmConfig


def inputs():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 5, generator=g)
    return lp, lp + 0.3 * torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g), torch.ones(2, 5)


def test_regular_value():
    lp, old, adv, mask = inputs()
    loss, metrics = PolicyLossRegistry.get("regular")(lp, old, adv, AlgorithmConfig(), loss_mask=mask)
    ratio = torch.exp(lp - old)
    expected = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
    torch.testing.assert_close(loss, expected)
    assert 0 <= metrics["clip_ratio"] <= 1


def test_registry_returns_skyrls_own_function():
    assert PolicyLossRegistry.get("regular").__module__.startswith("skyrl."), PolicyLossRegistry.get("regular")


def test_dppo_value():
    lp, old, adv, mask = inputs()
    loss, metrics = PolicyLossRegistry.get("dppo")(lp, old, adv, AlgorithmConfig(policy_loss_type="dppo"),
                                                   loss_mask=mask)
    diff = lp.exp() - old.exp()
    inside = ~(((adv > 0) & (diff > 0.2)) | ((adv < 0) & (-diff > 0.2)))
    torch.testing.assert_close(loss, -(torch.exp(lp - old) * adv * inside).sum())
    assert 0 <= metrics["clip_ratio"] <= 1


def test_a_loss_registered_under_its_own_name_stays_its_own():
    def own_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
        return -(log_probs * advantages).sum(), {}

    PolicyLossRegistry.register("own_loss", own_loss)
    try:
        assert PolicyLossRegistry.get("own_loss") is own_loss
    finally:
        PolicyLossRegistry.unregister("own_loss")
'''
OTHER = '''
def test_nothing_to_swap_here():
    assert True
'''


def test_harness_runs_both_ways_and_names_the_difference(tmp_path):
    tests = tmp_path / "tests"
    for name, text in (("train/algorithms/test_losses.py", LOSSES), ("train/algorithms/test_off_policy_correction.py",
                       OTHER), ("backends/skyrl_train/utils/test_ppo_utils.py", OTHER)):  # fmt: skip
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(textwrap.dedent(text))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "suites" / "skyrl_suite.py"), "--skyrl-tests", str(tests),
         "--skyrl-ref", "written-in-this-test", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    logs = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 1, f"exit {run.returncode} (1: one test differs)\n{logs}"
    record = json.loads((out / "skyrl_suite.json").read_text())
    assert [d["test"] for d in record["differ"]] == [
        "train.algorithms.test_losses::test_registry_returns_skyrls_own_function"], logs
    for side in ("stock", "swapped"):
        got = {t: e["outcome"] for t, e in record[side].items()}
        assert got["train.algorithms.test_losses::test_regular_value"] == "passed", (side, record[side])
        assert got["train.algorithms.test_losses::test_dppo_value"] == "passed", (side, record[side])
        own = "train.algorithms.test_losses::test_a_loss_registered_under_its_own_name_stays_its_own"
        assert got[own] == "passed", (side, record[side])
    calls = {f"train/algorithms/test_losses.py::{test}": 1 for test in ("test_regular_value", "test_dppo_value")}
    assert record["grpo_kernels_calls"] == calls, record
    assert record["passed_both"] == 5 and record["passed_both_through_grpo_kernels"] == 2, record
    assert record["skyrl_tests"]["ref"] == "written-in-this-test"
    assert "DIFFERS train.algorithms.test_losses::test_registry_returns_skyrls_own_function" in run.stdout


def test_harness_refuses_a_folder_without_the_test_files(tmp_path):
    run = subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "suites" / "skyrl_suite.py"), "--skyrl-tests", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 2 and "must be SkyRL's tests/ folder" in run.stderr, run.stderr
