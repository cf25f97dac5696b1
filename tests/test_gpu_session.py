"""The GPU session (benchmarks/gpu/run.sh) on CPU: the plan of both calls and its time, the wheel step,
and a rehearsal of call 1 on tiny shapes with a provider made to crash and one made to hang (each costs
exactly its one row, named in session.json, and everything else completes); rows on disk the moment they
are measured (a session killed mid-run keeps them); call 2's opt-in rows and profile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kernels.bench import gpu_session
from grpo_kernels.bench.providers import REGISTRY
from grpo_kernels.bench.session_worker import FAULT_ENV, read_rows

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
ROW_LIMIT = "15"  # seconds: what the planted hang costs (a tiny row takes well under a second)


def _env(**extra):
    return {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
            **extra}  # fmt: skip


def run_sh(*args, timeout=600, **env):
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


def test_dry_run_prints_both_calls_within_twenty_minutes_of_device_time(tmp_path):
    out = run_sh("--dry-run", "--out", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    call1, call2 = text.split("\ncall 2:")
    order = [
        "[wheels]",
        "[preflight]",
        "[smoke]",
        "[micro]",
        "[headline]",
        "[sweep]",
        "[gpu-tests]",
        "[opt-in-kernels]",
    ]
    assert [call1.index(p) for p in order] == sorted(call1.index(p) for p in order), call1
    for part in ("[smoke-opt-in]", "[opt-in]", "[profile]", "grpo_kernels-one-pass-dz", "grpo_kernels-tma"):
        assert part in call2, call2
    assert "one_pass_dz" not in call1 and "grpo_kernels-tma" not in call1  # item 6; TMA only as micro cases
    total = int(text.split("machine start = ")[1].split(" s")[0])
    assert total <= gpu_session.DEVICE_TIME_S == 1200, text
    for call in (1, 2):
        assert (
            sum(p.budget_s for p in gpu_session.plan(call, False)) + gpu_session.RESERVE_S
            <= gpu_session.CALL_BUDGET_S[call]
        )
        assert len(gpu_session.file_list(call)) <= gpu_session.MAX_FILES
    assert gpu_session.CALL_BUDGET_S[1] < 600  # the GPU machine's 10-minute command limit
    assert not (tmp_path / "s").exists(), "a dry run wrote files"


def test_every_provider_has_one_place_and_the_opt_in_kernels_come_after_the_core_rows():
    call1 = set(gpu_session.CALL1_PROVIDERS)
    call2 = set(gpu_session.call2_providers())
    excluded = set(gpu_session.EXCLUDED_PROVIDERS)
    assert call1 | call2 | excluded == set(REGISTRY.providers)
    assert not (call1 & call2) and not (call1 & excluded) and not (call2 & excluded)
    assert gpu_session.call2_providers()[-1] == "torch-compile"  # compiles inside its row: last
    assert "one_pass_dz" not in gpu_session.core_schedules()
    parts = gpu_session.plan(1, False)
    opt_in = [i for i, p in enumerate(parts) for j in p.jobs if "--opt-in" in j.argv]
    core = [i for i, p in enumerate(parts) if p.name in ("smoke", "micro", "headline", "sweep")]
    assert opt_in and min(opt_in) > max(core)


def test_make_wheels_dry_run_names_every_peer_for_cp312(tmp_path):
    out = run_sh("make-wheels", "--dry-run", "--dest", str(tmp_path / "whl"))
    assert out.returncode == 0, out.stderr
    for pin in ("trl==1.16.0", "liger-kernel==0.8.5", "cut-cross-entropy==25.1.1", "--python-version 3.12",
                "--only-binary=:all:"):  # fmt: skip
        assert pin in out.stdout, out.stdout
    assert not (tmp_path / "whl").exists()


def test_rehearsal_a_crash_and_a_hang_cost_one_row_each(tmp_path):
    out_dir = tmp_path / "session"
    fault = "crash:torch-eager,hang:grpo_kernels-low-memory"
    out = run_sh("--rehearsal", "--out", str(out_dir), "--row-limit", ROW_LIMIT, **{FAULT_ENV: fault})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # a part lost rows
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(gpu_session.file_list(1))
    record = json.loads((out_dir / "session.json").read_text())
    status = {p["name"]: p["status"] for p in record["parts"]}
    assert status == {"wheels": "skipped", "preflight": "ok", "smoke": "ok", "micro": "ok", "headline": "partial",
                      "sweep": "ok", "gpu-tests": "ok", "opt-in-kernels": "ok"}, status  # fmt: skip
    lost = {r["key"]: r["status"] for r in record["lost_rows"]}
    assert lost == {"headline|fused_grpo|torch-eager|64": "crashed",
                    "headline|fused_grpo|grpo_kernels-low-memory|64": "timeout"}, lost  # fmt: skip
    assert "SIGABRT" in record["lost_rows"][0]["reason"] + record["lost_rows"][1]["reason"]
    # every other row of the two faulty providers was measured by a fresh process
    rows = read_rows(out_dir / "results.jsonl")
    bench = {r["key"]: r for r in rows if r["kind"] == "bench"}
    expected = {
        k for job in gpu_session.plan(1, True) for j in job.jobs if j.argv[0] == "bench" for k in j.keys
    }
    assert set(bench) == expected
    ok = {k for k, r in bench.items() if r["status"] == "ok"}
    assert ok == expected - set(lost)
    tests = next(p for p in record["parts"] if p["name"] == "gpu-tests")["tests"]
    assert tests["counts"]["skipped"] == len(tests["cases"]) > 0  # the GPU tier skips without CUDA
    assert record["source"]["sha"], record["source"]
    assert record["verdict"]["measured"] is False  # never a verdict from a CPU run
    assert all(c["met"] is None for c in record["verdict"]["checks"])
    report = json.loads((out_dir / "headline.json").read_text())
    assert report["git"]["sha"] == record["source"]["sha"]
    assert {r["part"] for r in report["results"]} == {"headline", "sweep"}
    crashed = next(r for r in report["results"] if r.get("status") == "crashed")
    assert crashed["provider"] == "torch-eager" and crashed["op"] == "fused_grpo"
    ours = [r for r in report["results"] if r["provider"] == "grpo_kernels" and r["op"] == "fused_grpo"]
    assert ours and all(r["paths"]["schedule"] for r in ours), ours  # the schedule chosen is recorded
    assert all(r.get("x_floor") for r in report["results"] if r["status"] == "ok")
    smoke = [r for r in rows if r["kind"] == "smoke"]
    assert len(smoke) == 2 * (3 + len(gpu_session.REHEARSAL_SCHEDULES)) and all(
        r["status"] == "ok" for r in smoke
    )
    micro = {r["case"]: r["status"] for r in rows if r["kind"] == "micro"}
    assert micro["ceiling-gemm"] == micro["cublas-logits"] == "ok" and micro["kernel-a-tma"] == "skipped"
    for png in ("headline.png", "sweep.png", "kernels.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_are_on_disk_as_measured_and_a_killed_session_keeps_them(tmp_path):
    out_dir = tmp_path / "killed"
    proc = subprocess.Popen(["bash", str(RUN), "--rehearsal", "--parts", "headline", "--out", str(out_dir)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    results = out_dir / "results.jsonl"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            bench = [r for r in read_rows(results) if r.get("kind") == "bench"]
            if len(bench) >= 3:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session and its worker, mid-run
        proc.wait()
    assert len(bench) >= 3, "no rows appeared while the session ran"
    kept = [r for r in read_rows(results) if r.get("kind") == "bench"]
    assert [r["key"] for r in kept[: len(bench)]] == [r["key"] for r in bench]
    assert all(r["status"] == "ok" and r["time"]["median_ms"] > 0 for r in kept)
    record = json.loads((out_dir / "session.json").read_text())  # written before the part started
    assert record["parts"][-1]["name"] == "headline" and record["parts"][-1]["status"] == "running"


def test_call_two_rehearsal_runs_the_opt_in_providers_and_the_profile(tmp_path):
    out_dir = tmp_path / "call2"
    out = run_sh("--call", "2", "--rehearsal", "--parts", "opt-in,profile", "--out", str(out_dir))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_rows(out_dir / "results.jsonl")
    tp = [r for r in rows if r.get("provider") == "grpo_kernels-tp"]
    assert tp and all(r["status"] == "ok" and "TP = 1" in r["impl"] for r in tp)  # a 1-rank group, no socket
    profile = {r["key"]: r for r in rows if r["kind"] == "profile"}
    assert profile["profile|torch.profiler"]["top"], profile
    assert {profile["profile|ncu"]["status"], profile["profile|nsys"]["status"]} <= {"ok", "skipped"}
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(gpu_session.file_list(2))


def test_a_part_past_its_limit_is_killed_and_earlier_results_stay(tmp_path):
    slow = gpu_session.Part(
        "gpu-tests", "sleeps", 3, "tests", command=[sys.executable, "-c", "import time; time.sleep(60)"]
    )
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=True, parts=[slow])
    start = time.monotonic()
    gpu_session.MIN_PART_S, saved = 1, gpu_session.MIN_PART_S
    try:
        code = session.run()
    finally:
        gpu_session.MIN_PART_S = saved
    record = json.loads((tmp_path / "session.json").read_text())
    assert code == 1
    assert record["parts"][0]["status"] == "timeout"
    assert time.monotonic() - start < 30
    assert record["verdict"] == {"measured": False, "why": "no headline results (see the parts' status)"}


@pytest.mark.parametrize("argv", [["--budget", "10"], ["--bogus"], ["--parts", "nope"], ["--call", "3"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        gpu_session.main(argv)
    assert exc.value.code == 2


def test_device_peaks_by_name_and_the_shares_of_them():
    from grpo_kernels.bench.microbench import device_peaks, rates

    assert device_peaks("NVIDIA H100 80GB HBM3")["part"] == "H100 SXM 80 GB"
    assert device_peaks("NVIDIA H200")["hbm_tbps"] == 4.8
    assert device_peaks("NVIDIA H100 PCIe")["bf16_tflops"] == 756.0
    assert device_peaks("NVIDIA A100-SXM4-80GB") is None  # unknown: no share of a datasheet is claimed
    peaks = device_peaks("NVIDIA H100 80GB HBM3")
    # 1 ms for 494.5 GFLOP and 1.675 GB: half the datasheet's 989 TF/s and 3.35 TB/s
    r = rates(1e-3, 494.5e9, 1.675e9, peaks, {"tflops": 791.2, "gbps": 3000.0})
    assert r["tflops"] == pytest.approx(494.5) and r["gbps"] == pytest.approx(1675.0)
    assert r["pct_datasheet_tflops"] == pytest.approx(50.0) and r["pct_datasheet_gbps"] == pytest.approx(50.0)
    assert r["pct_measured_tflops"] == pytest.approx(62.5) and r["pct_measured_gbps"] == pytest.approx(
        55.83, abs=0.01
    )
    assert "pct_datasheet_tflops" not in rates(1e-3, 1e9, 0, None, {})
