"""Group filters: which rows (completions) of a batch to train on, and why the others were dropped.

Every filter returns a ``FilterResult``: the kept row indices (ascending), one reason string per input row
("kept" or why it was dropped) and, for filters with a target size, how many groups are still missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._groups import (
    check_choice,
    check_float,
    check_group_index,
    check_mask,
    check_rewards,
    check_same_device,
    group_count,
    group_max,
    group_min,
    working_dtype,
)

KEPT = "kept"


@dataclass(frozen=True)
class FilterResult:
    """Which rows a filter kept, and why the others were dropped.

    kept: int64 [K] kept row indices, ascending. reasons: one string per input row, "kept" or the reason
    it was dropped. shortfall: groups still missing to reach the filter's target (0 without a target).
    """

    kept: torch.Tensor
    reasons: tuple[str, ...]
    shortfall: int = 0

    @property
    def kept_mask(self) -> torch.Tensor:
        """bool [B], True for kept rows."""
        mask = torch.zeros(len(self.reasons), dtype=torch.bool, device=self.kept.device)
        mask[self.kept] = True
        return mask


def _result(keep: torch.Tensor, drop_reason: list[str], shortfall: int = 0) -> FilterResult:
    """keep: bool [B]; drop_reason: per-row reason used where keep is False."""
    reasons = tuple(KEPT if k else why for k, why in zip(keep.tolist(), drop_reason))
    return FilterResult(keep.nonzero().flatten(), reasons, shortfall)


def _uniform_groups(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """bool [G]: every value of the group is equal (a group of one is uniform)."""
    return group_max(values, group_index, num_groups) == group_min(values, group_index, num_groups)


def dynamic_sampling(
    rewards: torch.Tensor, group_index: torch.Tensor, *, num_groups: int | None = None
) -> FilterResult:
    """DAPO dynamic sampling: drop groups whose rewards are all equal; keep the first ``num_groups`` others.

    Sample more groups than needed (an oversampled batch), call this, and train on ``kept``; when
    ``shortfall`` > 0, sample ``shortfall`` more groups and call again on the union (the refill).

    Rule:
        keep group g  iff  0 < #{distinct rewards in g} - 1, i.e. not all r_i equal (DAPO: 0 < |correct| < G),
        in group order until ``num_groups`` groups are kept.
    Reasons: "uniform_reward" (all rewards equal; a group of one counts as uniform), "surplus" (beyond
    ``num_groups``).

    Args:
        rewards: float [B].
        group_index: int64 [B], groups 0..G-1.
        num_groups: target number of groups; None keeps every non-uniform group.

    Paper: DAPO: An Open-Source LLM Reinforcement Learning System at Scale (arXiv:2503.14476), dynamic
        sampling.
    Peer: verl 0.9.1 ``algorithm.filter_groups`` (trainer/ppo/v1/replay_buffer.py drops groups with
        len > 1 and np.std == 0; it keeps groups of one, which get no gradient from a group baseline, so
        here they drop).
    """
    rewards = check_rewards(rewards)
    group_index, total_groups = check_group_index(group_index, rewards.shape[0])
    uniform = _uniform_groups(rewards, group_index, total_groups)
    informative_rank = torch.cumsum((~uniform).long(), 0)  # 1-based rank among informative groups
    if num_groups is None:
        surplus = torch.zeros_like(uniform)
        shortfall = 0
    else:
        if not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        surplus = ~uniform & (informative_rank > num_groups)
        shortfall = max(0, num_groups - int((~uniform).sum()))
    keep_group = ~uniform & ~surplus
    reasons = ["uniform_reward" if bool(uniform[g]) else "surplus" for g in group_index.tolist()]
    return _result(keep_group[group_index], reasons, shortfall)


def reinforce_rej(correct: torch.Tensor, group_index: torch.Tensor) -> FilterResult:
    """Reinforce-Rej: drop prompts whose completions are all correct or all incorrect.

    Reasons: "all_correct", "all_incorrect".

    Args:
        correct: bool/0-1 [B].
        group_index: int64 [B].

    Paper: A Minimalist Approach to LLM Reasoning: from Rejection Sampling to Reinforce (arXiv:2504.11343).
    Peer: — (the same rule as dynamic sampling on binary rewards, without a target size).
    """
    if not isinstance(correct, torch.Tensor) or correct.ndim != 1:
        raise ValueError(f"correct must be a bool [B] tensor, got {getattr(correct, 'shape', correct)}")
    correct = check_mask("correct", correct, tuple(correct.shape))
    group_index, num_groups = check_group_index(group_index, correct.shape[0])
    check_same_device(correct=correct, group_index=group_index)
    count = group_count(group_index, num_groups, torch.float32)
    solved = torch.zeros(num_groups, device=correct.device).index_add_(0, group_index, correct.float())
    all_correct = solved == count
    all_wrong = solved == 0
    reasons = ["all_correct" if bool(all_correct[g]) else "all_incorrect" for g in group_index.tolist()]
    return _result(~(all_correct | all_wrong)[group_index], reasons)


CPPO_SCOPES = ("group", "batch")


def cppo(
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    prune_fraction: float | None = None,
    min_abs_advantage: float | None = None,
    scope: str = "group",
) -> FilterResult:
    """CPPO completion pruning: train only on completions with large |advantage|.

    Rules (give exactly one):
        min_abs_advantage = gamma:  keep i iff |A_i| >= gamma.  Reason "low_abs_advantage".
        prune_fraction = P:         keep the k = floor(n (1 - P)) completions with the largest |A| (n = group
                                    size for scope="group", B for scope="batch"; ties keep the lower index).
                                    Reason "pruned_low_abs_advantage".

    Args:
        advantages: float [B] advantages (e.g. from ``estimate("grpo", ...)``).
        group_index: int64 [B].
        prune_fraction: P in [0, 1).
        min_abs_advantage: gamma >= 0.
        scope: "group" (the paper keeps k = floor(G (1 - P)) per question) or "batch" (the authors' verl
            recipe ranks the whole batch).

    Paper: CPPO: Accelerating the Training of Group Relative Policy Optimization-Based Reasoning Models
        (arXiv:2503.22342).
    Peer: — (authors' code lzhxmu/CPPO; not in TRL or verl).
    """
    advantages = check_float("advantages", advantages, ndim=1)
    group_index, num_groups = check_group_index(group_index, advantages.shape[0])
    check_same_device(advantages=advantages, group_index=group_index)
    check_choice("scope", scope, CPPO_SCOPES)
    if (prune_fraction is None) == (min_abs_advantage is None):
        raise ValueError("give exactly one of prune_fraction and min_abs_advantage")
    magnitude = advantages.abs()
    batch = advantages.shape[0]
    if min_abs_advantage is not None:
        if not min_abs_advantage >= 0:
            raise ValueError(f"min_abs_advantage must be >= 0, got {min_abs_advantage!r}")
        return _result(magnitude >= min_abs_advantage, ["low_abs_advantage"] * batch)
    if not 0 <= prune_fraction < 1:
        raise ValueError(f"prune_fraction must be in [0, 1), got {prune_fraction!r}")
    groups = group_index if scope == "group" else torch.zeros_like(group_index)
    keep = _top_k_per_group(
        magnitude, groups, 1 if scope == "batch" else num_groups, fraction_kept=1 - prune_fraction
    )
    return _result(keep, ["pruned_low_abs_advantage"] * batch)


def _top_k_per_group(
    score: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    *,
    fraction_kept: float | None = None,
    k: int | None = None,
) -> torch.Tensor:
    """bool [B]: the k highest-``score`` rows of each group (k = floor(n_g * fraction_kept) or a fixed k).

    Ties are broken by the lower row index (a stable sort).
    """
    batch = score.shape[0]
    # Order by (group, -score, row): stable sorts, least significant key first.
    order = torch.argsort(-score.to(torch.float64), stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    sorted_groups = groups[order]
    count = group_count(groups, num_groups, torch.float64)
    start = torch.cumsum(count, 0) - count  # [G] first sorted position of each group
    rank = torch.arange(batch, device=score.device) - start[sorted_groups].long()
    if k is None:
        limit = torch.floor(count * fraction_kept + 1e-9).long()
    else:
        limit = torch.full((num_groups,), k, dtype=torch.long, device=score.device)
    keep = torch.zeros(batch, dtype=torch.bool, device=score.device)
    keep[order] = rank < limit[sorted_groups]
    return keep


GFPO_METRICS = ("length", "reward_per_token")


def gfpo_filter(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    lengths: torch.Tensor,
    keep: int,
    metric: str = "length",
) -> FilterResult:
    """GFPO: keep k of each group's completions, the shortest or those with the most reward per token.

    Rules:
        metric="length":            keep the k shortest completions of each group (ties: lower index)
        metric="reward_per_token":  keep the k with the largest r_i / l_i
        groups with at most k rows keep them all.
    Reason for dropped rows: "filtered_by_length" or "filtered_by_reward_per_token".

    Args:
        rewards: float [B].
        group_index: int64 [B].
        lengths: [B] completion lengths (> 0 for reward_per_token).
        keep: k >= 1.
        metric: "length" or "reward_per_token".

    Paper: Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning
        (arXiv:2508.09726). The advantage over the retained set is ``estimate("gfpo", ...)``.
    Peer: — (not in TRL or verl).
    """
    rewards = check_rewards(rewards)
    group_index, num_groups = check_group_index(group_index, rewards.shape[0])
    check_choice("metric", metric, GFPO_METRICS)
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (rewards.shape[0],):
        raise ValueError(
            f"lengths must be a [{rewards.shape[0]}] tensor, got {getattr(lengths, 'shape', lengths)}"
        )
    check_same_device(rewards=rewards, lengths=lengths, group_index=group_index)
    lengths = check_float("lengths", lengths.to(working_dtype(rewards.dtype)))
    if metric == "length":
        score = -lengths
    else:
        if bool((lengths <= 0).any()):
            i = int((lengths <= 0).nonzero()[0])
            raise ValueError(
                f"lengths must be > 0 for metric='reward_per_token'; lengths[{i}] = {float(lengths[i])}"
            )
        score = rewards.to(lengths.dtype) / lengths
    kept = _top_k_per_group(score, group_index, num_groups, k=keep)
    return _result(kept, [f"filtered_by_{metric}"] * rewards.shape[0])


def two_rollout_contrastive(rewards: torch.Tensor, group_index: torch.Tensor) -> FilterResult:
    """2-GRPO contrastive pairs: every group has exactly two rollouts; keep the pairs whose rewards differ.

    With G = 2 the group-normalized advantages of a pair with r_1 != r_2 are +-1/sqrt(2) (Bessel std, epsilon
    aside) whatever the reward gap, a DPO-like contrast; a tied pair carries no signal. Reason: "tied_pair".
    A group whose size is not 2 raises ``ValueError``.

    Args:
        rewards: float [B].
        group_index: int64 [B].

    Paper: It Takes Two: Your GRPO Is Secretly DPO (arXiv:2510.00977).
    Peer: — (not in TRL or verl).
    """
    rewards = check_rewards(rewards)
    group_index, num_groups = check_group_index(group_index, rewards.shape[0])
    count = group_count(group_index, num_groups, torch.float32)
    if bool((count != 2).any()):
        g = int((count != 2).nonzero()[0])
        raise ValueError(
            f"group_index: group {g} has {int(count[g])} rollouts; the 2-GRPO setting needs exactly 2"
        )
    uniform = _uniform_groups(rewards, group_index, num_groups)
    return _result(~uniform[group_index], ["tied_pair"] * rewards.shape[0])


def overlong_filter(
    lengths: torch.Tensor, *, max_length: int, truncated: torch.Tensor | None = None
) -> FilterResult:
    """DAPO overlong filtering: drop (mask the loss of) truncated completions.

    Rule: drop row i iff it was truncated: ``truncated[i]`` when given (e.g. no EOS), else l_i >= max_length
    (a completion that reached the length limit). Reason: "truncated".

    Args:
        lengths: [B] completion lengths in tokens.
        max_length: the generation limit.
        truncated: optional bool [B] overriding the length test.

    Paper: DAPO: An Open-Source LLM Reinforcement Learning System at Scale (arXiv:2503.14476), overlong
        filtering.
    Peer: TRL 1.16 ``mask_truncated_completions`` (truncated = no EOS among the completion tokens).
    """
    if not isinstance(lengths, torch.Tensor) or lengths.ndim != 1:
        raise ValueError(f"lengths must be a [B] tensor, got {getattr(lengths, 'shape', lengths)}")
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if truncated is None:
        is_truncated = lengths >= max_length
    else:
        is_truncated = check_mask("truncated", truncated, tuple(lengths.shape))
    return _result(~is_truncated, ["truncated"] * lengths.shape[0])


__all__ = [
    "FilterResult",
    "cppo",
    "dynamic_sampling",
    "gfpo_filter",
    "overlong_filter",
    "reinforce_rej",
    "two_rollout_contrastive",
]
