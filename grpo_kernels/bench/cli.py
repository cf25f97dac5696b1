"""`python -m benchmarks` / `grpo-kernels bench` (the same CLI): every op against every peer in one run.

  python -m benchmarks                                  # tiny shapes on CPU, the full GPU run on CUDA
  python -m benchmarks --op fused_grpo --shapes qwen3-8b --providers grpo_kernels,trl,liger-chunked
  python -m benchmarks --shapes tiny --out /tmp/bench --json-only
  python -m benchmarks --list                           # ops, shape presets, providers and availability
  python -m benchmarks --readme-table benchmarks/results/X.json [--write-readme README.md]

  python -m benchmarks --op fused_grpo --shapes cpu --providers grpo_kernels,trl-materialised,trl \
      --threads 2 --dtype fp32 --iters 5     # the PyTorch backend against TRL on a CPU (README's CPU table)

On CPU the tiny preset proves the suite works (its timings are not the product's numbers); the cpu preset
measures the PyTorch backend, the path of every machine without CUDA, against TRL's. A full GPU run
(--shapes full, all ops) takes tens of minutes: split it by --op and pass all its JSON files to
--readme-table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .ops import DTYPES, OPS
from .shapes import PRESET_HELP, PRESETS, resolve_presets

OURS_PROVIDERS = ("grpo_kernels", "grpo_kernels-torch")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    from .providers import REGISTRY

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="all", help=f"comma-separated ops or 'all': {', '.join(OPS)}")
    p.add_argument("--shapes", default=None,
                   help="comma-separated shape presets; default 'tiny' off CUDA, 'full' on CUDA. "
                        + "; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items()))  # fmt: skip
    p.add_argument(
        "--providers", default="all", help=f"comma-separated or 'all': {', '.join(REGISTRY.providers)}"
    )
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dtype of hidden states and LM head")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default="benchmarks/results", help="where the JSON and PNG files go")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 3 on CUDA, 1 on CPU)"
    )
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 10 on CUDA, 3 on CPU)")
    p.add_argument("--json-only", action="store_true", help="write only the JSON: no console tables, no PNGs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU runs: torch intra-op threads (default 1: the tiny shapes gain nothing from more, "
                        "and OpenMP spin-waits dominate on a busy machine)")  # fmt: skip
    p.add_argument("--interleave", action="store_true",
                   help="time the providers of a shape in turns, one call each per round (a shared machine's "
                        "drifting load then reaches each of them alike); the `cpu` preset's default")  # fmt: skip
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the torch-compile provider ('aot_eager' traces without "
                        "code generation: a quick check of the provider on CPU)")  # fmt: skip
    p.add_argument(
        "--list", action="store_true", help="list ops, presets and providers (with availability) and exit"
    )
    p.add_argument(
        "--readme-table",
        metavar="RESULTS_JSON",
        nargs="+",
        help="print the README headline table of a results file (several: one run split by --op)",
    )
    p.add_argument(
        "--write-readme", metavar="README", help="with --readme-table: replace the table block in README"
    )
    p.add_argument("--allow-cpu", action="store_true", help="with --write-readme: accept a CPU results file")
    p.add_argument("--verbose", action="store_true",
                   help="also print grpo_kernels' DEBUG log (the path each call took: schedule, backend)")  # fmt: skip
    return p


def _settings(args):
    from .providers import RunSettings

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    return RunSettings(
        dtype=DTYPES[args.dtype], device=device,
        warmup=args.warmup if args.warmup is not None else (3 if cuda else 1),
        iters=args.iters if args.iters is not None else (10 if cuda else 3),
        compile_backend=args.compile_backend, seed=args.seed,
        explicit=frozenset(_csv(args.providers)) if args.providers != "all" else frozenset(),
        interleave=args.interleave or (args.shapes is not None and "cpu" in _csv(args.shapes)),
    )  # fmt: skip


def _list(settings) -> int:
    from .providers import REGISTRY

    print("ops:")
    for op in OPS.values():
        print(f"  {op.name:<15} {op.title}")
    print("shape presets:")
    for name, shapes in PRESETS.items():
        print(f"  {name:<12} {PRESET_HELP[name]} ({len(shapes)} shape{'s' if len(shapes) > 1 else ''})")
    print(f"providers (availability on {settings.device.type}):")
    for p in REGISTRY.providers.values():
        reasons = {op: p.unavailable(settings, op) for op in p.ops}
        status = (
            "available"
            if not any(reasons.values())
            else "; ".join(sorted({r for r in reasons.values() if r}))
        )
        print(f"  {p.name:<20} ops: {', '.join(p.ops)}\n  {'':<20} {p.summary}\n  {'':<20} -> {status}")
    return 0


def _readme(args) -> int:
    from .report import (README_CPU_END, README_CPU_START, is_cpu_preset, load_json, merge_reports,
                         readme_cpu_table, readme_table, write_readme)  # fmt: skip

    reports = [load_json(Path(path)) for path in args.readme_table]
    if all(is_cpu_preset(r) for r in reports):  # the `cpu` preset: the README's CPU table, its own block
        table = readme_cpu_table(reports, ", ".join(args.readme_table))
        if args.write_readme:
            write_readme(Path(args.write_readme), table, README_CPU_START, README_CPU_END)
            print(f"wrote the CPU benchmark table into {args.write_readme}")
        else:
            print(table)
        return 0
    report = merge_reports(reports)
    table = readme_table(report, ", ".join(args.readme_table))
    if args.write_readme:
        if report["device"]["type"] != "cuda" and not args.allow_cpu:
            print(f"refusing to put CPU numbers in {args.write_readme}: the README shows GPU results "
                  "(pass --allow-cpu to override)", file=sys.stderr)  # fmt: skip
            return 2
        write_readme(Path(args.write_readme), table)
        print(f"wrote the benchmark table into {args.write_readme}")
    else:
        print(table)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """`prog`: how the user invoked it (`grpo-kernels bench` from the console script), for the usage line."""
    args = build_parser(prog).parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("grpo_kernels").setLevel(logging.DEBUG)
    if args.readme_table:
        return _readme(args)
    if args.write_readme:
        print("--write-readme needs --readme-table RESULTS_JSON", file=sys.stderr)
        return 2

    from .providers import REGISTRY

    settings = _settings(args)
    if settings.device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.list:
        return _list(settings)
    ops = list(OPS) if args.op == "all" else _csv(args.op)
    providers = list(REGISTRY.providers) if args.providers == "all" else _csv(args.providers)
    presets = _csv(args.shapes) if args.shapes else (["full"] if settings.device.type == "cuda" else ["tiny"])
    unknown = [o for o in ops if o not in OPS] + [p for p in providers if p not in REGISTRY.providers]
    if unknown:
        print(f"unknown op / provider: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    try:
        shapes = resolve_presets(presets)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    from .report import console_report, write_json
    from .runner import run_suite

    report = run_suite(ops, shapes, providers, settings, presets)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:  # torchrun (grpo_kernels-tp): rank 0 reports
        return 0
    out_dir = Path(args.out)
    json_path = write_json(report, out_dir)
    if not args.json_only:
        from .plots import write_plots

        print(console_report(report))
        pngs = write_plots(report, out_dir)
        print(f"\nwrote {json_path}")
        for png in pngs:
            print(f"wrote {png}")
    else:
        for s in report["skipped"]:
            print(f"skipped {s['provider']} [{s['op']}]: {s['reason']}", file=sys.stderr)
        print(json_path)
    ours_failed = [r for r in report["results"] if r["provider"] in OURS_PROVIDERS and r["status"] in
                   ("parity-failed", "error")]  # fmt: skip
    for r in ours_failed:
        print(
            f"grpo_kernels FAILED on {r['op']} {r['shape_label']} ({r['provider']}): {r['reason']}",
            file=sys.stderr,
        )
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
