"""PNG plots: time and peak extra memory against tokens, one line per provider, per op and LM head."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .ops import OPS
from .runner import FLOOR


def _family(row: dict) -> str:
    s = row["shape"]
    return f"{s['model']} H={s['hidden']} V={s['vocab']}"


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in report["results"]:
        groups[(r["op"], _family(r))].append(r)
    cpu = report["device"]["type"] != "cuda"
    for (op, family), rows in groups.items():
        fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
        lines: dict[str, list[tuple[int, dict]]] = defaultdict(list)
        for r in rows:
            if r["status"] == "ok" and r["time"]:
                lines[r["provider"]].append((r["shape"]["tokens"], r))
        for provider, points in lines.items():
            points.sort(key=lambda p: p[0])
            tokens = [n for n, _ in points]
            style = dict(color="black", linestyle="--") if provider == FLOOR else dict(marker="o")
            label = OPS[op].floor_label if provider == FLOOR else provider
            ax_time.plot(tokens, [r["time"]["median_ms"] for _, r in points], label=label, **style)
            memory = [(n, r["memory"]["beyond_grads_bytes"] / 2**20) for n, r in points if r["memory"]]
            if memory and provider != FLOOR:
                ax_mem.plot([n for n, _ in memory], [m for _, m in memory], label=label, **style)
        device = report["device"]["name"]
        ax_time.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median time (ms)",
                    title=f"{op}: time ({report['settings']['dtype']})")  # fmt: skip
        ax_mem.set(xscale="log", xlabel="tokens N", ylabel="peak MiB beyond inputs and gradients",
                   title=f"{op}: extra memory")  # fmt: skip
        if cpu or not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "memory is measured on CUDA only", ha="center", va="center",
                        transform=ax_mem.transAxes)  # fmt: skip
        for ax in (ax_time, ax_mem):
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        v, sha = report["versions"], (report["git"]["sha"] or "unknown")[:10]
        caption = (f"{family} | {device} | torch {v['torch']}, triton {v['triton']} | grpo_kernels {sha} | "
                   f"{report['date'][:10]}")  # fmt: skip
        if cpu:
            caption += " | CPU: not the product's numbers"
        fig.suptitle(caption)
        fig.tight_layout()
        slug = re.sub(r"[^A-Za-z0-9]+", "-", family).strip("-")
        path = out_dir / f"{report['stem']}_{op}_{slug}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
