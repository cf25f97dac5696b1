"""The trainer's rollouts in one generate call per step: HFSampler.generate_groups draws each prompt group's
tokens from the group's own seed, so it samples what one generate call per group (after
torch.manual_seed(the group's seed), the per-group path) samples, whatever the batch around the group.

In this process: the tokens of generate_groups against the per-group calls, on several models (a model
perturbed as training would move it) and seeds, at temperature 1 and 0.7, with groups of several prompt
widths and rows of different lengths in one group (the second turn of a multi-turn task), split into the
blocks 1, 2 and 3 processes each generate; and torch's global generator left where the per-group path
leaves it. Under torchrun (gloo, 1-3 processes): the main job's trainer with batched sampling against a
plain run with per-group sampling (GRPO_KERNELS_PER_GROUP_SAMPLING=1), the same rewards exactly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the trainer's sampler needs the [train] extra")

from grpo_kernels.trainer.distributed import DistContext, ShardedSampler  # noqa: E402
from grpo_kernels.trainer.model import build_embedded_model  # noqa: E402
from grpo_kernels.trainer.rollout import HFSampler  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[1]


def sampler(temperature: float, model_seed: int, spread: float, eos_scale: float = 1.0) -> HFSampler:
    """The embedded model with its weights moved by N(0, spread) noise (a stand-in for training: peaked
    distributions, where a draw is less random, as well as flat ones), and its EOS row of the LM head scaled
    by eos_scale (EOS likely in some contexts: groups that finish at different steps of one call)."""
    model, tokenizer = build_embedded_model(seed=0)
    generator = torch.Generator().manual_seed(model_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * spread)
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_scale
    return HFSampler(model, tokenizer, [tokenizer.eos_token_id], temperature, contextlib.nullcontext)


def prompts(tokenizer, groups: int, rows: int, seed: int, mixed: bool) -> list[list[list[int]]]:
    """[groups][rows] prompt token lists: the copy task's `d d d =` (one width), or with `mixed` groups of
    2-6 digits, and within some groups rows of different lengths (as a second turn's contexts are)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        width = 3 if not mixed else 2 + g % 5
        digits = torch.randint(0, 10, (width,), generator=generator).tolist()
        row = tokenizer(" ".join(map(str, digits)) + " =")["input_ids"]
        group = [row] * rows
        if mixed and g % 3 == 0:  # rows of one group, different contexts: the group's padding matters
            group = [row + [4 + (r % 3)] * (r % 4) for r in range(rows)]
        out.append(group)
    return out


def per_group(s: HFSampler, groups, seeds, max_new_tokens):
    """(each group's generate() after torch.manual_seed(its seed), the global generator's state after it)."""
    results, states = [], []
    for group, seed in zip(groups, seeds):
        torch.manual_seed(seed)
        results.append(s.generate(group, max_new_tokens))
        states.append(torch.get_rng_state())
    return results, states


def blocks(n: int, world: int) -> list[slice]:
    return [DistContext(rank, world, torch.device("cpu"), False).block(n) for rank in range(world)]


CASES = [  # (temperature, weight spread, EOS row scale, prompt widths mixed, groups, rows, max_new_tokens)
    (1.0, 0.0, 1.0, False, 32, 8, 4),  # the main job's first step: 32 x 8, the initial model
    (1.0, 0.3, 1.0, False, 32, 8, 4),  # a trained-looking model: peaked rows
    (0.7, 0.15, 6.0, True, 13, 5, 6),  # odd sizes, several prompt widths, uneven rows in a group
    (1.0, 0.3, 10.0, True, 7, 3, 9),  # a long budget: groups finish at different steps (2 to 9 tokens)
]


@pytest.mark.parametrize("temperature,spread,eos_scale,mixed,groups,rows,max_new", CASES)
def test_generate_groups_draws_the_per_group_tokens(temperature, spread, eos_scale, mixed, groups, rows, max_new):
    for step in range(3):  # several steps: other weights, other seeds
        s = sampler(temperature, model_seed=10 * step + 1, spread=spread, eos_scale=eos_scale)
        batch = prompts(s.tokenizer, groups, rows, seed=step, mixed=mixed)
        seeds = [1_000_003 * step + 17 * g for g in range(groups)]
        expected, states = per_group(s, batch, seeds, max_new)
        for world in (1, 2, 3):  # a rank's block of groups in one call, as ShardedSampler gives it
            got = []
            for block in blocks(groups, world):
                torch.manual_seed(12345)  # generate_groups must not depend on the global generator's state
                got += s.generate_groups(batch[block], seeds[block], max_new)
                # the global generator where the block's last group leaves it: seeded, then its draws (only
                # while one of its rows is unfinished)
                assert torch.equal(torch.get_rng_state(), states[block.stop - 1]), (step, world, block)
            for g, (want, have) in enumerate(zip(expected, got)):
                assert have == want, (f"step {step}, {world} processes, group {g}: batched {have[0]} "
                                      f"truncated {have[1]}, per group {want[0]} truncated {want[1]}")  # fmt: skip


def test_sharded_sampler_uses_one_call_and_falls_back(monkeypatch):
    s = sampler(1.0, model_seed=1, spread=0.3)
    batch = prompts(s.tokenizer, 6, 4, seed=0, mixed=False)
    rows = [r for g in batch for r in g]
    calls = []
    original = s._generate
    monkeypatch.setattr(s, "_generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    batched = ShardedSampler(s, None, group_rows=4, seed=3)
    batched.begin_step(2)
    out = batched.generate(rows, 4)
    assert len(calls) == 1, "one generate call for groups of one prompt width"
    reference = ShardedSampler(s, None, group_rows=4, seed=3)
    reference.batched = False
    reference.begin_step(2)
    assert reference.generate(rows, 4) == out and len(calls) == 7  # then one call per group
    # a model whose own generation config adds a processor this sampler cannot reproduce: per group
    s.model.generation_config.renormalize_logits = True
    assert not s.groups_exact
    calls.clear()
    batched.generate(rows, 4)
    assert len(calls) == 6


def test_per_group_switch_is_checked(monkeypatch):
    monkeypatch.setenv("GRPO_KERNELS_PER_GROUP_SAMPLING", "yes")
    with pytest.raises(ValueError, match="GRPO_KERNELS_PER_GROUP_SAMPLING must be 0 or 1, got 'yes'"):
        ShardedSampler(None, None, group_rows=4, seed=0)
    monkeypatch.setenv("GRPO_KERNELS_PER_GROUP_SAMPLING", "1")
    assert not ShardedSampler(None, None, group_rows=4, seed=0).batched


# ---- under torchrun (gloo): the trainer, batched, against a plain per-group run --------------------------

ARGS = ["--prompts-per-step", "6", "--group-size", "4", "--no-progress", "--seed", "5", "--steps", "3"]


@pytest.fixture(scope="module")
def per_group_run(tmp_path_factory):
    from test_distributed_trainer import metrics

    run_dir = tmp_path_factory.mktemp("per_group") / "run"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), OMP_NUM_THREADS="1", GRPO_KERNELS_PER_GROUP_SAMPLING="1")
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.train", "--run-dir", str(run_dir), *ARGS],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("processes", [1, 2, 3])
def test_torchrun_batched_sampling_equals_per_group(processes, per_group_run, tmp_path):
    """6 groups of 4 over 1, 2, 3 ranks (blocks of 6, 3 + 3, 2 + 2 + 2 groups): every step's rewards as the
    per-group run's exactly (the same completions), the losses to fp32 rounding (DDP's gradient average)."""
    from test_distributed_trainer import metrics, torchrun

    torchrun(processes, "--run-dir", str(tmp_path / "run"), *ARGS)
    batched = metrics(tmp_path / "run")
    assert [m["step"] for m in batched] == [1, 2, 3]
    for a, b in zip(per_group_run, batched):
        for key in ("reward", "reward_std", "solved", "tokens"):
            assert a[key] == b[key], (processes, a["step"], key, a[key], b[key])
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * (1 + abs(a["loss"])), (processes, a["step"], a["loss"], b["loss"])
