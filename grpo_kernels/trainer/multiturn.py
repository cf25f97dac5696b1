"""Multi-turn episodes: the policy speaks several turns, the environment answers between them.

An episode's completion is the policy's turns and the environment's replies in order, one token list:

    prompt | turn 0 (policy, up to its EOS) | reply 0 (environment) | turn 1 (policy) | ... | last turn

The replies are attended to (they are the context of the next turn) but are not the policy's tokens: the
loss masks them out (turn id -1). The reward function scores the last turn's text; the environment gives
each turn its own reward, which turn- and step-level estimators use (MT-GRPO ``turn_rewards``, GiGPO
``step_rewards`` with the state each turn started from as its anchor).

Your own environment plugs in as a Task with an ``environment``: pass ``--task package.module:make_task``
where ``make_task()`` returns ``Task(..., environment=Environment(turns, respond, turn_rewards))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    """What happens between the policy's turns, and what each turn earns.

    respond(prompt, turns) -> str: the environment's reply after the policy's turns so far (texts, each cut
        at its EOS); it is appended to the context, tokenized without special tokens.
    turn_rewards(prompt, answer, turns) -> K floats: the reward of each of the K policy turns.
    """

    turns: int  # K >= 2 policy turns per episode
    respond: Callable[[str, list[str]], str]
    turn_rewards: Callable[[str, str, list[str]], list[float]]

    def __post_init__(self) -> None:
        if not isinstance(self.turns, int) or self.turns < 2:
            raise ValueError(f"Environment.turns must be an int >= 2, got {self.turns!r}")


@dataclass
class Episodes:
    """B sampled episodes (the multi-turn counterpart of one generate call)."""

    completion_tokens: list[list[int]]  # [B] policy turns and environment replies, in order
    turn_ids: list[list[int]]  # [B] per token: the turn 0..K-1, -1 for environment replies
    final_texts: list[str]  # [B] the last turn's text (what the reward function scores)
    turn_texts: list[list[str]]  # [B][K]
    truncated: list[bool]  # [B] the last turn ended without EOS
    state_keys: list[list[str]]  # [B][K] the context (token ids) each turn started from, as a string


def generate_episodes(
    generate: Callable,
    environment: Environment,
    prompts: list[str],
    prompt_tokens: list[list[int]],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
) -> Episodes:
    """Sample one episode per prompt row: K calls of `generate` (all rows at once), replies in between.
    `max_new_tokens` is the budget of each turn."""
    rows = len(prompts)
    completion = [[] for _ in range(rows)]
    turn_ids = [[] for _ in range(rows)]
    texts = [[] for _ in range(rows)]
    states = [[] for _ in range(rows)]
    truncated = [False] * rows
    for turn in range(environment.turns):
        contexts = [prompt_tokens[i] + completion[i] for i in range(rows)]
        for i in range(rows):
            states[i].append(" ".join(map(str, contexts[i])))
        tokens, cut, _ = generate(contexts, max_new_tokens)
        for i in range(rows):
            completion[i] += tokens[i]
            turn_ids[i] += [turn] * len(tokens[i])
            texts[i].append(decode(tokens[i]))
            truncated[i] = cut[i]
        if turn < environment.turns - 1:
            for i in range(rows):
                reply = encode(environment.respond(prompts[i], list(texts[i])))
                completion[i] += reply
                turn_ids[i] += [-1] * len(reply)
    return Episodes(completion, turn_ids, [t[-1] for t in texts], texts, truncated, states)


# ---- the built-in two-turn task: look a value up, then answer with it -----------------------------------


def lookup_value(a: int, b: int) -> int:
    """The hidden table the tool knows and the policy does not: (3a + 7b + 1) mod 10."""
    return (3 * a + 7 * b + 1) % 10


def _key(prompt: str) -> list[str]:
    return prompt.split()[:2]  # "3 1 =" -> ["3", "1"]


def lookup_respond(prompt: str, turns: list[str]) -> str:
    """After turn 0 (the call): '+ v =' with v the table's value for the called key, '+ =' when the call is
    not two digits (a failed lookup)."""
    call = turns[0].split()
    if len(call) == 2 and all(len(w) == 1 and w.isdigit() for w in call):
        return f"+ {lookup_value(int(call[0]), int(call[1]))} ="
    return "+ ="


def lookup_turn_rewards(prompt: str, answer: str, turns: list[str]) -> list[float]:
    """Turn 0: the share of the call's words right in place (1 only for exactly the prompt's key, partial
    credit per right digit, extra words cost: a dense signal, as the copy task's); turn 1: 1 when it
    answered the right value."""
    call, key = turns[0].split(), _key(prompt)
    call_share = sum(c == k for c, k in zip(call, key)) / max(len(call), len(key))
    return [call_share, float(turns[1].strip() == answer.strip())]


def make_lookup(generator) -> tuple[str, str]:
    import torch

    a, b = torch.randint(0, 10, (2,), generator=generator).tolist()
    return f"{a} {b} =", str(lookup_value(a, b))


LOOKUP_ENVIRONMENT = Environment(2, lookup_respond, lookup_turn_rewards)
