"""The GPU session (benchmarks/gpu/run.sh) on CPU: the plan against the 15-minute lease, the wheel step, and
rehearsals on tiny shapes: a provider made to crash and one made to hang in headline rows (each costs exactly
its one row, named in session.json, and the verdict of the rows measured before stays), a call killed a third
of the way into its budget (the verdict of the headline rows measured before the kill is on disk), and a
resumed call that measures only what the first left out."""

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
from grpo_kernels.bench.runner import FLOOR

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
ROW_LIMIT = "60"  # seconds: what the planted hang costs (a tiny row takes seconds; TRL imports inside its first)


def _env(**extra):
    return {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
            "HOME": os.environ.get("HOME", "/tmp"), **extra}  # fmt: skip


def run_sh(*args, timeout=900, **env):
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


def _keys(rows, kind=None):
    return [r["key"] for r in rows if r.get("key") and r.get("kind") != "meta" and (kind is None or r["kind"] == kind)]


def test_dry_run_fits_the_lease_with_room_for_a_second_call(tmp_path):
    out = run_sh("--dry-run", "--out", str(tmp_path / "s"))
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "device time: 120 s machine start + 2 x (340 s command + 30 s transfers) = 860 s <= 900 s" in text, text
    assert "fits" in text and not (tmp_path / "s").exists(), "a dry run wrote files"
    lease = gpu_session.lease_plan()
    assert lease["fits"] and len(lease["calls"]) >= 2
    # the first call reaches the verdict's rows whatever else it reaches, and by its budgets the smoke check
    # and the microbenchmarks; a resumed call installs the wheels and checks the machine again
    # the first call: the GPU test tier first after preflight, then the verdict's rows (every peer beside the
    # floor); the sweep against TRL, the gap trace, csrc/'s kernel A check and the training step (at most ~3
    # minutes) fit the second call with its wheels and preflight
    assert lease["calls"][0] == ["wheels", "preflight", "gpu-tests", "headline"], lease["calls"]
    assert lease["calls"][1] == ["wheels", "preflight", "sweep-trl", "trace", "csrc", "step"], lease["calls"]
    step = next(p for p in lease["parts"] if p.name == "step")
    assert step.budget_s <= 180 and all(j.row_limit_s <= step.budget_s for j in step.jobs)
    assert all(c[:2] == ["wheels", "preflight"] for c in lease["calls"][1:])
    assert gpu_session.CALL_BUDGET_S + gpu_session.RESERVE_S <= gpu_session.CALL_LIMIT_S <= 600  # one command's limit
    headline = next(p for p in lease["parts"] if p.name == "headline")
    assert [j.argv[0] for j in headline.jobs] == ["interleaved"]  # every verdict row beside its floor
    assert int(headline.jobs[0].argv[headline.jobs[0].argv.index("--iters") + 1]) >= 20
    assert len(gpu_session.file_list()) <= gpu_session.MAX_FILES


def test_a_plan_that_does_not_fit_the_lease_fails_the_dry_run(monkeypatch, capsys):
    monkeypatch.setattr(gpu_session, "CALL_LIMIT_S", 400)  # 120 + 2 x 430 = 980 > 900
    assert gpu_session.print_plan(Path("/nonexistent"), rehearsal=False) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_the_verdict_rows_come_first_and_every_provider_has_one_place():
    parts = gpu_session.plan(False)
    names = [p.name for p in parts]
    assert names[:4] == ["wheels", "preflight", "gpu-tests", "headline"]
    # the sweep against TRL, the gap trace, csrc/'s kernel A check, then the training step (the second call)
    assert names[4:8] == ["sweep-trl", "trace", "csrc", "step"], names
    headline = next(p for p in parts if p.name == "headline")
    (job,) = headline.jobs  # one process: the floor and every verdict provider, timed in turns
    providers = job.argv[job.argv.index("--providers") + 1].split(",")
    assert providers == ["floor", *gpu_session.HEADLINE_PROVIDERS]
    # every peer the verdict judges is timed beside it, with the log-probs peers
    judged = {p for goals in gpu_session.TARGETS.values() for p in goals.get("faster_than", {})}
    assert judged <= set(providers) and {"liger-flsce", "cce", "verl-kernel", "liger-chunked-tuned"} <= judged
    assert {k.split("|")[1] for k in job.keys} == {"fused_grpo", "logprobs"}
    # every row that is not in the verdict comes after the verdict's rows
    assert all(names.index(n) > names.index("headline") for n in names
               if n not in ("wheels", "preflight", "gpu-tests", "headline"))  # fmt: skip
    placed = [set(gpu_session.HEADLINE_PROVIDERS), set(gpu_session.SCHEDULE_PROVIDERS),
              set(gpu_session.opt_in_providers()), set(gpu_session.EXCLUDED_PROVIDERS)]  # fmt: skip
    assert set().union(*placed) == set(REGISTRY.providers)
    assert sum(len(s) for s in placed) == len(REGISTRY.providers)  # disjoint
    assert gpu_session.opt_in_providers()[-1] == "torch-compile"  # compiles inside its row: last
    assert "one_pass_dz" not in gpu_session.core_schedules()
    opt_in = [i for i, p in enumerate(parts) for j in p.jobs if "--opt-in" in j.argv]
    core = [names.index(n) for n in ("headline", "smoke", "micro", "schedules", "sweep")]
    assert opt_in and min(opt_in) > max(core)
    # the rows of the other schedules and opt-in providers share the headline's floor (one report)
    for name in ("schedules", "opt-in"):
        part = next(p for p in parts if p.name == name)
        assert all(gpu_session._row_part(j) == "headline" for j in part.jobs)


def test_make_wheels_dry_run_names_every_peer_for_cp312(tmp_path):
    out = run_sh("make-wheels", "--dry-run", "--dest", str(tmp_path / "whl"))
    assert out.returncode == 0, out.stderr
    for pin in ("trl==1.16.0", "liger-kernel==0.8.5", "cut-cross-entropy==25.1.1", "verl==0.9.1", "--python-version 3.12",
                "--only-binary=:all:"):  # fmt: skip
        assert pin in out.stdout, out.stdout
    assert not (tmp_path / "whl").exists()


def test_a_failed_wheel_costs_its_providers_only():
    trl = {"trl", "trl-materialised"}  # TRL's fused head and its materialised path: both TRL code
    assert set(gpu_session._wheel_providers("trl-1.16.0-py3-none-any.whl")) == trl
    assert set(gpu_session._wheel_providers("multiprocess-0.70.19-py312-none-any.whl")) == trl
    assert set(gpu_session._wheel_providers("liger_kernel-0.8.5-py3-none-any.whl")) == {
        "liger-chunked", "liger-chunked-tuned", "liger-triton", "liger-flsce"}  # fmt: skip
    assert gpu_session._wheel_providers("cut_cross_entropy-25.1.1-py3-none-any.whl") == ["cce"]
    assert set(gpu_session._wheel_providers("verl-0.9.1-py3-none-any.whl")) == {"verl", "verl-torch", "verl-kernel"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One rehearsal of a whole call with a crash planted in TRL's first headline row and a hang in
    PyTorch eager's (each a fresh process measures the rest)."""
    pytest.importorskip("trl.trainer.grpo_trainer")  # TRL's rows are the verdict's; CI's environment has it
    out_dir = tmp_path_factory.mktemp("session") / "call1"
    # the first parts only (what a call cut short leaves), with room for the planted hang on a slow machine
    out = run_sh("--rehearsal", "--out", str(out_dir), "--row-limit", ROW_LIMIT, "--budget", "600",
                 "--parts", "wheels,preflight,gpu-tests,headline,smoke",
                 **{FAULT_ENV: "crash:trl,hang:torch-eager"})  # fmt: skip
    return out_dir, out


def test_rehearsal_a_crash_and_a_hang_cost_one_row_each_and_the_verdict_stays(rehearsal):
    out_dir, out = rehearsal
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # the headline lost rows
    assert set(p.name for p in out_dir.iterdir()) <= set(gpu_session.file_list())
    assert {"session.json", "log.txt", "results.jsonl", "verdict.json", "headline.json", "headline.png"} <= {
        p.name for p in out_dir.iterdir()}  # fmt: skip
    record = json.loads((out_dir / "session.json").read_text())
    call = record["calls"][-1]
    status = {p["name"]: p["status"] for p in call["parts"]}
    assert status["wheels"] == "skipped" and status["preflight"] == "ok" and status["headline"] == "partial", status
    # the GPU test tier ran first after preflight (every test skipped here: no CUDA) and recorded its result
    assert [p["name"] for p in call["parts"]][:4] == ["wheels", "preflight", "gpu-tests", "headline"]
    tier = next(p for p in call["parts"] if p["name"] == "gpu-tests")
    assert tier["status"] == "ok" and tier["tests"]["counts"]["skipped"] > 400, tier["tests"]["counts"]
    assert {c["test"].split("::")[0].rsplit(".", 1)[-1] for c in tier["tests"]["cases"]} == {"test_gpu_tier", "test_gpu"}
    lost = {r["key"]: r["status"] for r in record["lost_rows"]}
    # the first row of each provider in the job's order: log-probs first, at the smaller shape
    assert lost == {"headline|logprobs|trl|64": "crashed", "headline|logprobs|torch-eager|64": "timeout"}, lost
    assert "SIGABRT" in next(r["reason"] for r in record["lost_rows"] if r["status"] == "crashed")
    rows = read_rows(out_dir / "results.jsonl")
    bench = {r["key"]: r for r in rows if r["kind"] == "bench"}
    headline = next(p for p in gpu_session.plan(True) if p.name == "headline")
    expected = {k for j in headline.jobs for k in j.keys}
    assert expected <= set(bench)  # every other row of the two faulty providers was measured by a fresh process
    assert {k for k in expected if bench[k]["status"] == "ok"} == expected - set(lost)
    # the verdict: of the rows measured, TRL's lost fused row named; never a judgement off a GPU
    verdict = json.loads((out_dir / "verdict.json").read_text())
    assert verdict == record["verdict"] and verdict["measured"] is False
    assert all(c["met"] is None for c in verdict["checks"])
    fused = {c["check"]: c for c in verdict["checks"] if c["op"] == "fused_grpo"}
    assert fused["time <= 1.1x the GEMM floor"]["value"] > 0
    # the verdict reads the largest shape (the target on a GPU); the planted faults hit the first (64 tokens),
    # and a fresh process measured every later row of the two providers
    assert fused[">= 1.35x faster than trl"]["value"] > 0
    assert fused["faster than liger-chunked"]["met"] is None  # not run here (no CUDA for its compile): named
    logprobs = {c["check"]: c for c in verdict["checks"] if c["op"] == "logprobs"}
    assert logprobs["time <= 1.05x the GEMM floor"]["value"] > 0
    providers = {(r["op"], r["provider"]): r for r in verdict["rows"]}
    assert providers[("logprobs", "trl")]["median_ms"] > 0  # TRL's other rows, measured after the crash
    # every verdict row: its median with the 20th / 80th percentiles and the number of timed calls, interleaved
    timed = [r for r in verdict["rows"] if r["median_ms"]]
    assert timed and all(r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] and r["iters"] == 3 for r in timed), timed
    assert all("interleaved" in r["timer"] for r in timed)
    assert record["calls"][-1]["source"]["sha"]
    report = json.loads((out_dir / "headline.json").read_text())
    assert report["git"]["sha"] == record["calls"][-1]["source"]["sha"]
    ours = [r for r in report["results"] if r["provider"] == "grpo_kernels" and r["op"] == "fused_grpo"]
    assert ours and all(r["paths"]["schedule"] for r in ours), ours  # the schedule chosen is recorded
    assert all(r.get("x_floor") for r in report["results"] if r["status"] == "ok" and r["part"] == "headline")
    smoke = [r for r in rows if r["kind"] == "smoke" and r["part"] == "smoke"]
    assert smoke and all(r["status"] == "ok" for r in smoke)
    preflight = next(r for r in rows if r["kind"] == "preflight")
    assert preflight["key"] == "preflight|call1" and preflight["providers"]["trl"] == "ok"
    assert (out_dir / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the closing summary is the output's end: the verdict table, then what to do next
    tail = out.stdout[-4000:]
    assert "verdict (" in tail and "time <= 1.1x the GEMM floor" in tail and "lost rows:" in tail, tail
    assert "3 calls)" in tail, tail  # each verdict row with its p20-p80 and its number of calls


@pytest.fixture(scope="module")
def resumed(rehearsal, tmp_path_factory):
    """A second call resuming the first: every part the first did not reach, the training step's included."""
    first_dir, _ = rehearsal
    out_dir = tmp_path_factory.mktemp("session") / "call2"
    out = run_sh("--rehearsal", "--resume", str(first_dir), "--out", str(out_dir), "--budget", "900")
    return first_dir, out_dir, out


def test_a_resumed_call_measures_only_what_is_missing(resumed):
    first_dir, out_dir, out = resumed
    first = read_rows(first_dir / "results.jsonl")
    before = set(_keys(first))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_rows(out_dir / "results.jsonl")
    assert rows[: len(first)] == first  # the first call's rows, kept as they were
    new = _keys(rows[len(first):])
    assert new and not (set(new) - {"preflight|call2"}) & before, new  # nothing measured twice
    assert "preflight|call2" in new  # a fresh machine is checked again
    record = json.loads((out_dir / "session.json").read_text())
    assert [c["call"] for c in record["calls"]] == [1, 2]
    done = {p["name"] for p in record["calls"][1]["parts"] if p["status"] == "done"}
    # measured in call 1, not again; and the sweep's rows (the floor and ours) measured by sweep-trl just before
    assert done == {"gpu-tests", "headline", "smoke", "sweep"}, record["calls"][1]["parts"]
    assert {p["name"] for p in record["calls"][1]["parts"] if p["status"] == "ok"} >= {"preflight", "micro", "sweep-trl"}
    # the sweep against TRL: each size's rows timed in turns with its floor, judged at every size (never off a GPU)
    verdict = json.loads((out_dir / "verdict.json").read_text())
    sweep_checks = [c for c in verdict["checks"] if c["check"].endswith("tokens (sweep)")]
    assert [c["check"] for c in sweep_checks] == ["faster than trl at 64 tokens (sweep)",
                                                 "faster than trl at 256 tokens (sweep)"], verdict["checks"]
    assert all(c["value"] > 0 and c["met"] is None for c in sweep_checks)
    # after both calls every planned row is on disk (measured, skipped, or lost and named)
    planned = {k for p in gpu_session.plan(True, call=2) for j in p.jobs for k in j.keys if not k.startswith("preflight")}
    assert planned <= set(_keys(rows)), planned - set(_keys(rows))


def test_rehearsal_the_training_step_part(resumed):
    """The step part on CPU (grpo_kernels/bench/step.py, the GPU's code path on a tiny Qwen3, 2 steps): both
    sides of every pair gave the same loss before anything was timed, every side was timed with its phases,
    the memory walls were searched against the planted limit (each try its own process), and the report
    (session.json's "step") and its plot were written with the versions and the git sha."""
    from grpo_kernels.bench import step

    _, out_dir, out = resumed
    record = json.loads((out_dir / "session.json").read_text())
    part = next(p for p in record["calls"][-1]["parts"] if p["name"] == "step")
    assert part["status"] == "ok" and part["files"] == ["session.json", "step.png"], part
    rows = {r["key"]: r for r in read_rows(out_dir / "results.jsonl") if r.get("part") == "step"}
    assert set(rows) == set(step.session_rows(True)), set(rows) ^ set(step.session_rows(True))
    for key, row in rows.items():
        if row["kind"] != "step":
            continue
        assert row["status"] == "ok", (key, row.get("reason"), [s.get("reason") for s in row.get("sides", [])])
        for first, second in step.PAIRS:
            if second in row["parity"]:
                check = row["parity"][second]
                assert check["ok"] and check["diff"] <= check["tolerance"] < 1e-4, (key, second, check)
        for side in row["sides"]:
            assert side["status"] == "ok" and len(side["steps"]) == 2, (key, side)
            assert all(side["median_s"][ph] > 0 for ph in (*step.PHASES, "step")), side["median_s"]
            assert side["peak_memory_bytes"] is None and "CUDA only" in side["peak_memory_note"]
            assert side["tokens_per_s"] > 0 and side["tokens"] == row["shape"]["seqs"] * (
                row["shape"]["prompt"] + row["shape"]["completion"])  # fmt: skip
    assert {s["settings"]["lora"] for k in ("step|tiny-lora|trainer", "step|tiny-lora|trl")
            for s in rows[k]["sides"]} == {True}  # fmt: skip
    # the planted limit: the 4 x 64 logits fit, 4 x 128 do not (a tensor over 600 kB), on both sides
    for side in ("trainer-torch-head", "trainer-fused"):
        wall = rows[f"wall|tiny|length|{side}"]
        assert wall["planted_limit_bytes"] == step.REHEARSAL_PLANTED_BYTES and len(wall["tries"]) <= 3
        assert (wall["largest_ok"], wall["smallest_oom"]) == (64, 128), wall["tries"]
        assert "planted limit" in wall["tries"][-1]["reason"]
    seqs = rows["wall|tiny|seqs|trainer-torch-head"]  # the other axis: sequences at a fixed length
    assert (seqs["largest_ok"], seqs["smallest_oom"], seqs["exact"]) == (8, 16, True) and seqs["base"]["completion"] == 16, seqs["tries"]
    report = record["step"]
    assert report["schema"] == step.SCHEMA and report["measured"] is False
    assert report["git"]["sha"] == record["calls"][-1]["source"]["sha"]
    assert report["environment"]["trl"] == "1.16.0" and report["environment"]["torch"]
    assert {(p["stock"], p["ours"]) for p in report["pairs"]} == set(step.PAIRS)
    assert (out_dir / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep.png" not in {p.name for p in out_dir.iterdir()}  # drawn below the headline's panels
    tail = out.stdout[-4000:]  # the closing summary names each pair's step speed and each wall
    assert "step tiny: trl-stock -> trl-fused: " in tail and "wall tiny length trainer-fused: fits 64" in tail, tail


def test_the_memory_wall_search_is_bounded_and_exact_when_it_can_be():
    from grpo_kernels.bench.step import wall_search

    calls = []

    def fits(limit):
        def f(value):
            calls.append(value)
            return "ok" if value <= limit else "oom"

        return f

    r = wall_search(fits(700), lo=64, hi=4096, grid=64, tries=8)
    assert (r["largest_ok"], r["smallest_oom"], r["exact"]) == (640, 704, True) and len(r["tries"]) <= 8
    calls.clear()
    r = wall_search(fits(700), lo=64, hi=4096, grid=64, tries=3, guess=2000)  # a guess past the wall
    assert len(calls) == 3 and r["largest_ok"] is not None and not r["exact"] and r["smallest_oom"] <= 2000
    r = wall_search(fits(10**6), lo=64, hi=4096, grid=64, tries=10)  # no wall in the range
    assert (r["largest_ok"], r["smallest_oom"], r["exact"]) == (4096, None, True)
    r = wall_search(fits(0), lo=64, hi=4096, grid=64, tries=10)  # not even the smallest fits
    assert (r["largest_ok"], r["smallest_oom"], r["exact"]) == (None, 64, True)


def test_step_parity_refuses_to_time_a_side_whose_loss_differs(monkeypatch):
    """A side whose loss leaves its pair's by more than the dtype's tolerance is not timed, and says why."""
    import torch

    from grpo_kernels.bench import step

    assert step.parity_tolerance(1.0, 1024, torch.bfloat16) > 1e-3 > 1e-5 > step.parity_tolerance(1.0, 1024, torch.float32)
    losses = {"trainer-torch-head": 0.25, "trainer-fused": 0.25 + 1e-3}  # a head that is off by 1e-3

    class Fake:
        def __init__(self, side, *args):
            self.side = side

        def old(self, r):
            return torch.zeros(r["completion_ids"].shape)

        ref = old

        def loss_backward(self, r, old, ref):
            return losses[self.side]

        def zero_grad(self):
            pass

    timed = []
    monkeypatch.setattr(step, "make_side", lambda side, *a: Fake(side))
    monkeypatch.setattr(step, "time_side", lambda side, *a: timed.append(side) or {"side": side, "status": "ok"})
    row = step.run_family("trainer", "tiny", step.Shape(2, 4, 8), 1, 0)
    fused = next(s for s in row["sides"] if s["side"] == "trainer-fused")
    assert timed == ["trainer-torch-head"] and fused["status"] == "parity-failed", row["sides"]
    assert "> tolerance" in fused["reason"] and row["parity"]["trainer-fused"]["diff"] > 9e-4


def _kill_workers_writing_to(out_dir: Path) -> None:
    """SIGKILL every process whose command line names `out_dir`: the session starts each worker in a process
    group of its own (to kill it on a timeout), so killing the session's group leaves the worker running."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if str(out_dir) in (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read


def test_a_call_killed_a_third_into_its_budget_keeps_the_verdict_of_the_rows_before(tmp_path):
    budget = 90
    out_dir = tmp_path / "killed"
    proc = subprocess.Popen(["bash", str(RUN), "--rehearsal", "--parts", "headline", "--budget", str(budget),
                             "--row-limit", "600", "--out", str(out_dir)],
                            env=_env(**{FAULT_ENV: "hang:fused_grpo|torch-eager|256"}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    results, start = out_dir / "results.jsonl", time.monotonic()
    needed = {"headline|fused_grpo|floor|64", "headline|fused_grpo|grpo_kernels|64"}
    try:  # a third of the budget, and no sooner than the first rows of ours and the floor (a slow machine)
        while time.monotonic() - start < 300 and proc.poll() is None:
            if time.monotonic() - start >= budget / 3 and needed <= set(_keys(read_rows(results))):
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session, mid-run
        proc.wait()
        _kill_workers_writing_to(out_dir)  # its worker runs in a session of its own (the planted hang waits on)
    rows = read_rows(results)
    assert needed <= set(_keys(rows)), _keys(rows)
    verdict = json.loads((out_dir / "verdict.json").read_text())
    measured = {(r["op"], r["provider"]) for r in verdict["rows"] if r["median_ms"]}
    assert ("fused_grpo", "floor") in measured and ("fused_grpo", "grpo_kernels") in measured, verdict
    check = next(c for c in verdict["checks"] if c["check"] == "time <= 1.1x the GEMM floor")
    assert check["value"] > 0
    record = json.loads((out_dir / "session.json").read_text())  # written before the part started
    assert record["calls"][-1]["parts"][-1] == {**record["calls"][-1]["parts"][-1], "name": "headline",
                                                  "status": "running"}  # fmt: skip


def test_a_part_past_its_limit_is_killed_and_earlier_results_stay(tmp_path):
    script = ("import time; print('tests/t.py::test_a[x] PASSED', flush=True); "
              "print('[gw0] [ 9%] FAILED tests/t.py::test_b[grpo-packed]', flush=True); time.sleep(60)")  # fmt: skip
    slow = gpu_session.Part("gpu-tests", "sleeps", 3, "tests", command=[sys.executable, "-c", script])
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=True, parts=[slow])
    start = time.monotonic()
    gpu_session.MIN_PART_S, saved = 1, gpu_session.MIN_PART_S
    try:
        code = session.run()
    finally:
        gpu_session.MIN_PART_S = saved
    record = json.loads((tmp_path / "session.json").read_text())
    assert code == 1
    assert record["calls"][0]["parts"][0]["status"] == "timeout"
    # a tier cut at its limit still names what passed and what failed (its -v lines in log.txt)
    tests = record["calls"][0]["parts"][0]["tests"]
    assert tests["counts"]["passed"] == 1 and tests["cases"] == [
        {"test": "tests/t.py::test_b[grpo-packed]", "outcome": "failed"}], tests  # fmt: skip
    assert time.monotonic() - start < 30
    assert record["verdict"]["measured"] is False and "no headline results" in record["verdict"]["why"]


def _csrc_part(script: str, budget: int = 20) -> "gpu_session.Part":
    # what benchmarks/gpu/csrc_check.py does: one JSON file at --out, rewritten after each phase
    return gpu_session.Part("csrc", "a stand-in for csrc_check.py", budget, "script",
                            command=[sys.executable, "-c", script])  # fmt: skip


def test_the_csrc_part_lands_in_session_json_and_a_finished_one_is_not_run_again(tmp_path):
    script = ("import json, sys; out = sys.argv[sys.argv.index('--out') + 1]; json.dump({'checks': ["
              "{'case': 'small bf16', 'ok': True}, {'case': 'target bf16', 'ok': False}], 'all_checks_ok': False}, "
              "open(out, 'w')); sys.exit(0)")  # fmt: skip
    session = gpu_session.Session(tmp_path / "a", budget_s=60, rehearsal=False, parts=[_csrc_part(script)])
    gpu_session.MIN_PART_S, saved = 1, gpu_session.MIN_PART_S
    try:
        assert session.run() == 0
        record = json.loads((tmp_path / "a" / "session.json").read_text())
        assert record["calls"][0]["parts"][0]["status"] == "ok", record["calls"][0]["parts"][0]
        assert record["csrc"]["checks"][1] == {"case": "target bf16", "ok": False}, record["csrc"]
        summary = gpu_session.closing_summary(record, gpu_session.read_rows(tmp_path / "a" / "results.jsonl"),
                                              tmp_path / "a")  # fmt: skip
        assert "csrc kernel A" in summary and "1/2 checks ok (wrong: target bf16)" in summary, summary
        # a resumed call keeps the part's JSON and does not run it again (a command that would fail)
        again = gpu_session.Session(tmp_path / "b", budget_s=60, rehearsal=False, resume=tmp_path / "a",
                                    parts=[_csrc_part("import sys; sys.exit(3)")])  # fmt: skip
        assert again.run() == 0
    finally:
        gpu_session.MIN_PART_S = saved
    record = json.loads((tmp_path / "b" / "session.json").read_text())
    assert record["csrc"]["all_checks_ok"] is False and record["calls"][-1]["parts"][0]["status"] != "failed"


def test_a_csrc_part_cut_at_its_limit_keeps_what_it_wrote(tmp_path):
    script = ("import json, sys, time; out = sys.argv[sys.argv.index('--out') + 1]; "
              "json.dump({'phase': 'checked', 'all_checks_ok': True}, open(out, 'w')); time.sleep(60)")  # fmt: skip
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=False, parts=[_csrc_part(script, budget=3)])
    gpu_session.MIN_PART_S, saved = 1, gpu_session.MIN_PART_S
    start = time.monotonic()
    try:
        assert session.run() == 1
    finally:
        gpu_session.MIN_PART_S = saved
    record = json.loads((tmp_path / "session.json").read_text())
    assert record["calls"][0]["parts"][0]["status"] == "timeout"
    assert record["csrc"] == {"phase": "checked", "all_checks_ok": True}
    assert time.monotonic() - start < 30


def test_the_stamp_names_the_commit_only_for_the_tree_it_was_made_from(tmp_path):
    if gpu_session._git("rev-parse", "HEAD") is None:
        pytest.skip("not a git checkout")
    stamp = gpu_session.stamp_source(tmp_path)
    assert stamp["digest"] and stamp["sha"] == gpu_session._git("rev-parse", "HEAD")
    assert "grpo_kernels/bench/gpu_session.py" in stamp["files"] and not any(f.startswith(".whl") for f in stamp["files"])
    fake = dict(stamp, sha="f" * 40)
    (tmp_path / "SOURCE.json").write_text(json.dumps(fake))
    info = gpu_session._source_info(tmp_path / "SOURCE.json")
    assert info["sha"] == "f" * 40 and "digest equal" in info["from"]  # what a GPU machine's old git gets
    (tmp_path / "SOURCE.json").write_text(json.dumps(dict(fake, digest="0" * 64)))
    info = gpu_session._source_info(tmp_path / "SOURCE.json")
    assert info["sha"] == stamp["sha"] and info["from"] == "git" and "differ" in info["stamp_ignored"]


@pytest.mark.parametrize("argv", [["--budget", "10"], ["--bogus"], ["--parts", "nope"], ["--call", "2"],
                                  ["--resume", "/nonexistent-folder"]])  # fmt: skip
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


def test_the_closing_summary_names_the_slowest_kernels_against_their_ceilings():
    rows = [{"kind": "micro", "status": "ok", "case": "ceiling-gemm", "tflops": 798, "pct_measured_tflops": 100.0},
            {"kind": "micro", "status": "ok", "case": "kernel-a", "median_ms": 35.7, "tflops": 571, "pct_measured_tflops": 71.6},
            {"kind": "micro", "status": "ok", "case": "loss-head", "median_ms": 2.2, "gbps": 8.1, "pct_measured_gbps": 0.27},
            {"kind": "micro", "status": "ok", "case": "cublas-logits", "median_ms": 29.3, "tflops": 696, "pct_measured_tflops": 87.2},
            {"kind": "micro", "status": "ok", "case": "backward", "median_ms": 98.8, "tflops": 619, "pct_measured_tflops": 77.6}]  # fmt: skip
    slow = gpu_session.slowest_kernels(rows)
    assert [c["case"] for c in slow] == ["loss-head", "kernel-a", "backward"]
    record = {"verdict": {"device": "NVIDIA H100", "rows": [], "checks": [
        {"op": "fused_grpo", "check": "time <= 1.2x the GEMM floor", "value": 1.3, "met": False}]},
        "lost_rows": [], "calls": [{"parts": [{"name": "profile", "status": "skipped", "reason": "out of time (3 s left)"}]}]}  # fmt: skip
    text = gpu_session.closing_summary(record, rows, Path("/out"))
    assert "[MISSED] fused_grpo: time <= 1.2x the GEMM floor: 1.300" in text
    assert text.index("loss-head") < text.index("kernel-a") and "--resume" in text


def test_the_diagnostic_scripts_run_their_flow_on_cpu(tmp_path):
    """benchmarks/gpu/probe.py and trace_gaps.py on a tiny CPU shape: each writes its JSON (the numbers are
    the GPU's to give)."""
    probe = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "probe.py"), "--rehearsal", "--only",
                            "fused", "--warmup", "0", "--iters", "1", "--out", str(tmp_path / "p")],
                           capture_output=True, text=True, timeout=600, env=_env())  # fmt: skip
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    record = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert [r["name"] for r in record["rows"]][:2] == ["fused floor (3 cuBLAS GEMMs)",
                                                      "fused auto, max_extra_memory default 1.5 GiB"]  # fmt: skip
    assert all(r.get("median_ms", 0) > 0 for r in record["rows"]), record["rows"]
    gaps = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "trace_gaps.py"), "--out",
                           str(tmp_path / "g")], capture_output=True, text=True, timeout=600, env=_env())  # fmt: skip
    assert gaps.returncode == 0, gaps.stdout[-2000:] + gaps.stderr[-2000:]
    assert json.loads((tmp_path / "g" / "gaps.json").read_text())["call_ms"] > 0
    assert (tmp_path / "g" / "trace.json.gz").stat().st_size > 0
    # the session's "trace" part: one JSON file (session.json's "trace"), the Chrome trace kept out of $OUT
    one = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "trace_gaps.py"), "--out",
                          str(tmp_path / "t.json")], capture_output=True, text=True, timeout=600, env=_env())  # fmt: skip
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["call_ms"] > 0 and not Path(record["chrome_trace"]).is_relative_to(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "p", "t.json"]


# ------------------------------------------------------------------------------------------------
# The csrc gate beside the GPU test tier (stand-ins for csrc_check.py --gate and for the tier)
# ------------------------------------------------------------------------------------------------
_TIER = ("import os, sys; sys.path.insert(0, 'tests'); from test_gpu_tier import csrc_gate_verdict; "
         f"print('the tier saw the gate:', csrc_gate_verdict(os.environ['{gpu_session.CSRC_GATE_ENV}'])['status'])")
_GATES = {  # what the gate's JSON holds at its end (csrc_check.py rewrites it after each phase)
    "ok": "{'phase': 'kernel C checked', 'loaded': True, 'gate': [{'case': 'A-small', 'ok': True}], 'gate_ok': True}",
    "wrong": "{'phase': 'kernel C checked', 'loaded': True, 'gate': [{'case': 'A-small', 'ok': True}, "
             "{'case': 'backward-wide', 'ok': False}], 'gate_ok': False}",
    "hung": "{'phase': 'kernel A checked', 'loaded': True}",
    "crashed": "{'phase': 'loaded', 'loaded': True}",
    "inconclusive": "{'phase': 'loaded', 'loaded': True}",
    "not loaded": "{'phase': 'done', 'loaded': False, 'why_not': 'csrc library: not an sm_90 device'}",
}


def _gate_script(outcome: str) -> str:
    end = {"hung": "time.sleep(60)", "crashed": "sys.exit('RuntimeError: CUDA error: an illegal memory access')",
           "inconclusive": "sys.exit('TypeError: a bug in the gate itself')"}.get(outcome, "")
    return (f"import json, sys, time; out = sys.argv[sys.argv.index('--out') + 1]; "
            f"json.dump({_GATES[outcome]}, open(out, 'w')); {end}")


def _gate_session(folder, outcome, resume=None):
    parts = [gpu_session.Part("gpu-tests", "a stand-in tier", 40, "tests", command=[sys.executable, "-c", _TIER],
                              beside=[sys.executable, "-c", _gate_script(outcome)]),
             _csrc_part("import json, sys; json.dump({'all_checks_ok': False}, "
                        "open(sys.argv[sys.argv.index('--out') + 1], 'w'))")]  # fmt: skip
    return gpu_session.Session(folder, budget_s=90, rehearsal=False, parts=parts, resume=resume)


@pytest.mark.parametrize("outcome", list(_GATES))
def test_the_csrc_gate_beside_the_tier_skips_the_csrc_providers_unless_ok(outcome, tmp_path, monkeypatch):
    """The gate runs beside the tier and is killed at its limit; the tier's csrc tests read its verdict (a hung
    gate fails them at once instead of hanging a worker); anything but ok skips the csrc providers with the
    reason, for the call and a resumed one; a hung or crashed gate skips the csrc part too (it would hang or
    crash again), a wrong one leaves it to say where; a gate whose own Python failed (inconclusive) skips nothing."""
    monkeypatch.setattr(gpu_session, "CSRC_GATE_LIMIT_S", 3)
    monkeypatch.setattr(gpu_session, "MIN_PART_S", 1)
    start = time.monotonic()
    _gate_session(tmp_path / "a", outcome).run()
    assert time.monotonic() - start < 60  # the stand-in hang sleeps 60 s: killed at the gate's 3 s limit
    record = json.loads((tmp_path / "a" / "session.json").read_text())
    gate = record["csrc_gate"]
    assert gate["status"] == outcome, gate
    log = (tmp_path / "a" / "log.txt").read_text()
    assert f"the tier saw the gate: {outcome}" in log, log[-2000:]
    skipped = {p: why for p, why in record["skipped_providers"].items() if p in gpu_session.CSRC_PROVIDERS}
    if outcome in ("ok", "inconclusive"):  # inconclusive: the gate's own code failed, nothing known of csrc
        assert not skipped, skipped
    else:
        assert set(skipped) == set(gpu_session.CSRC_PROVIDERS), skipped
        assert all(why.startswith(f"the csrc gate: {outcome}: ") for why in skipped.values()), skipped
    reason = {"wrong": "1 of 2 checks: backward-wide",
              "hung": "not done within 3 s (the last phase it finished: kernel A checked)",
              "crashed": "an illegal memory access", "not loaded": "not an sm_90 device",
              "inconclusive": "a bug in the gate itself"}
    assert reason.get(outcome, "1 checks") in gate["reason"], gate
    if outcome in ("ok", "wrong"):  # each case of the gate, for the next session to act on
        assert gate["checks"][0] == {"case": "A-small", "ok": True}, gate
    csrc = record["calls"][0]["parts"][1]
    assert csrc["status"] == ("skipped" if outcome in ("hung", "crashed") else "ok"), csrc
    summary = gpu_session.closing_summary(record, read_rows(tmp_path / "a" / "results.jsonl"), tmp_path / "a")
    assert f"csrc gate (session.json \"csrc_gate\"): {outcome}" in summary, summary
    if outcome == "hung":  # a resumed call keeps the verdict (and the skips) and runs neither the tier nor the gate
        again = _gate_session(tmp_path / "b", "ok", resume=tmp_path / "a")
        assert set(gpu_session.CSRC_PROVIDERS) <= set(again.record["skipped_providers"])
        again.run()
        record = json.loads((tmp_path / "b" / "session.json").read_text())
        assert record["csrc_gate"]["status"] == "hung"
        assert [p["status"] for p in record["calls"][1]["parts"]] == ["done", "done"], record["calls"][1]["parts"]


def test_a_lost_csrc_row_skips_every_csrc_provider(tmp_path):
    """One library: a csrc row that hangs or crashes the headline's process stops the other csrc providers from
    being tried (each would cost its row limit and a fresh process for the rest of the shape), and the csrc part;
    a csrc row cut by its part's clock says nothing of the library."""
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=False, parts=[])
    job = gpu_session._interleaved_job("headline", (FLOOR, "grpo_kernels", *gpu_session.CSRC_PROVIDERS),
                                       ("logprobs",), "qwen3-8b", [], None)  # fmt: skip
    key = next(k for k in job.keys if k.split("|")[2] == "grpo_kernels-csrc")
    part = gpu_session.Part("headline", "", 10)
    session.lose(part, job, key, "timeout", "timeout: the part's time limit")  # the clock's, not csrc's doing
    assert session.record["csrc_gate"] is None and not session.record["skipped_providers"]
    session.lose(part, job, key, "timeout", "timeout: the row ran past its limit of 60 s")
    assert session.record["csrc_gate"]["status"] == "hung" and key in session.record["csrc_gate"]["reason"]
    assert set(gpu_session.CSRC_PROVIDERS) <= set(session.record["skipped_providers"])
    assert "grpo_kernels" not in session.record["skipped_providers"]


def test_an_interleaved_row_is_held_to_its_own_providers_limit(tmp_path):
    """In the headline's one process each gate and timed call is announced by key: a provider that hangs is
    killed at its own limit (ROW_LIMITS, else ROW_LIMIT_S), not at the slowest compiler's (liger-chunked-tuned's
    150 s); --row-limit sets them all."""
    providers = (FLOOR, "grpo_kernels", "liger-chunked-tuned", "grpo_kernels-csrc")
    job = gpu_session._interleaved_job("headline", providers, ("logprobs", "fused_grpo"), "qwen3-8b", [], None)
    by_provider = {k.split("|")[2]: limit for k, limit in job.key_limits.items()}
    assert by_provider == {FLOOR: gpu_session.ROW_LIMIT_S, "grpo_kernels": gpu_session.ROW_LIMIT_S,
                           "liger-chunked-tuned": 150, "grpo_kernels-csrc": gpu_session.ROW_LIMIT_S}  # fmt: skip
    assert job.row_limit_s == 150
    assert not gpu_session._interleaved_job("headline", providers, ("logprobs",), "qwen3-8b", [], 5).key_limits
    session = gpu_session.Session(tmp_path, budget_s=60, rehearsal=False, parts=[])
    hang = [sys.executable, "-c", "import time; print('@@start fast', flush=True); time.sleep(0.5); "
            "print('@@end fast', flush=True); print('@@start slow', flush=True); time.sleep(60)"]  # fmt: skip
    start = time.monotonic()
    code, key, why, _ = session.watch(hang, 30, time.monotonic() + 50, key_limits={"slow": 2, "fast": 5})
    assert (code, key, why) == (None, "slow", "timeout: the row ran past its limit of 2 s")
    assert time.monotonic() - start < 20
