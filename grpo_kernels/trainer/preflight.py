"""What the trainer checks before the run folder is made, on the model, tokenizer, task and folder together.

    model       an LM head that is a Linear, finite weights, eos ids inside the vocabulary, its context
                length and vocabulary (padded rows beyond the tokenizer's: masked out of sampling and the
                loss), its dropout (off by default, stated)
    task        every prompt and answer of a .jsonl task through the tokenizer: characters it cannot encode
                (the <unk> token), ids the model cannot embed, answers the built-in rewards could never
                score 1 (the tokenizer does not give them back), prompt + generation budget against the
                model's context (refused, or prompts truncated from the left when asked, counted)
    run folder  writable (a probe file in the folder, or the nearest existing folder above a new one)

Each check raises ValueError naming the file and line (task), the tensor (model) or the path (folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass

import torch

from .model import lm_head_params


class NotWritable(ValueError):
    """The run folder (or the folder it would be made in) cannot be written."""


class PromptTooLong(ValueError):
    """A prompt longer than the model's context leaves for it (and truncation was not asked for)."""


@dataclass(frozen=True)
class Vocabulary:
    """The model's vocabulary (LM-head rows) against the tokenizer's.

    Token ids [0, limit) are the ones the run samples and scores. A model padded beyond its tokenizer (rows
    no token decodes to, e.g. a vocabulary rounded up to a multiple of 64 or 128) has limit < model_size:
    the samplers give those ids no probability and the loss's softmax runs over the first `limit` rows,
    so the distribution trained is the one sampled."""

    model_size: int  # LM-head rows V
    tokenizer_size: int  # len(tokenizer): ids the tokenizer decodes

    @property
    def limit(self) -> int:
        return min(self.model_size, self.tokenizer_size)

    @property
    def padded(self) -> bool:
        return self.model_size > self.tokenizer_size

    def describe(self) -> str:
        if self.padded:
            return (f"vocabulary: the model's {self.model_size} rows, the tokenizer's {self.tokenizer_size} "
                    f"tokens: ids {self.tokenizer_size}..{self.model_size - 1} decode to no text and get no "
                    "probability (masked in sampling and in the loss)")  # fmt: skip
        if self.tokenizer_size > self.model_size:
            return (f"vocabulary: {self.model_size} tokens (the tokenizer's {self.tokenizer_size - self.model_size} "
                    "ids beyond the model's rows are never sampled)")  # fmt: skip
        return f"vocabulary: {self.model_size} tokens"


def check_model(model, tokenizer, eos_ids: list[int], where: str) -> Vocabulary:
    """The model and tokenizer can train together: a Linear LM head, finite weights, eos ids the model can
    emit and the tokenizer decodes. `where` names the model in messages ('--model DIR')."""
    try:
        weight, _ = lm_head_params(model)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(f"{where}: weight {name!r} holds {bad} non-finite value(s) (NaN / inf) of "
                                 f"{tensor.numel()}; the model cannot be trained from it")  # fmt: skip
    vocabulary = Vocabulary(weight.shape[0], len(tokenizer))
    outside = [i for i in eos_ids if i >= vocabulary.limit]
    if outside:
        raise ValueError(f"{where}: eos token id(s) {outside} are beyond the vocabulary the run samples (ids "
                         f"0..{vocabulary.limit - 1}: {vocabulary.describe()}); completions could never end")
    return vocabulary


def context_length(model) -> int | None:
    """The model's context (max_position_embeddings; GPT-2's n_positions), or None when its config has none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class PromptEncoder:
    """Prompt text -> token ids, within the model's context: a prompt may take `limit` tokens (the context
    minus the tokens generated after it). A longer one is refused (ValueError naming it), or with
    `truncate`, cut from the left, keeping its leading special tokens (BOS) and its last tokens; `truncated`
    counts the prompts cut since the last `take_count()`."""

    def __init__(self, tokenizer, limit: int | None, truncate: bool, why: str = ""):
        self.tokenizer, self.limit, self.truncate = tokenizer, limit, truncate
        self.why = why  # how the limit follows from the context and the budget, for the messages
        self.truncated = 0

    def __call__(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        if self.limit is None or len(ids) <= self.limit:
            return ids
        if not self.truncate:
            raise PromptTooLong(
                f"prompt {_short(text)} is {len(ids)} tokens, more than the {self.limit} {self.why}: shorten it, "
                "or pass --truncate-prompts to cut long prompts from the left"
            )
        self.truncated += 1
        # the tokens the tokenizer adds around the text (a BOS before it, an EOS after it) stay; the text's
        # own tokens lose their beginning
        text_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        prefix = next((i for i in range(len(ids) - len(text_ids) + 1) if ids[i : i + len(text_ids)] == text_ids), 0)
        suffix = max(len(ids) - prefix - len(text_ids), 0)
        keep = max(self.limit - prefix - suffix, 1)
        return ids[:prefix] + text_ids[len(text_ids) - keep :] + ids[len(ids) - suffix :]

    def take_count(self) -> int:
        count, self.truncated = self.truncated, 0
        return count


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def prompt_limit(model, budget: int, turns: int, where: str) -> tuple[int | None, str, str]:
    """(the prompt tokens the context leaves after `turns` x `budget` generated tokens, or None when the
    model states no context; why (for messages); the startup line). Refuses a budget that alone fills the
    context."""
    context = context_length(model)
    if context is None:
        return None, "", "context: not in the model's config (max_position_embeddings): prompt lengths not checked"
    generated = budget * turns
    if generated >= context:
        per_turn = f" ({turns} turns x {budget})" if turns > 1 else ""
        raise ValueError(f"{where}: the generation budget{per_turn} is {generated} tokens, the model's context "
                         f"{context} (max_position_embeddings): no room for a prompt; lower --max-new-tokens")
    replies = " plus the environment's replies" if turns > 1 else ""
    why = (f"tokens that the {context}-token context of {where} (max_position_embeddings) leaves beside the "
           f"{generated} generated (--max-new-tokens)")  # fmt: skip
    line = f"context: {context} tokens; prompts up to {context - generated}, then {generated} generated{replies}"
    return context - generated, why, line


def check_task_examples(examples, tokenizer, vocabulary: Vocabulary, encoder: PromptEncoder,
                        reward_fn=None) -> str:  # fmt: skip
    """Every (prompt, answer) of a .jsonl task through the tokenizer, before the run. Refuses, naming file and
    line (the first 5 faults): characters the tokenizer cannot encode (its unknown token), ids beyond the
    model's vocabulary, a prompt longer than the context allows (unless truncation is on: then counted),
    and, with a built-in `reward_fn`, an answer that the tokenizer does not give back, so that the reward
    could never reach 1. Returns the startup line's note on truncation ('' when none)."""
    unk = tokenizer.unk_token_id
    prompts = [e.prompt for e in examples]
    answers = [e.answer for e in examples]
    prompt_ids = tokenizer(prompts)["input_ids"]  # one batched call: a large file takes seconds, not minutes
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    problems = []

    def check_ids(example, field, text, ids):
        if unk is not None and unk in ids:
            problems.append(f"{example.where}: the {field} has text the tokenizer cannot encode "
                            f"({_unknown_spans(tokenizer, text, field)} become {tokenizer.unk_token})")  # fmt: skip
        elif any(i >= vocabulary.model_size for i in ids):
            beyond = sorted({i for i in ids if i >= vocabulary.model_size})[:4]
            problems.append(f"{example.where}: the {field} encodes to id(s) {beyond} beyond the model's "
                            f"{vocabulary.model_size} rows")  # fmt: skip

    for example, p_ids, a_ids in zip(examples, prompt_ids, answer_ids):
        if encoder.limit is not None and len(p_ids) > encoder.limit and not encoder.truncate:
            problems.append(f"{example.where}: the prompt is {len(p_ids)} tokens, more than the {encoder.limit} "
                            f"{encoder.why} (shorten it, or pass --truncate-prompts to cut long prompts from the "
                            "left)")  # fmt: skip
        check_ids(example, "prompt", example.prompt, p_ids)
        check_ids(example, "answer", example.answer, a_ids)
        if len(problems) >= 5:
            break
    if not problems and reward_fn is not None:
        back = tokenizer.batch_decode(answer_ids, skip_special_tokens=False)
        values = reward_fn(prompts=prompts, completions=back, answers=answers)
        for example, text, value in zip(examples, back, values):
            if value < 1.0:
                problems.append(f"{example.where}: the answer {_short(example.answer)} comes back from the "
                                f"tokenizer as {_short(text)}, which the reward scores {value:g}: it could never be "
                                "solved")  # fmt: skip
                if len(problems) >= 5:
                    break
    if problems:
        more = " (the first 5)" if len(problems) >= 5 else ""
        raise ValueError(f"the task does not fit the model{more}:\n  " + "\n  ".join(problems))
    if encoder.limit is None:
        return ""
    cut = sum(len(ids) > encoder.limit for ids in prompt_ids)
    if cut:
        return (f"; the prompts of {cut} of the task's {len(examples)} lines are longer and are truncated from the "
                "left (--truncate-prompts)")  # fmt: skip
    return ""


def _unknown_spans(tokenizer, text: str, field: str) -> str:
    """The parts of `text` that encode to the unknown token, quoted (from the fast tokenizer's offsets)."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [text[a:b] for token, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"])
                 if token == tokenizer.unk_token_id]  # fmt: skip
    except (NotImplementedError, KeyError, TypeError, ValueError):
        spans = []
    if not spans:
        return f"parts of the {field}"
    unique = list(dict.fromkeys(spans))
    return ", ".join(repr(s) for s in unique[:6]) + (" ..." if len(unique) > 6 else "")


def describe_dropout(model, keep: bool) -> str:
    """The startup line on dropout: what the model's modules and config set, and whether the run keeps it."""
    rates = sorted({round(m.p, 6) for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    named = sorted(f"{k}={v:g}" for k, v in config.to_dict().items()
                   if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0)  # fmt: skip
    found = ", ".join(named) if named else (f"dropout modules with p={rates}" if rates else "")
    if not found:
        return "dropout: the model has none"
    if keep:
        return (f"dropout: kept in the training forward ({found}; --keep-dropout); sampling, old-policy and "
                "reference log-probs run without it")  # fmt: skip
    return (f"dropout: off in the policy and the reference (the model's config has {found}; --keep-dropout "
            "keeps it in the training forward)")  # fmt: skip


# texts whose token ids show how the tokenizer frames a prompt (a BOS / EOS added around the text, a prefix
# space): a change there changes every prompt the policy is sampled and scored on
TEMPLATE_PROBES = ("0", "Hello world")
# generation-config fields that change nothing sampled or scored (bookkeeping, outputs, caching)
_GENERATION_BOOKKEEPING = ("transformers_version", "_from_model_config", "use_cache", "output_attentions",
                           "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
                           "cache_implementation", "cache_config", "compile_config", "disable_compile")  # fmt: skip


def model_fingerprint(model, tokenizer) -> dict:
    """What a checkpoint records of the model it was written with, to refuse a resume on another: its class,
    its config (minus the fields that name a file or a library version), its tokenizer (a hash of the
    vocabulary, the added and special tokens, and its size), its generation config (generation_config.json:
    the eos ids that end a completion, and any field the sampler reads; bookkeeping fields aside) and the
    tokenizer's input template (the ids of TEMPLATE_PROBES with and without special tokens: a BOS / EOS the
    tokenizer adds around a prompt). The chat template is not recorded: the trainer encodes prompts as they
    are, without it."""
    config = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "architectures"):
        config.pop(key, None)
    tokens = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "class": type(tokenizer).__name__.removesuffix("Fast"),
    }
    digest = hashlib.sha256(json.dumps(tokens, sort_keys=True, default=str).encode()).hexdigest()
    generation = getattr(model, "generation_config", None)
    generation = {} if generation is None else generation.to_diff_dict()
    for key in _GENERATION_BOOKKEEPING:
        generation.pop(key, None)
    template = {}
    for text in TEMPLATE_PROBES:
        try:
            template[text] = [list(tokenizer(text)["input_ids"]), list(tokenizer(text, add_special_tokens=False)["input_ids"])]
        except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot encode the probe: recorded as such
            template[text] = f"{type(exc).__name__}"
    return {
        "class": type(model).__name__,
        "config": json.loads(json.dumps(config, sort_keys=True, default=str)),
        "tokenizer_sha256": digest,
        "tokenizer_size": len(tokenizer),
        "generation": json.loads(json.dumps(generation, sort_keys=True, default=str)),
        "input_template": template,
    }


def check_writable(run_dir: str | None, resume: bool) -> None:
    """The run folder can be written: a probe file is made and removed in it (resume: in it and in its
    checkpoints folder), or for a new run in the nearest folder that exists above it. NotWritable names
    the folder and the reason."""
    target = run_dir if run_dir is not None else "runs"
    if resume:
        folders = [(target, f"the run folder {target!r}")]
        checkpoints = os.path.join(target, "checkpoints")
        if os.path.isdir(checkpoints):
            folders.append((checkpoints, f"the run's checkpoints folder {checkpoints!r}"))
    else:
        existing = os.path.abspath(target)
        while not os.path.isdir(existing):
            if os.path.exists(existing):
                raise NotWritable(f"run folder {target!r} cannot be made: {existing!r} is a file, not a folder")
            existing = os.path.dirname(existing)
        label = (f"the run folder {target!r}" if existing == os.path.abspath(target)
                 else f"{existing!r}, where run folder {target!r} would be made,")  # fmt: skip
        folders = [(existing, label)]
    for folder, label in folders:
        try:
            handle, probe = tempfile.mkstemp(prefix=".grpo-kernels-write-probe-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as exc:
            raise NotWritable(f"{label} cannot be written: {exc.strerror or exc} (checked before loading the "
                              "model)") from None  # fmt: skip
