"""The main job's figures: `grpo-kernels train` with no options (the embedded model on `copy`, preset
grpo, 200 steps), summarised into docs/records/main_job.json with every step's reward and loss; the README's
figures are generated from it (its main-job-figures and random-policy spans, rewritten here);
tests/test_readme_records.py re-runs the first PREFIX_STEPS steps and compares them with the record, and CI
re-runs every step (`python tools/records/records.py --check`, .ci/steps/records.sh).

    python tools/records/main_job_record.py            # about a minute on 2 CPU cores
    python tools/records/records.py                    # this record and the lookup record, one command
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from readme_spans import dump_record, write_span

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "main_job.json"
MARKS = (1, 25, 50, 75, 100)
PREFIX_STEPS = 5  # what CI re-runs (a few seconds): the rewards must equal the record's, the losses to rounding


def summarize(metrics: list[dict]) -> dict:
    reward = {m["step"]: m["reward"] for m in metrics}
    above = next((m["step"] for m in metrics if m["reward"] > 0.9), None)
    last = metrics[-10:]
    return {
        "steps": len(metrics),
        "reward_at": {str(s): round(reward[s], 3) for s in MARKS if s in reward},
        "first_step_above_0.9": above,
        "reward_last10": round(sum(m["reward"] for m in last) / len(last), 3),
        "solved_first": round(metrics[0]["solved"], 2),
        "solved_last": round(metrics[-1]["solved"], 2),
        "train_seconds": round(metrics[-1]["elapsed_s"]),
        # every step, exactly as the run wrote them (the prefix check compares the first PREFIX_STEPS)
        "per_step": {key: [m.get(key) for m in metrics] for key in ("reward", "solved", "loss")},
    }


def figures_sentence(record: dict) -> str:
    """The README's measured figures of the main job (the main-job-figures span)."""
    r = record["reward_at"]
    return (
        f"torch {record['versions']['torch']}, transformers {record['versions']['transformers']}): "
        f"**{record['steps']} steps in {record['cpu_seconds']} s of CPU time** (one thread; "
        f"{record['wall_seconds']} s wall on {record['cpus']} cores shared at a load average of "
        f"{record['load_average_1min']['end']:g}); mean reward **{r['1']:.3f}** at step 1, {r['25']:.3f} at step 25, {r['50']:.3f} at step 50, "
        f"{r['75']:.3f} at step 75, {r['100']:.3f} at step 100, above 0.9 from step "
        f"{record['first_step_above_0.9']}, **{record['reward_last10']:.3f}** over the last 10 steps; the "
        f"solved fraction (exact answer, sampled at temperature 1) goes from {record['solved_first']:.2f} to "
        f"{record['solved_last']:.2f}."
    )


def random_policy_text(record: dict) -> str:
    """The random-policy baseline as the README gives it (the random-policy span): the plot's dashed line."""
    return f"{record['random_policy_reward']:.3f}"


def write_readme(record: dict) -> None:
    write_span("main-job-figures", figures_sentence(record))
    write_span("random-policy", random_policy_text(record))


def measure() -> dict:
    """Train the main job (200 steps, the embedded default) and return its record."""
    import torch
    import transformers

    from grpo_kernels.trainer import TrainConfig, train

    load_at_start = round(os.getloadavg()[0], 1)
    started, cpu_started = time.time(), time.process_time()
    result = train(TrainConfig(run_dir=tempfile.mkdtemp() + "/run"), progress=False, log=lambda *a, **k: None)
    record = summarize(result.metrics)
    record["wall_seconds"] = round(time.time() - started)
    record["cpu_seconds"] = round(time.process_time() - cpu_started)  # what the machine's load does not change
    record["random_policy_reward"] = round(result.random_reward, 4)  # trainer.random_policy_reward
    record["prefix_steps"] = PREFIX_STEPS
    # the times depend on what else runs on the machine (a shared one: the load average says how busy)
    record["load_average_1min"] = {"start": load_at_start, "end": round(os.getloadavg()[0], 1)}
    record["cpus"] = os.cpu_count()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__}  # fmt: skip
    record["git_sha"] = sha.stdout.strip() or None
    return record


def write(record: dict) -> None:
    """The record into docs/records/main_job.json and the README spans generated from it."""
    RECORD.write_text(dump_record(record))
    write_readme(record)


def main() -> int:
    record = measure()
    write(record)
    shown = {k: v for k, v in record.items() if k != "per_step"}
    print(json.dumps(shown, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
