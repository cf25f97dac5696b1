"""PNG plots: time and peak extra memory against tokens, one line per provider, per op and LM head.

Readable as drawn: the caption is two short lines (one line of every field was cut at both ends);
lines that coincide (two providers on one code path) stay distinguishable, each provider with its own
colour, marker and dash pattern and a small offset along N; a panel with nothing to draw (memory off
CUDA) says why in place of empty axes."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .ops import OPS
from .runner import FLOOR

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
_DASHES = ("-", "--", "-.", ":")


def sha_label(git: dict | None) -> str:
    """The commit a figure or report is of: its first 10 hex digits, "+dirty" for a tree with changes."""
    git = git or {}
    return (git.get("sha") or "unknown")[:10] + ("+dirty" if git.get("dirty") else "")


def save_figure(fig, path: Path) -> Path:
    """Lay out, write at the reports' resolution and close a figure (the plots of every report)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_style(index: int) -> dict:
    """The style of the index-th provider's line: colour, marker (hollow every other one) and dashes."""
    return {"marker": _MARKERS[index % len(_MARKERS)], "linestyle": _DASHES[index % len(_DASHES)],
            "color": f"C{index % 10}", "markersize": 6, "markerfacecolor": "none" if index % 2 else None}  # fmt: skip


def offset(index: int, count: int, spread: float = 0.03) -> float:
    """A factor on N (a log axis) that fans `count` lines apart by `spread` in all: coinciding lines both show."""
    return 1.0 + spread * ((index - (count - 1) / 2) / max(1, count - 1))


def empty_panel(ax, why: str) -> None:
    """Say why a panel has no data instead of leaving blank axes."""
    ax.set_xscale("linear")
    ax.set_yscale("linear")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=10, wrap=True)


def _family(row: dict) -> str:
    s = row["shape"]
    return f"{s['model']} H={s['hidden']} V={s['vocab']}"


CAPTION_FONTSIZE = 9
FIGSIZE = (12, 5)  # inches: time | memory


def caption(report: dict, family: str) -> str:
    """Two lines: what and where, then the software (one line of it all was cut at both ends)."""
    v, sha = report["versions"], (report["git"]["sha"] or "unknown")[:10]
    cpu = report["device"]["type"] != "cuda"
    threads = f" ({report['device'].get('threads')} threads)" if cpu and report["device"].get("threads") else ""
    first = f"{family} | {report['device']['name']}{threads} | {report['date'][:10]}"
    note = " | CPU: the PyTorch backend" if report.get("settings", {}).get("presets") == ["cpu"] else (
        " | CPU: not the product's numbers")
    return first + (note if cpu else "") + (
        f"\ntorch {v['torch']}, triton {v['triton']} | grpo_kernels {sha}")


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in report["results"]:
        groups[(r["op"], _family(r))].append(r)
    for (op, family), rows in groups.items():
        fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=FIGSIZE)
        lines: dict[str, list[tuple[int, dict]]] = defaultdict(list)
        for r in rows:
            if r["status"] == "ok" and r["time"]:
                lines[r["provider"]].append((r["shape"]["tokens"], r))
        for index, (provider, points) in enumerate(lines.items()):
            points.sort(key=lambda p: p[0])
            shift = 1.0 if provider == FLOOR else offset(index, len(lines))
            tokens = [n * shift for n, _ in points]
            style = {"color": "black", "linestyle": "--", "marker": "x"} if provider == FLOOR else line_style(index)
            label = OPS[op].floor_label if provider == FLOOR else provider
            ax_time.plot(tokens, [r["time"]["median_ms"] for _, r in points], label=label, **style)
            memory = [(n * shift, r["memory"]["beyond_grads_bytes"] / 2**20) for n, r in points if r["memory"]]
            if memory and provider != FLOOR:
                ax_mem.plot([n for n, _ in memory], [m for _, m in memory], label=label, **style)
        ax_time.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median time (ms)",
                    title=f"{op}: time ({report['settings']['dtype']})")  # fmt: skip
        ax_mem.set(xscale="log", xlabel="tokens N", ylabel="peak MiB beyond inputs and gradients",
                   title=f"{op}: extra memory")  # fmt: skip
        if not ax_mem.lines:
            empty_panel(ax_mem, "no memory figures: peak memory is measured on CUDA and CPU only;\nthis run is on "
                        + report["device"]["type"].upper() if report["device"]["type"] not in ("cuda", "cpu") else
                        "no memory figures: no row measured its peak memory")  # fmt: skip
        for ax in (ax_time, ax_mem):
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7, ncol=2 if len(ax.lines) > 6 else 1)
        fig.suptitle(caption(report, family), fontsize=CAPTION_FONTSIZE)
        fig.tight_layout()
        slug = re.sub(r"[^A-Za-z0-9]+", "-", family).strip("-")
        path = out_dir / f"{report['stem']}_{op}_{slug}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
