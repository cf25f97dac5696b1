"""batch_invariant=True: one sequence's log-probs and entropy are bitwise the same alone and in a batch of
64 random others, padded and packed, through fused_linear_logprobs and fused_linear_grpo_loss (every
schedule, two one-pass chunk sizes, two SM counts that would change the default vocabulary split), and
the gradients are bitwise repeatable. PyTorch backend, and the Triton kernels under the interpreter (a
subprocess: the interpreter must be on before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def report(request):
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    if request.param == "triton":
        pytest.importorskip("triton")
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "_batch_invariant_cases.py"), request.param], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bitwise_equal_alone_and_in_any_batch(report):
    checks = {k: v for k, v in report.items() if k.startswith(("logprobs/", "loss/"))}
    assert len(checks) >= 3, checks
    bad = {k: diff for k, (same, diff) in checks.items() if not same}
    assert not bad, f"not bitwise equal to the sequence scored alone (max |difference|): {bad}"


def test_gradients_are_repeatable(report):
    assert report["gradients_repeatable"][0]


def test_flag_is_validated():
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        gk.fused_linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), batch_invariant=1)


def test_trainer_switch_reaches_the_kernels(tmp_path, monkeypatch):
    """grpo-kernels train --batch-invariant: every log-prob pass and every loss call runs in the mode."""
    pytest.importorskip("transformers")
    from grpo_kernels.trainer import cli, trainer

    seen = []
    for name in ("fused_linear_logprobs", "fused_linear_grpo_loss"):
        original = getattr(trainer, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs.get("batch_invariant"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(trainer, name, spy)
    code = cli.main(["--batch-invariant", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                     "--no-progress", "--run-dir", str(tmp_path / "run")])  # fmt: skip
    assert code == 0
    assert seen and all(flag is True for flag in seen), seen
