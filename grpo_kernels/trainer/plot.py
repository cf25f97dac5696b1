"""The run's learning curves, one PNG: reward, completion length, entropy, KL, clip fraction, grad norm."""

from __future__ import annotations

import json
import math
import os

PANELS = (  # (title, [(metric, label)], y-axis note)
    ("reward", [("reward", "mean reward"), ("solved", "solved fraction")]),
    ("completion length (tokens, EOS included)", [("completion_length", "mean")]),
    ("entropy (nats / token)", [("entropy", "policy entropy")]),
    ("KL to the reference", [("kl", "kl")]),
    ("clip fraction", [("clip_ratio/region_mean", "clipped tokens")]),
    ("grad norm (before clipping)", [("grad_norm", "global norm")]),
)


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str, png_path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    for ax, (panel_title, series) in zip(axes.flat, PANELS):
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        drawn = False
        for key, label in series:
            points = [
                (r["step"], r[key])
                for r in rows
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=label, linewidth=1.4)
                drawn = True
        if not drawn:
            ax.text(
                0.5,
                0.5,
                "not measured in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        elif len(series) > 1:
            ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=12)
    partial = png_path + ".partial.png"
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    os.replace(partial, png_path)
