"""Prompts with verifiable answers, and the reward functions that score completions against them.

A reward function is any callable

    reward_fn(prompts: list[str], completions: list[str], answers: list[str]) -> Sequence[float]

called with keyword arguments, one float per completion (the completion text is cut at the first EOS).
Pass a name from REWARDS or "package.module:function" as TrainConfig.reward.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .multiturn import LOOKUP_ENVIRONMENT, Environment, make_lookup


def token_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Position-wise share of correct whitespace-separated tokens, over the longer of answer and completion:
    1 only for the exact answer (the empty answer included: an empty completion scores 1), partial credit
    for each right token in its place, extra tokens cost."""
    rewards = []
    for completion, answer in zip(completions, answers):
        got, want = completion.split(), answer.split()
        if not got and not want:  # the exact empty answer: 0 / max(0, 0) is a match, not a miss
            rewards.append(1.0)
            continue
        matches = sum(g == w for g, w in zip(got, want))
        rewards.append(matches / max(len(got), len(want)))
    return rewards


def exact_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 if the completion equals the answer (surrounding whitespace ignored), else 0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def length_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 if the completion has as many words as the answer, else 0: a format reward (a second objective for
    the multi-reward methods)."""
    return [float(len(c.split()) == len(a.split())) for c, a in zip(completions, answers)]


REWARDS: dict[str, Callable] = {
    "token_match": token_match,
    "exact_match": exact_match,
    "length_match": length_match,
}


def resolve_reward(spec: str) -> Callable:
    """A reward function from its REWARDS name or "module:function"."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}; use one of {sorted(REWARDS)} or 'package.module:function'"
        )
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attribute!r}")
    return fn


@dataclass(frozen=True)
class Example:
    """One line of a .jsonl task: its prompt and answer, and where it came from (``file:line``)."""

    prompt: str
    answer: str
    where: str  # "path:line", for the messages of the checks before a run


@dataclass(frozen=True)
class Task:
    """A verifiable task: draws prompts with known answers.

    ``make(generator) -> (prompt, answer)`` draws one pair; ``reward`` names the default reward function;
    ``max_new_tokens`` is the generation budget (per turn for multi-turn tasks); ``num_prompts`` the
    distinct prompts it can draw; ``environment`` makes it multi-turn (trainer/multiturn.py); ``words``
    lets the trainer refuse words the embedded model's vocabulary lacks; ``examples`` (a .jsonl task)
    lets it check every prompt and answer against the model's tokenizer and context before the run."""

    name: str  # shown in logs and the plot title
    make: Callable[[torch.Generator], tuple[str, str]]
    reward: str  # default reward function name
    max_new_tokens: int  # default generation budget (answer + EOS, with no slack)
    num_prompts: int  # distinct prompts the task can draw
    description: str  # one line for the run log
    environment: Environment | None = None  # multi-turn tasks: the replies and turn rewards (multiturn.py)
    words: frozenset[str] | None = None  # every word of its prompts and answers, when known in advance
    examples: tuple[Example, ...] | None = None  # every (prompt, answer) with its file:line (.jsonl tasks)

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None

    def sample(self, generator: torch.Generator, n: int, exclude: set[str]) -> tuple[list[str], list[str]]:
        """Up to n prompts, distinct and not in `exclude` (a prompt is one group per step: DCPO's running
        statistics are keyed by prompt), with their answers. Fewer only when the task runs out."""
        pairs: dict[str, str] = {}
        for _ in range(100 * n):
            if len(pairs) == n or len(pairs) + len(exclude) >= self.num_prompts:
                break
            prompt, answer = self.make(generator)
            if prompt not in exclude:
                pairs.setdefault(prompt, answer)
        return list(pairs), list(pairs.values())


def _digits(generator: torch.Generator, n: int) -> list[str]:
    return [str(d) for d in torch.randint(0, 10, (n,), generator=generator).tolist()]


def _copy(generator):
    digits = _digits(generator, 3)
    return " ".join(digits) + " =", " ".join(digits)


def _reverse(generator):
    digits = _digits(generator, 3)
    return " ".join(digits) + " =", " ".join(reversed(digits))


def _max(generator):
    digits = _digits(generator, 4)
    return " ".join(digits) + " =", max(digits)


TASKS: dict[str, Task] = {
    "copy": Task("copy", _copy, "token_match", 4, 1000, "repeat three digits: '3 1 4 =' -> '3 1 4' <eos>"),
    "reverse": Task(
        "reverse", _reverse, "token_match", 4, 1000, "reverse three digits: '3 1 4 =' -> '4 1 3' <eos>"
    ),
    "max": Task(
        "max", _max, "token_match", 2, 10_000, "the largest of four digits: '3 1 4 1 =' -> '4' <eos>"
    ),
    "lookup": Task(
        "lookup",
        make_lookup,
        "exact_match",
        3,
        100,
        "two turns with a tool: '3 1 =' -> call '3 1' <eos>, the tool replies '+ 7 =', answer '7' <eos>",
        environment=LOOKUP_ENVIRONMENT,
    ),
}


def _json_type(value) -> str:
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)  # fmt: skip


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: an object that gives a key twice is refused (json.loads keeps the last value,
    silently: a line would be read one way here and another way by a tool that keeps the first)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _lone_surrogate(value, path: str = "") -> tuple[str, int, str] | None:
    """(where in the line, character index, the surrogate) of the first lone surrogate in a parsed JSON value
    ("\\ud83d" alone is valid JSON but no Unicode character: no tokenizer can encode it), or None."""
    if isinstance(value, str):
        for index, char in enumerate(value):
            if "\ud800" <= char <= "\udfff":
                return path, index, char
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(value, dict) and isinstance(key, str):
            found = _lone_surrogate(key, path)  # a key itself
            if found:
                return found
        found = _lone_surrogate(item, f"{path}.{key}" if path else f"{key}")
        if found:
            return found
    return None


def read_jsonl_examples(path: str) -> tuple[list[Example], list[str]]:
    """Every example of a .jsonl task file, typed: (examples, the other keys its lines hold, sorted).

    Each non-blank line must be a JSON object whose "prompt" is a non-empty string and whose "answer" is a
    string (possibly empty); anything else (a null answer, a list prompt, a number, bytes that are not
    UTF-8, a line that is not JSON, a key given twice, a lone surrogate escape such as "\\ud83d" that is no
    Unicode character) is refused with the file and line, never converted with str() or read one way of two."""
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    examples, other_keys = [], set()
    for line_number, raw in enumerate(raw_lines, 1):
        where = f"{path}:{line_number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); a task file is "
                "UTF-8 JSON lines"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except _DuplicateKey as exc:
            raise ValueError(f'{where}: the key "{exc}" is given twice in one object; give each key once (JSON '
                             "readers differ on which value they keep)") from None  # fmt: skip
        except json.JSONDecodeError as exc:
            raise ValueError(f'{where}: not a JSON line ({exc}); expected {{"prompt": "...", "answer": "..."}}') from None
        surrogate = _lone_surrogate(row)
        if surrogate is not None:
            field, index, char = surrogate
            raise ValueError(
                f'{where}: {f"the {field!r} value" if field else "the line"} holds a lone surrogate '
                f"\\u{ord(char):04x} at character {index + 1}: half of a UTF-16 pair, not a Unicode character; "
                "write the character itself (UTF-8) or both halves of its escape"
            )
        if not isinstance(row, dict):
            raise ValueError(f'{where}: {_json_type(row)}, not a JSON object {{"prompt": "...", "answer": "..."}}')
        for key in ("prompt", "answer"):
            if key not in row:
                raise ValueError(f'{where}: no "{key}" key (keys: {sorted(row)})')
            if not isinstance(row[key], str):
                raise ValueError(
                    f'{where}: "{key}" is {_json_type(row[key])} ({json.dumps(row[key])[:60]}), not a string; '
                    f"write it as a JSON string"
                )
        if not row["prompt"].strip():
            raise ValueError(f'{where}: "prompt" is empty')
        other_keys.update(k for k in row if k not in ("prompt", "answer"))
        examples.append(Example(row["prompt"], row["answer"], where))
    return examples, sorted(other_keys)


def jsonl_task(path: str) -> Task:
    """A task from a .jsonl file of {"prompt": str, "answer": str} lines, drawn uniformly with replacement
    (read_jsonl_examples says what a line must hold)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file {path!r} does not exist")
    try:
        examples, other_keys = read_jsonl_examples(path)
    except PermissionError as exc:
        raise ValueError(f"task file {path!r} cannot be read: {exc.strerror}") from None
    if not examples:
        raise ValueError(f"task file {path!r} holds no examples")
    pairs = [(e.prompt, e.answer) for e in examples]

    def make(generator):
        return pairs[int(torch.randint(len(pairs), (1,), generator=generator))]

    num_prompts = len({prompt for prompt, _ in pairs})
    description = f"{len(examples)} examples ({num_prompts} distinct prompts) from {path}"
    if other_keys:  # said once at startup: nothing a line holds is dropped without a word
        description += f"; keys other than prompt and answer are not used: {', '.join(other_keys)}"
    words = frozenset(w for pair in pairs for text in pair for w in text.split())
    return Task(os.path.basename(path), make, "exact_match", 32, num_prompts, description, words=words,
                examples=tuple(examples))  # fmt: skip


def resolve_task(spec: str) -> Task:
    """A built-in task, a .jsonl file, or "package.module:name" (a Task, or a function returning one:
    how your own environment plugs in, see multiturn.py)."""
    if spec in TASKS:
        return TASKS[spec]
    if spec.endswith(".jsonl"):
        return jsonl_task(spec)
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"task {spec!r}: cannot load {attribute!r} from {module_name!r} ({exc})") from None
        task = found() if callable(found) and not isinstance(found, Task) else found
        if not isinstance(task, Task):
            raise ValueError(f"task {spec!r} is a {type(task).__name__}, not a grpo_kernels Task")
        return task
    raise ValueError(
        f"unknown task {spec!r}; use one of {sorted(TASKS)}, a .jsonl file of prompt/answer lines, "
        "or package.module:make_task"
    )


def check_rewards(values: Sequence[float] | torch.Tensor, expected: int, name: str) -> torch.Tensor:
    """The reward function's output as fp32 [B]; a clear error for a wrong length or a non-finite value."""
    try:
        rewards = torch.as_tensor(
            values if isinstance(values, torch.Tensor) else list(values), dtype=torch.float32
        )
    except (TypeError, ValueError) as exc:
        message = f"reward function {name} must return {expected} floats, got {type(values).__name__} ({exc})"
        raise ValueError(message) from None
    if rewards.shape != (expected,):
        raise ValueError(
            f"reward function {name} returned shape {tuple(rewards.shape)} for {expected} completions"
        )
    return rewards
