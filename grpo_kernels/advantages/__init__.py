"""Advantage estimators, reward shaping and group filters for GRPO-family RL (pure PyTorch, O(batch)).

    import grpo_kernels as gk
    adv = gk.advantages.estimate("grpo", rewards, group_index)              # [B]
    adv = gk.advantages.estimate("gtpo", rewards, group_index, entropy=H, mask=m)   # [B, T]
    gk.advantages.available()                                                # name -> EstimatorSpec

``rewards`` float [B] ([B, K] for multi-reward, [B, S] for step rewards), ``group_index`` int64 [B] covering
0..G-1. Register your own with ``@register("name", output="[B]")``. The README table comes from
``registry_table_markdown()`` (``python -m grpo_kernels.advantages --markdown``).
"""

from . import filters, outcome, per_token, shaping, stateful
from .filters import (
    FilterResult,
    cppo,
    dynamic_sampling,
    gfpo_filter,
    overlong_filter,
    reinforce_rej,
    two_rollout_contrastive,
)
from .registry import EstimatorSpec, available, estimate, get, register, registry_table_markdown
from .shaping import (
    dapo_overlong_penalty,
    diver_rewards,
    kl_penalized_token_rewards,
    lead_length_reward,
    textual_diversity,
    token_kl,
)
from .stateful import SmoothAdvantageStandardizer

__all__ = [
    "EstimatorSpec",
    "FilterResult",
    "SmoothAdvantageStandardizer",
    "available",
    "cppo",
    "dapo_overlong_penalty",
    "diver_rewards",
    "dynamic_sampling",
    "estimate",
    "get",
    "gfpo_filter",
    "kl_penalized_token_rewards",
    "lead_length_reward",
    "overlong_filter",
    "register",
    "registry_table_markdown",
    "reinforce_rej",
    "textual_diversity",
    "token_kl",
    "two_rollout_contrastive",
    # submodules
    "filters",
    "outcome",
    "per_token",
    "shaping",
    "stateful",
]
