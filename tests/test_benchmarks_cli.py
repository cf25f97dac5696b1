"""The benchmark suite runs end to end on CPU: the CLI with the tiny preset (console tables, JSON,
PNGs, in a temporary folder, never benchmarks/results/), the parity gate rejects a wrong provider
before timing it, the README table renders from a results file, and the pytest-benchmark suite runs.

The CLI test runs `python -m benchmarks` in a subprocess exactly as a user would, with every
provider installed here (TRL, verl, Liger: see `pip install -e ".[test,parity]"`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_kernels.bench import cli as bench_cli
from grpo_kernels.bench import plots
from grpo_kernels.bench import report as bench_report
from grpo_kernels.bench.ops import OPS
from grpo_kernels.bench.providers import REGISTRY, Forward, Provider, RunSettings
from grpo_kernels.bench.runner import run_suite
from grpo_kernels.bench.shapes import resolve_presets
from grpo_kernels.bench.timing import _quantile

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str], timeout: float = 300.0) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - start


def _listing() -> set[str]:
    folder = ROOT / "benchmarks" / "results"
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    before = _listing()
    proc, seconds = _run(["-m", "benchmarks", "--shapes", "tiny", "--out", str(out)])
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    assert _listing() == before, "the CLI test wrote into benchmarks/results/"
    (json_path,) = out.glob("*.json")
    return dict(
        out=out, proc=proc, seconds=seconds, json_path=json_path, report=json.loads(json_path.read_text())
    )


@pytest.mark.slow
def test_tiny_cli_run_prints_one_table_per_op(tiny_run):
    stdout = tiny_run["proc"].stdout
    assert "NOT grpo_kernels' performance numbers" in stdout  # CPU timings are labelled as such
    assert "Skipped providers:" in stdout
    for op, spec in OPS.items():
        assert f"== {op}: {spec.title}" in stdout
        assert spec.floor_label in stdout
    table = stdout.split("== fused_grpo")[1].split("\n== ")[0]
    for provider in ("grpo_kernels", "torch-eager", "trl", "liger-chunked", "verl-torch"):
        assert f"  {provider} " in table, f"{provider} missing from the fused_grpo table:\n{table}"
    assert f"wrote {tiny_run['json_path']}" in stdout
    # quiet unless asked: the DEBUG lines of the path each call took stay out (a peer's import may have
    # configured the root logger); --verbose shows them
    assert "DEBUG" not in stdout + tiny_run["proc"].stderr


@pytest.mark.slow
def test_tiny_cli_run_json(tiny_run):
    report, path = tiny_run["report"], tiny_run["json_path"]
    assert report["schema"] == "grpo_kernels.bench/1"
    assert report["device"]["type"] == "cpu" and report["device"]["threads"] == 1
    assert path.name.startswith("cpu_") and report["date"][:10] in path.name  # device and date in the name
    for key in ("torch", "triton", "grpo_kernels", "trl", "verl", "liger-kernel", "cut-cross-entropy"):
        assert key in report["versions"]
    assert report["git"]["sha"] is None or len(report["git"]["sha"]) == 40
    assert report["settings"]["dtype"] == "bf16" and report["settings"]["timing"] == "perf_counter"
    assert any("NOT grpo_kernels' performance numbers" in n for n in report["notes"])
    shapes = resolve_presets(["tiny"])
    for op in OPS:
        rows = [r for r in report["results"] if r["op"] == op]
        assert {r["shape"]["tokens"] for r in rows} == {s.tokens for s in shapes}
        for r in rows:
            if r["provider"] == "floor":
                assert r["status"] == "ok" and r["x_floor"] == pytest.approx(1.0)
                continue
            # every provider that ran was checked against the fp32 reference before it was timed
            assert r["status"] == "ok", f"{op} {r['provider']}: {r['status']} {r['reason']}"
            assert r["parity"]["checks"] and {c["name"] for c in r["parity"]["checks"]} <= set(OPS[op].compared)
            if not r["parity"]["passed"]:  # only a baseline timed despite its known error (TRL's bf16 log-softmax)
                assert REGISTRY.providers[r["provider"]].timed_despite_parity, (op, r["provider"], r["parity"])
                assert "timed anyway" in r["parity_note"]
            t = r["time"]
            assert t["p20_ms"] <= t["median_ms"] <= t["p80_ms"] and t["iters"] == 3
            # on a CPU from the profiler's allocation record: the call's own peak, gradients included
            assert r["memory"]["peak_extra_bytes"] > 0 and r["memory"]["grad_bytes"] >= 0
            assert r["x_floor"] > 0 and r["ours_speedup"] > 0
        ours = [r for r in rows if r["provider"] == "grpo_kernels"]
        assert len(ours) == len(shapes) and all(r["ours_speedup"] == pytest.approx(1.0) for r in ours)
    skipped = {(s["provider"], s["op"]): s["reason"] for s in report["skipped"]}
    # a peer that is not installed (the newest-stack tier has neither) is skipped saying so
    for peer, module in (("liger-triton", "liger_kernel"), ("verl", "verl")):
        installed = importlib.util.find_spec(module) is not None
        reason = skipped[(peer, "fused_grpo")]
        assert ("needs a CUDA device" if installed else "not installed") in reason, (peer, reason)
    if importlib.util.find_spec("verl") is not None:
        assert ("verl", "loss_head") not in skipped  # verl's loss code itself runs on CPU
    assert "torch.compile on CPU" in skipped[("torch-compile", "fused_grpo")]
    # the vocabulary-parallel provider ran (parity-checked above) on a 1-rank group, and says so
    tp_rows = [r for r in report["results"] if r["provider"] == "grpo_kernels-tp"]
    assert {r["op"] for r in tp_rows} == {"logprobs", "logprobs_grad", "fused_grpo"}
    assert all("TP = 1" in r["impl"] for r in tp_rows), [r["impl"] for r in tp_rows]


@pytest.mark.slow
def test_tiny_cli_run_plots(tiny_run):
    pngs = sorted(tiny_run["out"].glob("*.png"))
    assert len(pngs) == len(OPS)  # one figure (time | memory) per op and LM head
    stem = tiny_run["json_path"].stem
    for png in pngs:
        assert png.name.startswith(stem) and png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_readme_table_from_results(tiny_run, tmp_path, capsys):
    from grpo_kernels.bench.cli import main as bench_main

    assert bench_main(["--readme-table", str(tiny_run["json_path"])]) == 0
    out = capsys.readouterr().out
    assert "CPU run" in out  # a CPU file is labelled, never passed off as the product's numbers
    assert "| provider | median ms (p20-p80) | x floor | grpo_kernels faster by | extra memory |" in out
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{bench_report.README_START}\nold\n{bench_report.README_END}\ntail\n")
    assert bench_main(["--readme-table", str(tiny_run["json_path"]), "--write-readme", str(readme)]) == 2
    assert "refusing" in capsys.readouterr().err
    assert "old" in readme.read_text()


def _gpu_like_report(tiny_report: dict) -> dict:
    """The tiny CPU report relabelled as a CUDA one, to exercise the README writer."""
    report = json.loads(json.dumps(tiny_report))
    report["device"] = {"type": "cuda", "name": "NVIDIA H200", "driver": "570.00", "cuda_runtime": "12.8"}
    report["notes"] = []
    return report


@pytest.mark.slow
def test_write_readme_replaces_only_the_block(tiny_run, tmp_path):
    report = _gpu_like_report(tiny_run["report"])
    table = bench_report.readme_table(report, "benchmarks/results/x.json")
    assert "Measured on NVIDIA H200 (driver 570.00, CUDA 12.8)" in table and "CPU run" not in table
    for op in OPS:
        assert f"**{op}**" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{bench_report.README_START}\nold\n{bench_report.README_END}\ntail\n")
    bench_report.write_readme(readme, table)
    text = readme.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text and table in text


def test_readme_has_the_table_block():
    text = (ROOT / "README.md").read_text()
    assert bench_report.README_START in text and bench_report.README_END in text


# ---------------------------------------------------------------------------------------------------
# The parity gate, in process (loss_head at the tiny shapes: no LM head, no peers needed)
# ---------------------------------------------------------------------------------------------------
def _settings() -> RunSettings:
    return RunSettings(dtype=torch.bfloat16, device=torch.device("cpu"), warmup=0, iters=2)


def _broken_loss_head(inp, s):
    import grpo_kernels as gk

    cfg = dataclasses.replace(inp.config, kl_coef=0.0)  # forgets the KL term

    def fn():
        return gk.grpo_loss(
            inp.logprobs, inp.advantages, inp.mask, inp.old_logprobs, inp.ref_logprobs, config=cfg
        ).loss

    return Forward(fn, "drops the KL term")


def _crashing_loss_head(inp, s):
    def fn():
        raise RuntimeError("kernel launch failed")

    return Forward(fn)


def test_parity_gate_reports_a_wrong_provider_and_does_not_time_it(monkeypatch):
    monkeypatch.setitem(
        REGISTRY.providers, "wrong", Provider("wrong", "test", {"loss_head": _broken_loss_head})
    )
    monkeypatch.setitem(
        REGISTRY.providers, "crash", Provider("crash", "test", {"loss_head": _crashing_loss_head})
    )
    report = run_suite(["loss_head"], resolve_presets(["tiny"])[:1], ["grpo_kernels", "wrong", "crash"],
                       _settings(), ["tiny"])  # fmt: skip
    rows = {r["provider"]: r for r in report["results"]}
    assert rows["grpo_kernels"]["status"] == "ok" and rows["grpo_kernels"]["time"]
    wrong = rows["wrong"]
    assert wrong["status"] == "parity-failed" and wrong["time"] is None and "FAIL" in wrong["reason"]
    failed = [c for c in wrong["parity"]["checks"] if not c["passed"]]
    assert failed and all("worst |diff|" in c["worst"] for c in failed)  # the message shows the worst element
    crash = rows["crash"]
    assert crash["status"] == "error" and crash["time"] is None and "kernel launch failed" in crash["reason"]
    text = bench_report.console_report(report)
    assert "parity-failed" in text and "error: RuntimeError: kernel launch failed" in text


def test_interleaved_timing_and_a_baseline_timed_despite_its_gate(monkeypatch):
    """--interleave: every provider gated first, then timed in turns; a provider registered as a baseline
    (timed_despite_parity) is timed with its failed gate kept in the row, any other is not timed."""
    monkeypatch.setitem(
        REGISTRY.providers, "wrong", Provider("wrong", "test", {"loss_head": _broken_loss_head})
    )
    monkeypatch.setitem(
        REGISTRY.providers, "baseline",
        Provider("baseline", "test", {"loss_head": _broken_loss_head}, timed_despite_parity="a known error"),
    )  # fmt: skip
    settings = dataclasses.replace(_settings(), interleave=True, iters=3)
    report = run_suite(["loss_head"], resolve_presets(["tiny"])[:1], ["grpo_kernels", "wrong", "baseline"],
                       settings, ["tiny"])  # fmt: skip
    rows = {r["provider"]: r for r in report["results"]}
    assert rows["grpo_kernels"]["time"]["iters"] == 3 and "interleaved" in rows["grpo_kernels"]["time"]["timer"]
    assert rows["grpo_kernels"]["memory"]["peak_extra_bytes"] > 0  # measured on a CPU too
    assert rows["wrong"]["status"] == "parity-failed" and rows["wrong"]["time"] is None
    baseline = rows["baseline"]
    assert baseline["status"] == "ok" and baseline["time"]["iters"] == 3
    assert not baseline["parity"]["passed"] and "timed anyway: a known error" in baseline["parity_note"]
    assert report["settings"]["interleaved"] is True


def _cpu_preset_files() -> list[Path]:
    files = sorted((ROOT / "benchmarks" / "results").glob("cpu_*.json"))
    return [f for f in files if bench_report.is_cpu_preset(json.loads(f.read_text()))]


def test_readme_cpu_table_is_the_committed_results():
    """The README's CPU table is what `--readme-table` renders from the committed `cpu`-preset results files
    (both dtypes), never typed: re-measure with the command in the table, then regenerate it."""
    text = (ROOT / "README.md").read_text()
    assert bench_report.README_CPU_START in text and bench_report.README_CPU_END in text
    block = text.split(bench_report.README_CPU_START, 1)[1].split(bench_report.README_CPU_END, 1)[0].strip()
    files = _cpu_preset_files()
    assert files, "no committed cpu-preset results in benchmarks/results/"
    reports = [bench_report.load_json(f) for f in files]
    assert sorted(r["settings"]["dtype"] for r in reports) == ["bf16", "fp32"]
    source = ", ".join(str(f.relative_to(ROOT)) for f in files)
    table = bench_report.readme_cpu_table(reports, source)
    assert block == table, (
        "README CPU table differs from the committed results: run python -m benchmarks --readme-table "
        f"{source.replace(', ', ' ')} --write-readme README.md"
    )
    for r in reports:  # every row measured: the timed providers passed (or, the baseline, were timed anyway)
        for row in r["results"]:
            if row["provider"] != "floor":
                assert row["status"] == "ok" and row["time"] and row["memory"], (row["provider"], row["reason"])


def test_unavailable_providers_say_why():
    cpu = _settings()
    liger_triton = REGISTRY.providers["liger-triton"].unavailable(cpu, "fused_grpo")
    assert "needs a CUDA device" in liger_triton or "not installed" in liger_triton
    missing = Provider("ghost", "test", {"loss_head": _crashing_loss_head}, dist="no-such-distribution-xyz")
    assert missing.unavailable(cpu, "loss_head") == (
        "no-such-distribution-xyz is not installed (pip install no-such-distribution-xyz)"
    )
    compile_cpu = REGISTRY.providers["torch-compile"]
    assert "name it in --providers" in compile_cpu.unavailable(cpu, "loss_head")
    assert (
        compile_cpu.unavailable(dataclasses.replace(cpu, explicit=frozenset({"torch-compile"})), "loss_head")
        is None
    )


def test_quantiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert _quantile(values, 0.5) == 3.0
    assert _quantile(values, 0.2) == pytest.approx(1.8)
    assert _quantile(values, 0.8) == pytest.approx(5.2)


def test_bench_subcommand_lists_providers(capsys):
    from grpo_kernels.cli import main

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY.providers:
        assert name in out
    for preset in ("tiny", "qwen2.5-7b", "llama3-8b", "qwen3-8b", "sweep", "full"):
        assert preset in out


def test_bench_usage_names_the_command_it_was_invoked_as(capsys):
    from grpo_kernels.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--bogus"])
    assert capsys.readouterr().err.startswith("usage: grpo-kernels bench ")
    with pytest.raises(SystemExit):
        bench_cli.main(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: python -m benchmarks ")


def test_plot_caption_fits_and_coinciding_lines_stay_distinguishable():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = {"versions": {"torch": "2.11.0+cu130", "triton": "3.6.0"}, "git": {"sha": "0123456789abcdef" * 2},
              "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}, "date": "2026-11-24T23:00:00+00:00"}
    for device in ("cuda", "cpu"):
        report["device"]["type"] = device
        fig = plt.figure(figsize=plots.FIGSIZE)
        title = fig.suptitle(plots.caption(report, "Qwen3-8B H=4096 V=151936"), fontsize=plots.CAPTION_FONTSIZE)
        fig.canvas.draw()
        box = title.get_window_extent()
        plt.close(fig)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox)  # not cut at either end
    styles = [plots.line_style(i) for i in range(10)]
    assert len({(s["marker"], s["linestyle"], s["color"]) for s in styles}) == 10
    assert len({s["marker"] for s in styles}) == 10  # two lines on one path: different markers at least
    factors = [plots.offset(i, 4) for i in range(4)]
    assert factors == sorted(factors) and len(set(factors)) == 4 and 0.98 < factors[0] < factors[-1] < 1.02


def test_pytest_does_not_collect_the_benchmarks_by_default():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]


@pytest.mark.slow
def test_pytest_benchmark_suite_runs(tmp_path):
    proc, _ = _run(["-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider", "--bench-ops", "loss_head",
                    "--benchmark-disable", f"--rootdir={ROOT}"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout
