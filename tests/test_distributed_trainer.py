"""One seed, one run, however it is launched. `torchrun --nproc_per_node=K -m grpo_kernels.train` on CPU
(gloo): two processes with DDP, and with FSDP2 (--fsdp) stopped after 2 steps and resumed to 3, against
one process for 3 steps with the same seed and global batch; and a plain run (`python -m
grpo_kernels.train`, no torchrun) against torchrun with one process. Every run samples each prompt group
under its own seed, so the completions, hence the rewards, are the same exactly; the per-step loss, KL,
entropy and grad norm, and the final parameters, agree to fp32 rounding (the two ranks' gradient halves
are summed by DDP's / FSDP's average instead of in one process: a few ulp per step; after 3 AdamW steps
the parameters differ by < 1e-6 of their largest value). Files come from rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.testing.distributed import free_port

CHECKOUT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed
ARGS = ["--prompts-per-step", "4", "--group-size", "4", "--no-progress", "--seed", "3"]


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "grpo_kernels.train", *args]  # fmt: skip
    # PYTHONFAULTHANDLER: a rank that aborts (once in CI, at exit after a complete 3-rank run: "terminate called
    # without an active exception") prints every thread's Python stack, so the failure shows where it was
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    torchrun(1, "--steps", "3", "--run-dir", str(run_dir), *ARGS)
    return run_dir


def assert_same_run(one: Path, two: Path, processes: int | None = 2):
    from safetensors.torch import load_file

    a, b = metrics(one), metrics(two)
    assert [m["step"] for m in b] == [1, 2, 3] and all(m.get("processes") == processes for m in b)
    for m1, m2 in zip(a, b):
        for key in ("reward", "reward_std", "tokens"):  # the same completions: equal exactly
            assert m1[key] == m2[key], (m1["step"], key, m1[key], m2[key])
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert abs(m1[key] - m2[key]) <= 1e-5 * (1 + abs(m1[key])), (m1["step"], key, m1[key], m2[key])
    pa = load_file(one / "final_model" / "model.safetensors")
    pb = load_file(two / "final_model" / "model.safetensors")
    scale = max(t.abs().max().item() for t in pa.values())
    worst = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    assert worst <= 1e-6 * scale, f"parameters differ by {worst} (largest {scale})"


def test_two_processes_ddp_equal_one_process(one_process, tmp_path):
    two = tmp_path / "ddp"
    run = torchrun(2, "--steps", "3", "--run-dir", str(two), *ARGS)
    assert run.stdout.count("run folder:") == 1  # rank 0 speaks, the other rank is quiet
    assert "processes: 2 (torchrun), data parallel with DDP, gloo backend" in run.stdout, run.stdout
    assert_same_run(one_process, two)


def test_plain_run_equals_torchrun_with_one_process(one_process, tmp_path):
    """`grpo-kernels train --seed 3 ...` samples the completions torchrun does (per-group seeds in every
    run), so the plain run is the torchrun run: same rewards exactly, losses to fp32 rounding."""
    plain = tmp_path / "plain"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.train", "--steps", "3", "--run-dir", str(plain),
                           *ARGS], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "processes: 1 (not under torchrun), no data parallelism" in proc.stdout, proc.stdout
    assert_same_run(plain, one_process, processes=1)  # torchrun records its process count, a plain run none


def test_two_processes_fsdp2_stopped_and_resumed_equal_one_process(one_process, tmp_path):
    two = tmp_path / "fsdp"
    torchrun(2, "--steps", "2", "--run-dir", str(two), "--fsdp", *ARGS)
    torchrun(2, "--resume", str(two), "--steps", "3")  # the sharded model and optimizer from the checkpoint
    assert_same_run(one_process, two)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_fsdp_without_torchrun_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT))
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.train", "--fsdp", "--steps", "1",
                           "--run-dir", str(tmp_path / "r")], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 2 and "torchrun" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()
