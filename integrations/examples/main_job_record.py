"""The main job's figures: `grpo-kernels train` with no options (the embedded model on `copy`, preset
grpo, 200 steps), summarised into docs/records/main_job.json, which the README quotes (a test compares).

    python integrations/examples/main_job_record.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "main_job.json"
MARKS = (1, 25, 50, 75, 100)


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
    }


def main() -> int:
    import torch
    import transformers

    from grpo_kernels.trainer import TrainConfig, train

    started = time.time()
    result = train(TrainConfig(run_dir=tempfile.mkdtemp() + "/run"), progress=False, log=lambda *a, **k: None)
    record = summarize(result.metrics)
    record["wall_seconds"] = round(time.time() - started)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__}  # fmt: skip
    record["git_sha"] = sha.stdout.strip() or None
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
