"""The one-command GPU session (benchmarks/gpu/run.sh) on CPU: the plan, the wheel step, the whole flow
on tiny shapes (a rehearsal), and a part that runs past its limit leaving the earlier results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.bench import gpu_session

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"


def run_sh(*args, timeout=300):
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_dry_run_prints_the_plan_and_at_most_eight_files(tmp_path):
    out = run_sh("--dry-run", "--out", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr
    for part in ("[wheels]", "[gpu-tests]", "[headline]", "[sweep]", "tests/test_gpu.py", "--shapes qwen3-8b",
                 "--shapes session-sweep"):  # fmt: skip
        assert part in out.stdout, out.stdout
    files = [line.strip() for line in out.stdout.split("files:\n", 1)[1].splitlines() if line.strip()]
    assert 0 < len(files) <= gpu_session.MAX_FILES, files
    assert not (tmp_path / "s").exists(), "a dry run wrote files"


def test_make_wheels_dry_run_names_every_peer_for_cp312(tmp_path):
    out = run_sh("make-wheels", "--dry-run", "--dest", str(tmp_path / "whl"))
    assert out.returncode == 0, out.stderr
    for pin in ("trl==1.16.0", "liger-kernel==0.8.5", "cut-cross-entropy==25.1.1", "--python-version 3.12",
                "--only-binary=:all:"):  # fmt: skip
        assert pin in out.stdout, out.stdout
    assert not (tmp_path / "whl").exists()


def test_rehearsal_runs_every_part_and_writes_the_files(tmp_path):
    out_dir = tmp_path / "session"
    out = run_sh("--rehearsal", "--out", str(out_dir), "--budget", "240")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == sorted(["session.json", "log.txt", "headline.json", "headline.png", "sweep.json", "sweep.png"])
    record = json.loads((out_dir / "session.json").read_text())
    status = {p["name"]: p["status"] for p in record["parts"]}
    assert status == {"wheels": "skipped", "gpu-tests": "ok", "headline": "ok", "sweep": "ok"}, status
    tests = record["parts"][1]["tests"]
    assert tests["counts"]["skipped"] == len(tests["cases"]) > 0  # the GPU tier skips without CUDA
    assert record["source"]["sha"], record["source"]
    assert record["verdict"]["measured"] is False  # never a verdict from a CPU run
    assert all(c["met"] is None for c in record["verdict"]["checks"])
    headline = record["parts"][2]["rows"]
    ours = [r for r in headline if r["provider"] == "grpo_kernels" and r["op"] == "fused_grpo"]
    assert ours and all(r["paths"]["schedule"] for r in ours), ours  # the schedule chosen is recorded
    report = json.loads((out_dir / "headline.json").read_text())
    assert report["git"]["sha"] == record["source"]["sha"]


def test_a_part_past_its_limit_is_killed_and_earlier_results_stay(tmp_path, monkeypatch):
    slow = gpu_session.Part("gpu-tests", "sleeps", 3, (), [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(gpu_session, "plan", lambda out, rehearsal: [slow])
    monkeypatch.setattr(gpu_session, "MIN_PART_S", 1)
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=True)
    session.parts[0].budget_s = 2
    code = session.run()
    record = json.loads((tmp_path / "session.json").read_text())
    assert code == 1
    assert record["parts"][0]["status"] == "timeout"
    assert record["parts"][0]["seconds"] < 30
    assert record["verdict"] == {"measured": False, "why": "no headline results (see the parts' status)"}


@pytest.mark.parametrize("argv", [["--budget", "10"], ["--bogus"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        gpu_session.main(argv)
    assert exc.value.code == 2
