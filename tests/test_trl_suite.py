"""tools/suites/trl_suite.py, the harness that runs TRL's own GRPO trainer tests with TRL's trainer
and with GRPOKernelsTrainer swapped in and compares every outcome.

TRL's test file is not in its wheel and cannot be committed here, so CI runs the harness on a small
TRL-style test folder written below: one training test on the stand-in model and prompt dataset (passes
both ways, the swapped run through the fused loss), one test that only the swap changes (the harness must
name it and exit 1), one whose helper the installed TRL lacks (shimmed: skipped both ways). The source
transforms (the swap, the shim) are checked on their own first. The recorded run on TRL's real tests is
docs/records/trl_suite.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from checkout import CHECKOUT
from parity_helpers import require_peer

require_peer("trl", "trl")
sys.path.insert(0, str(CHECKOUT / "tools" / "suites"))
import trl_suite  # noqa: E402


def test_swap_goes_after_the_import_that_names_grpo_trainer():
    one_line = "import os\nfrom trl import GRPOConfig, GRPOTrainer\nx = 1\n"
    assert trl_suite.swap_trainer(one_line) == (
        "import os\nfrom trl import GRPOConfig, GRPOTrainer\n" + trl_suite.SWAP_LINE + "x = 1\n"
    )
    parenthesised = "from trl import SFTConfig\nfrom trl import (\n    GRPOConfig,\n    GRPOTrainer,\n)\nx = 1\n"
    swapped = trl_suite.swap_trainer(parenthesised)
    assert swapped.endswith(")\n" + trl_suite.SWAP_LINE + "x = 1\n"), swapped
    assert swapped.count("GRPOKernelsTrainer") == 1
    with pytest.raises(ValueError, match="nothing to swap"):
        trl_suite.swap_trainer("from trl import GRPOConfig\nfrom trl.trainer import GRPOTrainerX\n")


def test_shim_defines_only_the_helpers_the_installed_trl_lacks():
    source = "import x\nfrom trl.import_utils import (\n    is_a_available,\n    is_gone_available,\n)\n\ny = 2\n"
    shimmed, missing = trl_suite.shim_missing_imports(source, {"is_a_available"})
    assert missing == ["is_gone_available"]
    namespace = {}
    exec(shimmed.split("from trl.import_utils import (is_a_available)\n")[1], namespace)  # the shim alone
    assert namespace["is_gone_available"]() is False
    assert "from trl.import_utils import (is_a_available)\n" in shimmed
    assert "def is_gone_available():" in shimmed and "return False" in shimmed
    assert shimmed.endswith("\ny = 2\n")
    unchanged, none_missing = trl_suite.shim_missing_imports(source, {"is_a_available", "is_gone_available"})
    assert (unchanged, none_missing) == (source, [])


FAKE_TESTING_UTILS = '''
import pytest
from trl.import_utils import (
    is_vllm_available,
    is_helper_this_trl_never_had_available,
)

require_the_gone_helper = pytest.mark.skipif(
    not is_helper_this_trl_never_had_available(), reason="needs the gone helper")
'''

FAKE_TESTS = '''
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from .testing_utils import require_the_gone_helper


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


class TestStandIns:
    def test_trains_one_step(self, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
        args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3,
                          max_completion_length=8, max_steps=1, learning_rate=0.1, report_to="none",
                          bf16=False)
        trainer = GRPOTrainer(model="trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", reward_funcs=reward_length,
                              args=args, train_dataset=dataset)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None

    def test_datasets_hold_the_zen_prompts(self):
        standard = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
        chat = load_dataset("trl-internal-testing/zen", "conversational_prompt_only", split="test")
        assert standard[1]["prompt"] == "Explicit is" and len(standard) == 17
        assert chat[0]["prompt"][0]["role"] == "user"

    def test_trainer_is_trls_own(self):
        assert GRPOTrainer.__module__.startswith("trl."), GRPOTrainer.__module__

    @require_the_gone_helper
    def test_needs_the_gone_helper(self):
        raise AssertionError("the shim must make this skip")
'''


def test_harness_runs_both_ways_and_names_the_difference(tmp_path):
    fake = tmp_path / "trl_tests"
    fake.mkdir()
    (fake / "__init__.py").touch()
    (fake / "testing_utils.py").write_text(textwrap.dedent(FAKE_TESTING_UTILS))
    (fake / "test_grpo_trainer.py").write_text(textwrap.dedent(FAKE_TESTS))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "suites" / "trl_suite.py"), "--trl-tests", str(fake),
         "--trl-ref", "written-in-this-test", "--out", str(out), "--models", "tiny-Qwen2ForCausalLM-2.5"],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )
    logs = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 1, f"exit {run.returncode} (1: one test differs)\n{logs}"
    record = json.loads((out / "trl_suite.json").read_text())
    assert [d["test"] for d in record["differ"]] == ["TestStandIns::test_trainer_is_trls_own"], logs
    for side in ("stock", "swapped"):
        got = {t: e["outcome"] for t, e in record[side].items()}
        assert got["TestStandIns::test_trains_one_step"] == "passed", (side, record[side])
        assert got["TestStandIns::test_datasets_hold_the_zen_prompts"] == "passed", (side, record[side])
        assert got["TestStandIns::test_needs_the_gone_helper"] == "skipped", (side, record[side])
    assert record["stock"]["TestStandIns::test_trainer_is_trls_own"]["outcome"] == "passed"
    assert "grpo_kernels.integrations.trl" in record["swapped"]["TestStandIns::test_trainer_is_trls_own"]["error"]
    assert record["shimmed_helpers"] == ["is_helper_this_trl_never_had_available"]
    assert record["fused_loss_calls"].get("TestStandIns::test_trains_one_step", 0) > 0, record["fused_loss_calls"]
    assert record["passed_both"] == 2 and record["passed_both_through_fused_loss"] == 1
    assert record["trl_tests"]["ref"] == "written-in-this-test"
    assert "DIFFERS TestStandIns::test_trainer_is_trls_own" in run.stdout


def test_harness_refuses_a_folder_without_the_test_file(tmp_path):
    run = subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "suites" / "trl_suite.py"), "--trl-tests", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 2 and "must be TRL's tests/ folder" in run.stderr, run.stderr
