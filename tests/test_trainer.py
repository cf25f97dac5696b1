"""The reference trainer (grpo_kernels.trainer): a smoke run and its run folder, learning (a sign error in
any gradient fails it), resume exactness, the micro-batch / normalizer algebra, the hidden-state shift,
the hooks, every preset for a step, a local Hugging Face checkpoint via --model, and bad-input exits."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.trainer import PRESETS, TrainConfig, train  # noqa: E402
from grpo_kernels.trainer import trainer as trainer_module  # noqa: E402
from grpo_kernels.trainer.hooks import (  # noqa: E402
    EdgeGuidedErrorCorrection,
    GFPOFilter,
    HookContext,
    LoptiStages,
)
from grpo_kernels.trainer.model import build_embedded_model  # noqa: E402
from grpo_kernels.trainer.rollout import HFSampler, Rollouts  # noqa: E402
from grpo_kernels.trainer.task import token_match  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A small batch: every code path, a fraction of a second per step on 2 cores.
SMALL = dict(prompts_per_step=4, group_size=4, micro_batch_size=8, steps=2, warmup_steps=0)
TIMING_KEYS = ("step_time_s", "elapsed_s")


def quiet(*_):
    pass


def run(tmp_path, name="run", resume=False, **fields) -> trainer_module.TrainResult:
    config = TrainConfig(**{**SMALL, "run_dir": str(tmp_path / name), **fields})
    return train(config, resume=resume, progress=False, log=quiet)


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


# ---- reward functions the CLI tests load by "test_trainer:<name>" (tests/ is on the subprocess's path;
# not "tests.test_trainer": verl's wheel installs a top-level `tests` package that would shadow it) ----

_calls = {"nan_on_second_call": 0}


def nan_on_second_call(prompts, completions, answers):
    """Zero rewards on the first call, NaN on the second (so one step completes before the failure)."""
    _calls["nan_on_second_call"] += 1
    return [0.0 if _calls["nan_on_second_call"] == 1 else float("nan")] * len(completions)


def raising_reward(prompts, completions, answers):
    raise RuntimeError("the grader is down")


# ---- smoke run: the run folder ------------------------------------------------------------------------


def test_smoke_run_writes_metrics_plot_and_loadable_checkpoints(tmp_path):
    result = run(tmp_path, steps=3, save_every=2, keep_checkpoints=2)
    run_dir = pathlib.Path(result.run_dir)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for key in (
        "reward",
        "solved",
        "entropy",
        "kl",
        "clip_ratio/region_mean",
        "completion_length",
        "grad_norm",
        "loss",
    ):
        assert all(isinstance(r[key], float) for r in lines), key
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 3
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000003"]

    # the last checkpoint loads (safetensors + JSON, nothing unpickled) into a fresh model: same weights
    from safetensors.torch import load_model

    fresh, _ = build_embedded_model(seed=123)
    load_model(fresh, str(run_dir / "checkpoints" / "step_000003" / "model.safetensors"))
    for (name, a), b in zip(fresh.state_dict().items(), result.model.state_dict().values()):
        assert torch.equal(a, b), name
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["step"] == 3

    # the final model folder is a Hugging Face checkpoint
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    assert torch.equal(reloaded.lm_head.weight, result.model.lm_head.weight)


# ---- learning: the reward must rise ---------------------------------------------------------------------

# The "max" task (the largest of four digits, then EOS) has reward ~0.04 under the initial, nearly uniform
# policy over 16 tokens. With the right gradient the mean reward of steps 56-60 is 0.5-0.75 (seeds 0-2);
# a sign error anywhere in the policy gradient drives it toward 0 instead (checked by flipping the sign of
# the loss in _update: the test then fails with a last-5 mean of 0.00).
LEARNING = dict(
    task="max",
    prompts_per_step=16,
    group_size=8,
    micro_batch_size=128,
    steps=60,
    lr=3e-3,
    warmup_steps=5,
    num_iterations=1,
)


def test_reward_rises_from_chance(tmp_path):
    result = run(tmp_path, **LEARNING)
    rewards = [m["reward"] for m in result.metrics]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert start < 0.1, rewards[:5]
    assert end > 0.3 and end > 3 * start, f"reward did not rise: first 5 steps {start:.3f}, last 5 {end:.3f}"


# ---- resume: the same state as an uninterrupted run ---------------------------------------------------


@pytest.mark.parametrize("preset", ["grpo", "dcpo", "prorl", "edge_grpo"])
def test_resume_continues_exactly(tmp_path, preset):
    fields = dict(PRESETS[preset], preset=preset, steps=4, save_every=2)
    if preset == "prorl":
        fields["ref_reset_interval"] = 1  # a reference that changes: it must be restored too
    straight = run(tmp_path, "straight", **fields)
    run(tmp_path, "resumed", **{**fields, "steps": 2})
    resumed = run(tmp_path, "resumed", resume=True, **fields)  # same config, steps 2 -> 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert len(resumed.metrics) == 4
    for a, b in zip(without_timing(straight.metrics), without_timing(resumed.metrics)):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


# ---- the update: micro-batches and global normalizers, the hidden-state shift -------------------------


def _batch_for(model, tokenizer, prompts, completions):
    rollouts = Rollouts(
        prompts=prompts,
        answers=["0"] * len(prompts),
        groups=[i // 2 for i in range(len(prompts))],
        prompt_tokens=[tokenizer(p)["input_ids"] for p in prompts],
        completion_tokens=[
            tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for c in completions
        ],
        completions=completions,
        truncated=[False] * len(prompts),
    )
    return rollouts.tensors(tokenizer.pad_token_id, torch.device("cpu"))


PROMPTS = ["1 2 3 =", "4 =", "5 6 =", "7 8 9 1 =", "2 =", "3 3 ="]  # ragged: left padding matters
COMPLETIONS = ["1 2", "4 4 4", "5", "7 8 9 1", "0 0", "3"]


CPU_FP32 = trainer_module.Compute(torch.device("cpu"), torch.float32)


def _model_with_logit_transform(kind: str):
    """A tiny model built in code whose logits are transformed after the LM head: Gemma 2's soft-cap
    (cap 2, small enough to bind), or Granite's 1 / logits_scaling; the embedded tokenizer."""
    from grpo_kernels.trainer.model import EMBEDDED_VOCAB, build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer()
    common = dict(vocab_size=len(EMBEDDED_VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    if kind == "gemma2-softcap":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        model = Gemma2ForCausalLM(Gemma2Config(head_dim=16, final_logit_softcapping=2.0, **common))
    else:
        from transformers import GraniteConfig, GraniteForCausalLM

        model = GraniteForCausalLM(GraniteConfig(logits_scaling=0.5, tie_word_embeddings=False, **common))
    return model.float(), tokenizer


@pytest.mark.parametrize("kind", ["embedded", "gemma2-softcap", "granite-logits-scaling"])
def test_token_logprobs_match_the_full_model_logits(kind):
    """The one-token shift, left padding and the model's logit transform: log-probs of each completion
    token equal those of the plain model run on that row alone (soft-capped / scaled logits included)."""
    if kind == "embedded":
        model, tokenizer = build_embedded_model(seed=0)
    else:
        model, tokenizer = _model_with_logit_transform(kind)
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)  # a non-uniform policy
    batch = _batch_for(model, tokenizer, PROMPTS, COMPLETIONS)
    config = TrainConfig(micro_batch_size=4)
    logprobs, entropy = trainer_module._token_logprobs(model, batch, config, CPU_FP32, need_entropy=True)
    for i, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits.double(), -1)  # [n, V]
        n = len(completion_ids)
        expected_logprobs = expected.gather(1, torch.tensor(completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(logprobs[i, :n].double(), expected_logprobs, rtol=1e-5, atol=1e-5)
        expected_entropy = -(expected.exp() * expected).sum(-1)
        torch.testing.assert_close(entropy[i, :n].double(), expected_entropy, rtol=1e-5, atol=1e-5)
        assert not batch.completion_mask[i, n:].any()


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_micro_batches_give_the_full_batch_gradient(loss):
    """With the step's global token / sequence counts, accumulating 3 micro-batches = one batch of 6."""
    old = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) * 0.1 - 2.8  # ratios != 1: clipping
    results = []
    for micro_batch_size in (6, 2):
        model, tokenizer = build_embedded_model(seed=0)
        batch = _batch_for(model, tokenizer, PROMPTS, COMPLETIONS)
        config = TrainConfig(loss=loss, micro_batch_size=micro_batch_size, grad_clip=None)
        loss_config = config.loss_config(max_new_tokens=6)
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
        batch.old_logprobs = old
        batch.ref_logprobs = old - 0.05 if loss_config.needs_reference else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        metrics = trainer_module._update(model, optimizer, batch, loss_config, config, CPU_FP32)
        results.append(([p.grad.clone() for p in model.parameters()], metrics["loss"]))
    (full, full_loss), (accumulated, accumulated_loss) = results
    assert accumulated_loss == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
    for a, b in zip(full, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_prompts_are_distinct_within_a_step(tmp_path):
    """A prompt is one group per step (DCPO keys its running statistics by prompt), across the rounds of
    dynamic sampling too; a task with too few prompts is refused before the run folder is made."""
    from grpo_kernels.trainer.task import TASKS

    generator = torch.Generator().manual_seed(0)
    first, _ = TASKS["copy"].sample(generator, 200, exclude=set())
    second, _ = TASKS["copy"].sample(generator, 200, exclude=set(first))
    assert len(set(first)) == 200 and len(set(second)) == 200 and not set(first) & set(second)
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{d} =", "answer": str(d)}) + "\n" for d in range(3)))
    with pytest.raises(ValueError, match="3 distinct prompts, fewer than prompts_per_step=4"):
        run(tmp_path, task=str(path), prompts_per_step=4)
    assert not (tmp_path / "run").exists()
    result = run(tmp_path, "jsonl", task=str(path), prompts_per_step=3, steps=1)  # a .jsonl task trains
    assert result.metrics[0]["sequences"] == 3 * 4


# ---- hooks ----------------------------------------------------------------------------------------------


def _scored(rewards, completion_lengths, group_size):
    n = len(rewards)
    return Rollouts(
        prompts=[f"p{i // group_size}" for i in range(n)],
        answers=["1 2"] * n,
        groups=[i // group_size for i in range(n)],
        prompt_tokens=[[1, 5]] * n,
        completion_tokens=[[7] * k for k in completion_lengths],
        completions=["x"] * n,
        truncated=[False] * n,
        rewards=torch.tensor(rewards, dtype=torch.float32),
    )


def _context(group_size, score=None, generator_seed=0):
    model, tokenizer = build_embedded_model(seed=0)
    sampler = HFSampler(
        model, tokenizer, [tokenizer.eos_token_id], 1.0, trainer_module.contextlib.nullcontext
    )
    return HookContext(
        generate=sampler.generate,
        score=score,
        encode=lambda t: tokenizer(t, add_special_tokens=False)["input_ids"],
        decode=lambda ids: tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id]),
        eos_id=tokenizer.eos_token_id,
        max_new_tokens=4,
        group_size=group_size,
        correct_reward=1.0,
        generator=torch.Generator().manual_seed(generator_seed),
    )


def test_gfpo_keeps_the_shortest_and_matches_the_gfpo_estimator():
    rewards = [1.0, 0.0, 1.0, 0.5, 0.2, 0.0, 1.0, 1.0]
    lengths = [5, 2, 3, 4, 1, 6, 2, 3]
    rollouts = _scored(rewards, lengths, group_size=4)
    kept, stats = GFPOFilter(oversample=2).after_scoring(rollouts, _context(group_size=2))
    assert kept.completion_tokens == [[7] * 2, [7] * 3, [7] * 1, [7] * 2]  # the 2 shortest of each group of 4
    assert stats["gfpo/kept_fraction"] == 0.5
    on_kept = gk.advantages.estimate("grpo", kept.rewards, kept.group_index)
    gfpo = gk.advantages.estimate(
        "gfpo",
        rollouts.rewards,
        rollouts.group_index,
        lengths=torch.tensor(lengths, dtype=torch.float32),
        keep=2,
    )
    torch.testing.assert_close(on_kept, gfpo[gfpo != 0])


def test_edge_gec_rewrites_wrong_completions_and_rescores():
    rollouts = _scored([1.0, 0.0, 0.5, 0.0], [2, 2, 2, 2], group_size=4)

    def score(r):
        return Rollouts(
            **{**r.__dict__, "rewards": torch.tensor(token_match(r.prompts, r.completions, r.answers))}
        )

    corrected, stats = EdgeGuidedErrorCorrection(p_correct=1.0).after_scoring(rollouts, _context(4, score))
    assert corrected.completions == ["x", "1 2", "1 2", "1 2"]  # the correct row is left alone
    assert corrected.rewards.tolist() == [0.0, 1.0, 1.0, 1.0]  # rescored ("x" scores 0 against "1 2")
    assert corrected.completion_tokens[1][-1] == _context(4).eos_id
    assert stats["edge_gec/corrected_fraction"] == 0.75


def test_edge_gec_reflection_continues_sampling_after_the_reflection_text():
    rollouts = _scored([0.0] * 8, [2] * 8, group_size=4)  # all wrong
    rollouts = Rollouts(**{**rollouts.__dict__, "truncated": [True] * 8})  # no EOS to strip

    def score(r):
        return Rollouts(**{**r.__dict__, "rewards": torch.zeros(len(r))})

    ctx = _context(4, score)
    hook = EdgeGuidedErrorCorrection(p_correct=1.0, reflection="=")  # "=" is in the embedded vocabulary
    corrected, _ = hook.after_scoring(rollouts, ctx)
    reflect_id = ctx.encode("=")[0]
    reflected = [t for t in corrected.completion_tokens if t[:3] == [7, 7, reflect_id]]
    guided = [t for t in corrected.completion_tokens if t == ctx.encode("1 2") + [ctx.eos_id]]
    # no hint template: reflect and replace share the weights 0.5 : 0.25; every wrong row is one of them
    assert reflected and guided and len(reflected) + len(guided) == 8
    assert all(3 < len(t) <= 3 + ctx.max_new_tokens for t in reflected)  # the policy continued after "="


def test_lopti_two_stages_low_then_high():
    stages = LoptiStages(threshold=0.5).update_stages(gk.PolicyLossConfig.grpo())
    assert [(s.old_prob_threshold, s.old_prob_side) for s in stages] == [(0.5, "low"), (0.5, "high")]


# ---- a local Hugging Face checkpoint trains via --model (every preset: test_trainer_methods.py) ----------


def test_cli_trains_a_local_hugging_face_checkpoint(tmp_path, capsys):
    """The embedded default saved with save_pretrained and trained with --model gives the very same run
    (weights, tokenizer, generation settings all survive the round trip)."""
    from grpo_kernels.cli import main

    model, tokenizer = build_embedded_model(seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--no-progress"]
    assert main(["train", "--model", str(tmp_path / "model"), "--run-dir", str(tmp_path / "hf"), *args]) == 0
    assert "LlamaForCausalLM from" in capsys.readouterr().out
    assert main(["train", "--run-dir", str(tmp_path / "embedded"), *args]) == 0  # the same seed, 0
    from_path, embedded = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
                           for name in ("hf", "embedded"))  # fmt: skip
    assert without_timing(from_path) == without_timing(embedded)
    assert [m["reward"] for m in embedded] != [0.0, 0.0]


# ---- bad input: a clear message, a non-zero exit, the run folder intact ---------------------------------


def cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, "-m", "grpo_kernels", "train", "--no-progress", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_trains_a_soft_capped_model(tmp_path, capsys):
    """A Gemma 2 folder (final_logit_softcapping) trains through --model: the fused loss applies the same
    soft-cap as the model's own forward, which the sampler draws from."""
    from grpo_kernels.cli import main

    model, tokenizer = _model_with_logit_transform("gemma2-softcap")
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    args = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--no-progress"]
    assert main(["train", "--model", str(tmp_path / "gemma2"), "--run-dir", str(tmp_path / "run"), *args]) == 0
    assert "Gemma2ForCausalLM" in capsys.readouterr().out


def test_cli_unknown_preset_exits_2_and_creates_nothing(tmp_path):
    done = cli("--preset", "grpoo", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 2
    assert "invalid choice: 'grpoo'" in done.stderr
    assert not (tmp_path / "run").exists()


def test_cli_missing_model_exits_2_and_creates_nothing(tmp_path):
    done = cli("--model", str(tmp_path / "no-such-model"), "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 2
    assert "no such directory" in done.stderr and "no-such-model" in done.stderr
    assert not (tmp_path / "run").exists()


def test_cli_nan_reward_exits_1_and_keeps_the_completed_steps(tmp_path):
    args = [
        "--reward",
        "test_trainer:nan_on_second_call",
        "--steps",
        "5",
        "--save-every",
        "1",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--run-dir",
        "run",
    ]
    done = cli(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert "returned nan" in done.stderr and "rewards must be finite" in done.stderr
    run_dir = tmp_path / "run"
    assert (
        json.loads((run_dir / "config.json").read_text())["reward"] == "test_trainer:nan_on_second_call"
    )
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]


def test_every_option_has_help_text():
    import dataclasses

    from grpo_kernels.trainer.cli import _field_comments

    assert set(_field_comments()) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_cli_bad_input_in_process(tmp_path, capsys):
    from grpo_kernels.cli import main

    def fails(args, code, message):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *args])
        assert exit_info.value.code == code
        assert message in capsys.readouterr().err

    def returns(args, code, message):
        assert main(["train", "--no-progress", *args]) == code
        assert message in capsys.readouterr().err

    fails(["--bogus", "1"], 2, "unrecognized arguments: --bogus")
    fails(["--steps", "ten"], 2, "invalid int value")
    returns(["--loss-option", "clip_hgh=0.3"], 2, "clip_hgh")
    returns(["--advantage-option", "scael=batch"], 2, "has no option(s) ['scael']")
    returns(["--reward", "no_such_reward"], 2, "unknown reward 'no_such_reward'")
    returns(["--task", "nope"], 2, "unknown task 'nope'")
    returns(["--max-sampling-rounds", "3"], 2, "only used with dynamic_sampling")  # never silently dropped
    returns(["--preset", "dapo", "--ref-reset-interval", "10"], 2, "this loss has none")
    run_dir = tmp_path / "run"
    returns(
        ["--reward", "test_trainer:raising_reward", "--run-dir", str(run_dir)], 1, "the grader is down"
    )
    assert (run_dir / "config.json").is_file()
    # never overwrites a run; a run that never reached a checkpoint is said to be one, on either command
    returns(["--run-dir", str(run_dir)], 2, "holds a run that stopped before its first checkpoint was complete")
    returns(["--resume", str(run_dir), "--temperature", "0.5"], 2, "only --steps and --lr may be given")
    returns(["--resume", str(run_dir)], 2, "it stopped before its first checkpoint was complete (no step completed)")


@pytest.mark.parametrize("num_prompts,per_step,rounds", [(40, 32, 2), (40, 32, 4), (20, 8, 3), (9, 8, 4)])
def test_dynamic_sampling_refill_keeps_one_prompt_per_group(tmp_path, num_prompts, per_step, rounds):
    """Dynamic sampling refills a step from later rounds that draw fewer prompts than the first: every
    group of the batch must hold exactly one prompt and group_size completions (labels of a later round
    once collided with kept groups, merging two prompts into one group)."""
    import json

    import torch

    from grpo_kernels.trainer import trainer as tr
    from grpo_kernels.trainer.config import TrainConfig
    from grpo_kernels.trainer.hooks import HookContext, make_hook
    from grpo_kernels.trainer.task import resolve_task

    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i} =", "answer": str(i)}) + "\n" for i in range(num_prompts)))
    task = resolve_task(str(path))
    group_size = 4
    config = TrainConfig(dynamic_sampling=True, prompts_per_step=per_step, group_size=group_size,
                         max_sampling_rounds=rounds, task=str(path))  # fmt: skip

    class Tokenizer:
        def __call__(self, text, **kwargs):
            return {"input_ids": [len(text)]}

    class Sampler:  # completion i of a prompt: [i]; a prompt with an even number is uninformative
        def generate(self, prompt_tokens, max_new_tokens):
            return [[i % group_size] for i in range(len(prompt_tokens))], [False] * len(prompt_tokens), None

    def score(rollouts: Rollouts) -> Rollouts:
        rewards = [0.0 if int(p[1:-2]) % 2 == 0 else float(c[0]) for p, c in zip(rollouts.prompts,
                                                                                     rollouts.completion_tokens)]  # fmt: skip
        return rollouts.__class__(**{**rollouts.__dict__, "rewards": torch.tensor(rewards)})

    context = HookContext(generate=Sampler().generate, score=score, encode=lambda t: [1], decode=lambda t: "x",
                          eos_id=0, max_new_tokens=2, group_size=group_size, correct_reward=1.0,
                          generator=torch.Generator())  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # several steps: the prompt generator moves on
        rollouts, _, stats = tr._collect_rollouts(config, task, Tokenizer(), Sampler(), make_hook(None, {}), context,
                                                 generator)  # fmt: skip
        assert rollouts is not None
        index = rollouts.group_index.tolist()
        for g in set(index):
            rows = [i for i, x in enumerate(index) if x == g]
            assert len(rows) == group_size, (g, len(rows))
            assert len({rollouts.prompts[i] for i in rows}) == 1, (g, {rollouts.prompts[i] for i in rows})
        assert len(set(index)) <= per_step
