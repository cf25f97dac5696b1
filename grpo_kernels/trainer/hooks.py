"""Rollout hooks: methods that act on the samples between scoring and the update.

A hook may rewrite or drop rows after scoring (`after_scoring`), ask for more samples per prompt
(`sample_multiplier`), or split the update into stages with different loss settings (`update_stages`).

    edge_gec  EDGE-GRPO guided error correction: wrong completions are corrected (reflection, hint, replace)
    gfpo      GFPO: sample `oversample` x group_size completions, keep the group_size best by a metric
    lopti     Lopti: one update on low-probability tokens, then one on the others
    two_rollouts  2-GRPO: groups of two, pairs with equal rewards dropped before the update
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..advantages import gfpo_filter, two_rollout_contrastive
from ..config import PolicyLossConfig
from .rollout import Rollouts


@dataclass
class HookContext:
    """What a hook may use besides the rollouts: the sampler, the scorer, the tokenizer's encode / decode,
    the EOS id, the generation budget, the group size, the correctness threshold and the hook's own
    random generator (saved in checkpoints, so a resumed run draws the same)."""

    generate: Callable  # (prompt token lists, max_new_tokens) -> (completion tokens, truncated, logprobs)
    score: Callable[[Rollouts], Rollouts]  # fills .rewards for every row
    encode: Callable[[str], list[int]]  # text -> token ids (no special tokens)
    decode: Callable[[list[int]], str]  # completion tokens -> the text the reward sees (cut at EOS)
    eos_id: int  # the token that ends a completion
    max_new_tokens: int  # the generation budget (per turn)
    group_size: int  # completions per prompt the update expects
    correct_reward: float  # a completion is correct when its reward >= this
    generator: torch.Generator  # the hook's randomness (saved in checkpoints)


class RolloutHook:
    """A rollout hook: the no-op base; subclass and override what the method needs.

    ``sample_multiplier`` asks for more completions per prompt; ``after_scoring`` may drop, add or rewrite
    scored rows (rescoring rewritten ones with ``ctx.score``); ``update_stages`` splits one batch's update
    into several with different loss settings. Register a subclass in ``HOOKS`` to name it in the CLI."""

    sample_multiplier: int = 1  # completions sampled per prompt = group_size * sample_multiplier

    def after_scoring(self, rollouts: Rollouts, ctx: HookContext) -> tuple[Rollouts, dict[str, float]]:
        """The rollouts to train on (scored), and metrics to log."""
        return rollouts, {}

    def update_stages(self, loss_config: PolicyLossConfig) -> list[PolicyLossConfig]:
        """The loss settings of each optimizer update on one batch (repeated num_iterations times)."""
        return [loss_config]


class EdgeGuidedErrorCorrection(RolloutHook):
    """EDGE-GRPO guided error correction (arXiv:2507.21848 §3.3; authors' code ZhangXJ199/EDGE-GRPO).

    Each wrong completion (reward < correct_reward) is corrected with probability `p_correct`, by one of
    three branches drawn with the weights `split` (the paper: 50% / 25% / 25%):
      * reflect: the completion without its EOS, then `reflection` (the paper: " Wait! Something is wrong
        here."), then the policy continues sampling;
      * hint: rewritten to `hint.format(completion=..., answer=...)` + EOS, the reflection followed by the
        correct answer (the paper: "{completion} Wait! Something is wrong here. After verification, the
        correct answer is \\boxed{{{answer}}}.");
      * replace: rewritten to `guidance.format(answer=..., completion=...)` + EOS, the reference solution.
    A branch whose text is None is not drawn; the others share its weight in proportion. With the defaults
    (no reflection, no hint) every correction replaces. The corrected rows are scored again. They were not
    sampled from the policy as a whole, which is the method's point (advantage diversity in all-wrong
    groups); the loss treats them as on-policy samples.
    """

    BRANCHES = ("reflect", "hint", "replace")

    def __init__(
        self,
        p_correct: float = 0.5,
        guidance: str = "{answer}",
        reflection: str | None = None,
        hint: str | None = None,
        split: list | tuple = (0.5, 0.25, 0.25),
    ):
        if not 0 < p_correct <= 1:
            raise ValueError(f"edge_gec: p_correct must be in (0, 1], got {p_correct!r}")
        for name, template in (("guidance", guidance), ("hint", hint)):
            try:
                None if template is None else template.format(answer="", completion="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"edge_gec: {name} may use only {{answer}} and {{completion}} ({exc!r})"
                ) from None
        if (
            not isinstance(split, (list, tuple))
            or len(split) != 3
            or not all(isinstance(w, (int, float)) and w >= 0 for w in split)
        ):
            raise ValueError(f"edge_gec: split must be 3 weights >= 0 (reflect, hint, replace), got {split!r}")
        available = (reflection is not None, hint is not None, True)
        weights = [float(w) if ok else 0.0 for w, ok in zip(split, available)]
        if sum(weights) == 0:
            raise ValueError(f"edge_gec: split {split} gives no weight to an available branch")
        self.p_correct, self.guidance, self.reflection, self.hint = p_correct, guidance, reflection, hint
        self.weights = [w / sum(weights) for w in weights]  # normalised over the available branches

    def choose_branches(self, count: int, generator: torch.Generator) -> list[str]:
        """One branch per corrected row, drawn with self.weights."""
        if count == 0:
            return []
        draws = torch.multinomial(torch.tensor(self.weights), count, replacement=True, generator=generator)
        return [self.BRANCHES[i] for i in draws.tolist()]

    def after_scoring(self, rollouts, ctx):
        wrong = [i for i, r in enumerate(rollouts.rewards.tolist()) if r < ctx.correct_reward]
        draws = torch.rand(len(wrong), generator=ctx.generator).tolist()
        corrected = [i for i, u in zip(wrong, draws) if u < self.p_correct]
        stats = {f"edge_gec/{b}_fraction": 0.0 for b in self.BRANCHES}
        if not corrected:
            return rollouts, {"edge_gec/corrected_fraction": 0.0, **stats}
        branch = dict(zip(corrected, self.choose_branches(len(corrected), ctx.generator)))
        reflect = [i for i in corrected if branch[i] == "reflect"]

        new_tokens, truncated = {}, {}
        for i in corrected:
            if branch[i] == "reflect":
                continue
            template = self.hint if branch[i] == "hint" else self.guidance
            text = template.format(answer=rollouts.answers[i], completion=rollouts.completions[i])
            new_tokens[i], truncated[i] = ctx.encode(text) + [ctx.eos_id], False
        if reflect:
            heads = [
                _without_eos(rollouts.completion_tokens[i], rollouts.truncated[i])
                + ctx.encode(self.reflection)
                for i in reflect
            ]
            tails, cut, _ = ctx.generate(
                [rollouts.prompt_tokens[i] + h for i, h in zip(reflect, heads)], ctx.max_new_tokens
            )
            for i, head, tail, flag in zip(reflect, heads, tails, cut):
                new_tokens[i], truncated[i] = head + tail, flag
        rows = sorted(new_tokens)
        rollouts = rollouts.with_completions(
            rows,
            [new_tokens[i] for i in rows],
            [ctx.decode(new_tokens[i]) for i in rows],
            [truncated[i] for i in rows],
        )
        for b in self.BRANCHES:
            stats[f"edge_gec/{b}_fraction"] = sum(branch[i] == b for i in rows) / len(rollouts)
        return ctx.score(rollouts), {"edge_gec/corrected_fraction": len(rows) / len(rollouts), **stats}


def _without_eos(tokens: list[int], truncated: bool) -> list[int]:
    return tokens if truncated else tokens[:-1]


class GFPOFilter(RolloutHook):
    """GFPO (arXiv:2508.09726): sample `oversample` x group_size completions per prompt and keep the
    group_size with the best `metric` ("length": shortest; "reward_per_token": highest reward / length).
    Advantages are then computed over the kept rows only (= gk.advantages.estimate("gfpo") on them)."""

    def __init__(self, oversample: int = 2, metric: str = "length"):
        if not isinstance(oversample, int) or oversample < 2:
            raise ValueError(f"gfpo: oversample must be an int >= 2, got {oversample!r}")
        if metric not in ("length", "reward_per_token"):
            raise ValueError(f"gfpo: metric must be 'length' or 'reward_per_token', got {metric!r}")
        self.sample_multiplier, self.metric = oversample, metric

    def after_scoring(self, rollouts, ctx):
        lengths = torch.tensor([len(t) for t in rollouts.completion_tokens], dtype=torch.float32)
        kept = gfpo_filter(
            rollouts.rewards, rollouts.group_index, lengths=lengths, keep=ctx.group_size, metric=self.metric
        ).kept
        return rollouts.select(kept.tolist()), {"gfpo/kept_fraction": len(kept) / len(rollouts)}


class LoptiStages(RolloutHook):
    """Lopti (arXiv:2505.12929): split the tokens by old-policy probability at `threshold`; update on the
    low-probability tokens first, then on the high-probability ones (PolicyLossConfig.old_prob_threshold /
    old_prob_side). The second update is off-policy: its old log-probs are those before the first."""

    def __init__(self, threshold: float = 0.5):
        if not 0 < threshold < 1:
            raise ValueError(f"lopti: threshold must be in (0, 1), got {threshold!r}")
        self.threshold = threshold

    def update_stages(self, loss_config):
        if loss_config.old_prob_threshold is not None:
            raise ValueError("lopti sets old_prob_threshold itself; drop it from loss_options")
        return [
            loss_config.replace(old_prob_threshold=self.threshold, old_prob_side=side)
            for side in ("low", "high")
        ]


class TwoRolloutPairs(RolloutHook):
    """2-GRPO (arXiv:2510.00977): groups of two rollouts; a pair with equal rewards carries no signal (its
    advantages are 0) and is dropped before the update, which saves its forward and backward."""

    def after_scoring(self, rollouts, ctx):
        kept = two_rollout_contrastive(rollouts.rewards, rollouts.group_index).kept
        return rollouts.select(kept.tolist()), {"two_rollouts/kept_fraction": len(kept) / len(rollouts)}


HOOKS: dict[str, type[RolloutHook]] = {
    "edge_gec": EdgeGuidedErrorCorrection,
    "gfpo": GFPOFilter,
    "lopti": LoptiStages,
    "two_rollouts": TwoRolloutPairs,
}


def make_hook(name: str | None, options: dict) -> RolloutHook:
    if name is None:
        return RolloutHook()
    cls = HOOKS[name]
    known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"hook {name!r} has no option(s) {unknown}; its options: {known}")
    return cls(**options)
