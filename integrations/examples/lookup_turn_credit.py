"""Turn-level credit on the built-in two-turn task: GRPO (outcome reward only) against MT-GRPO and
GiGPO (turn rewards), 200 steps each on the embedded model, same seed. Writes the summary the README
quotes to docs/records/lookup_turn_credit.json (a test compares the two).

    python integrations/examples/lookup_turn_credit.py            # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "lookup_turn_credit.json"
RUNS = {"grpo": dict(preset="grpo", task="lookup"), "mt_grpo": dict(preset="mt_grpo"),
        "gigpo": dict(preset="gigpo")}  # fmt: skip
STEPS = 200


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
    }


def main() -> int:
    import torch
    import transformers

    from grpo_kernels.trainer import PRESETS, TrainConfig, train

    results = {}
    for name, fields in RUNS.items():
        preset = fields["preset"]
        config = TrainConfig.from_preset(preset, **{k: v for k, v in fields.items() if k != "preset"},
                                         steps=STEPS, run_dir=tempfile.mkdtemp() + "/run")  # fmt: skip
        assert config.task == "lookup", (name, PRESETS[preset])
        print(f"{name}: training {STEPS} steps on lookup", flush=True)
        result = train(config, progress=False, log=lambda *a, **k: None)
        results[name] = summarize(result.metrics)
        print(f"  {results[name]}", flush=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record = {
        "what": f"{STEPS} steps on task 'lookup' (embedded model, seed 0): outcome-only GRPO vs turn credit",
        "runs": results,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},  # fmt: skip
        "git_sha": sha.stdout.strip() or None,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads before the trainer's 1",
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
