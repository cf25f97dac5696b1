"""Turn-level credit on the built-in two-turn task: GRPO (outcome reward only) against MT-GRPO and
GiGPO (turn rewards), 200 steps each on the embedded model, same seed. Writes the summary, with every
step's reward and loss, to docs/records/lookup_turn_credit.json and the README's lookup-figures span from
it; tests/test_readme_records.py re-runs the first PREFIX_STEPS steps of each run against the record, and CI
every step (`python tools/records/records.py --check`, .ci/steps/records.sh).

    python tools/records/lookup_turn_credit.py            # the three runs in parallel processes
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
import tempfile

from readme_spans import dump_record, write_span

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "lookup_turn_credit.json"
RUNS = {"grpo": dict(preset="grpo", task="lookup"), "mt_grpo": dict(preset="mt_grpo"),
        "gigpo": dict(preset="gigpo")}  # fmt: skip
STEPS = 200
PREFIX_STEPS = 3  # what CI re-runs of each: the rewards must equal the record's, the losses to rounding


def summarize(metrics: list[dict]) -> dict:
    last = metrics[-10:]

    def mean(key):
        return round(sum(m[key] for m in last) / len(last), 3)

    return {
        "reward_last10": mean("reward"),
        "solved_last10": mean("solved"),
        "call_turn_reward_last10": mean("turn_reward/0"),
        "first_step_reward": round(metrics[0]["reward"], 3),
        "train_seconds": round(metrics[-1]["elapsed_s"]),
        "per_step": {key: [m.get(key) for m in metrics] for key in ("reward", "loss")},
    }


def figures_sentence(record: dict) -> str:
    """The README's lookup figures (the lookup-figures span)."""
    runs = record["runs"]

    def run(name):
        return f"{runs[name]['solved_last10']:.3f} (first turn {runs[name]['call_turn_reward_last10']:.3f})"

    grpo = runs["grpo"]
    return (
        f"with the outcome reward alone (`--preset grpo --task lookup`) the solved fraction over the last 10 "
        f"steps is {grpo['solved_last10']:.3f} (first-turn reward {grpo['call_turn_reward_last10']:.3f}); "
        f"MT-GRPO reaches {run('mt_grpo')}, GiGPO {run('gigpo')}."
    )


def run_one(name: str) -> dict:
    """One of RUNS, 200 steps (each run is deterministic on its own: they may run in parallel processes)."""
    from grpo_kernels.trainer import PRESETS, TrainConfig, train

    fields = RUNS[name]
    preset = fields["preset"]
    config = TrainConfig.from_preset(preset, **{k: v for k, v in fields.items() if k != "preset"},
                                     steps=STEPS, run_dir=tempfile.mkdtemp() + "/run")  # fmt: skip
    assert config.task == "lookup", (name, PRESETS[preset])
    print(f"{name}: training {STEPS} steps on lookup", flush=True)
    result = train(config, progress=False, log=lambda *a, **k: None)
    summary = summarize(result.metrics)
    print(f"  {name}: {({k: v for k, v in summary.items() if k != 'per_step'})}", flush=True)
    return summary


def measure() -> dict:
    """The three runs (in parallel processes) and their record."""
    import concurrent.futures as cf
    import multiprocessing

    import torch
    import transformers

    load_at_start = round(os.getloadavg()[0], 1)  # the times depend on what else runs on the machine
    # the three runs in three processes (each trains on one thread): a third of the wall time on a shared
    # machine; the train_seconds then include what the other two take of the cores
    with cf.ProcessPoolExecutor(len(RUNS), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = dict(zip(RUNS, pool.map(run_one, RUNS)))
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record = {
        "what": f"{STEPS} steps on task 'lookup' (embedded model, seed 0): outcome-only GRPO vs turn credit",
        "runs": results,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},  # fmt: skip
        "git_sha": sha.stdout.strip() or None,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads before the trainer's 1",
        "prefix_steps": PREFIX_STEPS,
        "load_average_1min": {"start": load_at_start, "end": round(os.getloadavg()[0], 1)},  # shared machine
        "cpus": os.cpu_count(),
    }
    return record


def write(record: dict) -> None:
    """The record into docs/records/lookup_turn_credit.json and the README's lookup-figures span."""
    RECORD.write_text(dump_record(record))
    write_span("lookup-figures", figures_sentence(record))


def main() -> int:
    write(measure())
    print(f"wrote {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
