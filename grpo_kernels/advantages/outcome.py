"""Sequence-level (outcome) advantage estimators: one scalar advantage per completion, shape [B].

Notation in the docstrings: r_i is the reward of row i, g = g(i) its group, n_g the group size,
mu_g = mean_{j in g} r_j, sigma_g = the Bessel-corrected std over the group, sigma_B the Bessel-corrected
std over the whole batch. A group of one row gets a group-relative value of 0 (documented divergence from
verl, which uses mean 0 / std 1 for singletons and so returns r_i / (1 + eps)); estimators that then
normalize over the whole batch (reinforce_plus_plus_baseline, gdpo) move it to (0 - batch mean) / batch std.
A zero std with epsilon = 0 (a constant group) gives 0, not NaN.
"""

from __future__ import annotations

import torch

from ._groups import (
    batch_std,
    check_choice,
    check_float,
    check_mask,
    check_positive,
    check_same_device,
    group_count,
    group_max,
    group_mean,
    group_min,
    group_std,
    group_sum,
    masked_whiten,
    safe_divide,
    working_dtype,
)
from .filters import gfpo_filter
from .registry import register

SCALES = ("group", "batch", "none")


def group_normalized(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, scale: str, epsilon: float
) -> torch.Tensor:
    """(r - mu_g) / (sigma + eps) with sigma per group, over the batch, or none. [B] -> [B]."""
    check_choice("scale", scale, SCALES)
    check_positive("epsilon", epsilon, allow_zero=True)
    r = rewards.to(working_dtype(rewards.dtype))
    centered = r - group_mean(r, group_index, num_groups)[group_index]
    if scale == "none":
        return centered
    sigma = group_std(r, group_index, num_groups)[group_index] if scale == "group" else batch_std(r)
    return safe_divide(centered, sigma + epsilon)


@register(
    "grpo",
    paper="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models "
    "(arXiv:2402.03300)",
    peer="verl `compute_grpo_outcome_advantage`, `compute_grpo_vectorized_outcome_advantage`; "
    "TRL `GRPOTrainer` `scale_rewards` group/batch/none",
)
def grpo(rewards, group_index, *, num_groups, scale: str = "group", epsilon: float = 1e-4):
    """Group-normalized reward (GRPO), scaled by the group std, the batch std, or not at all.

    Formula:
        A_i = (r_i - mu_g) / (sigma + epsilon)
        sigma = sigma_g (scale="group"), sigma_B (scale="batch"); scale="none": A_i = r_i - mu_g.

    Options:
        scale: "group" (default, GRPO and verl), "batch" (TRL ``scale_rewards="batch"``, Lite-PPO) or "none"
            (Dr. GRPO, TRL ``scale_rewards="none"``, verl ``norm_adv_by_std_in_grpo=False``).
        epsilon: added to the std. Default 1e-4 follows TRL; verl uses 1e-6.

    Paper: DeepSeekMath (arXiv:2402.03300), §4.1.2 outcome supervision.
    Peer: TRL 1.16 ``GRPOTrainer._generate_and_score_completions`` (sum_then_normalize, one reward function);
        verl 0.9.1 ``compute_grpo_outcome_advantage`` with ``epsilon=1e-6``.
    """
    return group_normalized(rewards, group_index, num_groups, scale, epsilon)


@register(
    "dr_grpo",
    paper="Understanding R1-Zero-Like Training: A Critical Perspective (arXiv:2503.20783)",
    peer='verl `compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)`; TRL `scale_rewards="none"`',
)
def dr_grpo(rewards, group_index, *, num_groups):
    """Dr. GRPO: the group-mean baseline without the std division.

    Formula:
        A_i = r_i - mu_g

    Paper: Understanding R1-Zero-Like Training: A Critical Perspective (arXiv:2503.20783), §3.2.
    Peer: verl 0.9.1 ``compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)``; TRL 1.16
        ``scale_rewards="none"``. (The Dr. GRPO loss normalisation is on the loss side.)
    """
    return group_normalized(rewards, group_index, num_groups, "none", 0.0)


@register(
    "lite_ppo",
    paper="Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning (arXiv:2508.08221)",
    peer='TRL `scale_rewards="batch"`',
)
def lite_ppo(rewards, group_index, *, num_groups, epsilon: float = 1e-4):
    """Lite-PPO advantage: group-mean baseline, batch-level std.

    Formula:
        A_i = (r_i - mu_g) / (sigma_B + epsilon)

    Options:
        epsilon: default 1e-4, as TRL's ``scale_rewards="batch"`` which computes the same quantity.

    Paper: Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning (arXiv:2508.08221), "group-level
        mean, batch-level std" (Lite PPO also uses token-level loss aggregation, which is on the loss side).
    Peer: TRL 1.16 ``GRPOTrainer`` with ``scale_rewards="batch"``.
    """
    return group_normalized(rewards, group_index, num_groups, "batch", epsilon)


@register(
    "rloo",
    paper="Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs "
    "(arXiv:2402.14740)",
    peer="verl `compute_rloo_outcome_advantage`, `compute_rloo_vectorized_outcome_advantage`; "
    "TRL `RLOOTrainer`",
)
def rloo(rewards, group_index, *, num_groups):
    """REINFORCE leave-one-out: each completion's baseline is the mean of the other completions of its group.

    Formula:
        A_i = r_i - (1 / (n_g - 1)) * sum_{j in g, j != i} r_j  =  n_g / (n_g - 1) * (r_i - mu_g)
        A_i = 0 when n_g = 1.

    Paper: Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs
        (arXiv:2402.14740), Eq. RLOO.
    Peer: verl 0.9.1 ``compute_rloo_outcome_advantage`` and ``compute_rloo_vectorized_outcome_advantage``
        (the loop version leaves a singleton's raw reward in place; the vectorised one gives 0, as here);
        TRL 1.16 ``RLOOTrainer`` with ``beta=0`` and ``normalize_advantages=False``.
    """
    r = rewards.to(working_dtype(rewards.dtype))
    count = group_count(group_index, num_groups, r.dtype)[group_index]
    centered = r - group_mean(r, group_index, num_groups)[group_index]
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return centered * factor


@register(
    "reinforce_plus_plus_baseline",
    paper="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models "
    "(arXiv:2501.03262)",
    peer="verl `compute_reinforce_plus_plus_baseline_outcome_advantage`",
)
def reinforce_plus_plus_baseline(
    rewards, group_index, *, num_groups, mask: torch.Tensor | None = None, epsilon: float = 1e-8
):
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    Formula:
        A'_i = r_i - mu_g
        A_i  = (A'_i - mean_w(A')) * rsqrt(var_w(A') + epsilon)
        mean_w / var_w: weighted by w_i = number of valid tokens of row i when ``mask`` is given (verl
        whitens the per-token broadcast, so longer completions weigh more), w_i = 1 otherwise; var_w is
        Bessel-corrected over sum(w).

    Options:
        mask: optional bool/0-1 [B, T] response mask, selects the token-weighted statistics.
        epsilon: inside the rsqrt, 1e-8 as verl's ``masked_whiten``.

    Paper: REINFORCE++ (arXiv:2501.03262), REINFORCE++-baseline: group-mean baseline + global normalization.
    Peer: verl 0.9.1 ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (with ``mask``); verl
        returns the value broadcast over tokens, here one value per row.
    """
    r = rewards.to(working_dtype(rewards.dtype))
    centered = r - group_mean(r, group_index, num_groups)[group_index]
    if mask is None:
        weights = torch.ones_like(centered)
    else:
        if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
            raise ValueError(f"mask must be a [B, T] tensor, got {getattr(mask, 'shape', type(mask))}")
        mask = check_mask("mask", mask, (r.shape[0], mask.shape[1]))
        check_same_device(rewards=r, mask=mask)
        weights = mask.to(r.dtype).sum(-1)
    return masked_whiten(centered, weights, check_positive("epsilon", epsilon, allow_zero=True))


@register(
    "opo",
    paper="On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585)",
    peer="verl `compute_opo_outcome_advantage`",
)
def opo(rewards, group_index, *, num_groups, lengths: torch.Tensor):
    """OPO: baseline is the length-weighted mean reward of the group (the optimal baseline for sequence loss).

    Formula:
        b_g = sum_{j in g} l_j r_j / sum_{j in g} l_j ,   A_i = r_i - b_g
        l_j = completion length in tokens.

    Options:
        lengths: float or int [B], completion lengths (>= 0; a group's total must be > 0).

    Paper: On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585).
    Peer: verl 0.9.1 ``compute_opo_outcome_advantage`` (lengths = response_mask.sum(-1)); verl gives a
        singleton its raw reward, here 0.
    """
    r = rewards.to(working_dtype(rewards.dtype))
    lengths = _check_lengths(lengths, r)
    length_sum = group_sum(lengths, group_index, num_groups)
    if bool((length_sum <= 0).any()):
        bad = int((length_sum <= 0).nonzero()[0])
        raise ValueError(
            f"lengths of group {bad} sum to {float(length_sum[bad])}; OPO needs a positive total"
        )
    baseline = group_sum(lengths * r, group_index, num_groups) / length_sum
    return r - baseline[group_index]


def _check_lengths(lengths: object, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"lengths must be a torch.Tensor [B], got {type(lengths).__name__}")
    if tuple(lengths.shape) != (like.shape[0],):
        raise ValueError(f"lengths must have shape ({like.shape[0]},), got {tuple(lengths.shape)}")
    check_same_device(rewards=like, lengths=lengths)
    lengths = lengths.to(like.dtype)
    check_float("lengths", lengths)
    if bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(f"lengths must be >= 0; lengths[{i}] = {float(lengths[i])}")
    return lengths


def _argmax_per_group(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Row index of the first maximum of each group. [B] -> [G] int64."""
    best = group_max(values, group_index, num_groups)
    rows = torch.arange(values.shape[0], device=values.device)
    candidates = torch.where(values == best[group_index], rows, torch.full_like(rows, values.shape[0]))
    first = torch.full((num_groups,), values.shape[0], dtype=torch.long, device=values.device)
    return first.scatter_reduce(0, group_index, candidates, reduce="amin", include_self=True)


@register(
    "grpo_passk",
    paper="Optimizing Language Models for Inference Time Objectives using Reinforcement Learning "
    "(arXiv:2503.19595, as cited by verl)",
    peer="verl `compute_grpo_passk_outcome_advantage`",
)
def grpo_passk(rewards, group_index, *, num_groups, normalize_by_std: bool = True, epsilon: float = 1e-6):
    """GRPO pass@k: only the best completion of a group gets an advantage, the margin over the runner-up.

    Formula:
        i* = argmax_{j in g} r_j (first index on ties),  A_{i*} = (r_(1) - r_(2)) / (sigma_g + epsilon)
        A_i = 0 for every other i; without ``normalize_by_std`` the division is dropped.
        r_(1), r_(2): largest and second largest reward of the group (equal on ties, so a tie gives 0).

    Options:
        normalize_by_std: divide by sigma_g + epsilon (verl ``norm_adv_by_std_in_grpo``, default True).
        epsilon: default 1e-6 as verl.

    Paper: arXiv:2503.19595 (the pass@k objective with a leave-one-out max baseline), as cited by verl.
    Peer: verl 0.9.1 ``compute_grpo_passk_outcome_advantage``; verl raises on a group of one, here it gets 0.
    """
    r = rewards.to(working_dtype(rewards.dtype))
    best_row = _argmax_per_group(r, group_index, num_groups)  # [G]
    best_value = r[best_row]
    without_best = r.clone()
    without_best[best_row] = float("-inf")
    runner_up = group_max(without_best, group_index, num_groups)  # -inf for a group of one
    margin = torch.where(torch.isfinite(runner_up), best_value - runner_up, torch.zeros_like(best_value))
    if normalize_by_std:
        margin = safe_divide(
            margin, group_std(r, group_index, num_groups) + check_positive("epsilon", epsilon, True)
        )
    advantages = torch.zeros_like(r)
    advantages[best_row] = margin
    return advantages


ALPHA_MODES = ("valid_groups", "nonzero_rewards")


@register(
    "gpg",
    paper="GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546)",
    peer='verl `compute_gpg_outcome_advantage` (alpha_mode="nonzero_rewards")',
)
def gpg(rewards, group_index, *, num_groups, alpha_mode: str = "valid_groups", f_norm: float = 1.0):
    """GPG: group-mean baseline rescaled by the inverse fraction of rows that carry a learning signal.

    Formula:
        A_i = alpha * (r_i - mu_g) / F_norm
        alpha = B / max(M, 1), where M counts
            alpha_mode="valid_groups": rows whose group does not have all-equal rewards (the paper's
                B / (B - #invalid); the authors' code flags a group invalid when its reward std is ~0);
            alpha_mode="nonzero_rewards": rows with r_i != 0 (what verl 0.9.1 computes).

    Options:
        alpha_mode: see above; default follows the paper.
        f_norm: F_norm, a positive constant (default 1, as the paper and verl).

    Paper: GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546).
    Peer: verl 0.9.1 ``compute_gpg_outcome_advantage`` with ``alpha_mode="nonzero_rewards"``.
    """
    check_choice("alpha_mode", alpha_mode, ALPHA_MODES)
    f_norm = check_positive("f_norm", f_norm)
    r = rewards.to(working_dtype(rewards.dtype))
    centered = r - group_mean(r, group_index, num_groups)[group_index]
    if alpha_mode == "valid_groups":
        uniform = group_max(r, group_index, num_groups) == group_min(r, group_index, num_groups)
        signal_rows = (~uniform[group_index]).sum()
    else:
        signal_rows = (r != 0).sum()
    alpha = r.shape[0] / signal_rows.clamp(min=1).to(r.dtype)
    return alpha * centered / f_norm


def lead_difficulty_weight(
    correct_ratio: torch.Tensor, weight_min: float, weight_max: float, midpoint: float, steepness: float
) -> torch.Tensor:
    """GRPO-LEAD logistic weight w(x) = A + (B - A) / (1 + exp(k (x - x0)))."""
    return weight_min + (weight_max - weight_min) / (1 + torch.exp(steepness * (correct_ratio - midpoint)))


@register(
    "grpo_lead",
    paper="GRPO-LEAD: A Difficulty-Aware Reinforcement Learning Approach for Concise Mathematical "
    "Reasoning in Language Models (arXiv:2504.09696)",
)
def grpo_lead(
    rewards,
    group_index,
    *,
    num_groups,
    correct: torch.Tensor | None = None,
    weight_min: float = 0.4,
    weight_max: float = 1.5,
    midpoint: float = 0.75,
    steepness: float = 10.0,
    epsilon: float = 1e-6,
):
    """GRPO-LEAD difficulty-aware reweighting of the group-normalized advantage.

    Formula:
        A~_i = (r_i - mu_g) / (sigma_g + epsilon)
        rho_g = fraction of correct completions in group g
        w(x)  = weight_min + (weight_max - weight_min) / (1 + exp(steepness * (x - midpoint)))
        A_i = A~_i * w(rho_g) if A~_i > 0, else A~_i * w(1 - rho_g)
    Hard prompts (low rho) amplify positive advantages; easy prompts amplify the penalty of wrong answers.

    Options:
        correct: bool [B]; default ``rewards > 0`` (as the authors' code: with GRPO-LEAD's rewards a correct
            completion scores exp(-alpha z) > 0 and a wrong one -1, see ``shaping.lead_length_reward``).
        weight_min, weight_max, midpoint, steepness: A, B, rho_0, k; defaults 0.4, 1.5, 0.75, 10 from the
            authors' code (aeroplanepaper/GRPO-LEAD, core_algos.logistic_reweight).
        epsilon: 1e-6, as the authors' verl code.

    Paper: GRPO-LEAD (arXiv:2504.09696), §3.3 difficulty-aware advantage reweighting.
    Peer: — (not in TRL or verl).
    """
    r = rewards.to(working_dtype(rewards.dtype))
    correct = _check_correct(correct, r)
    base = group_normalized(r, group_index, num_groups, "group", epsilon)
    ratio = group_mean(correct.to(r.dtype), group_index, num_groups)[group_index]
    weight_pos = lead_difficulty_weight(ratio, weight_min, weight_max, midpoint, steepness)
    weight_neg = lead_difficulty_weight(1 - ratio, weight_min, weight_max, midpoint, steepness)
    return torch.where(base > 0, base * weight_pos, base * weight_neg)


def _check_correct(correct: object, like: torch.Tensor) -> torch.Tensor:
    if correct is None:
        return like > 0
    return check_mask("correct", correct, (like.shape[0],))


def mean_token_entropy(entropy: object, mask: object, batch: int) -> torch.Tensor:
    """Per-row mean entropy over valid tokens. entropy float [B, T], mask [B, T] -> [B]."""
    if not isinstance(entropy, torch.Tensor) or entropy.ndim != 2 or entropy.shape[0] != batch:
        raise ValueError(
            f"entropy must be a float [B={batch}, T] tensor, got {getattr(entropy, 'shape', entropy)}"
        )
    entropy = check_float("entropy", entropy)
    mask = check_mask("mask", mask, tuple(entropy.shape))
    check_same_device(entropy=entropy, mask=mask)
    if bool((entropy < 0).any()):
        where = tuple(int(i) for i in (entropy < 0).nonzero()[0])
        raise ValueError(f"entropy must be >= 0; entropy{list(where)} = {entropy[where].item()}")
    tokens = mask.sum(-1)
    if bool((tokens == 0).any()):
        raise ValueError(f"mask row {int((tokens == 0).nonzero()[0])} has no valid token")
    m = mask.to(working_dtype(entropy.dtype))
    return (entropy.to(m.dtype) * m).sum(-1) / tokens.to(m.dtype)


ENTROPY_NORMALIZERS = ("group", "batch")


@register(
    "edge_grpo",
    paper="EDGE-GRPO: Entropy-Driven GRPO with Guided Error Correction for Advantage Diversity "
    "(arXiv:2507.21848)",
)
def edge_grpo(
    rewards,
    group_index,
    *,
    num_groups,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    entropy_normalizer: str = "group",
    epsilon: float = 1e-4,
):
    """EDGE-GRPO entropy-driven advantage: the GRPO advantage divided by the response's normalized entropy.

    Formula:
        P_i = (1/|o_i|) sum_t H_{i,t}              (mean token entropy over valid tokens)
        P^_i = P_i / mean_{j in S} P_j              S = the group of i (default) or the whole batch
        A_i = [(r_i - mu_g) / (sigma_g + epsilon)] / P^_i
    Confident (low-entropy) correct answers get larger advantages, confident wrong ones larger penalties.

    Options:
        entropy: float [B, T], per-token policy entropy (``lp.entropy`` from the kernels), >= 0.
        mask: bool/0-1 [B, T], valid completion tokens; every row needs one.
        entropy_normalizer: "group" (the paper's 1/G sum over the group) or "batch" (the authors' TRL code
            divides by the mean over the gathered batch, and averages entropy over all T positions, padding
            included; here padding is always excluded).
        epsilon: 1e-4, the authors' TRL-based code.

    Paper: EDGE-GRPO (arXiv:2507.21848), Entropy-Driven Advantage. Guided Error Correction changes the
        samples, not the advantage: it is the trainer's ``edge_gec`` rollout hook
        (``grpo_kernels.trainer.EdgeGuidedErrorCorrection``, the paper's 50/25/25 split).
    Peer: — (not in TRL or verl).
    """
    check_choice("entropy_normalizer", entropy_normalizer, ENTROPY_NORMALIZERS)
    r = rewards.to(working_dtype(rewards.dtype))
    mean_entropy = mean_token_entropy(entropy, mask, r.shape[0]).to(r.dtype)
    check_same_device(rewards=r, entropy=mean_entropy)
    if entropy_normalizer == "group":
        reference = group_mean(mean_entropy, group_index, num_groups)[group_index]
    else:
        reference = mean_entropy.mean()
    normalized = mean_entropy / reference
    if bool((normalized == 0).any()) or not bool(torch.isfinite(normalized).all()):
        i = int(((normalized == 0) | ~torch.isfinite(normalized)).nonzero()[0])
        raise ValueError(
            f"entropy: row {i} has normalized mean entropy {float(normalized[i])}; EDGE-GRPO divides by it, "
            "so every response needs a positive mean entropy"
        )
    return group_normalized(r, group_index, num_groups, "group", epsilon) / normalized


@register(
    "grpo_lambda_clamp",
    paper="GRPO-λ: Credit Assignment improves LLM Reasoning (arXiv:2510.00194)",
)
def grpo_lambda_clamp(
    rewards, group_index, *, num_groups, min_advantage: float, scale: str = "group", epsilon: float = 1e-4
):
    """GRPO-λ's negative-advantage clamp: the group-normalized advantage bounded below.

    Formula:
        A_i = max((r_i - mu_g) / (sigma + epsilon), min_advantage),   min_advantage <= 0

    Options:
        min_advantage: required lower bound (<= 0); 0 keeps only non-negative advantages.
        scale, epsilon: as ``grpo``.

    Paper: GRPO-λ: Credit Assignment improves LLM Reasoning (arXiv:2510.00194) names clamping negative
        advantages as a stability mechanism for its eligibility-trace objective (the traces themselves are a
        loss-side change). The exact clamp value and form could not be verified from the accessible text, so
        the bound has no default: pass the value you use.
    Peer: — (not in TRL or verl).
    """
    if not isinstance(min_advantage, (int, float)) or isinstance(min_advantage, bool) or min_advantage > 0:
        raise ValueError(f"min_advantage must be a number <= 0, got {min_advantage!r}")
    advantages = group_normalized(rewards, group_index, num_groups, scale, epsilon)
    return advantages.clamp(min=float(min_advantage))


def _check_weights(weights: object, num_rewards: int, like: torch.Tensor) -> torch.Tensor:
    if weights is None:
        return torch.ones(num_rewards, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device)
    if tuple(w.shape) != (num_rewards,):
        raise ValueError(
            f"weights must have {num_rewards} entries (one per reward column), got shape {tuple(w.shape)}"
        )
    return check_float("weights", w)


def per_reward_group_normalized(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, epsilon: float
) -> torch.Tensor:
    """(r_k - mu_{g,k}) / (sigma_{g,k} + eps) for every reward column. [B, K] -> [B, K]."""
    r = rewards.to(working_dtype(rewards.dtype))
    mean = group_mean(r, group_index, num_groups)[group_index]
    std = group_std(r, group_index, num_groups)[group_index]
    return safe_divide(r - mean, std + check_positive("epsilon", epsilon, allow_zero=True))


@register(
    "mo_grpo",
    rewards_shape="[B, K]",
    paper="MO-GRPO: Mitigating Reward Hacking of Group Relative Policy Optimization on Multi-Objective "
    "Problems (arXiv:2509.22047)",
)
def mo_grpo(
    rewards,
    group_index,
    *,
    num_groups,
    weights: torch.Tensor | None = None,
    renormalize: bool = True,
    epsilon: float = 1e-4,
):
    """MO-GRPO: each reward function normalized by its own group std before they are combined.

    Formula:
        z_{i,k} = (r_{i,k} - mu_{g,k}) / (sigma_{g,k} + epsilon)        (per reward column k, per group)
        s_i = sum_k w_k z_{i,k}
        A_i = (s_i - mu_g(s)) / (sigma_g(s) + epsilon)   (renormalize=True: GRPO on the variance-reweighted
                                                           sum; mu_g(s) = 0 already)
        A_i = s_i                                           (renormalize=False)
    Scaling any reward column by a positive constant leaves A unchanged, so no objective dominates by scale.

    Options:
        weights: optional float [K] (default all 1).
        renormalize: see formula. The paper describes MO-GRPO as GRPO on rewards reweighted by their group
            std; whether the combined advantage is divided by its group std once more is not stated in the
            text we could read, so both readings are available (default: renormalize).
        epsilon: 1e-4 (TRL's constant; MO-GRPO is built on TRL).

    Paper: MO-GRPO (arXiv:2509.22047).
    Peer: — (closest: TRL's normalize_then_sum, whose last step is batch-level, not group-level; see gdpo).
    """
    r = rewards.to(working_dtype(rewards.dtype))
    w = _check_weights(weights, r.shape[1], r)
    combined = (per_reward_group_normalized(r, group_index, num_groups, epsilon) * w).sum(-1)
    if not renormalize:
        return combined
    return group_normalized(combined, group_index, num_groups, "group", epsilon)


BATCH_NORMALIZATIONS = ("sequence", "token")


@register(
    "gdpo",
    rewards_shape="[B, K]",
    paper="GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization "
    "(arXiv:2601.05242)",
    peer='TRL `multi_objective_aggregation="normalize_then_sum"`; verl `compute_gdpo_outcome_advantage`',
)
def gdpo(
    rewards,
    group_index,
    *,
    num_groups,
    weights: torch.Tensor | None = None,
    epsilon: float = 1e-4,
    batch_normalization: str = "sequence",
    mask: torch.Tensor | None = None,
    whiten_epsilon: float = 1e-8,
):
    """GDPO / TRL normalize_then_sum: normalize each reward per group, sum with weights, normalize the batch.

    Formula:
        z_{i,k} = (r_{i,k} - mu_{g,k}) / (sigma_{g,k} + epsilon)
        s_i = sum_k w_k z_{i,k}
        batch_normalization="sequence" (TRL):  A_i = (s_i - mean_B(s)) / (sigma_B(s) + epsilon)
        batch_normalization="token" (verl):    A_i = (s_i - mean_w(s)) * rsqrt(var_w(s) + whiten_epsilon),
            statistics weighted by each row's valid-token count from ``mask`` (verl's masked_whiten).

    Options:
        weights: optional float [K] (default all 1), TRL ``reward_weights`` / verl ``gdpo_reward_weights``.
        epsilon: group stage (and TRL's batch stage); 1e-4 as TRL, verl uses 1e-6.
        batch_normalization: "sequence" (default, TRL) or "token" (verl; needs ``mask``).
        mask: bool/0-1 [B, T], only for batch_normalization="token".
        whiten_epsilon: 1e-8 as verl's masked_whiten, only for "token".

    Paper: GDPO (arXiv:2601.05242): group-wise decoupled normalization, weighted sum, batch normalization.
    Peer: TRL 1.16 ``GRPOTrainer`` ``multi_objective_aggregation="normalize_then_sum"``; verl 0.9.1
        ``compute_gdpo_outcome_advantage`` (batch_normalization="token", epsilon=1e-6).
    """
    check_choice("batch_normalization", batch_normalization, BATCH_NORMALIZATIONS)
    r = rewards.to(working_dtype(rewards.dtype))
    w = _check_weights(weights, r.shape[1], r)
    combined = (per_reward_group_normalized(r, group_index, num_groups, epsilon) * w).sum(-1)
    if batch_normalization == "sequence":
        if mask is not None:
            raise ValueError("mask is only used with batch_normalization='token'")
        return safe_divide(combined - combined.mean(), batch_std(combined) + epsilon)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise ValueError("batch_normalization='token' needs mask, a [B, T] tensor")
    mask = check_mask("mask", mask, (r.shape[0], mask.shape[1]))
    check_same_device(rewards=r, mask=mask)
    return masked_whiten(
        combined, mask.to(r.dtype).sum(-1), check_positive("whiten_epsilon", whiten_epsilon, True)
    )


POLARITY_NORMALIZATIONS = ("per_polarity", "joint")


def normalize_by_polarity(
    values: torch.Tensor,
    valid: torch.Tensor,
    positive: torch.Tensor,
    group_of: torch.Tensor,
    num_groups: int,
    normalize: str,
    epsilon: float,
) -> torch.Tensor:
    """Standardize ``values`` within each group, separately for positive/negative rows or jointly.

    values, valid, positive, group_of: same shape ([B] or [B, T]); only ``valid`` entries enter the statistics
    and invalid entries come back as 0. Statistics are Bessel-corrected; a set of one entry gives 0.
    """
    check_choice("normalize", normalize, POLARITY_NORMALIZATIONS)
    flat_values = values[valid]
    if normalize == "per_polarity":
        key = group_of[valid] * 2 + positive[valid].long()
        num_keys = 2 * num_groups
    else:
        key = group_of[valid]
        num_keys = num_groups
    mean = group_mean(flat_values, key, num_keys)
    count = group_count(key, num_keys, flat_values.dtype)
    std = group_std(flat_values, key, num_keys)
    standardized = torch.where(
        count[key] > 1,
        safe_divide(flat_values - mean[key], std[key] + epsilon),
        torch.zeros_like(flat_values),
    )
    out = torch.zeros_like(values)
    out[valid] = standardized
    return out


@register(
    "grpo_s",
    paper="GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy (arXiv:2508.04349)",
)
def grpo_s(
    rewards,
    group_index,
    *,
    num_groups,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    correct: torch.Tensor | None = None,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    normalize: str = "per_polarity",
    epsilon: float = 1e-8,
):
    """GRPO-S: sequence-level reward shaped by the response's mean entropy, then standardized.

    Formula (per group; O+ = correct responses, n = |O+|; O- = the others, m = |O-|):
        H^_i = (1/|o_i|) sum_t H_{i,t}
        i in O+:  r^_i =  alpha1 * r_i + alpha2 * (H^_i / sum_{k in O+} H^_k) * n
        j in O-:  r^_j = -alpha1       - alpha2 * ((1/H^_j) / sum_{k in O-} (1/H^_k)) * m
        normalize="per_polarity": A = (r^ - mean) / (std + epsilon) within O+ and within O- of the group;
        normalize="joint": the same over the whole group.
    High-entropy correct responses are rewarded more; confident (low-entropy) wrong ones penalised more.

    Options:
        entropy: float [B, T] per-token entropy (> 0 on valid tokens of wrong responses: 1/H is used).
        mask: bool/0-1 [B, T] valid tokens.
        correct: bool [B], default ``rewards > 0``.
        alpha1, alpha2: 1.0 and 0.1 (the paper's experimental values).
        normalize: "per_polarity" (default) or "joint". The paper has been revised several times; the
            separate O+/O- standardization follows the token-level Eq. 6 of v5 as read by two independent
            re-implementations, and the sequence level mirrors it. Use "joint" for a single group z-score.
        epsilon: 1e-8.

    Paper: GTPO and GRPO-S (arXiv:2508.04349), GRPO-S.
    Peer: — (not in TRL or verl).
    """
    r = rewards.to(working_dtype(rewards.dtype))
    correct = _check_correct(correct, r)
    seq_entropy = mean_token_entropy(entropy, mask, r.shape[0]).to(r.dtype)
    incorrect = ~correct
    if bool((seq_entropy[incorrect] <= 0).any()):
        i = int((incorrect & (seq_entropy <= 0)).nonzero()[0])
        raise ValueError(
            f"entropy: wrong response {i} has mean entropy 0; GRPO-S weights wrong responses by 1/H"
        )
    positive_share = _share_within(seq_entropy, correct, group_index, num_groups)
    inverse = torch.where(
        incorrect, 1 / seq_entropy.clamp(min=torch.finfo(r.dtype).tiny), torch.zeros_like(r)
    )
    negative_share = _share_within(inverse, incorrect, group_index, num_groups)
    shaped = torch.where(correct, alpha1 * r + alpha2 * positive_share, -alpha1 - alpha2 * negative_share)
    valid = torch.ones_like(correct)
    return normalize_by_polarity(shaped, valid, correct, group_index, num_groups, normalize, epsilon)


def _share_within(weight: torch.Tensor, member: torch.Tensor, group_index: torch.Tensor, num_groups: int):
    """weight_i / sum_{k in set(i)} weight_k * |set(i)| for members, else 0 (set(i): members of i's group)."""
    w = torch.where(member, weight, torch.zeros_like(weight))
    total = group_sum(w, group_index, num_groups)[group_index]
    size = group_sum(member.to(weight.dtype), group_index, num_groups)[group_index]
    share = torch.where(
        total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(w)
    )
    return share * size


@register(
    "gfpo",
    paper="Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning "
    "(arXiv:2508.09726)",
)
def gfpo(
    rewards,
    group_index,
    *,
    num_groups,
    lengths: torch.Tensor,
    keep: int,
    metric: str = "length",
    epsilon: float = 1e-4,
):
    """GFPO: keep k completions per group by a metric; advantages over the retained ones, 0 for the rest.

    Formula:
        S_g = the k completions of group g with the shortest length (metric="length") or the highest
              r_i / l_i (metric="reward_per_token")
        A_i = (r_i - mu_S) / (sigma_S + epsilon) * 1[i in S_g]      (mean and std over S_g only)

    Options:
        lengths: [B] completion lengths in tokens (> 0 for "reward_per_token").
        keep: k >= 1; groups with at most k rows keep them all.
        metric: "length" or "reward_per_token".
        epsilon: 1e-4 (GFPO builds on the GRPO normalisation; the TRL constant).

    Paper: Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning
        (arXiv:2508.09726). The filter alone, with its reasons, is ``filters.gfpo_filter``.
    Peer: — (not in TRL or verl).
    """
    r = rewards.to(working_dtype(rewards.dtype))
    kept = gfpo_filter(r, group_index, lengths=lengths, keep=keep, metric=metric).kept_mask
    kept_rewards = r[kept]
    kept_groups = group_index[kept]
    advantages = torch.zeros_like(r)
    advantages[kept] = group_normalized(kept_rewards, kept_groups, num_groups, "group", epsilon)
    return advantages
