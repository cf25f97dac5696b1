"""Rendering a results report: console tables, the JSON file, and the README headline table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .ops import BENCH_LOSS_SUMMARY, OPS
from .plots import sha_label
from .runner import FLOOR, OURS

README_START = "<!-- bench-table:start -->"
README_END = "<!-- bench-table:end -->"
# the CPU table (the `cpu` preset: the PyTorch backend against TRL), its own block
README_CPU_START = "<!-- cpu-bench-table:start -->"
README_CPU_END = "<!-- cpu-bench-table:end -->"
CPU_PRESET = "cpu"
CPU_BASELINE = "trl-materialised"  # what the time and memory ratios divide by
CPU_COLUMNS = ("grpo_kernels", "trl-materialised", "trl")
HEADLINE = ("Qwen3-8B", 16384)  # docs/design.md §7: N=16384, H=4096, V=151936


def _mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _format_table(header: list[str], rows: list[list[str]], left: int = 2) -> str:
    """Plain text table; the first `left` columns are left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _cells(r: dict, gemm: bool) -> list[str]:
    name = r["provider"] if r["provider"] != FLOOR else OPS[r["op"]].floor_label
    if r["status"] != "ok" or not r["time"]:
        return [f"  {name}", f"{r['status']}: {r['reason']}"[:60], "", "", "", "", "", ""]
    t = r["time"]
    parity = "-" if r["provider"] == FLOOR else r.get("parity_summary", "")
    speed = r.get("ours_speedup")
    throughput = r.get("tflops") if gemm else r.get("gbps")
    memory = r["memory"]["beyond_grads_bytes"] if r["memory"] else None
    return [
        f"  {name}",
        parity,
        _ms(t["median_ms"]),
        f"{_ms(t['p20_ms'])}-{_ms(t['p80_ms'])}",
        "-" if r.get("x_floor") is None else f"{r['x_floor']:.2f}x",
        "-" if speed is None or r["provider"] == OURS else f"{speed:.2f}x",
        "-" if throughput is None else f"{throughput:.3g}",
        _mib(memory) if r["provider"] != FLOOR else "-",
    ]


def op_table(report: dict, op: str) -> str:
    spec = OPS[op]
    rows = [r for r in report["results"] if r["op"] == op]
    if not rows:
        return ""
    gemm = spec.gemm_units > 0
    header = ["shape / provider", "parity (err vs torch)", "median ms", "p20-p80 ms", "x floor"]
    header += ["ours faster", "TFLOP/s" if gemm else "GB/s", "extra MiB"]
    body: list[list[str]] = []
    shape = None
    for r in rows:
        if r["shape_label"] != shape:
            shape = r["shape_label"]
            body.append([shape] + [""] * (len(header) - 1))
        body.append(_cells(r, gemm))
    dtype = "fp32 log-probs" if op == "loss_head" else report["settings"]["dtype"]
    loss = BENCH_LOSS_SUMMARY if op in ("fused_grpo", "loss_head") else "temperature 1"
    floor = (
        f"{spec.gemm_units} GEMM(s) [N,H]x[H,V] on the device BLAS; TFLOP/s at {spec.gemm_units} x 2NHV FLOPs"
        if gemm
        else "a device copy of the op's compulsory bytes (17 B/token); GB/s of those bytes"
    )
    title = [
        f"== {op}: {spec.title} [{dtype}; {loss}] ==",
        f"floor: {floor}",
        "ours faster = provider time / grpo_kernels time; "
        "extra MiB = peak allocated beyond inputs and gradients"
        + ("" if report["device"]["type"] == "cuda" else " (not measured off CUDA)"),
    ]
    impls = {}
    for r in rows:
        if r["impl"] and r["provider"] != FLOOR:
            impls.setdefault(r["provider"], r["impl"])
    legend = ["implementations: " + "; ".join(f"{k}: {v}" for k, v in impls.items())] if impls else []
    return "\n".join(title) + "\n" + _format_table(header, body) + "".join("\n" + x for x in legend)


def console_report(report: dict) -> str:
    device = report["device"]
    v = report["versions"]
    sha = sha_label(report["git"])
    lines = [
        f"Machine: {device['name']} ({device['type']}) | torch {v['torch']} | triton {v['triton']} | "
        f"grpo_kernels {v['grpo_kernels']} @ {sha} | {report['date']}",
        *[f"NOTE: {n}" for n in report["notes"]],
    ]
    if report["skipped"]:
        lines.append("Skipped providers:")
        seen = set()
        for s in report["skipped"]:
            key = (s["provider"], s["reason"])
            ops_for = [x["op"] for x in report["skipped"] if (x["provider"], x["reason"]) == key]
            if key not in seen:
                seen.add(key)
                lines.append(f"  {s['provider']:<20} [{', '.join(ops_for)}] {s['reason']}")
    for op in report["settings"]["ops"]:
        table = op_table(report, op)
        if table:
            lines += ["", table]
    return "\n".join(lines)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report['stem']}.json"
    path.write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    return path


def load_json(path: Path) -> dict:
    report = json.loads(Path(path).read_text())
    if not str(report.get("schema", "")).startswith("grpo_kernels.bench/"):
        raise ValueError(
            f"{path} is not a grpo_kernels benchmark results file (schema {report.get('schema')!r})"
        )
    return report


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs on the same device (a GPU session split by --op / --shapes)."""
    first = reports[0]
    for other in reports[1:]:
        if other["device"]["name"] != first["device"]["name"]:
            raise ValueError(
                f"results from different devices: {first['device']['name']} and {other['device']['name']}"
            )
    merged = {**first, "results": [], "skipped": [], "settings": {**first["settings"], "ops": []}}
    for report in reports:
        merged["results"] += report["results"]
        merged["skipped"] += report["skipped"]
        merged["settings"]["ops"] += [
            op for op in report["settings"]["ops"] if op not in merged["settings"]["ops"]
        ]
    merged["date"] = max(r["date"] for r in reports)
    return merged


# ------------------------------------------------------------------------------------------------
# README headline table
# ------------------------------------------------------------------------------------------------
def headline_shape(report: dict, op: str) -> str | None:
    """The docs/design.md §7 shape when the run has it, else the largest N of the first model."""
    rows = [r for r in report["results"] if r["op"] == op]
    if not rows:
        return None
    for r in rows:
        if (r["shape"]["model"], r["shape"]["tokens"]) == HEADLINE:
            return r["shape_label"]
    first_model = rows[0]["shape"]["model"]
    return max((r for r in rows if r["shape"]["model"] == first_model), key=lambda r: r["shape"]["tokens"])[
        "shape_label"
    ]


def _readme_row(r: dict) -> str:
    name = OPS[r["op"]].floor_label if r["provider"] == FLOOR else r["provider"]
    if r["status"] != "ok" or not r["time"]:
        return f"| {name} | {r['status']}: {r['reason'][:80]} | | | |"
    t = r["time"]
    speed = r.get("ours_speedup")
    speed_cell = "—" if r["provider"] == OURS or speed is None else f"{speed:.2f}x"
    memory = r["memory"]["beyond_grads_bytes"] if r["memory"] else None
    memory_cell = "n/a" if memory is None or r["provider"] == FLOOR else f"{memory / 2**30:.2f} GiB"
    floor_cell = "—" if r.get("x_floor") is None else f"{r['x_floor']:.2f}x"
    return (
        f"| {name} | {_ms(t['median_ms'])} ({_ms(t['p20_ms'])}-{_ms(t['p80_ms'])}) | "
        f"{floor_cell} | {speed_cell} | {memory_cell} |"
    )


def readme_table(report: dict, source: str) -> str:
    device = report["device"]
    v = report["versions"]
    sha = (report["git"]["sha"] or "unknown")[:10]
    where = device["name"] + (
        f" (driver {device.get('driver')}, CUDA {device.get('cuda_runtime')})"
        if device["type"] == "cuda"
        else ""
    )
    lines = []
    if device["type"] != "cuda":
        lines += [f"> **{report['notes'][0] if report['notes'] else 'CPU run'}**", ""]
    lines += [
        f"Measured on {where}, {report['date'][:10]}, torch {v['torch']}, triton {v['triton']}, "
        f"{report['settings']['dtype']}, grpo_kernels {sha}; from `{source}`. "
        "Each provider was checked against the fp32 reference on these inputs before it was timed (a failure "
        "is listed, not timed); x floor = time / the floor measured in the same run (cuBLAS GEMMs, a memory "
        "copy for loss_head); extra memory = peak beyond inputs and gradients.",
    ]
    for op in report["settings"]["ops"]:
        shape = headline_shape(report, op)
        if shape is None:
            continue
        lines += [
            "",
            f"**{op}** — {OPS[op].title}, {shape}",
            "",
            "| provider | median ms (p20-p80) | x floor | grpo_kernels faster by | extra memory |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [_readme_row(r) for r in report["results"] if r["op"] == op and r["shape_label"] == shape]
        not_run = [f"{s['provider']} ({s['reason']})" for s in report["skipped"] if s["op"] == op]
        if not_run:
            lines += ["", "Not run: " + "; ".join(not_run) + "."]
    return "\n".join(lines)


def is_cpu_preset(report: dict) -> bool:
    """A CPU run of the `cpu` preset alone: the README's CPU table, not its GPU table."""
    return report["device"]["type"] == "cpu" and report["settings"]["presets"] == [CPU_PRESET]


def _gib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f}"


def _grad_error(r: dict) -> float | None:
    """The larger relative L2 error of the two gradients against the fp32 reference (the parity gate's)."""
    if not r.get("parity"):
        return None
    errors = [c["error"] for c in r["parity"]["checks"] if c["name"].startswith("grad_")]
    return max(errors) if errors else None


def readme_cpu_table(reports: list[dict], source: str) -> str:
    """The README's CPU table from `cpu`-preset runs (one per dtype): per head and dtype, the median time and
    the peak memory of grpo_kernels (backend "auto" = the PyTorch backend on a CPU) and of TRL's two paths, and
    the ratios to TRL's materialised path."""
    first = reports[0]
    device, v = first["device"], first["versions"]
    shas = sorted({(r["git"]["sha"] or "unknown")[:10] for r in reports})
    dtypes = [r["settings"]["dtype"] for r in reports]
    iters = sorted({r["settings"]["iters"] for r in reports})
    loads = [r["device"].get("load_average") for r in reports if r["device"].get("load_average")]
    load = ""
    if loads:  # the 1-minute load average when each run started (a shared machine)
        load = f"; load average {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} at the runs' starts"
    lines = [
        f"Measured on {device['name']} with {device.get('threads')} threads ({device.get('cpus')} cores{load}), "
        f"{max(r['date'] for r in reports)[:10]}, torch {v['torch']}, TRL {v.get('trl')}, grpo_kernels "
        f"{', '.join(shas)}, {' and '.join(dtypes)}; from `{source}` (`python -m benchmarks --op fused_grpo --shapes "
        f"cpu --providers {','.join(CPU_COLUMNS)} --threads {device.get('threads')} --dtype DTYPE`). fused_grpo: "
        f"hidden states -> GRPO loss ({BENCH_LOSS_SUMMARY}) -> grads of hidden states and weight; median of "
        f"{'/'.join(str(i) for i in iters)} calls, interleaved; peak = torch allocations during one call beyond "
        "what was allocated before it, gradients included; grad error = the larger relative L2 error of the two "
        "gradients against the fp32 reference. TRL materialised: the model's [B, T, V] logits in the input dtype "
        "and `selective_log_softmax_and_entropy`; TRL fused head: its GRPOTrainer's `ChunkedLogProbFunction`.",
        "",
        "| head, tokens | dtype | grpo_kernels ms | TRL materialised ms | TRL fused head ms | time / TRL materialised "
        "| grpo_kernels peak GiB | TRL materialised peak GiB | TRL fused head peak GiB | memory / TRL materialised "
        "| grad error: grpo_kernels / TRL materialised |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    labels = []
    for report in reports:
        for r in report["results"]:
            if r["shape_label"] not in labels and r["op"] == "fused_grpo":
                labels.append(r["shape_label"])
    for label in labels:
        for report in reports:
            rows = {r["provider"]: r for r in report["results"]
                    if r["op"] == "fused_grpo" and r["shape_label"] == label}  # fmt: skip
            if not rows:
                continue
            shape = next(iter(rows.values()))["shape"]

            def ms(name):
                r = rows.get(name)
                return None if not r or r["status"] != "ok" or not r["time"] else r["time"]["median_ms"]

            def peak(name):
                r = rows.get(name)
                return None if not r or not r.get("memory") else r["memory"]["peak_extra_bytes"]

            def ratio(a, b):
                return "n/a" if a is None or b is None else f"{a / b:.2f}"

            def time_cell(name):
                r = rows.get(name)
                if r is None:
                    return "not run"
                if r["status"] != "ok" or not r["time"]:
                    return f"{r['status']}: {r['reason'][:60]}"
                t = r["time"]
                return f"{_ms(t['median_ms'])} ({_ms(t['p20_ms'])}-{_ms(t['p80_ms'])})"

            ours, base = CPU_COLUMNS[0], CPU_BASELINE
            errors = [_grad_error(rows[n]) if n in rows else None for n in (ours, base)]
            error_cell = " / ".join("n/a" if e is None else f"{e:.1e}" for e in errors)
            lines.append(
                f"| {shape['model']}: H={shape['hidden']} V={shape['vocab']}, N={shape['tokens']} | "
                f"{report['settings']['dtype']} | {time_cell(ours)} | {time_cell(base)} | {time_cell('trl')} | "
                f"**{ratio(ms(ours), ms(base))}** | {_gib(peak(ours))} | {_gib(peak(base))} | {_gib(peak('trl'))} | "
                f"**{ratio(peak(ours), peak(base))}** | {error_cell} |"
            )
    return "\n".join(lines)


def write_readme(readme: Path, table: str, start: str = README_START, end: str = README_END) -> None:
    text = readme.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{readme} has no {start} ... {end} block to replace")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}")
