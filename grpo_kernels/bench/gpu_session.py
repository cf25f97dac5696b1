"""One command on a GPU machine gives the whole verdict: `bash benchmarks/gpu/run.sh`.

A GPU machine here has no network, at most 10 minutes per command and 8 result files: so the session
runs its parts in order, each as a subprocess under its own time limit, and writes every result file
as soon as the part that makes it ends (a time-out leaves what was done). Parts:

  wheels     install the carried peer wheels (.whl/, made here by `run.sh make-wheels`) into a
             private folder put on the children's PYTHONPATH; nothing is installed system-wide
  gpu-tests  the GPU test tier, tests/test_gpu.py (bf16 parity at real shapes, schedules agree, the
             backward GEMMs take the fp32-out path: any slower fallback fails it)
  headline   the target shape (Qwen3-8B head, N = 16384, bf16): fused GRPO loss fwd+bwd and log-probs
             without grad, for grpo_kernels and every peer that can run (TRL 1.16, Liger 0.8.5,
             cut-cross-entropy, torch eager; each skipped with its reason when absent), the cuBLAS
             GEMM floor measured in the same run, schedule and peak extra memory per row
  sweep      grpo_kernels and the floor over 4k-64k tokens (fused GRPO loss): how time and memory grow

Files in the output folder (7 at most): session.json (environment, git sha, plan, each part's status,
time and summary, the verdict against the performance targets), log.txt (everything the parts
printed), headline.json + headline.png, sweep.json + sweep.png.

  python -m grpo_kernels.bench.gpu_session run [--out DIR] [--budget SECONDS] [--dry-run] [--rehearsal]
  python -m grpo_kernels.bench.gpu_session make-wheels [--dest .whl] [--dry-run]

--rehearsal runs the same parts with the tiny CPU shapes (what CI does: the flow, not the numbers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = "grpo_kernels.gpu_session/1"
ROOT = Path(__file__).resolve().parents[2]  # the repository (a copy of it on the GPU machine)
DEFAULT_BUDGET_S = 570  # inside the GPU machine's 10-minute command limit, with room to write files
RESERVE_S = 15  # kept back from every part for writing session.json and the plots
MIN_PART_S = 20  # a part with less time than this left is skipped, not started
MAX_FILES = 8
WHEEL_LIMIT_BYTES = 48 * 2**20  # the tree travels too, under 64 MiB in all

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
# Providers not run in a session: torch-compile spends minutes compiling, verl's wheel brings too much,
# grpo_kernels-torch is the CPU backend.
EXCLUDED_PROVIDERS = ("torch-compile", "verl", "verl-torch", "grpo_kernels-torch")
# The sweep compares "auto" (the low-memory schedule wherever the one-pass peak exceeds the memory goal,
# so at the target head) with the one-pass schedule it replaces there: the time the memory costs.
SWEEP_PROVIDERS = ("grpo_kernels", "grpo_kernels-one-pass")


@dataclass
class Part:
    name: str
    what: str
    budget_s: int  # the most this part may take (less when less is left)
    files: tuple[str, ...]  # result files it leaves in the output folder
    command: list[str] = field(default_factory=list)


def _python() -> str:
    return sys.executable or "python3"


def plan(out: Path, rehearsal: bool) -> list[Part]:
    from .providers import REGISTRY

    providers = ",".join(p for p in REGISTRY.providers if p not in EXCLUDED_PROVIDERS)
    bench = [_python(), "-m", "grpo_kernels.bench.cli"]
    shapes_head, shapes_sweep = ("tiny", "tiny") if rehearsal else ("qwen3-8b", "session-sweep")
    timing = ["--warmup", "1", "--iters", "1"] if rehearsal else ["--warmup", "2", "--iters", "5"]
    if rehearsal:
        providers = "grpo_kernels"
    return [
        Part("wheels", "install the carried peer wheels (.whl/) into a private folder", 60, ()),
        Part("gpu-tests", "GPU test tier: tests/test_gpu.py", 180, (),
             [_python(), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")]),
        Part("headline", f"fused_grpo + logprobs at {shapes_head}, providers {providers}", 240,
             ("headline.json", "headline.png"),
             bench + ["--op", "fused_grpo,logprobs", "--shapes", shapes_head, "--providers", providers,
                      "--json-only", *timing]),
        Part("sweep", f"fused_grpo over {shapes_sweep}, providers {','.join(SWEEP_PROVIDERS)}", 240,
             ("sweep.json", "sweep.png"),
             bench + ["--op", "fused_grpo", "--shapes", shapes_sweep, "--providers", ",".join(SWEEP_PROVIDERS),
                      "--json-only", *timing]),
    ]  # fmt: skip


def file_list(parts: list[Part]) -> list[str]:
    files = ["session.json", "log.txt"] + [f for p in parts for f in p.files]
    assert len(files) <= MAX_FILES, files
    return files


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------


class Session:
    def __init__(self, out: Path, budget_s: float, rehearsal: bool):
        self.out = out
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.rehearsal = rehearsal
        self.parts = plan(out, rehearsal)
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
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "rehearsal": rehearsal,
            "budget_s": budget_s,
            "source": self.source,
            "environment": _environment(),
            "plan": [{"name": p.name, "what": p.what, "budget_s": p.budget_s, "files": list(p.files)}
                     for p in self.parts],  # fmt: skip
            "files": file_list(self.parts),
            "parts": [],
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

    def run_command(self, command: list[str], limit: float) -> tuple[int | None, float]:
        """Run, echoing its output into the log; returns (returncode or None on time-out, seconds)."""
        t0 = time.monotonic()
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                self.say("  " + line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: pytest's or the bench's children too
            proc.wait()
            code = None
        reader.join(timeout=10)
        return code, time.monotonic() - t0

    def run(self) -> int:
        self.say(f"grpo_kernels GPU session: budget {self.budget_s:.0f} s, results in {self.out}")
        self.save()
        for part in self.parts:
            limit = min(part.budget_s, self.left() - RESERVE_S)
            entry = {"name": part.name, "status": "skipped", "seconds": 0.0, "files": []}
            self.record["parts"].append(entry)
            if limit < MIN_PART_S:
                entry["reason"] = f"out of time ({self.left():.0f} s left of the budget)"
                self.say(f"[{part.name}] skipped: {entry['reason']}")
                self.save()
                continue
            self.say(f"[{part.name}] {part.what} (limit {limit:.0f} s)")
            getattr(self, "_" + part.name.replace("-", "_"))(part, entry, limit)
            self.say(f"[{part.name}] {entry['status']} in {entry['seconds']:.0f} s")
            self.save()
        self.record["verdict"] = verdict(self.out)
        self.record["seconds"] = round(time.monotonic() - self.start, 1)
        self.save()
        self.say(json.dumps(self.record["verdict"], indent=1))
        self.log.close()
        failed = [p["name"] for p in self.record["parts"] if p["status"] not in ("ok", "skipped")]
        return 1 if failed else 0

    # -- parts ------------------------------------------------------------------------------------

    def _wheels(self, part: Part, entry: dict, limit: float) -> None:
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if not wheels:
            entry.update(status="skipped", reason="no .whl/ folder carried: peers absent here are skipped")
            return
        command = [_python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(self.site), *map(str, wheels)]  # fmt: skip
        code, seconds = self.run_command(command, limit)
        entry.update(seconds=round(seconds, 1), wheels=[w.name for w in wheels],
                     status="ok" if code == 0 else ("timeout" if code is None else "failed"))  # fmt: skip

    def _gpu_tests(self, part: Part, entry: dict, limit: float) -> None:
        junit = Path(tempfile.gettempdir()) / "grpo_kernels_gpu_tests.xml"
        junit.unlink(missing_ok=True)
        code, seconds = self.run_command(part.command + [f"--junitxml={junit}"], limit)
        tests = _junit_summary(junit)
        entry.update(seconds=round(seconds, 1), tests=tests)
        if code is None:
            entry["status"] = "timeout"
        elif code == 0:
            entry["status"] = "ok"
        else:
            entry["status"] = "failed"
            entry["reason"] = f"pytest exit code {code}"

    def _bench(self, part: Part, entry: dict, limit: float, stem: str) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f"gk_{stem}_"))
        code, seconds = self.run_command(part.command + ["--out", str(tmp)], limit)
        entry.update(seconds=round(seconds, 1))
        produced = sorted(tmp.glob("*.json"))
        if produced:
            report = json.loads(produced[-1].read_text())
            (self.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
            entry["files"].append(f"{stem}.json")
            entry["rows"] = summarize(report)
            try:
                png = (headline_plot if stem == "headline" else sweep_plot)(report, self.out / f"{stem}.png")
                entry["files"].append(png.name)
            except Exception as exc:  # noqa: BLE001 - a plot must not lose the JSON
                entry["plot_error"] = f"{type(exc).__name__}: {exc}"
        shutil.rmtree(tmp, ignore_errors=True)
        if code is None:
            entry["status"] = "timeout"
        elif code == 0 and produced:
            entry["status"] = "ok"
        else:
            entry["status"] = "failed"
            entry["reason"] = f"exit code {code}" + ("" if produced else ", no results file")

    def _headline(self, part: Part, entry: dict, limit: float) -> None:
        self._bench(part, entry, limit, "headline")

    def _sweep(self, part: Part, entry: dict, limit: float) -> None:
        self._bench(part, entry, limit, "sweep")


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
        rows = {r["provider"]: r for r in report["results"] if r["op"] == op}
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


def _caption(report: dict) -> str:
    v, git = report["versions"], report["git"]
    sha = (git.get("sha") or "unknown")[:10] + ("+dirty" if git.get("dirty") else "")
    device = report["device"]
    driver = f", driver {device['driver']}" if device.get("driver") else ""
    return (f"{device['name']}{driver} | torch {v['torch']}, triton {v['triton']} | grpo_kernels {sha} | "
            f"{report['settings']['dtype']} | {report['date'][:16]}")  # fmt: skip


def headline_plot(report: dict, path: Path) -> Path:
    """Per op: median time per provider as bars, the GEMM floor and the target as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in report["settings"]["ops"] if any(r["op"] == op for r in report["results"])]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(6.5 * max(1, len(ops)), 4.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in report["results"] if r["op"] == op]
        largest = max(r["shape"]["tokens"] for r in rows)  # one shape per panel (the target shape on a GPU)
        rows = [r for r in rows if r["shape"]["tokens"] == largest]
        floor = next((r for r in rows if r["provider"] == "floor" and r.get("time")), None)
        bars = [r for r in rows if r["provider"] != "floor"]
        names = [r["provider"] for r in bars]
        times = [r["time"]["median_ms"] if r.get("time") else 0.0 for r in bars]
        colors = ["tab:red" if n == "grpo_kernels" else "tab:blue" for n in names]
        ax.bar(range(len(bars)), times, color=colors)
        for i, r in enumerate(bars):
            label = f"{r['x_floor']:.2f}x" if r.get("x_floor") else r["status"]
            ax.text(i, times[i], label, ha="center", va="bottom", fontsize=8)
        if floor:
            f_ms = floor["time"]["median_ms"]
            ax.axhline(f_ms, color="black", linestyle="--", label=f"GEMM floor {f_ms:.1f} ms")
            goal = TARGETS.get(op, {}).get("x_floor")
            if goal:
                ax.axhline(goal * f_ms, color="green", linestyle=":", label=f"target {goal}x floor")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(bars)), names, rotation=30, ha="right", fontsize=8)
        shape = rows[0]["shape"] if rows else {}
        ax.set(ylabel="median ms", title=f"{op}: N={shape.get('tokens')} H={shape.get('hidden')} V={shape.get('vocab')}")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_caption(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_plot(report: dict, path: Path) -> Path:
    """Time and extra memory against tokens, grpo_kernels and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for provider in sorted({r["provider"] for r in report["results"]}):
        pts = sorted((r["shape"]["tokens"], r) for r in report["results"] if r["provider"] == provider and r.get("time"))
        if not pts:
            continue
        style = dict(color="black", linestyle="--") if provider == "floor" else dict(marker="o")
        ax_t.plot([n for n, _ in pts], [r["time"]["median_ms"] for _, r in pts], label=provider, **style)
        mem = [(n, r["memory"]["beyond_grads_bytes"] / 2**30) for n, r in pts if r.get("memory")]
        if mem and provider != "floor":
            ax_m.plot([n for n, _ in mem], [g for _, g in mem], label=provider, **style)
    ax_m.axhline(TARGETS["fused_grpo"]["extra_gib"], color="green", linestyle=":", label="target")
    ax_t.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median ms", title="fused_grpo: time")
    ax_m.set(xscale="log", xlabel="tokens N", ylabel="GiB beyond inputs and gradients", title="fused_grpo: extra memory")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_caption(report), fontsize=9)
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
        return {"sha": sha, "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "from": "git"}
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
    print(f"  then: SOURCE.json (git sha) into {dest}/, total checked against {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB")
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
        print(f"too large to carry: {total / 2**20:.1f} MiB > {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    return 0


def print_plan(out: Path, budget: float, rehearsal: bool) -> None:
    parts = plan(out, rehearsal)
    print(f"grpo_kernels GPU session plan ({'rehearsal, tiny CPU shapes' if rehearsal else 'GPU'}), "
          f"budget {budget:.0f} s, output {out}")  # fmt: skip
    for p in parts:
        print(f"  [{p.name}] up to {p.budget_s} s: {p.what}")
        if p.command:
            print("      " + " ".join(p.command))
    print("files:")
    for f in file_list(parts):
        print(f"  {out / f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/run.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the session (default)")
    run.add_argument("--out", default=None, help="output folder (default: $OUT if set, else benchmarks/results/gpu_session)")
    run.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts together")
    run.add_argument("--dry-run", action="store_true", help="print the plan and the file list, run nothing")
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
    if args.budget < 60:
        parser.error(f"--budget must be at least 60 s, got {args.budget}")
    if args.dry_run:
        print_plan(out, args.budget, args.rehearsal)
        return 0
    return Session(out, args.budget, args.rehearsal).run()


if __name__ == "__main__":
    sys.exit(main())
