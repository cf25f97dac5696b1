"""Estimators that keep state across training steps (DCPO smooth advantage standardization)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ._groups import check_group_index, check_rewards, group_count, group_mean, group_std, working_dtype
from .registry import register


@dataclass
class _PromptStats:
    """Running statistics of every reward seen for one prompt (Chan et al. parallel update)."""

    times: int = 0  # steps in which the prompt was sampled
    count: int = 0  # rewards seen
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean

    def merged(self, count: int, mean: float, m2: float) -> _PromptStats:
        total = self.count + count
        delta = mean - self.mean
        new_mean = self.mean + delta * count / total
        new_m2 = self.m2 + m2 + delta * delta * self.count * count / total
        return _PromptStats(self.times + 1, total, new_mean, new_m2)

    @property
    def std(self) -> float:
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 0.0


class SmoothAdvantageStandardizer:
    """DCPO smooth advantage standardization; keep one instance across training steps.

    For a prompt sampled for the i-th time (i counts this step), with the current group's rewards:
        SA_new   = (r - mu_new) / sigma_new          (this step's group; 0 if sigma_new = 0)
        SA_total = (r - mu_total) / sigma_total      (every reward of this prompt so far, this step included;
                                                      0 if sigma_total = 0)
        SA^_new   = (i - 1)/i * SA_new + 1/i * SA_total
        SA^_total = 1/i * SA_new + (i - 1)/i * SA_total
        A = SA^_new if |SA^_new| < |SA^_total| else SA^_total
    On a prompt's first step both equal SA_new (plain GRPO without epsilon). Stds are Bessel-corrected.

    The authors' code (lime-RL/DCPO ``get_mean_std``) merges a step into the running std with a formula that
    mixes per-step unbiased stds; here the running statistics are exact over all rewards seen (equal when
    every step has the same group size and the population variance is used).

    Paper: DCPO: Dynamic Clipping Policy Optimization (arXiv:2509.02333), smooth advantage standardization.

    Example::

        standardizer = SmoothAdvantageStandardizer()
        for step in range(num_steps):
            adv = estimate("dcpo", rewards, group_index, state=standardizer, prompt_keys=uids)
    """

    def __init__(self) -> None:
        self._stats: dict[Hashable, _PromptStats] = {}

    def __len__(self) -> int:
        return len(self._stats)

    def times_seen(self, prompt_key: Hashable) -> int:
        stats = self._stats.get(prompt_key)
        return 0 if stats is None else stats.times

    def state_dict(self) -> dict:
        return {key: (s.times, s.count, s.mean, s.m2) for key, s in self._stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self._stats = {key: _PromptStats(*values) for key, values in state.items()}

    def __call__(
        self, rewards: torch.Tensor, group_index: torch.Tensor, prompt_keys: Sequence[Hashable]
    ) -> torch.Tensor:
        """Advantages [B] for this step's groups; updates the per-prompt statistics.

        Args:
            rewards: float [B].
            group_index: int64 [B], groups 0..G-1 of this step.
            prompt_keys: G hashable keys (one per group, e.g. the dataset index of the prompt) identifying the
                prompt across steps; a tensor [G] is accepted. Keys must be distinct within a step.
        """
        rewards = check_rewards(rewards)
        group_index, num_groups = check_group_index(group_index, rewards.shape[0])
        if isinstance(prompt_keys, torch.Tensor):
            prompt_keys = prompt_keys.tolist()
        if isinstance(prompt_keys, (str, bytes)) or len(prompt_keys) != num_groups:
            raise ValueError(f"prompt_keys must hold one key per group ({num_groups}), got {prompt_keys!r}")
        if len(set(prompt_keys)) != num_groups:
            raise ValueError(f"prompt_keys must be distinct within a step, got {list(prompt_keys)}")
        r = rewards.to(torch.float64)
        count = group_count(group_index, num_groups, r.dtype)
        mean_new = group_mean(r, group_index, num_groups)
        std_new = group_std(r, group_index, num_groups)
        m2_new = std_new**2 * (count - 1)

        times = torch.empty(num_groups, dtype=r.dtype)
        mean_total = torch.empty(num_groups, dtype=r.dtype)
        std_total = torch.empty(num_groups, dtype=r.dtype)
        updated = {}
        for g, key in enumerate(prompt_keys):
            stats = self._stats.get(key, _PromptStats()).merged(
                int(count[g]), float(mean_new[g]), float(m2_new[g])
            )
            updated[key] = stats
            times[g], mean_total[g], std_total[g] = stats.times, stats.mean, stats.std
        times, mean_total, std_total = (t.to(r.device) for t in (times, mean_total, std_total))

        sa_new = _standardize(r, mean_new[group_index], std_new[group_index])
        sa_total = _standardize(r, mean_total[group_index], std_total[group_index])
        i = times[group_index]
        smooth_new = (i - 1) / i * sa_new + 1 / i * sa_total
        smooth_total = 1 / i * sa_new + (i - 1) / i * sa_total
        advantages = torch.where(smooth_new.abs() < smooth_total.abs(), smooth_new, smooth_total)
        self._stats.update(updated)
        return advantages.to(working_dtype(rewards.dtype))


def _standardize(r: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(std > 0, (r - mean) / safe, torch.zeros_like(r))


@register(
    "dcpo",
    paper="DCPO: Dynamic Clipping Policy Optimization (arXiv:2509.02333)",
)
def dcpo(
    rewards, group_index, *, num_groups, state: SmoothAdvantageStandardizer, prompt_keys: Sequence[Hashable]
):
    """DCPO smooth advantage standardization: blend this step's and the cumulative per-prompt z-scores.

    Formula (i = times the prompt has been sampled, this step included):
        SA_new = (r - mu_new) / sigma_new,   SA_total = (r - mu_total) / sigma_total
        SA^_new = (i-1)/i SA_new + 1/i SA_total,   SA^_total = 1/i SA_new + (i-1)/i SA_total
        A = SA^_new if |SA^_new| < |SA^_total| else SA^_total
    (a zero std makes its z-score 0). Stateful: see ``SmoothAdvantageStandardizer``.

    Options:
        state: a ``SmoothAdvantageStandardizer`` kept by the caller across steps (updated in place).
        prompt_keys: G hashable keys, one per group, identifying each prompt across steps.

    Paper: DCPO: Dynamic Clipping Policy Optimization (arXiv:2509.02333), §3.2 smooth advantage
        standardization (the dynamic clipping is loss-side).
    Peer: — (not in TRL or verl; the authors' verl fork is lime-RL/DCPO).
    """
    if not isinstance(state, SmoothAdvantageStandardizer):
        raise ValueError(f"state must be a SmoothAdvantageStandardizer, got {type(state).__name__}")
    return state(rewards, group_index, prompt_keys)
