"""The run's learning curves, one PNG: reward (with a random-policy baseline), completion length,
entropy, KL (named by its estimator) or what replaces it, clip fraction, grad norm, and with a vLLM sampler
how far its log-probs are from the trainer's (log scale).

Each curve is drawn raw (faint) and smoothed (a trailing mean over `smooth` steps), so a trend reads at a
glance on a noisy small-batch run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PlotInfo:
    """What the plot says about the run besides its metrics."""

    title: str
    kl_estimator: str | None = None  # None: no KL term in this run (no KL panel)
    dynamic_sampling: bool = False  # a panel of the sampling rounds each step took
    random_reward: float | None = None  # the task reward of uniformly random completions (a dashed line)
    sampler_mismatch: bool = False  # a panel of the sampler's log-probs against the trainer's (vLLM rollouts)
    smooth: int = 10  # trailing-mean window, in steps


def panels(info: PlotInfo) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(metric, label)]) of the panels of this run: six, or seven with dynamic sampling and KL, and
    one more with a vLLM sampler."""
    chosen = [
        ("reward", [("reward", "mean reward"), ("solved", "solved fraction"),
                    ("turn_reward/0", "first-turn reward")]),  # fmt: skip
        ("completion length (tokens, EOS included)", [("completion_length", "mean")]),
        ("entropy (nats / token)", [("entropy", "policy entropy")]),
    ]
    if info.kl_estimator is not None:
        chosen.append((f"KL to the reference ({info.kl_estimator} estimator)", [("kl", "kl")]))
    if info.dynamic_sampling:
        chosen.append(("dynamic sampling: rounds per step", [("sampling_rounds", "rounds")]))
    if len(chosen) == 3:  # neither: the tokens each step trained on
        chosen.append(("tokens trained per step", [("tokens", "tokens")]))
    chosen += [
        ("clip fraction", [("clip_ratio/region_mean", "clipped tokens")]),
        ("grad norm (before clipping)", [("grad_norm", "global norm")]),
    ]
    if info.sampler_mismatch:  # TRL's and verl's names (rollout.MISMATCH_METRICS)
        chosen.append((MISMATCH_PANEL, [
            ("sampling/sampling_logp_difference/mean", "mean |log r|"),
            ("sampling/sampling_logp_difference/max", "max |log r|"),
            ("rollout_corr/k3_kl", "k3 KL"),
            ("sampling/ratio_outside_0.5_2", "share of r outside [1/2, 2]"),
        ]))  # fmt: skip
    return chosen


MISMATCH_PANEL = "vLLM sampler vs trainer, r = p_trainer / p_sampler (log scale)"


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """out[i] = mean(values[max(0, i - window + 1) .. i])."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(metrics_path: str, png_path: str, info: PlotInfo) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    chosen = panels(info)
    columns = math.ceil(len(chosen) / 2)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7.5), constrained_layout=True)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    for ax, (panel_title, series) in zip(axes.flat, chosen):
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        drawn = False
        for key, label in series:
            points = [
                (r["step"], r[key])
                for r in rows
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
                and (panel_title != MISMATCH_PANEL or r[key] > 0)  # log scale: exact zeros are not drawn
            ]
            if points:
                steps, values = zip(*points)
                (line,) = ax.plot(steps, values, linewidth=0.8, alpha=0.35)
                smooth = trailing_mean(list(values), info.smooth) if len(values) > info.smooth else values
                suffix = f" ({info.smooth}-step mean)" if len(values) > info.smooth else ""
                ax.plot(steps, smooth, color=line.get_color(), linewidth=1.6, label=label + suffix)
                drawn = True
        if panel_title == MISMATCH_PANEL and drawn:
            ax.set_yscale("log")
        if panel_title == "reward" and info.random_reward is not None:
            ax.axhline(info.random_reward, color="gray", linestyle="--", linewidth=1.0,
                       label=f"random policy ({info.random_reward:.3f})")  # fmt: skip
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
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle(info.title, fontsize=12)
    partial = png_path + ".partial.png"
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    os.replace(partial, png_path)
