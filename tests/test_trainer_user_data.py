"""A user's own model and data (`grpo-kernels train --model DIR --task FILE.jsonl`): what the trainer checks
before the run folder is made, resume from the last intact checkpoint, and the errors of a run that cannot go
on. Six architectures built in code and saved with save_pretrained (Llama untied, Qwen2 tied, Gemma 2 with a
final soft-cap, Phi with an LM-head bias, a Llama whose vocabulary is padded beyond its tokenizer, GPT-2 with
learned positions), each 1 layer of width 32 with a 16-position context and the embedded word-level
tokenizer; runs of 2-4 steps of 2 x 2 completions (a second or two each).

Each case of the issue "a user's own model and data" has a test here: a clear refusal before the run folder
exists, a correct run, or a resume from the last intact checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

from grpo_kernels.trainer import TrainConfig, TrainingError, train  # noqa: E402
from grpo_kernels.trainer import checkpoint as ckpt  # noqa: E402
from grpo_kernels.trainer import preflight  # noqa: E402
from grpo_kernels.trainer import trainer as trainer_module  # noqa: E402
from grpo_kernels.trainer.model import (  # noqa: E402
    EMBEDDED_VOCAB,
    build_embedded_model,
    build_embedded_tokenizer,
    load_pretrained,
)
from grpo_kernels.trainer.rollout import HFSampler, VLLMSampler, VocabularyMask  # noqa: E402
from grpo_kernels.trainer.task import resolve_task, token_match  # noqa: E402

from test_trainer import COMPLETIONS, CPU_FP32, PROMPTS, TIMING_KEYS, _batch_for  # noqa: E402

V = len(EMBEDDED_VOCAB)  # 16 tokens
CONTEXT = 16  # every model's max_position_embeddings (GPT-2: n_positions)
PADDED_VOCAB = 300  # the padded model's LM-head rows; ids 16..299 decode to nothing
SMALL = dict(prompts_per_step=2, group_size=2, micro_batch_size=4, steps=2, warmup_steps=0)
SMALL_ARGS = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--warmup-steps", "0", "--no-progress"]
ARCHITECTURES = ("llama", "qwen2", "gemma2", "phi", "padded", "gpt2")


def build(name: str, **overrides):
    """One of the six architectures, randomly initialised (seed 0), with the embedded tokenizer."""
    import transformers as tf

    tokenizer = build_embedded_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=CONTEXT, **ids)  # fmt: skip
    torch.manual_seed(0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides}))
    elif name == "padded":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "vocab_size": PADDED_VOCAB, **overrides}))
    elif name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides}))
    elif name == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**common, "head_dim": 16, "final_logit_softcapping": 2.0,
                                                        **overrides}))  # fmt: skip
    elif name == "phi":
        model = tf.PhiForCausalLM(tf.PhiConfig(**{**common, **overrides}))
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=CONTEXT,
                                                 **ids, **overrides))  # fmt: skip
    else:
        raise ValueError(name)
    return model.float(), tokenizer


def save(model, tokenizer, folder) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: save(*build(name), root / name) for name in ARCHITECTURES}


def train_cli(capsys, *args) -> tuple[int, str, str]:
    """`grpo-kernels train ARGS` in this process: (exit status, stdout, stderr)."""
    from grpo_kernels.cli import main

    try:
        code = main(["train", *args])
    except SystemExit as exit_info:  # argparse's usage errors
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


DIGIT_TASK = [{"prompt": f"{d} =", "answer": str(d)} for d in range(4)]


# ---- the six architectures: the run trains, its log-probs are each model's own ---------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_architecture_trains_and_scores_as_its_own_forward(models, name, tmp_path, capsys):
    """Log-probs of every completion token equal log_softmax of the model's own logits (soft-cap, tied
    weights, head bias; for the padded model over the tokenizer's 16 ids, which is what it samples from), and
    `--model DIR` trains two steps."""
    model, tokenizer = load_pretrained(models[name])
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)  # a non-uniform policy
    batch = _batch_for(model, tokenizer, PROMPTS, COMPLETIONS)
    vocab = V if name == "padded" else None
    logprobs, _ = trainer_module._token_logprobs(model, batch, TrainConfig(micro_batch_size=4), CPU_FP32, False,
                                                 vocab=vocab)  # fmt: skip
    for i, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits[:, :V].double(), -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]
        got = logprobs[i, : len(completion_ids)].double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} row {i}: {m}")
    code, out, err = train_cli(capsys, "--model", models[name], "--run-dir", str(tmp_path / "run"), *SMALL_ARGS)
    assert code == 0, err
    assert f"context: {CONTEXT} tokens" in out


# ---- the task file: every line typed, the file and line named -------------------------------------------


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": "1 =", "answer": null}', '"answer" is null'),
        ('{"prompt": ["1", "="], "answer": "1"}', '"prompt" is a list'),
        ('{"prompt": "1 =", "answer": 1}', '"answer" is a number'),
        ('{"prompt": "1 =", "answer": true}', '"answer" is a boolean'),
        ('{"prompt": "1 ="}', 'no "answer" key'),
        ('{"prompt": "", "answer": "1"}', '"prompt" is empty'),
        ('["1 =", "1"]', "a list, not a JSON object"),
        ('{"prompt": "1 =", "answer": "1"', "not a JSON line"),
    ],
)
def test_task_lines_are_typed_and_refused_with_file_and_line(tmp_path, line, message):
    """Nothing is converted with str(): a null answer never trains as 'None', a list prompt never as its repr."""
    path = write_jsonl(tmp_path / "task.jsonl", [DIGIT_TASK[0], line])
    with pytest.raises(ValueError, match="task.jsonl:2: ") as info:
        resolve_task(path)
    assert message in str(info.value)


def test_task_file_that_is_not_utf8_is_refused_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "task.jsonl"
    path.write_bytes(b'{"prompt": "1 =", "answer": "1"}\n{"prompt": "2 =", "answer": "\xe9"}\n')
    code, _, err = train_cli(capsys, "--task", str(path), "--run-dir", str(tmp_path / "run"), *SMALL_ARGS)
    assert code == 2
    assert "task.jsonl:2: not UTF-8 text (byte 0xe9 at column 30)" in err
    assert not (tmp_path / "run").exists()


def test_task_keys_besides_prompt_and_answer_are_named_at_startup(tmp_path):
    path = write_jsonl(tmp_path / "task.jsonl", [{**row, "id": i} for i, row in enumerate(DIGIT_TASK)])
    assert "keys other than prompt and answer are not used: id" in resolve_task(path).description


def test_text_the_tokenizer_cannot_encode_is_refused_with_the_line(models, tmp_path, capsys):
    """A word-level tokenizer reads unknown words as <unk>: such an answer could never be matched."""
    path = write_jsonl(tmp_path / "task.jsonl", [*DIGIT_TASK, {"prompt": "cat 1 =", "answer": "1"},
                                                 {"prompt": "2 =", "answer": "dog"}])  # fmt: skip
    code, _, err = train_cli(capsys, "--model", models["llama"], "--task", path, "--max-new-tokens", "4", "--run-dir",
                             str(tmp_path / "run"), *SMALL_ARGS)  # fmt: skip
    assert code == 2
    assert "task.jsonl:5: the prompt has text the tokenizer cannot encode ('cat' become <unk>)" in err
    assert "task.jsonl:6: the answer has text the tokenizer cannot encode ('dog' become <unk>)" in err
    assert not (tmp_path / "run").exists()


def test_an_answer_the_tokenizer_does_not_give_back_is_refused(models, tmp_path, capsys):
    """The word-level tokenizer decodes '1  2' (two spaces) as '1 2', which exact_match never scores 1."""
    path = write_jsonl(tmp_path / "task.jsonl", [*DIGIT_TASK, {"prompt": "3 =", "answer": "1  2"}])
    code, _, err = train_cli(capsys, "--model", models["llama"], "--task", path, "--max-new-tokens", "4", "--run-dir",
                             str(tmp_path / "run"), *SMALL_ARGS)  # fmt: skip
    assert code == 2
    assert "task.jsonl:5: the answer '1  2' comes back from the tokenizer as '1 2', which the reward scores 0" in err
    assert not (tmp_path / "run").exists()


def test_token_match_scores_the_exact_empty_answer_1():
    got = token_match(["p"] * 4, ["", "  ", "1", ""], ["", "", "", "1"])
    assert got == [1.0, 1.0, 0.0, 0.0]


# ---- the model's context: prompt + generation budget ----------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # learned positions (crashed in generate), RoPE (ran past them)
def test_prompt_plus_budget_beyond_the_context_is_refused(models, name, tmp_path, capsys):
    # copy prompts are 5 tokens ('<bos> 3 1 4 ='); 12 new tokens leave 4 of the 16
    code, _, err = train_cli(capsys, "--model", models[name], "--max-new-tokens", "12", "--run-dir",
                             str(tmp_path / "run"), *SMALL_ARGS)  # fmt: skip
    assert code == 2
    assert "is 5 tokens, more than the 4 tokens that the 16-token context" in err and "--truncate-prompts" in err
    assert not (tmp_path / "run").exists()
    code, _, err = train_cli(capsys, "--model", models[name], "--max-new-tokens", "16", "--run-dir",
                             str(tmp_path / "run"), *SMALL_ARGS)  # fmt: skip
    assert code == 2 and "no room for a prompt" in err


def test_long_task_prompts_are_refused_by_line_or_truncated_when_asked(models, tmp_path, capsys):
    long = {"prompt": "1 2 3 4 5 6 7 8 9 0 1 2 3 4 =", "answer": "1"}  # 16 tokens with <bos>
    path = write_jsonl(tmp_path / "task.jsonl", [*DIGIT_TASK, long])
    args = ["--model", models["gpt2"], "--task", path, "--max-new-tokens", "4", *SMALL_ARGS]
    code, _, err = train_cli(capsys, *args, "--run-dir", str(tmp_path / "refused"))
    assert code == 2
    assert "task.jsonl:5: the prompt is 16 tokens, more than the 12 tokens" in err
    assert not (tmp_path / "refused").exists()
    code, out, err = train_cli(capsys, *args, "--truncate-prompts", "--seed", "3", "--steps", "4",
                               "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err
    assert "the prompts of 1 of the task's 5 lines are longer and are truncated from the left" in out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all("prompts_truncated" in m for m in metrics)


def test_truncation_keeps_the_bos_and_the_end_of_the_prompt():
    tokenizer = build_embedded_tokenizer()
    encoder = preflight.PromptEncoder(tokenizer, limit=4, truncate=True)
    assert encoder("1 2 3 4 5 =") == tokenizer("4 5 =")["input_ids"]  # <bos> 4 5 =
    assert encoder("1 =") == tokenizer("1 =")["input_ids"] and encoder.take_count() == 1
    with pytest.raises(preflight.PromptTooLong, match="is 7 tokens, more than the 4"):
        preflight.PromptEncoder(tokenizer, limit=4, truncate=False)("1 2 3 4 5 =")


# ---- a vocabulary padded beyond its tokenizer -------------------------------------------------------------


def test_padded_ids_get_no_probability_in_the_hf_sampler(models):
    """96 % of the initial mass of the padded model is on ids no token decodes to; the sampler draws none."""
    model, tokenizer = load_pretrained(models["padded"])
    prompts = [tokenizer("3 1 4 =")["input_ids"]] * 64

    def sample(vocab):
        torch.manual_seed(0)
        sampler = HFSampler(model, tokenizer, [tokenizer.eos_token_id], 1.0, trainer_module.contextlib.nullcontext,
                            vocab=vocab)  # fmt: skip
        completions, _, _ = sampler.generate(prompts, 4)
        return [t for c in completions for t in c]

    unmasked = sample(None)
    assert sum(t >= V for t in unmasked) > 0.8 * len(unmasked)  # the case: the mask is what removes them
    masked = sample(V)
    assert masked and max(masked) < V


def test_a_padded_model_trains_on_the_tokenizers_ids_only(models, tmp_path, monkeypatch):
    """Whatever path the trainer samples by, no completion of the padded model holds an id >= 16."""
    real, sampled = trainer_module._collect_rollouts, []

    def collect(*args, **kwargs):
        rollouts, rewards, stats = real(*args, **kwargs)
        sampled.extend(t for row in rollouts.completion_tokens for t in row)
        return rollouts, rewards, stats

    monkeypatch.setattr(trainer_module, "_collect_rollouts", collect)
    config = TrainConfig(**{**SMALL, "prompts_per_step": 4, "group_size": 4}, model=models["padded"],
                         run_dir=str(tmp_path / "run"))  # fmt: skip
    train(config, progress=False, log=lambda *a: None)
    assert len(sampled) >= 2 * 16 and max(sampled) < V


def test_vocabulary_mask_sets_minus_infinity_beyond_the_limit():
    scores = torch.randn(3, 10)
    masked = VocabularyMask(6)(None, scores)
    assert torch.equal(masked[:, :6], scores[:, :6]) and bool(torch.isneginf(masked[:, 6:]).all())
    assert torch.softmax(masked, -1)[:, 6:].sum() == 0
    assert VocabularyMask(10)(None, scores) is scores


def test_padded_ids_are_refused_to_the_vllm_sampler_as_allowed_token_ids(monkeypatch):
    """The vLLM path without an engine: a fake `vllm` module whose LLM records the SamplingParams and, like
    vLLM's sampler, draws only from allowed_token_ids. The real engine is exercised by tests/test_vllm_*.py
    (marker vllm, their own environment); vLLM applies allowed_token_ids before the temperature, so its
    processed log-probs are those of the restricted softmax the loss computes."""
    recorded = {}

    class FakeLLM:
        def __init__(self, **options):
            recorded["options"] = options

        def generate(self, requests, sampling_params, use_tqdm):
            recorded["params"] = sampling_params
            outputs = []
            for params in sampling_params:
                token = max(params.get("allowed_token_ids", range(PADDED_VOCAB)))
                sample = types.SimpleNamespace(token_ids=[token, 2], logprobs=[
                    {token: types.SimpleNamespace(logprob=-1.0)}, {2: types.SimpleNamespace(logprob=-0.5)}])  # fmt: skip
                outputs.append(types.SimpleNamespace(outputs=[sample]))
            return outputs

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True, device_name="cpu")
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.platforms = FakeLLM, (lambda **kwargs: kwargs), platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    completions, _, logprobs = VLLMSampler("model-dir", [2], 1.0, 0, vocab=V).generate([[1, 5], [1, 6]], 4)
    assert all(p["allowed_token_ids"] == list(range(V)) for p in recorded["params"])
    assert completions == [[V - 1, 2]] * 2 and logprobs == [[-1.0, -0.5]] * 2
    VLLMSampler("model-dir", [2], 1.0, 0).generate([[1, 5]], 4)  # no padding: no restriction
    assert "allowed_token_ids" not in recorded["params"][0]


# ---- the run folder: writable before the model loads, write errors named ---------------------------------


def test_an_unwritable_run_folder_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """As root every folder is writable, so the refusal is injected where the probe writes; the next test
    makes a folder read-only for real when not root."""
    real_mkstemp = preflight.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if os.path.abspath(dir) == str(tmp_path / "locked"):
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(preflight.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a: pytest.fail("the model loaded before the check"))
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "locked" / "run"), *SMALL_ARGS)
    assert code == 2
    assert f"{str(tmp_path / 'locked')!r}, where run folder" in err and "Permission denied" in err
    assert not (tmp_path / "locked" / "run").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes read-only folders")
def test_a_read_only_folder_is_refused_for_real(tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "ro" / "run"), *SMALL_ARGS)
    finally:
        os.chmod(tmp_path / "ro", stat.S_IRWXU)
    assert code == 2 and "cannot be written" in err and "Permission denied" in err


@pytest.mark.parametrize("failure", ["checkpoint read-only", "disk full at the metrics"])
def test_a_write_that_fails_mid_run_names_the_path_and_the_resume(tmp_path, capsys, monkeypatch, failure):
    """The checkpoints folder made read-only after step 1 (the save of step 2 fails), or the disk full when
    step 2's metrics line is appended: exit 1 naming what was being written, where, and the way back."""
    run_dir = tmp_path / "run"
    if failure == "checkpoint read-only":
        real_makedirs = os.makedirs

        def makedirs(path, *args, **kwargs):
            if str(path).endswith("step_000002.partial"):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_makedirs(path, *args, **kwargs)

        monkeypatch.setattr(ckpt.os, "makedirs", makedirs)
        folder = run_dir / "checkpoints" / "step_000002"
        expected = f"cannot write the checkpoint of step 2 to {folder} ({folder}.partial): Permission denied"
    else:
        real_open, appends = open, []

        class FullDisk:  # the metrics file object whose write fails (step 2's line)
            def __init__(self, path):
                self.file = real_open(path, "a")

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.file.close()

            def write(self, text):
                raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))

        def fake_open(path, mode="r", *args, **kwargs):
            if str(path).endswith("metrics.jsonl") and mode == "a":
                appends.append(path)
                if len(appends) == 2:
                    return FullDisk(path)
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr("builtins.open", fake_open)
        metrics = run_dir / "metrics.jsonl"
        expected = f"cannot write the metrics of step 2 to {metrics} ({metrics}): No space left on device"
    code, _, err = train_cli(capsys, "--run-dir", str(run_dir), "--save-every", "1", "--steps", "3", *SMALL_ARGS[2:])
    assert code == 1
    assert expected in err
    last = run_dir / "checkpoints" / "step_000001"
    assert f"the last checkpoint is step 1 ({last}); continue from it with: grpo-kernels train --resume {run_dir}" in err
    assert not (run_dir / "checkpoints" / "step_000002.partial").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_are_written_with_the_users_umask(tmp_path, umask):
    """safetensors writes through a private temporary file (0600): the run sets its files to the umask's mode."""
    previous = os.umask(umask)
    try:
        train(TrainConfig(**SMALL, run_dir=str(tmp_path / "run")), progress=False, log=lambda *a: None)
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and any(p.parent.name == "final_model" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(expected)}, modes


def test_final_model_is_written_aside_and_renamed(tmp_path, monkeypatch):
    """final_model/ is complete or absent: while it is written, only final_model.partial exists (a kill -9
    there leaves no folder that looks like a model), and a failed write leaves neither."""
    from transformers import PreTrainedTokenizerBase

    run_dir, seen = tmp_path / "run", []

    def failing_save(self, folder, *args, **kwargs):
        seen.append((str(folder), (run_dir / "final_model").exists()))
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", failing_save)
    with pytest.raises(TrainingError, match="cannot write the final model to .*final_model.*No space left on device"):
        train(TrainConfig(**SMALL, run_dir=str(run_dir)), progress=False, log=lambda *a: None)
    assert seen == [(str(run_dir / "final_model.partial"), False)]
    assert not (run_dir / "final_model").exists() and not (run_dir / "final_model.partial").exists()


# ---- resume: every checkpoint file verified, the newest intact one used ---------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run with a checkpoint after each step (step_000001, step_000002)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    config = TrainConfig(**SMALL, run_dir=str(run_dir), save_every=1, keep_checkpoints=3)
    result = train(config, progress=False, log=lambda *a: None)
    return config, result.metrics


def copy_run(finished_run, tmp_path):
    config, metrics = finished_run
    target = tmp_path / "run"
    shutil.copytree(config.run_dir, target)
    return config.replace(run_dir=str(target), steps=3), metrics, target


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


def nan_weight(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, path)


DAMAGES = {
    "model.safetensors truncated": ("model.safetensors", lambda p: truncate(p, lambda n: n // 2),
                                    "truncated: its header declares"),
    "model.safetensors empty": ("model.safetensors", lambda p: truncate(p, lambda n: 0), "truncated to 0 bytes"),
    "optimizer.safetensors empty": ("optimizer.safetensors", lambda p: truncate(p, lambda n: 0), "truncated to 0 bytes"),
    "optimizer.safetensors truncated": ("optimizer.safetensors", lambda p: truncate(p, lambda n: n - 5),
                                        "truncated: its header declares"),
    "state.json truncated": ("state.json", lambda p: truncate(p, lambda n: n // 2), "not valid JSON"),
    "model.safetensors NaN": ("model.safetensors", nan_weight, "holds 1 non-finite value(s) (NaN / inf) of"),
    "optimizer.safetensors NaN": ("optimizer.safetensors", nan_weight, "holds 1 non-finite value(s) (NaN / inf) of"),
    "reference.safetensors missing": ("reference.safetensors", os.remove, "missing"),
    "rng.safetensors header cut": ("rng.safetensors", lambda p: truncate(p, lambda n: 20), "shorter than its own header"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_latest_checkpoint_is_named_and_skipped(finished_run, tmp_path, damage):
    name, damage_file, reason = DAMAGES[damage]
    config, straight, run_dir = copy_run(finished_run, tmp_path)
    damage_file(run_dir / "checkpoints" / "step_000002" / name)
    logs = []
    result = train(config, resume=True, progress=False, log=logs.append)
    warning = next(line for line in logs if line.startswith("warning:"))
    assert f"checkpoint {run_dir}/checkpoints/step_000002 is damaged: {run_dir}/checkpoints/step_000002/{name}: " in warning
    assert reason in warning
    assert f"moved to {run_dir}/checkpoints/step_000002.damaged" in warning
    assert f"resumed {run_dir} at step 1" in logs
    assert [m["step"] for m in result.metrics] == [1, 2, 3]
    # step 2, re-run from the intact step-1 checkpoint, is the step 2 of the uninterrupted run
    assert {k: v for k, v in result.metrics[1].items() if k not in TIMING_KEYS} == pytest.approx(
        {k: v for k, v in straight[1].items() if k not in TIMING_KEYS}, rel=1e-6, abs=1e-7)  # fmt: skip
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000002.damaged", "step_000003"]  # fmt: skip


def test_every_checkpoint_damaged_is_a_clear_refusal(finished_run, tmp_path, capsys):
    config, _, run_dir = copy_run(finished_run, tmp_path)
    truncate(run_dir / "checkpoints" / "step_000002" / "model.safetensors", lambda n: 0)
    nan_weight(run_dir / "checkpoints" / "step_000001" / "optimizer.safetensors")
    code, out, err = train_cli(capsys, "--resume", str(run_dir), "--steps", "3", "--no-progress")
    assert code == 2
    assert f"cannot resume {str(run_dir)!r}: every checkpoint is damaged: step_000002 (" in err
    assert "step_000001 (" in err and "non-finite" in err
    assert out.count("warning: checkpoint") == 2


def test_a_truncated_run_config_is_named(finished_run, tmp_path, capsys):
    _, _, run_dir = copy_run(finished_run, tmp_path)
    truncate(run_dir / "config.json", lambda n: n // 2)
    code, _, err = train_cli(capsys, "--resume", str(run_dir), "--steps", "3")
    assert code == 2
    assert f"{run_dir}/config.json is not a valid run config" in err and "state.json" in err


def test_metrics_last_line_cut_short_is_dropped_and_a_bad_line_refused(finished_run, tmp_path):
    config, _, run_dir = copy_run(finished_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "rew')  # a kill while step 3's line was written
    result = train(config, resume=True, progress=False, log=lambda *a: None)
    assert [m["step"] for m in result.metrics] == [1, 2, 3]
    lines = metrics.read_text().splitlines()
    lines[0] = lines[0][:20]
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1 is not a step record"):
        train(config.replace(steps=4), resume=True, progress=False, log=lambda *a: None)


def _model_run(models, tmp_path, name="llama"):
    """A 2-step run of a copy of a model folder (so the test may change the folder)."""
    model_dir = tmp_path / "model"
    shutil.copytree(models[name], model_dir)
    config = TrainConfig(**SMALL, model=str(model_dir), run_dir=str(tmp_path / "run"))
    train(config, progress=False, log=lambda *a: None)
    return config.replace(steps=3), model_dir


def test_a_changed_tokenizer_is_refused_by_name(models, tmp_path, capsys):
    config, model_dir = _model_run(models, tmp_path)
    tokenizer = build_embedded_tokenizer()
    tokenizer.add_tokens(["cat"])  # the folder's tokenizer changes under the run
    tokenizer.save_pretrained(model_dir)
    code, _, err = train_cli(capsys, "--resume", config.run_dir, "--steps", "3")
    assert code == 2
    assert "was written with another model than this run now loads (its tokenizer differs (16 tokens then, 17 now))" in err


def test_another_architecture_is_refused_by_name(models, tmp_path, capsys):
    config, model_dir = _model_run(models, tmp_path)
    shutil.rmtree(model_dir)
    save(*build("llama", hidden_size=48), model_dir)  # another model in the same folder
    code, _, err = train_cli(capsys, "--resume", config.run_dir, "--steps", "3")
    assert code == 2
    assert "was written with another model than this run now loads (its config differs: " in err
    assert "hidden_size 32 -> 48" in err


def test_a_checkpoint_of_other_tensors_is_refused_before_loading(models, tmp_path):
    """The file-level check (a checkpoint written without the model's record, or whose record was edited):
    names and shapes against the model, before load_state_dict could fail half-way."""
    config, _ = _model_run(models, tmp_path)
    folder = os.path.join(config.run_dir, "checkpoints", "step_000002")
    other, _ = build("qwen2", hidden_size=48)
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(ckpt.CheckpointMismatch, match="holds another architecture than the model Qwen2ForCausalLM") as info:
        ckpt.verify_checkpoint(folder, model=other, reference=None, optimizer=optimizer, fingerprint=None)
    assert "other shapes" in str(info.value) and "[32]" in str(info.value) and "[48]" in str(info.value)
    same, _ = build("llama")  # the model of the run: accepted
    ckpt.verify_checkpoint(folder, model=same, reference=same, optimizer=torch.optim.AdamW(same.parameters()),
                           fingerprint=None)  # fmt: skip


def test_tied_weights_are_checked_once(models, tmp_path):
    """Qwen2's tied embedding and LM head are one tensor stored under one name: an intact checkpoint."""
    config, _ = _model_run(models, tmp_path, name="qwen2")
    model, _ = build("qwen2")
    folder = os.path.join(config.run_dir, "checkpoints", "step_000002")
    ckpt.verify_checkpoint(folder, model=model, reference=model, optimizer=torch.optim.AdamW(model.parameters()))


# ---- divergence, negative option values -----------------------------------------------------------------


def test_divergence_stops_with_step_values_rate_and_resume_command(tmp_path, capsys):
    """A learning rate that blows the run up (2, reached over a 3-step warmup): exit 1 at the step whose loss
    or gradients went non-finite, its rate, the last checkpoint and the command that resumes from it."""
    run_dir = tmp_path / "run"
    code, _, err = train_cli(capsys, "--lr", "2", "--warmup-steps", "3", "--save-every", "1", "--steps", "6",
                             "--prompts-per-step", "2", "--group-size", "2", "--no-progress",
                             "--run-dir", str(run_dir))  # fmt: skip
    assert code == 1
    step = int(err.split("training diverged at step ")[1].split(":")[0])
    assert "gradient norm is" in err and "at learning rate " in err and "was not applied" in err
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir()) if step > 1 else []
    if step > 1 and "is itself past the blow-up" in err:  # on this machine: step 1 moved the weights 20x their norm
        assert checkpoints[-1] == ckpt.checkpoint_name(step - 1)
        assert "no kept checkpoint is before it: start over" in err  # tests/test_trainer_cluster.py: the advice
    elif step > 1:
        assert checkpoints[-1] == ckpt.checkpoint_name(step - 1)
        assert f"grpo-kernels train --resume {run_dir} --lr 0.2" in err
        code, _, err = train_cli(capsys, "--resume", str(run_dir), "--lr", "0.001", "--steps", str(step + 1),
                                 "--no-progress")  # fmt: skip
        assert code == 0, err
        assert json.loads((run_dir / "config.json").read_text())["lr"] == 0.001
    else:
        assert "no checkpoint was written yet: start a new run with --lr 0.2" in err


def test_a_non_finite_gradient_is_never_applied(tmp_path, monkeypatch):
    """The guard itself, deterministically: the loss of step 2's first update made inf. The run stops before
    the optimizer step, so the weights are exactly those after step 1 (the checkpoint's)."""
    real, calls = trainer_module._micro_batch_loss, []

    def loss(*args, **kwargs):
        value, metrics = real(*args, **kwargs)
        calls.append(1)
        return (value * float("inf") if len(calls) == 3 else value), metrics  # 2 updates per step, 1 micro-batch

    monkeypatch.setattr(trainer_module, "_micro_batch_loss", loss)
    config = TrainConfig(**{**SMALL, "steps": 3}, run_dir=str(tmp_path / "run"), save_every=1)
    with pytest.raises(trainer_module.TrainingDiverged, match=r"diverged at step 2: the loss is inf") as info:
        train(config, progress=False, log=lambda *a: None)
    assert info.value.step == 2 and "the last checkpoint is step 1" in str(info.value)
    policy, _ = build_embedded_model(0)
    ckpt.load_checkpoint(os.path.join(config.run_dir, "checkpoints", "step_000001"), model=policy, reference=None,
                         optimizer=torch.optim.AdamW(policy.parameters()))  # fmt: skip
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_non_finite_hidden_states_and_logits_are_named():
    model, tokenizer = build_embedded_model(0)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("inf")
    batch = _batch_for(model, tokenizer, ["1 2 3 =", "4 ="], ["1 2", "4"])  # token 5 is "+": in no row
    batch.completion_ids[0, 0] = 5
    with pytest.raises(trainer_module._NonFinite, match="non-finite value.*last hidden states of the log-prob forward"):
        trainer_module._token_logprobs(model, batch, TrainConfig(), CPU_FP32, False)
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)
    with pytest.raises(trainer_module._NonFinite, match="the policy's logits hold"):
        trainer_module._check_logits_finite(model, tokenizer, CPU_FP32)


def test_negative_numbers_are_option_values(capsys):
    from grpo_kernels.trainer.cli import build_parser, join_negative_values

    parser = build_parser()
    assert join_negative_values(parser, ["--lr", "-1e-3", "--seed", "-1", "--loss-option", "clip=-0.2"]) == [
        "--lr=-1e-3", "--seed=-1", "--loss-option", "clip=-0.2"]  # fmt: skip
    assert join_negative_values(parser, ["--overlong-filter", "-1"]) == ["--overlong-filter", "-1"]  # a flag
    code, _, err = train_cli(capsys, "--lr", "-1e-3")
    assert code == 2 and "lr must be > 0, got -0.001" in err
    code, _, err = train_cli(capsys, "--temperature", "-inf")
    assert code == 2 and "temperature must be > 0, got -inf" in err


# ---- dropout, an all-masked step ----------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [False, True])
def test_dropout_is_off_unless_kept(models, tmp_path, capsys, keep):
    """GPT-2's config has dropout 0.1: by default the first update's KL to the reference (the same weights)
    is 0 to rounding; --keep-dropout trains with it (the KL then measures the dropout noise)."""
    args = ["--model", models["gpt2"], "--num-iterations", "1", "--steps", "1", "--prompts-per-step", "2",
            "--group-size", "4", "--no-progress", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    code, out, err = train_cli(capsys, *args, *(["--keep-dropout"] if keep else []))
    assert code == 0, err
    kl = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["kl"]
    if keep:
        assert "dropout: kept in the training forward" in out and kl > 1e-5
    else:
        assert "dropout: off in the policy and the reference (the model's config has attn_pdrop=0.1" in out
        assert abs(kl) < 1e-7


def test_the_embedded_model_has_no_dropout(tmp_path):
    """So the default (off) leaves the main job's run as it was (tests/test_readme_records.py checks its rewards)."""
    model, _ = build_embedded_model(0)
    assert preflight.describe_dropout(model, keep=False) == "dropout: the model has none"


def test_an_all_masked_step_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """Overlong filtering with a 1-token budget masks every completion that did not end at once; a step where
    all are masked makes no update (the loss is not called with 0 tokens) and says why; the run goes on."""
    real, counts = trainer_module.fused_linear_grpo_loss, []

    def loss(*args, **kwargs):
        counts.append(kwargs["num_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "fused_linear_grpo_loss", loss)
    logs = []
    config = TrainConfig(**{**SMALL, "steps": 3}, run_dir=str(tmp_path / "run"), overlong_filter=True, max_new_tokens=1,
                         seed=1)  # fmt: skip
    metrics = train(config, progress=False, log=logs.append).metrics
    skipped = [m for m in metrics if m.get("skipped")]
    assert [m["step"] for m in metrics] == [1, 2, 3] and skipped and 0 not in counts
    for m in skipped:
        assert m["skip_reason"].startswith("every token is masked: overlong filtering removed all 4 completions")
        assert f"step {m['step']} skipped (no update): {m['skip_reason']}" in logs


def test_a_checkpoint_whose_replacement_was_interrupted_is_restored(finished_run, tmp_path):
    """A kill between the two renames that replace a checkpoint folder leaves only `step_N.old` (complete):
    resume puts it back and uses it."""
    config, _, run_dir = copy_run(finished_run, tmp_path)
    os.replace(run_dir / "checkpoints" / "step_000002", run_dir / "checkpoints" / "step_000002.old")
    logs = []
    train(config, resume=True, progress=False, log=logs.append)
    assert any(line.startswith("note: ") and "step_000002 restored from step_000002.old" in line for line in logs)
    assert f"resumed {run_dir} at step 2" in logs


def test_a_built_in_task_the_tokenizer_cannot_encode_is_refused(tmp_path, capsys):
    """A model whose tokenizer lacks the digits of the built-in tasks: refused before the run, not trained on
    <unk> prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "="])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=CONTEXT, eos_token_id=2))  # fmt: skip
    path = save(model, tokenizer, tmp_path / "letters")
    code, _, err = train_cli(capsys, "--model", path, "--run-dir", str(tmp_path / "run"), *SMALL_ARGS)
    assert code == 2 and "task 'copy': the prompt" in err and "cannot encode (it becomes <unk>)" in err
    assert not (tmp_path / "run").exists()
