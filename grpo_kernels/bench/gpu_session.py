"""Two commands on a GPU machine give the whole verdict: `bash benchmarks/gpu/run.sh` (call 1), then
`bash benchmarks/gpu/run.sh --call 2`. Built so that a first GPU lease cannot be wasted.

A GPU machine here has no network, at most 10 minutes per command, 30 minutes of device time per
session and keeps 8 result files; the two calls are planned to fit 20 minutes of device time with
both machine starts (`--dry-run` prints the plan and the sum).

Isolation: every measurement runs in a child process (grpo_kernels/bench/session_worker.py), one per
provider, each row announced before it starts and appended to results.jsonl (flushed, fsync'd) the
moment it is measured. A row that crashes its process (a CUDA fault), hangs past its row limit or is
cut by its part's limit is recorded as lost (status "crashed" / "timeout", named in session.json's
`lost_rows`) and a fresh process measures the rest: one fault costs one row. The never-executed
opt-in kernels (TMA kernel A, the dz-in-GEMM kernels) run only after every core row.

Call 1 (under 10 minutes):
  wheels          install the carried peer wheels (.whl/, from `run.sh make-wheels`) into a private folder
  preflight       versions, the GPU and its datasheet peaks, which peers import, which profilers exist
  smoke           each kernel and fused-loss schedule against the PyTorch backend on the same bf16 inputs,
                  a small shape then the target; stops with a report at the first wrong one
  micro           per-kernel microbenchmarks at the target head (microbench.py): TF/s and GB/s against
                  the device's peaks and the ceilings measured in the same run
  headline        fused_grpo + logprobs at the target shape: the floor, then CALL1_PROVIDERS
  sweep           fused_grpo over 4k-64k tokens: the floor and SWEEP_PROVIDERS
  gpu-tests       the GPU test tier, tests/test_gpu.py
  opt-in-kernels  microbenchmarks of the opt-in kernels (TMA kernel A, one_pass_dz's dz kernels)
Call 2: wheels, preflight, the opt-in smoke (TMA kernel A, OPT_IN_SCHEDULES), every other provider of
the registry (opt-in variants, the other peers; torch-compile last), and a profile of the fused loss
(torch.profiler's kernel table; ncu on its three hottest kernels and nsys where they exist).

Files in the output folder: call 1 session.json, log.txt, results.jsonl, headline.json (the benchmark
report of the headline and sweep rows), headline.png, sweep.png, kernels.png; call 2 session.json,
log.txt, results.jsonl, optin.json, optin.png.

  python -m grpo_kernels.bench.gpu_session run [--call 1|2] [--out DIR] [--budget S] [--dry-run] [--rehearsal]
  python -m grpo_kernels.bench.gpu_session make-wheels [--dest .whl] [--dry-run]

--rehearsal runs the same flow on tiny CPU shapes with fewer providers (what CI does: the flow, the
isolation and the files, not the numbers).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .plots import empty_panel, line_style, offset
from .session_worker import (
    FLOOR,
    HEADLINE_OPS,
    RESTART,
    STOPPED,
    append,
    bench_keys,
    micro_keys,
    profile_keys,
    read_rows,
    smoke_keys,
)

SCHEMA = "grpo_kernels.gpu_session/2"
ROOT = Path(__file__).resolve().parents[2]  # the repository (a copy of it on the GPU machine)
CALL_BUDGET_S = {1: 570, 2: 400}  # each inside the 10-minute command limit
DEVICE_TIME_S = 20 * 60  # what both calls may spend together, the machine starts included
MACHINE_START_S = (
    90  # a fresh machine's start and the tree's transfer, per call (the device notes: "a minute or more")
)
RESERVE_S = 15  # kept back for writing session.json and the plots
MIN_PART_S = 20  # a part with less time than this left is skipped, not started
MAX_FILES = 8
WHEEL_LIMIT_BYTES = 48 * 2**20  # the tree travels too, under 64 MiB in all
ROW_LIMIT_S = (
    60  # one row (gate + timing + memory) at the target shape; the first compile of a kernel included
)
ROW_LIMITS = {"liger-chunked": 120, "torch-compile": 150}  # torch.compile inside the row
SMOKE_ROW_LIMIT_S = 90  # a smoke row compiles the kernels it runs first
STARTUP_LIMIT_S = 90  # a child that starts no row within this is stuck (imports, CUDA context)

# Peers the GPU image lacks, as cp312 wheels, with their own dependencies the image lacks too
# (the image has transformers, accelerate, pandas, pyarrow, xxhash, huggingface-hub, fsspec, ...).
PEER_WHEELS = (
    "trl==1.16.0",
    "liger-kernel==0.8.5",
    "cut-cross-entropy==25.1.1",
    "datasets==5.2.0",  # trl's import needs it
    "dill==0.4.1",  # datasets'
    "multiprocess==0.70.19",  # datasets'
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")

# Performance targets (the README's goals, checked on the headline shape)
TARGETS = {
    "fused_grpo": {"x_floor": 1.2, "extra_gib": 1.5, "faster_than": {"trl": 2.0, "liger-chunked": 2.0}},
    "logprobs": {"x_floor": 1.1},
}

# What runs where. Providers are names of grpo_kernels/bench/providers.py's REGISTRY; a provider the
# registry gains is measured in call 2 until its name is added to CALL1_PROVIDERS (one line), and a
# schedule fused/function.py's SCHEDULES gains is smoke-tested in call 1 unless it is in OPT_IN_SCHEDULES.
CALL1_PROVIDERS = (  # the core headline, in this order, after the floor: the verdict's rows first
    "grpo_kernels",  # schedule="auto"
    "trl",
    "liger-chunked",  # compiles its loss inside the row
    "torch-eager",
    "grpo_kernels-one-pass",
    "grpo_kernels-two-pass",
    "grpo_kernels-low-memory",
    # kernel A against the cuBLAS forward with grad_weight summed in place: "auto" (above) runs the cuBLAS
    # one at the target head by its time model; these two rows are what that choice should be checked by
    "grpo_kernels-one-pass-inplace",
    "grpo_kernels-one-pass-cublas",
)
SWEEP_PROVIDERS = ("grpo_kernels", "grpo_kernels-one-pass")  # auto (in place in bf16) against fp32 accumulation
OPT_IN_SCHEDULES = ("one_pass_dz",)  # call 2 only (README: estimated ~2x slower than one_pass)
# Not in any call: verl's wheel brings too much to carry; grpo_kernels-torch is the CPU backend.
EXCLUDED_PROVIDERS = ("verl", "verl-torch", "grpo_kernels-torch")
LAST_PROVIDERS = ("torch-compile",)  # call 2's end: inductor compiles inside the row
# The rehearsal (CPU, tiny shapes): the providers and schedules that run on the PyTorch backend.
REHEARSAL_CALL1 = ("grpo_kernels", "grpo_kernels-low-memory", "torch-eager")
REHEARSAL_SWEEP = ("grpo_kernels",)
REHEARSAL_CALL2 = ("grpo_kernels-batch-invariant", "grpo_kernels-tp")
REHEARSAL_SCHEDULES = ("auto", "low_memory")


def core_schedules() -> tuple[str, ...]:
    from ..ops.fused.function import SCHEDULES

    return tuple(s for s in SCHEDULES if s not in OPT_IN_SCHEDULES)


def call2_providers() -> tuple[str, ...]:
    from .providers import REGISTRY

    rest = [p for p in REGISTRY.providers
            if p not in CALL1_PROVIDERS and p not in EXCLUDED_PROVIDERS and p not in LAST_PROVIDERS]  # fmt: skip
    return tuple(rest) + tuple(p for p in LAST_PROVIDERS if p in REGISTRY.providers)


@dataclass
class Job:
    """One child process (restarted for the rows left after a crash or a time-out)."""

    label: str
    argv: list[str]  # the worker's arguments, the job's name first
    keys: list[str]  # the rows it measures, in order
    row_limit_s: float
    lost_fields: dict = field(default_factory=dict)  # key -> the fields a lost row of it carries


@dataclass
class Part:
    name: str
    what: str
    budget_s: int  # the most this part may take (less when less is left)
    kind: str = "rows"  # "rows" (jobs), "wheels", "tests"
    jobs: list[Job] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # "tests": the command


def _python() -> str:
    return sys.executable or "python3"


def _bench_job(part: str, provider: str, ops: tuple[str, ...], preset: str, common: list[str],
               row_limit: float | None) -> Job:  # fmt: skip
    keys = bench_keys(part, provider, ops, preset)
    lost = {k: {"op": op, "provider": provider, "shape": shape.as_dict(), "shape_label": shape.label,
                "impl": "", "parity": None, "time": None, "memory": None} for k, op, shape in keys}  # fmt: skip
    argv = ["bench", "--provider", provider, "--ops", ",".join(ops), "--shapes", preset, *common]
    return Job(
        provider, argv, [k for k, _, _ in keys], row_limit or ROW_LIMITS.get(provider, ROW_LIMIT_S), lost
    )


def plan(call: int, rehearsal: bool, row_limit: float | None = None) -> list[Part]:
    """The parts of one call, in order, with their budgets (the GPU plan; a rehearsal has the same
    parts on tiny shapes with the providers and schedules the PyTorch backend runs)."""
    timing = ["--warmup", "1", "--iters", "2"] if rehearsal else ["--warmup", "2", "--iters", "5"]
    sweep_timing = ["--warmup", "1", "--iters", "2"] if rehearsal else ["--warmup", "1", "--iters", "3"]
    flag = ["--rehearsal"] if rehearsal else []
    head, sweep = ("tiny", "tiny") if rehearsal else ("qwen3-8b", "session-sweep")

    def common(part: str, t=timing) -> list[str]:
        return ["--part", part, *t, *flag]

    def rows(name, what, budget, jobs):
        return Part(name, what, budget, "rows", jobs)

    wheels = Part("wheels", "install the carried peer wheels (.whl/) into a private folder", 20, "wheels")
    preflight = rows(
        "preflight",
        "versions, GPU and peaks, peers importable, profilers",
        30,
        [Job("preflight", ["preflight", *common("preflight")], ["preflight|preflight"], 60)],
    )
    if call == 1:
        schedules = REHEARSAL_SCHEDULES if rehearsal else core_schedules()
        providers = REHEARSAL_CALL1 if rehearsal else CALL1_PROVIDERS
        sweepers = REHEARSAL_SWEEP if rehearsal else SWEEP_PROVIDERS
        return [
            wheels,
            preflight,
            rows("smoke", f"kernel A, backward, loss head, schedules {', '.join(schedules)} vs the PyTorch "
                 "backend (bf16), small then target shape; stops at the first wrong", 100,
                 [Job("smoke", ["smoke", "--schedules", ",".join(schedules), *common("smoke")],
                      smoke_keys("smoke", schedules, False, rehearsal), row_limit or SMOKE_ROW_LIMIT_S)]),
            rows("micro", "per-kernel microbenchmarks (core kernels, cuBLAS at the same shapes, ceilings)", 45,
                 [Job("micro", ["micro", *common("micro")], micro_keys("micro", False), row_limit or ROW_LIMIT_S)]),
            rows("headline", f"{' + '.join(HEADLINE_OPS)} at {head}: floor, {', '.join(providers)}", 200,
                 [_bench_job("headline", p, HEADLINE_OPS, head, common("headline"), row_limit)
                  for p in (FLOOR, *providers)]),
            rows("sweep", f"fused_grpo over {sweep}: floor, {', '.join(sweepers)}", 60,
                 [_bench_job("sweep", p, ("fused_grpo",), sweep, common("sweep", sweep_timing), row_limit)
                  for p in (FLOOR, *sweepers)]),
            Part("gpu-tests", "GPU test tier: tests/test_gpu.py", 60, "tests",
                 command=[_python(), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_gpu.py")]),
            rows("opt-in-kernels", "microbenchmarks of the opt-in kernels (TMA kernel A, dz-in-GEMM), after "
                 "every core row", 35,
                 [Job("micro-opt-in", ["micro", "--opt-in", *common("opt-in-kernels")],
                      micro_keys("opt-in-kernels", True), row_limit or ROW_LIMIT_S)]),
        ]  # fmt: skip
    schedules = () if rehearsal else OPT_IN_SCHEDULES
    providers = REHEARSAL_CALL2 if rehearsal else call2_providers()
    return [
        wheels,
        preflight,
        rows("smoke-opt-in", f"TMA kernel A{''.join(', schedule=' + s for s in schedules)} vs the PyTorch backend "
             "(bf16); stops at the first wrong", 60,
             [Job("smoke-opt-in", ["smoke", "--opt-in", "--schedules", ",".join(schedules), *common("smoke-opt-in")],
                  smoke_keys("smoke-opt-in", schedules, True, rehearsal), row_limit or SMOKE_ROW_LIMIT_S)]),
        rows("opt-in", f"{' + '.join(HEADLINE_OPS)} at {head}: floor, {', '.join(providers)}", 160,
             [_bench_job("opt-in", p, HEADLINE_OPS, head, common("opt-in"), row_limit) for p in (FLOOR, *providers)]),
        rows("profile", "torch.profiler of the fused loss (auto) at the target; ncu on its 3 hottest kernels, nsys", 115,
             [Job("profile", ["profile", *common("profile")], profile_keys("profile"), row_limit or 150)]),
    ]  # fmt: skip


def file_list(call: int) -> list[str]:
    files = ["session.json", "log.txt", "results.jsonl"]
    files += (
        ["headline.json", "headline.png", "sweep.png", "kernels.png"]
        if call == 1
        else ["optin.json", "optin.png"]
    )
    assert len(files) <= MAX_FILES, files
    return files


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------


class Session:
    def __init__(self, out: Path, budget_s: float, rehearsal: bool, call: int = 1, row_limit: float | None = None,
                 parts: list[Part] | None = None):  # fmt: skip
        self.out = out
        self.call = call
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.rehearsal = rehearsal
        self.parts = parts if parts is not None else plan(call, rehearsal, row_limit)
        self.results = out / "results.jsonl"
        self.site = Path(tempfile.gettempdir()) / "grpo_kernels_session_site"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(self.site), *([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])]
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.source = _source_info()
        if self.source.get("sha"):
            self.env["GRPO_KERNELS_GIT_SHA"] = self.source["sha"]
            if self.source.get("dirty") is not None:
                self.env["GRPO_KERNELS_GIT_DIRTY"] = "1" if self.source["dirty"] else "0"
        self.record = {
            "schema": SCHEMA,
            "call": call,
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "rehearsal": rehearsal,
            "budget_s": budget_s,
            "source": self.source,
            "environment": _environment(),
            "plan": [_planned(p) for p in self.parts],
            "files": file_list(call),
            "parts": [],
            "lost_rows": [],
            "verdict": None,
        }
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "log.txt", "a", buffering=1)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        tmp = self.out / "session.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        tmp.replace(self.out / "session.json")

    def run(self) -> int:
        self.say(
            f"grpo_kernels GPU session, call {self.call}: budget {self.budget_s:.0f} s, results in {self.out}"
        )
        self.save()
        stop_reason = None
        for part in self.parts:
            limit = min(part.budget_s, self.left() - RESERVE_S)
            entry: dict = {"name": part.name, "status": "skipped", "seconds": 0.0}
            self.record["parts"].append(entry)
            if stop_reason or limit < MIN_PART_S:
                entry["reason"] = stop_reason or f"out of time ({self.left():.0f} s left of the budget)"
                self.say(f"[{part.name}] skipped: {entry['reason']}")
                self.save()
                continue
            self.say(f"[{part.name}] {part.what} (limit {limit:.0f} s)")
            entry.update(status="running", limit_s=round(limit))  # what a killed session.json shows
            self.save()
            t0 = time.monotonic()
            {"wheels": self._wheels, "tests": self._tests, "rows": self._rows}[part.kind](part, entry, limit)
            entry["seconds"] = round(time.monotonic() - t0, 1)
            self._outputs(part, entry)
            self.say(f"[{part.name}] {entry['status']} in {entry['seconds']:.0f} s")
            self.save()
            if part.name == "preflight" and not self.rehearsal and not self._on_gpu():
                stop_reason = "no CUDA device (see the preflight row): nothing else can run"
        if self.call == 1:
            self.record["verdict"] = verdict(self.out)
        self.record["seconds"] = round(time.monotonic() - self.start, 1)
        self.save()
        if self.record["verdict"]:
            self.say(json.dumps(self.record["verdict"], indent=1))
        if self.record["lost_rows"]:
            self.say(
                "lost rows: " + ", ".join(f"{r['key']} ({r['status']})" for r in self.record["lost_rows"])
            )
        self.log.close()
        failed = [p["name"] for p in self.record["parts"] if p["status"] not in ("ok", "skipped")]
        return 1 if failed else 0

    def _on_gpu(self) -> bool:
        """False only when the preflight saw no CUDA device (a lost preflight row stops nothing)."""
        rows = [
            r for r in read_rows(self.results) if r.get("kind") == "preflight" and r.get("status") == "ok"
        ]
        return not rows or bool(rows[-1].get("cuda_available"))

    # -- child processes --------------------------------------------------------------------------

    def watch(self, command: list[str], row_limit: float, deadline: float, rows: bool = True):
        """Run a command, echoing its output; kill its process group at the deadline and, for a worker
        (`rows`), when a row outlasts row_limit or no row starts for STARTUP_LIMIT_S. Returns (exit code
        or None if killed, the key in flight, why it was killed, its last lines)."""
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        state = {"key": None, "since": time.monotonic(), "tail": collections.deque(maxlen=15)}

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("@@start "):
                    state["key"], state["since"] = line[8:], time.monotonic()
                elif line.startswith("@@end "):
                    state["key"], state["since"] = None, time.monotonic()
                else:
                    state["tail"].append(line)
                    self.say("  " + line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        why = None
        while proc.poll() is None:
            now = time.monotonic()
            if state["key"] is not None and now - state["since"] > row_limit:
                why = f"timeout: the row ran past its limit of {row_limit:.0f} s"
            elif rows and state["key"] is None and now - state["since"] > STARTUP_LIMIT_S:
                why = f"timeout: no row started within {STARTUP_LIMIT_S} s"
            elif now > deadline:
                why = "timeout: the part's time limit"
            if why:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the worker's own children too
                break
            time.sleep(0.1)
        code = proc.wait()
        reader.join(timeout=10)
        return (None if why else code), state["key"], why, list(state["tail"])

    def done_keys(self) -> set[str]:
        return {r["key"] for r in read_rows(self.results) if r.get("key") and r.get("kind") != "meta"}

    def lose(self, part: Part, job: Job, key: str, status: str, reason: str) -> None:
        kind = job.argv[0]
        row = {"kind": kind, "part": part.name, "key": key, **job.lost_fields.get(key, {}), "status": status,
               "reason": reason}  # fmt: skip
        append(self.results, row)
        lost = {"part": part.name, "job": job.label, "key": key, "status": status, "reason": reason}
        self.record["lost_rows"].append(lost)
        self.say(f"  LOST {key}: {status}: {reason}")

    def run_job(self, part: Part, job: Job, entry: dict, deadline: float) -> None:
        while True:
            done = self.done_keys()
            remaining = [k for k in job.keys if k not in done]
            if not remaining:
                return
            if deadline - time.monotonic() < 3:
                entry.setdefault("not_run", []).extend(remaining)
                return
            command = [_python(), "-m", "grpo_kernels.bench.session_worker", *job.argv, "--jsonl", str(self.results),
                       "--only", ",".join(remaining)]  # fmt: skip
            code, key, why, tail = self.watch(command, job.row_limit_s, deadline)
            if code == STOPPED:
                entry["stopped"] = job.label
                entry.setdefault("not_run", []).extend(k for k in job.keys if k not in self.done_keys())
                return
            if key is None and why is None and code in (0, RESTART):
                left = [k for k in remaining if k not in self.done_keys()]
                if left and len(left) == len(remaining):  # a process that measured nothing: not again
                    entry.setdefault("not_run", []).extend(left)
                    return
                continue  # done, or a fresh process for the rest (RESTART: its CUDA context was poisoned)
            # killed or crashed: the row in flight is lost (the first one left when none had started)
            status = "timeout" if why else "crashed"
            detail = why or f"the process died ({_exit_text(code)})"
            if tail:
                detail += "; last output: " + " | ".join(tail[-3:])[-500:]
            left = [k for k in remaining if k not in self.done_keys()]
            if key is None and not left:  # killed after its last row (on its way out): nothing lost
                return
            self.lose(part, job, key or left[0], status, detail)
            if why == "timeout: the part's time limit":
                entry.setdefault("not_run", []).extend(k for k in job.keys if k not in self.done_keys())
                return

    # -- parts ------------------------------------------------------------------------------------

    def _rows(self, part: Part, entry: dict, limit: float) -> None:
        deadline = time.monotonic() + limit
        for job in part.jobs:
            self.run_job(part, job, entry, deadline)
        keys = {k for j in part.jobs for k in j.keys}
        rows = [r for r in read_rows(self.results) if r.get("key") in keys and r.get("kind") != "meta"]
        counts = collections.Counter(r.get("status", "?") for r in rows)
        entry["rows"] = dict(counts)
        entry["lost"] = [r["key"] for r in self.record["lost_rows"] if r["part"] == part.name]
        if entry.get("stopped"):
            first = next((r for r in rows if r.get("status") not in ("ok", "skipped")), None)
            entry.update(status="stopped", reason=f"first wrong: {first['key']}" if first else "stopped")
            if first:
                entry["report"] = first.get("report") or first.get("reason")
        elif entry["lost"] or entry.get("not_run"):
            entry["status"] = "partial"
        elif any(s in counts for s in ("error", "wrong", "parity-failed", "oom")):
            entry["status"] = "ok-with-errors"  # measured; the rows say which provider failed and why
        else:
            entry["status"] = "ok"
        if part.name in ("headline", "sweep", "opt-in"):
            entry["summary"] = summarize({"results": [r for r in rows if r.get("kind") == "bench"]})

    def _wheels(self, part: Part, entry: dict, limit: float) -> None:
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if not wheels:
            entry.update(status="skipped", reason="no .whl/ folder carried: peers absent here are skipped")
            return
        command = [_python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(self.site), *map(str, wheels)]  # fmt: skip
        code, _, why, _ = self.watch(command, limit, time.monotonic() + limit, rows=False)
        entry.update(
            wheels=[w.name for w in wheels], status="ok" if code == 0 else ("timeout" if why else "failed")
        )

    def _tests(self, part: Part, entry: dict, limit: float) -> None:
        junit = Path(tempfile.gettempdir()) / f"grpo_kernels_gpu_tests_{os.getpid()}.xml"
        junit.unlink(missing_ok=True)
        code, _, why, _ = self.watch(
            part.command + [f"--junitxml={junit}"], limit, time.monotonic() + limit, rows=False
        )
        entry["tests"] = _junit_summary(junit)
        if why:
            entry["status"] = "timeout"
        elif code == 0:
            entry["status"] = "ok"
        else:
            entry.update(status="failed", reason=f"pytest exit code {code}")

    # -- result files -----------------------------------------------------------------------------

    def _outputs(self, part: Part, entry: dict) -> None:
        """Rewrite the benchmark report and redraw the plots the part feeds (a failed plot never loses
        the JSON)."""
        stem = {"headline": "headline", "sweep": "headline", "opt-in": "optin", "micro": None,
                "opt-in-kernels": None}.get(part.name, "")  # fmt: skip
        if stem == "":
            return
        rows = read_rows(self.results)
        try:
            if stem is None:  # the microbenchmark parts: one plot of every micro row so far
                if kernels_plot(rows, self.out / "kernels.png", self.record["environment"], self.source):
                    entry["files"] = ["kernels.png"]
                return
            report = assemble(rows, ("headline", "sweep") if stem == "headline" else ("opt-in",))
            if report is None:
                return
            (self.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
            entry["files"] = [f"{stem}.json"]
            if part.name == "sweep":
                sweep_plot(report, self.out / "sweep.png")
                entry["files"].append("sweep.png")
            else:
                name = "headline.png" if stem == "headline" else "optin.png"
                headline_plot(report, self.out / name, part.name)
                entry["files"].append(name)
        except Exception as exc:  # noqa: BLE001 - a plot must not stop the session
            entry["plot_error"] = f"{type(exc).__name__}: {exc}"


def _planned(part: Part) -> dict:
    jobs = [{"label": j.label, "rows": len(j.keys), "row_limit_s": j.row_limit_s} for j in part.jobs]
    return {"name": part.name, "what": part.what, "budget_s": part.budget_s, "jobs": jobs}


def _exit_text(code: int | None) -> str:
    if code is None:
        return "killed"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def assemble(rows: list[dict], parts: tuple[str, ...]) -> dict | None:
    """The benchmark report (the schema of `python -m benchmarks`' JSON) of the bench rows of `parts`,
    with the ratios to the floor and to grpo_kernels per (part, op, shape)."""
    from .ops import OPS, compulsory_bytes, op_flops
    from .shapes import BenchShape

    bench = [r for r in rows if r.get("kind") == "bench" and r.get("part") in parts]
    metas = [r["report"] for r in rows if r.get("kind") == "meta" and r.get("part") in parts]
    if not bench or not metas:
        return None
    report = {**metas[0], "settings": {**metas[0]["settings"]}}
    report["settings"]["providers"] = list(dict.fromkeys(r["provider"] for r in bench))
    report["settings"]["ops"] = list(dict.fromkeys(r["op"] for r in bench))
    report["settings"]["presets"] = list(dict.fromkeys(p for m in metas for p in m["settings"]["presets"]))
    results = [{k: v for k, v in r.items() if k not in ("kind", "key")} for r in bench]
    groups = collections.defaultdict(list)
    for r in results:
        groups[(r["part"], r["op"], r["shape"]["tokens"])].append(r)
    for (_, op, _), group in groups.items():
        timed = {r["provider"]: r for r in group if r.get("time")}
        floor, ours = timed.get(FLOOR), timed.get("grpo_kernels")
        for r in group:
            if not r.get("time"):
                continue
            shape = BenchShape(**{k: v for k, v in r["shape"].items() if k != "batch"})
            seconds = r["time"]["median_ms"] * 1e-3
            r["x_floor"] = r["time"]["median_ms"] / floor["time"]["median_ms"] if floor else None
            r["ours_speedup"] = (
                r["time"]["median_ms"] / ours["time"]["median_ms"] if ours and r is not floor else None
            )
            if OPS[op].gemm_units:
                r["tflops"] = op_flops(OPS[op], shape) / seconds / 1e12
            else:
                r["gbps"] = compulsory_bytes(shape) / seconds / 1e9
    report["results"] = results
    report["skipped"] = [{"op": r["op"], "provider": r["provider"], "reason": r["reason"]}
                         for r in results if r["status"] == "skipped"]  # fmt: skip
    report["date"] = max(m["date"] for m in metas)
    return report


def _junit_summary(path: Path) -> dict:
    if not path.exists():
        return {"counts": None, "cases": []}
    root = ET.parse(path).getroot()
    cases, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                detail = (node.get("message") or "")[:300]
                break
        counts[outcome] += 1
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})  # fmt: skip
    return {"counts": counts, "cases": cases}


def summarize(report: dict) -> list[dict]:
    """One line per result row: what the verdict and a reader need."""
    rows = []
    for r in report["results"]:
        memory = r.get("memory") or {}
        rows.append({
            "op": r["op"], "tokens": r["shape"]["tokens"], "provider": r["provider"], "status": r["status"],
            "reason": r.get("reason", "")[:200],
            "median_ms": r["time"]["median_ms"] if r.get("time") else None,
            "x_floor": r.get("x_floor"), "ours_speedup": r.get("ours_speedup"),
            "extra_gib": None if not memory else memory["beyond_grads_bytes"] / 2**30,
            "paths": r.get("paths"),
        })  # fmt: skip
    return rows


def verdict(out: Path) -> dict | None:
    """The headline rows against the targets: met, missed, or not measured (never guessed)."""
    path = out / "headline.json"
    if not path.exists():
        return {"measured": False, "why": "no headline results (see the parts' status)"}
    report = json.loads(path.read_text())
    on_gpu = report["device"]["type"] == "cuda"
    result: dict = {"measured": on_gpu, "device": report["device"]["name"], "checks": []}
    if not on_gpu:  # a rehearsal: the values show the flow works; no target is judged off a GPU
        result["why"] = "not a GPU run: the targets are judged on H100 / H200 only, every 'met' is null"
    for op, goals in TARGETS.items():
        rows = {
            r["provider"]: r
            for r in report["results"]
            if r["op"] == op and r.get("part", "headline") == "headline"
        }
        ours = rows.get("grpo_kernels")
        if ours is None or not ours.get("time"):
            result["checks"].append({"op": op, "check": "grpo_kernels ran", "met": False,
                                     "value": None if ours is None else ours["status"]})  # fmt: skip
            continue
        x = ours.get("x_floor")
        result["checks"].append({"op": op, "check": f"time <= {goals['x_floor']}x the GEMM floor", "value": x,
                                 "met": None if x is None or not on_gpu else x <= goals["x_floor"]})  # fmt: skip
        if "extra_gib" in goals:
            mem = ours.get("memory")
            gib = None if not mem else mem["beyond_grads_bytes"] / 2**30
            result["checks"].append({"op": op, "check": f"extra memory <= {goals['extra_gib']} GiB", "value": gib,
                                     "met": None if gib is None or not on_gpu else gib <= goals["extra_gib"]})  # fmt: skip
        for peer, factor in goals.get("faster_than", {}).items():
            row = rows.get(peer)
            speed = row.get("ours_speedup") if row and row.get("time") else None
            result["checks"].append({"op": op, "check": f">= {factor}x faster than {peer}", "value": speed,
                                     "met": None if speed is None or not on_gpu else speed >= factor,
                                     **({} if speed is not None else {"why": row["status"] + ": " + row["reason"][:120]
                                         if row else "not run"})})  # fmt: skip
    return result


# ------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------
def caption_lines(report: dict) -> str:
    """Two short lines (a one-line caption of every field is cut at both ends of the figure)."""
    v, git = report["versions"], report["git"]
    sha = (git.get("sha") or "unknown")[:10] + ("+dirty" if git.get("dirty") else "")
    device = report["device"]
    driver = f", driver {device['driver']}" if device.get("driver") else ""
    cpu = "" if device.get("type") == "cuda" else " | CPU: the flow, not the product's numbers"
    return (f"{device['name']}{driver} | {report['settings']['dtype']} | {report['date'][:16]}{cpu}\n"
            f"torch {v['torch']}, triton {v['triton']} | grpo_kernels {sha}")  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def headline_plot(report: dict, path: Path, part: str = "headline") -> Path:
    """Per op: median time per provider as bars (lost / failed rows named in place of a bar), the GEMM
    floor and the target as lines."""
    plt = _pyplot()
    results = [r for r in report["results"] if r.get("part", part) == part]
    ops = [op for op in report["settings"]["ops"] if any(r["op"] == op for r in results)]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(7 * max(1, len(ops)), 5.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in results if r["op"] == op]
        largest = max(r["shape"]["tokens"] for r in rows)  # one shape per panel (the target shape on a GPU)
        rows = [r for r in rows if r["shape"]["tokens"] == largest]
        floor = next((r for r in rows if r["provider"] == FLOOR and r.get("time")), None)
        bars = [r for r in rows if r["provider"] != FLOOR]
        times = [r["time"]["median_ms"] if r.get("time") else 0.0 for r in bars]
        colors = ["tab:red" if r["provider"] == "grpo_kernels" else "tab:blue" for r in bars]
        ax.bar(range(len(bars)), times, color=colors)
        top = max(times + [floor["time"]["median_ms"] if floor else 0.0]) or 1.0
        for i, r in enumerate(bars):
            label = f"{r['x_floor']:.2f}x" if r.get("x_floor") else r["status"]
            ax.text(i, times[i] + 0.01 * top, label, ha="center", va="bottom", fontsize=8,
                    rotation=0 if r.get("x_floor") else 90)  # fmt: skip
        if floor:
            f_ms = floor["time"]["median_ms"]
            ax.axhline(f_ms, color="black", linestyle="--", label=f"GEMM floor {f_ms:.3g} ms")
            goal = TARGETS.get(op, {}).get("x_floor")
            if goal:
                ax.axhline(goal * f_ms, color="green", linestyle=":", label=f"target {goal}x floor")
            ax.legend(fontsize=8, loc="upper left")
        ax.set_xticks(range(len(bars)), [r["provider"] for r in bars], rotation=30, ha="right", fontsize=8)
        shape = rows[0]["shape"] if rows else {}
        ax.set_title(f"{op} ({part}): N={shape.get('tokens')} H={shape.get('hidden')} V={shape.get('vocab')}",
                     fontsize=10)  # fmt: skip
        ax.set_ylabel("median ms (bar label: x GEMM floor)")
        ax.set_ylim(0, top * 1.25)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(caption_lines(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_plot(report: dict, path: Path) -> Path:
    """Time and extra memory against tokens, one line per provider (floor dashed black)."""
    plt = _pyplot()
    results = [r for r in report["results"] if r.get("part", "sweep") == "sweep"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5))
    providers = list(dict.fromkeys(r["provider"] for r in results))
    for i, provider in enumerate(providers):
        pts = sorted(
            (r["shape"]["tokens"], r) for r in results if r["provider"] == provider and r.get("time")
        )
        if not pts:
            continue
        style = {"color": "black", "linestyle": "--", "marker": "x"} if provider == FLOOR else line_style(i)
        shift = 1.0 if provider == FLOOR else offset(i, len(providers))  # coinciding lines both show
        ax_t.plot(
            [n * shift for n, _ in pts], [r["time"]["median_ms"] for _, r in pts], label=provider, **style
        )
        mem = [(n, r["memory"]["beyond_grads_bytes"] / 2**30) for n, r in pts if r.get("memory")]
        if mem and provider != FLOOR:
            ax_m.plot([n * shift for n, _ in mem], [g for _, g in mem], label=provider, **style)
    ax_t.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median ms", title="fused_grpo: time")
    ax_m.set(
        xscale="log",
        xlabel="tokens N",
        ylabel="GiB beyond inputs and gradients",
        title="fused_grpo: extra memory",
    )
    if ax_m.lines:
        ax_m.axhline(TARGETS["fused_grpo"]["extra_gib"], color="green", linestyle=":", label="target")
    else:
        empty_panel(ax_m, "no memory figures: peak memory is measured on CUDA only" if report["device"].get("type")
                    != "cuda" else "no memory figures (every row failed or was lost: see session.json)")  # fmt: skip
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(caption_lines(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kernels_plot(rows: list[dict], path: Path, environment: dict, source: dict | None = None) -> Path | None:
    """The microbenchmarks: each case's achieved share of the measured ceiling (TF/s, or GB/s for
    bandwidth cases), and of the datasheet peak where the device is known."""
    micro = [r for r in rows if r.get("kind") == "micro"]
    if not micro:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(micro) + 1.8))
    labels, measured, sheet, notes = [], [], [], []
    for r in micro:
        tf = r.get("tflops") is not None
        labels.append(r["case"] + (" (TF/s)" if tf else " (GB/s)" if r.get("gbps") else ""))
        measured.append(r.get("pct_measured_tflops" if tf else "pct_measured_gbps") or 0.0)
        sheet.append(r.get("pct_datasheet_tflops" if tf else "pct_datasheet_gbps") or 0.0)
        if r.get("status") != "ok":
            notes.append(r.get("status", "?"))
        elif r.get("median_ms") is not None:
            rate = f"{r['tflops']:.3g} TF/s" if tf else f"{r['gbps']:.3g} GB/s" if r.get("gbps") else ""
            notes.append(f"{r['median_ms']:.3g} ms {rate}")
        else:
            notes.append("")
    y = list(range(len(micro)))
    ax.barh([i - 0.2 for i in y], measured, height=0.4, label="% of the ceiling measured in this run")
    ax.barh([i + 0.2 for i in y], sheet, height=0.4, label="% of the datasheet peak", alpha=0.6)
    for i, text in enumerate(notes):  # beside the longer bar (bars past 100 % are cut at 110)
        ax.text(min(100.0, max(measured[i], sheet[i])) + 1, i, text, va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 135)
    ax.set_xlabel("% of peak")
    ax.legend(fontsize=8, loc="lower right")
    if not any(measured) and not any(sheet):
        ax.text(55, len(micro) / 2, "no rates: not a GPU run (a rehearsal times the flow only)", ha="center",
                fontsize=10, color="gray")  # fmt: skip
    gpu = environment.get("gpu") or "no GPU"
    sha = ((source or {}).get("sha") or "unknown")[:10] + ("+dirty" if (source or {}).get("dirty") else "")
    driver = f", driver {environment['driver']}" if environment.get("driver") else ""
    ax.set_title(f"per-kernel microbenchmarks | {gpu}{driver}\n"
                 f"torch {environment.get('torch')}, triton {environment.get('triton')} | grpo_kernels {sha}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# environment, source, wheels
# ------------------------------------------------------------------------------------------------


def _environment() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                        memory_gib=round(props.total_memory / 2**30, 1), cuda_runtime=torch.version.cuda)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        info["torch"] = f"not importable: {exc}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"not importable: {exc}"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)  # fmt: skip
        info["driver"] = driver.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _source_info() -> dict:
    """The commit the tree came from: git where .git exists, else .whl/SOURCE.json (written by
    make-wheels next to the wheels, so it travels with them), else unknown."""
    sha = _git("rev-parse", "HEAD")
    if sha:
        return {
            "sha": sha,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "from": "git",
        }
    recorded = ROOT / ".whl" / "SOURCE.json"
    if recorded.exists():
        data = json.loads(recorded.read_text())
        return {**data, "from": ".whl/SOURCE.json"}
    return {"sha": None, "dirty": None, "from": "unknown (no .git, no .whl/SOURCE.json)"}


def make_wheels(dest: Path, dry_run: bool) -> int:
    command = [_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
               *PEER_WHEELS]  # fmt: skip
    print("make-wheels: the peers' cp312 wheels for a GPU machine without network")
    print("  " + " ".join(command))
    print(
        f"  then: SOURCE.json (git sha) into {dest}/, total checked against {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB"
    )
    if dry_run:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    code = subprocess.run(command).returncode
    if code != 0:
        return code
    sha = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if sha else None
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    (dest / "SOURCE.json").write_text(json.dumps({"sha": sha, "dirty": dirty, "wheels": wheels,
        "written": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, indent=1) + "\n")  # fmt: skip
    total = sum(p.stat().st_size for p in dest.glob("*"))
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}")
    if total > WHEEL_LIMIT_BYTES:
        print(
            f"too large to carry: {total / 2**20:.1f} MiB > {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB",
            file=sys.stderr,
        )
        return 1
    return 0


def print_plan(out: Path, rehearsal: bool, row_limit: float | None = None) -> None:
    kind = "rehearsal, tiny CPU shapes" if rehearsal else "GPU"
    print(f"grpo_kernels GPU session plan ({kind}); output in {out} (or $OUT)")
    total = 0
    for call in (1, 2):
        parts = plan(call, rehearsal, row_limit)
        budget = CALL_BUDGET_S[call]
        planned = sum(p.budget_s for p in parts)
        assert planned + RESERVE_S <= budget, (call, planned, budget)
        total += budget + MACHINE_START_S
        flag = "" if call == 1 else " --call 2"
        print(f"\ncall {call}: bash benchmarks/gpu/run.sh{flag}  (budget {budget} s: parts {planned} s + "
              f"{RESERVE_S} s for the files)")  # fmt: skip
        for p in parts:
            print(f"  [{p.name}] up to {p.budget_s} s: {p.what}")
            if p.command:
                print("      " + " ".join(p.command))
            for j in p.jobs:
                print(f"      process {j.label}: {len(j.keys)} row(s), each up to {j.row_limit_s:.0f} s")
        print("  files: " + ", ".join(file_list(call)))
    print(f"\ndevice time: {CALL_BUDGET_S[1]} + {CALL_BUDGET_S[2]} s of commands + 2 x {MACHINE_START_S} s of "
          f"machine start = {total} s <= {DEVICE_TIME_S} s ({DEVICE_TIME_S // 60} minutes)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/run.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the session (default)")
    run.add_argument(
        "--call", type=int, choices=(1, 2), default=1, help="1: the core verdict; 2: opt-in, peers, profile"
    )
    run.add_argument(
        "--out",
        default=None,
        help="output folder (default: $OUT if set, else benchmarks/results/gpu_session)",
    )
    run.add_argument(
        "--budget", type=float, default=None, help="seconds for all parts together (default: the call's)"
    )
    run.add_argument(
        "--row-limit", type=float, default=None, help="seconds one row may take (default: per part)"
    )
    run.add_argument(
        "--parts", default=None, help="comma-separated: run only these parts of the call (default: all)"
    )
    run.add_argument(
        "--dry-run", action="store_true", help="print the plan of both calls and the files, run nothing"
    )
    run.add_argument("--rehearsal", action="store_true", help="tiny CPU shapes: the flow, not the numbers")
    wheels = sub.add_parser("make-wheels", help="download the peers' cp312 wheels to carry")
    wheels.add_argument("--dest", default=str(ROOT / ".whl"))
    wheels.add_argument("--dry-run", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    if args.command == "make-wheels":
        return make_wheels(Path(args.dest), args.dry_run)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu_session")
    budget = args.budget if args.budget is not None else CALL_BUDGET_S[args.call]
    if budget < 60:
        parser.error(f"--budget must be at least 60 s, got {budget}")
    if args.dry_run:
        print_plan(out, args.rehearsal, args.row_limit)
        return 0
    parts = plan(args.call, args.rehearsal, args.row_limit)
    if args.parts:
        names = [n.strip() for n in args.parts.split(",") if n.strip()]
        unknown = sorted(set(names) - {p.name for p in parts})
        if unknown:
            parser.error(
                f"--parts: no part {', '.join(unknown)} in call {args.call} ({', '.join(p.name for p in parts)})"
            )
        parts = [p for p in parts if p.name in names]
    return Session(out, budget, args.rehearsal, args.call, args.row_limit, parts).run()


if __name__ == "__main__":
    sys.exit(main())
