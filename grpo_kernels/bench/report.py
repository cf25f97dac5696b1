"""Rendering a results report: console tables, the JSON file, and the README headline table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .ops import BENCH_LOSS_SUMMARY, OPS
from .runner import FLOOR, OURS

README_START = "<!-- bench-table:start -->"
README_END = "<!-- bench-table:end -->"
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
    sha = (report["git"]["sha"] or "unknown")[:10] + ("+dirty" if report["git"].get("dirty") else "")
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


def write_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} block to replace")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{table}\n{README_END}{tail}")
