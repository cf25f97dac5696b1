"""The vLLM-rollout figures: the main job (`grpo-kernels train`, the embedded model on `copy`, preset grpo,
200 steps) with `--rollout-engine vllm`, once with the engine's default dtype here (fp32 on a CPU) and once
with `--vllm-dtype bfloat16`, summarised into docs/records/vllm_rollouts.json, which the README quotes (a test
compares). Per run: the reward curve, the sampler-mismatch metrics over the steps, the engine's start time and
the per-step times (whole step, weight sync, generation).

Needs a vLLM engine in this environment (README, "vLLM rollouts"):

    VLLM_CPU_KVCACHE_SPACE=1 python tools/records/vllm_rollout_record.py  # minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "vllm_rollouts.json"
MARKS = (1, 25, 50, 100, 150, 200)
RUNS = {"engine_default": {}, "engine_bfloat16": {"vllm_dtype": "bfloat16"}}


def summarize(metrics: list[dict]) -> dict:
    reward = {m["step"]: m["reward"] for m in metrics}
    above = next((m["step"] for m in metrics if m["reward"] > 0.9), None)
    last = metrics[-10:]
    later = metrics[1:]  # the first step also pays for the first generation's warm-up

    def over_steps(key: str, reduce, digits: int | None = None) -> float:
        value = reduce(m[key] for m in metrics)
        return float(f"{value:.3g}") if digits is None else round(value, digits)  # 3 significant digits

    return {
        "steps": len(metrics),
        "reward_at": {str(s): round(reward[s], 3) for s in MARKS if s in reward},
        "first_step_above_0.9": above,
        "reward_last10": round(sum(m["reward"] for m in last) / len(last), 3),
        "solved_first": round(metrics[0]["solved"], 2),
        "solved_last": round(metrics[-1]["solved"], 2),
        # sampler vs trainer on the sampled tokens (TRL / verl names), over the run's steps
        "logp_diff_mean": over_steps("sampling/sampling_logp_difference/mean", statistics.fmean),
        "logp_diff_max": over_steps("sampling/sampling_logp_difference/max", max),
        "k3_kl_mean": over_steps("rollout_corr/k3_kl", statistics.fmean),
        "ratio_outside_0.5_2_max": over_steps("sampling/ratio_outside_0.5_2", max),
        "is_weight_min": over_steps("is_weight/min", min, digits=4),
        "is_weight_max": over_steps("is_weight/max", max, digits=4),
        "engine_start_s": round(metrics[0]["vllm/engine_start_s"], 1),
        "step_s_median": round(statistics.median(m["step_time_s"] for m in later), 3),
        "sync_s_median": round(statistics.median(m["vllm/sync_s"] for m in later), 3),
        "generate_s_median": round(statistics.median(m["vllm/generate_s"] for m in later), 3),
        "train_seconds": round(metrics[-1]["elapsed_s"]),
    }


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import transformers
    import vllm

    from grpo_kernels.trainer import TrainConfig, train

    record = {"load_average_1min_at_start": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
    for name, fields in RUNS.items():
        started = time.time()
        config = TrainConfig(rollout_engine="vllm", run_dir=tempfile.mkdtemp() + "/run", **fields)
        result = train(config, progress=False, log=lambda *a, **k: None)
        record[name] = summarize(result.metrics)
        record[name]["wall_seconds"] = round(time.time() - started)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__, "vllm": vllm.__version__}  # fmt: skip
    record["git_sha"] = sha.stdout.strip() or None
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
