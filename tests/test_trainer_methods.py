"""Every method of the catalogue reachable from `grpo-kernels train`: each preset runs 3 steps through the
CLI; the reward shaping (DAPO overlong, GRPO-LEAD, DIVER) and the pruning (CPPO, overlong filtering) with
hand-computed values; REINFORCE++'s KL-in-reward, MO-GRPO's several rewards and the multi-turn task
(MT-GRPO, GiGPO) reach their estimators; EDGE-GRPO's correction split; ProRL's reference reset; and what a
new user meets (unknown words, Ctrl-C, validation before the run folder, the summary line)."""

from __future__ import annotations

import json
import math
import pathlib
import signal

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.trainer import PRESETS, TrainConfig, TrainingInterrupted, train  # noqa: E402
from grpo_kernels.trainer import trainer as trainer_module  # noqa: E402
from grpo_kernels.trainer.hooks import EdgeGuidedErrorCorrection  # noqa: E402
from grpo_kernels.trainer.model import EMBEDDED_VOCAB  # noqa: E402
from grpo_kernels.trainer.multiturn import (  # noqa: E402
    Environment,
    generate_episodes,
    lookup_respond,
    lookup_turn_rewards,
    lookup_value,
)
from grpo_kernels.trainer.rollout import PaddedBatch, Rollouts  # noqa: E402

from test_trainer import ROOT, cli, quiet, run  # noqa: E402  the small-run and CLI helpers of the trainer tests

EOS = EMBEDDED_VOCAB.index("<eos>")


def capture(monkeypatch, function_name):
    """Wrap trainer_module.<function_name>: every call's (args, kwargs) in the returned list."""
    calls, original = [], getattr(trainer_module, function_name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, function_name, wrapper)
    return calls


def capture_estimates(monkeypatch):
    """Every gk.advantages.estimate call of the trainer: (name, rewards, group_index, options, result)."""
    calls, original = [], gk.advantages.estimate

    def wrapper(name, rewards, group_index, **options):
        result = original(name, rewards, group_index, **options)
        calls.append((name, rewards, group_index, options, result))
        return result

    monkeypatch.setattr(trainer_module.gk_advantages, "estimate", wrapper)
    return calls


# ---- every method row and every preset: `grpo-kernels train ... --steps 3` exits 0 ------------------------

from grpo_kernels.trainer.methods import METHODS, methods_table_markdown  # noqa: E402

RUNS = [m.args for m in METHODS] + [("--preset", p) for p in sorted(PRESETS)
                                    if not any(m.args[:2] == ("--preset", p) for m in METHODS)]  # fmt: skip


@pytest.mark.parametrize("args", RUNS, ids=[" ".join(a) for a in RUNS])
def test_every_method_trains_three_steps_from_the_cli(tmp_path, args, capsys):
    from grpo_kernels.cli import main

    if "vllm" in args:
        pytest.skip("runs against a real vLLM engine in tests/test_vllm_trainer.py (marker vllm, its own env)")
    run_dir = tmp_path / "run"
    assert main(["train", *args, "--steps", "3", "--run-dir", str(run_dir), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any("loss" in r for r in rows), "no step trained"
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert "solved" in capsys.readouterr().out  # the summary line quotes the solved fraction


def test_every_preset_is_in_the_method_table_and_the_readme_table_is_current():
    from grpo_kernels.trainer.cli import build_parser, config_from_args

    in_table = {m.args[1] for m in METHODS if m.args[0] == "--preset"}
    assert in_table == set(PRESETS), set(PRESETS) ^ in_table
    for m in METHODS:  # every row's arguments build a valid config
        config_from_args(build_parser().parse_args(list(m.args)))
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- methods-table:start -->\n", "<!-- methods-table:end -->"
    assert readme[readme.index(start) + len(start) : readme.index(end)] == methods_table_markdown(), (
        "README method table is stale: python -m grpo_kernels.trainer.methods"
    )


# ---- reward shaping, hand-computed -----------------------------------------------------------------------


def rollouts_of(lengths, groups, completions=None, truncated=None):
    n = len(lengths)
    completions = completions or ["1"] * n
    return Rollouts(
        prompts=["p"] * n,
        answers=["1"] * n,
        groups=groups,
        prompt_tokens=[[1]] * n,
        completion_tokens=[[5] * k for k in lengths],
        completions=completions,
        truncated=truncated or [False] * n,
    )


def test_dapo_soft_overlong_punishment_hand_computed():
    # budget L_max = 6, cache 2: expected length 4; |y| = 5 -> (4 - 5) / 2 = -0.5, |y| = 6 -> -1
    config = TrainConfig(overlong_cache=2)
    rollouts = rollouts_of([3, 4, 5, 6], [0, 0, 0, 0])
    components = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    shaped = trainer_module._shape_rewards(config, rollouts, components, budget=6)
    assert shaped.tolist() == [1.0, 1.0, 0.5, -1.0]


def test_grpo_lead_length_reward_hand_computed():
    # correct lengths 2, 4, 6: mean 4, Bessel std 2 -> z = -1, 0, 1 -> exp(0.05), 1, exp(-0.05); wrong -> -1
    config = TrainConfig(lead_length_alpha=0.05)
    rollouts = rollouts_of([2, 4, 6, 3], [0, 0, 0, 0])
    components = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    shaped = trainer_module._shape_rewards(config, rollouts, components, budget=8)
    expected = torch.tensor([math.exp(0.05), 1.0, math.exp(-0.05), -1.0])
    torch.testing.assert_close(shaped, expected, rtol=0, atol=2e-6)  # epsilon 1e-6 in z: |dz| <= 5e-7


def test_diver_bonus_only_for_correct_and_diverse_completions():
    # group 0: two identical correct completions (diversity 0: no bonus); group 1: one correct and one wrong
    # completion with no shared word (the correct one gets coef x its diversity, the wrong one nothing)
    config = TrainConfig(diversity_coef=0.5)
    # (five words: BLEU's 5-gram precision exists; a shorter identical pair would score BLEU 0 unsmoothed)
    texts = ["1 2 3 4 5", "1 2 3 4 5", "4 5 6 7 8", "9 0 1 2 3"]
    rollouts = rollouts_of([5, 5, 5, 5], [0, 0, 1, 1], completions=texts)
    components = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    shaped = trainer_module._shape_rewards(config, rollouts, components, budget=8)
    diversity = gk.advantages.textual_diversity(texts, rollouts.group_index, direction="one_way")
    assert diversity[0] == diversity[1] == 0 and diversity[2] > 0.9
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 1.0 + 0.5 * float(diversity[2]), 0.0], abs=1e-7)


# ---- pruning: CPPO and DAPO's overlong filtering ---------------------------------------------------------


def test_cppo_trains_on_the_half_of_each_group_with_the_largest_abs_advantage(tmp_path, monkeypatch):
    estimates, updates = capture_estimates(monkeypatch), capture(monkeypatch, "_update")
    result = run(tmp_path, prune_fraction=0.5, steps=1, num_iterations=1, task="max", max_new_tokens=3)
    (_, _, group_index, _, advantages), = estimates
    batch = updates[0][0][2]
    assert len(batch) == len(advantages) // 2 and result.metrics[0]["cppo/kept_fraction"] == 0.5
    for g in group_index.unique():
        in_group = advantages[group_index == g].abs().sort(descending=True).values
        assert in_group[1] >= in_group[2]  # the kept two are the two largest |A| (ties keep the lower index)
    expected = torch.cat([
        advantages[group_index == g][advantages[group_index == g].abs().topk(2, sorted=False).indices.sort().values]
        for g in group_index.unique()
    ])  # fmt: skip
    torch.testing.assert_close(batch.advantages.abs().sort().values, expected.abs().sort().values)


def test_overlong_filter_gives_truncated_completions_no_loss(tmp_path, monkeypatch):
    updates = capture(monkeypatch, "_update")
    result = run(tmp_path, overlong_filter=True, steps=1, num_iterations=1, max_new_tokens=3)
    batch = updates[0][0][2]
    ended = ((batch.completion_ids == EOS) & batch.completion_mask).any(1)  # an EOS within the budget
    assert (~ended).any() and ended.any()  # both kinds in the batch: the test can tell them apart
    assert not batch.loss_mask[~ended].any()
    assert torch.equal(batch.loss_mask[ended], batch.completion_mask[ended])
    assert result.metrics[0]["overlong/filtered_fraction"] == pytest.approx(float((~ended).float().mean()))


# ---- estimators that need more than one reward per sample ------------------------------------------------


def test_reinforce_pp_folds_the_kl_into_the_token_rewards(tmp_path, monkeypatch):
    estimates = capture_estimates(monkeypatch)
    fields = {**PRESETS["reinforce_pp"], "num_iterations": 1, "steps": 2}
    run(tmp_path, **fields)
    for step, (name, _, _, options, advantages) in enumerate(estimates, 1):
        assert name == "reinforce_plus_plus" and options["kl_coef"] == 0.01
        mask = options["mask"]
        kl = (options["logprobs"] - options["ref_logprobs"])[mask]
        if step == 1:  # the policy is the reference: KL 0
            assert kl.abs().max() == 0
        else:
            assert kl.abs().max() > 0
        without_kl = gk.advantages.registry.estimate(  # the unwrapped function
            "reinforce_plus_plus", estimates[step - 1][1], estimates[step - 1][2], mask=mask
        )
        assert torch.equal(advantages, without_kl) == (step == 1)


def test_mo_grpo_gets_one_reward_column_per_function(tmp_path, monkeypatch):
    estimates = capture_estimates(monkeypatch)
    result = run(tmp_path, advantage="mo_grpo", reward="exact_match,length_match", steps=1)
    (name, rewards, _, _, _), = estimates
    assert name == "mo_grpo" and rewards.shape[1] == 2
    assert result.metrics[0]["reward/length_match"] == pytest.approx(float(rewards[:, 1].mean()))


def test_several_rewards_need_a_multi_reward_estimator():
    with pytest.raises(ValueError, match="need a multi-reward estimator"):
        TrainConfig(reward="exact_match,length_match")
    with pytest.raises(ValueError, match="comma-separated"):
        TrainConfig(advantage="mo_grpo")


# ---- multi-turn episodes: the lookup task, MT-GRPO and GiGPO ---------------------------------------------


def test_lookup_environment():
    assert lookup_value(3, 1) == (9 + 7 + 1) % 10 == 7
    assert lookup_respond("3 1 =", ["3 1"]) == "+ 7 ="
    assert lookup_respond("3 1 =", ["3"]) == "+ ="  # a malformed call: a failed lookup
    assert lookup_turn_rewards("3 1 =", "7", ["3 1", "7"]) == [1.0, 1.0]
    assert lookup_turn_rewards("3 1 =", "7", ["3 2", "9"]) == [0.5, 0.0]  # one digit of two in place
    assert lookup_turn_rewards("3 1 =", "7", ["3 1 4", "7"]) == [2 / 3, 1.0]  # an extra word costs
    assert lookup_turn_rewards("3 1 =", "7", ["1 3", "7"]) == [0.0, 1.0]


def test_episodes_interleave_turns_and_replies():
    turns = iter([([[5, 6, EOS], [7, EOS]], [False, False]), ([[8, EOS], [9, 9, 9]], [False, True])])

    def generate(contexts, budget):
        tokens, cut = next(turns)
        generate.contexts.append(contexts)
        return tokens, cut, None

    generate.contexts = []
    environment = Environment(2, lambda prompt, said: "+", lambda prompt, answer, said: [0.0, 0.0])
    episodes = generate_episodes(generate, environment, ["a", "b"], [[1], [1, 4]], lambda text: [5, 5],
                                 lambda tokens: " ".join(map(str, tokens)), 3)  # fmt: skip
    assert episodes.completion_tokens == [[5, 6, EOS, 5, 5, 8, EOS], [7, EOS, 5, 5, 9, 9, 9]]
    assert episodes.turn_ids == [[0, 0, 0, -1, -1, 1, 1], [0, 0, -1, -1, 1, 1, 1]]
    assert generate.contexts[1] == [[1, 5, 6, EOS, 5, 5], [1, 4, 7, EOS, 5, 5]]  # turn 2 sees the reply
    assert episodes.truncated == [False, True]  # the last turn decides
    assert episodes.final_texts == [f"8 {EOS}", "9 9 9"]
    assert episodes.state_keys[0][0] == "1" and episodes.state_keys[0][1] == f"1 5 6 {EOS} 5 5"

    rollouts = Rollouts(prompts=["a", "b"], answers=["", ""], groups=[0, 0], prompt_tokens=[[1], [1, 4]],
                        completion_tokens=episodes.completion_tokens, completions=episodes.final_texts,
                        truncated=episodes.truncated, turn_ids=episodes.turn_ids)  # fmt: skip
    batch = PaddedBatch.build(rollouts, pad_id=0, device="cpu")
    assert batch.loss_mask.tolist() == [[True, True, True, False, False, True, True],
                                        [True, True, False, False, True, True, True]]  # fmt: skip
    assert batch.completion_mask.all()  # the replies are attended to


def test_mt_grpo_and_gigpo_options_from_episodes_hand_computed():
    # one group of two episodes: outcome rewards 1, 0; turn rewards (1, 1) and (0, 0)
    rollouts = Rollouts(
        prompts=["p", "p"], answers=["", ""], groups=[0, 0], prompt_tokens=[[1], [1]],
        completion_tokens=[[5, 2, 9, 6, 2], [5, 2, 9, 7, 2]], completions=["", ""], truncated=[False, False],
        rewards=torch.tensor([1.0, 0.0]), turn_ids=[[0, 0, -1, 1, 1], [0, 0, -1, 1, 1]],
        turn_rewards=torch.tensor([[1.0, 1.0], [0.0, 0.0]]), state_keys=[["1", "1 5 2 9"], ["1", "1 5 2 9"]],
    )  # fmt: skip
    batch = PaddedBatch.build(rollouts, pad_id=0, device="cpu")
    options = trainer_module._episode_options(rollouts, batch)
    assert options["turn_rewards"].tolist() == [[1.0, 0.0], [0.0, 0.0]]  # the last turn is the outcome itself
    assert options["state_ids"].tolist() == [[0, 1], [0, 1]]  # equal contexts: one anchor state
    # MT-GRPO: A^O = +-(0.5 / (std + 1e-4)), std of (1, 0) = sqrt(1/2); turn 0 adds the same A^T
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    mt = gk.advantages.estimate("mt_grpo", rollouts.rewards, rollouts.group_index,
                                turn_rewards=options["turn_rewards"], turn_ids=options["turn_ids"])  # fmt: skip
    torch.testing.assert_close(mt, torch.tensor([[2 * a, 2 * a, 0, a, a], [-2 * a, -2 * a, 0, -a, -a]]))
    # GiGPO (gamma 0.95, mean-only): A^E = +-0.5; step returns R_0 = r_0 + 0.95 r_1 = 1.95 / 0, R_1 = 1 / 0;
    # both anchors hold both episodes: A^S = +-0.975 at step 0, +-0.5 at step 1
    gi = gk.advantages.estimate("gigpo", rollouts.rewards, rollouts.group_index,
                                step_rewards=options["step_rewards"], state_ids=options["state_ids"],
                                step_ids=options["step_ids"])  # fmt: skip
    torch.testing.assert_close(gi, torch.tensor([[1.475, 1.475, 0, 1.0, 1.0], [-1.475, -1.475, 0, -1.0, -1.0]]))


def test_lookup_task_trains_with_mt_grpo_and_gigpo(tmp_path, monkeypatch):
    estimates = capture_estimates(monkeypatch)
    for advantage in ("mt_grpo", "gigpo"):
        result = run(tmp_path, name=advantage, task="lookup", advantage=advantage, steps=2)
        assert {"turn_reward/0", "turn_reward/1"} <= set(result.metrics[-1])
    assert {name for name, *_ in estimates} == {"mt_grpo", "gigpo"}
    for name, _, _, options, advantages in estimates:
        ids = options["turn_ids" if name == "mt_grpo" else "step_ids"]
        assert (ids == -1).any() and (advantages[ids == -1] == 0).all()  # replies carry no advantage


def test_turn_estimators_need_a_multi_turn_task(tmp_path):
    with pytest.raises(ValueError, match="multi-turn task"):
        run(tmp_path, advantage="mt_grpo")
    assert not (tmp_path / "run").exists()


# ---- EDGE-GRPO: the paper's split of the corrections -----------------------------------------------------


def test_edge_gec_branch_split_is_the_papers():
    n = 8000
    generator = torch.Generator().manual_seed(0)
    full = EdgeGuidedErrorCorrection(reflection="=", hint="{completion} = {answer}")
    drawn = full.choose_branches(n, generator)
    for branch, share in zip(EdgeGuidedErrorCorrection.BRANCHES, (0.5, 0.25, 0.25)):
        sigma = math.sqrt(share * (1 - share) / n)  # binomial standard deviation of the fraction
        assert abs(drawn.count(branch) / n - share) < 5 * sigma, branch
    assert set(EdgeGuidedErrorCorrection().choose_branches(100, generator)) == {"replace"}
    assert PRESETS["edge_grpo"]["hook_options"].keys() == {"reflection", "hint"}  # all three branches on


# ---- ProRL: after a reset the reference is the policy and the optimizer starts afresh --------------------


def test_prorl_reset_copies_the_policy_and_clears_the_optimizer(tmp_path):
    from safetensors.torch import load_file

    result = run(tmp_path, loss="dapo", loss_options={"kl_coef": 1e-4}, ref_reset_interval=2, steps=2,
                 save_every=1, keep_checkpoints=2)  # fmt: skip
    checkpoints = pathlib.Path(result.run_dir) / "checkpoints"
    for step, reset in ((1, False), (2, True)):
        folder = checkpoints / f"step_{step:06d}"
        model, reference = load_file(folder / "model.safetensors"), load_file(folder / "reference.safetensors")
        same = all(torch.equal(model[k], reference[k]) for k in model)
        assert same == reset, step
        optimizer_state = [k for k in load_file(folder / "optimizer.safetensors") if k.startswith("state.")]
        assert (not optimizer_state) == reset, step
    assert [m.get("ref_reset") for m in result.metrics] == [None, 1]


# ---- a new user's first runs -----------------------------------------------------------------------------


def test_jsonl_words_outside_the_embedded_vocabulary_are_refused(tmp_path):
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "cat =", "answer": "1"}\n{"prompt": "1 2 =", "answer": "dog"}\n')
    from grpo_kernels.cli import main

    assert main(["train", "--task", str(task), "--prompts-per-step", "1", "--run-dir", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


def test_unknown_words_message_lists_them(tmp_path, capsys):
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "cat =", "answer": "1"}\n{"prompt": "1 2 =", "answer": "dog"}\n')
    from grpo_kernels.cli import main

    main(["train", "--task", str(task), "--prompts-per-step", "1", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert "'cat', 'dog'" in err and "<unk>" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--advantage-option", "scale=bogus"], "scale"),
        pytest.param(["--backend", "triton"], "triton",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs Triton")),
    ],
)  # fmt: skip
def test_options_are_validated_before_the_run_folder_exists(tmp_path, capsys, args, message):
    from grpo_kernels.cli import main

    assert main(["train", *args, "--run-dir", str(tmp_path / "r"), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


_sigint_calls = {"n": 0}


def sigint_at_second_call(prompts, completions, answers):
    """Exact-match rewards; Ctrl-C (SIGINT to this process) while scoring the second step."""
    _sigint_calls["n"] += 1
    if _sigint_calls["n"] == 2:
        signal.raise_signal(signal.SIGINT)
    return [float(c == a) for c, a in zip(completions, answers)]


def twice_sigint_at_second_call(prompts, completions, answers):
    """Two Ctrl-C while scoring the second step: stop at once."""
    _sigint_calls["n"] += 1
    if _sigint_calls["n"] == 2:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    return [0.0] * len(completions)


def test_ctrl_c_finishes_the_step_checkpoints_plots_and_resumes(tmp_path):
    _sigint_calls["n"] = 0
    with pytest.raises(TrainingInterrupted) as stop:
        run(tmp_path, reward="test_trainer_methods:sigint_at_second_call", steps=4, save_every=10)
    run_dir = pathlib.Path(stop.value.run_dir)
    assert stop.value.step == 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]
    assert (run_dir / "metrics.png").is_file()
    resumed = train(TrainConfig.from_json_dict({**json.loads((run_dir / "config.json").read_text())}),
                    resume=True, progress=False, log=quiet)  # fmt: skip
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4]


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    _sigint_calls["n"] = 0
    with pytest.raises(TrainingInterrupted) as stop:
        run(tmp_path, reward="test_trainer_methods:twice_sigint_at_second_call", steps=4, save_every=1)
    assert stop.value.step == 1  # step 2 was abandoned; step 1's checkpoint stands
    lines = (pathlib.Path(stop.value.run_dir) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_cli_ctrl_c_prints_the_real_resume_command(tmp_path):
    done = cli("--reward", "test_trainer_methods:sigint_at_second_call", "--steps", "4", "--prompts-per-step",
               "4", "--group-size", "4", "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert "checkpoint at step 2; continue with: grpo-kernels train --resume run" in done.stderr
    assert "RUN_DIR" not in done.stderr


def test_readme_lookup_figures_come_from_the_record():
    record = json.loads((ROOT / "docs" / "records" / "lookup_turn_credit.json").read_text())["runs"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for name, label in (("grpo", "is"), ("mt_grpo", "MT-GRPO reaches"), ("gigpo", "GiGPO")):
        run = record[name]
        solved, call = f"{run['solved_last10']:.3f}", f"{run['call_turn_reward_last10']:.3f}"
        assert f"{label} {solved} (first" in readme and f"{call})" in readme, (name, solved, call)
