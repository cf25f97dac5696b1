"""Reward shaping: functions that turn raw rewards (and lengths, texts, log-probs) into shaped rewards.

They run before an advantage estimator: ``estimate(name, shaped_rewards, group_index, ...)``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from ._groups import (
    check_choice,
    check_float,
    check_group_index,
    check_mask,
    check_positive,
    check_rewards,
    check_same_device,
    group_mean,
    group_std,
    working_dtype,
)


def _lengths(name: str, lengths: object) -> torch.Tensor:
    """[B] lengths (int or float, >= 0) as a float tensor: fp32 for integers, >= fp32 for floats."""
    if not isinstance(lengths, torch.Tensor) or lengths.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-d tensor [B], got {getattr(lengths, 'shape', type(lengths).__name__)}"
        )
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(f"{name} must hold integer or float lengths, got dtype {lengths.dtype}")
    values = lengths.to(working_dtype(lengths.dtype)) if lengths.is_floating_point() else lengths.float()
    check_float(name, values)
    if bool((values < 0).any()):
        i = int((values < 0).nonzero()[0])
        raise ValueError(f"{name} must be >= 0; {name}[{i}] = {float(values[i])}")
    return values


def dapo_overlong_penalty(lengths: torch.Tensor, *, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO soft overlong punishment, a length reward added to the task reward.

    Formula (L_max = max_length, L_cache = cache_length, |y| = completion length):
        R_length(y) = 0                                   if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                  if |y| > L_max

    Args:
        lengths: [B] completion lengths in tokens.
        max_length: L_max > 0.
        cache_length: L_cache, 0 < L_cache <= L_max.

    Returns:
        float [B]: fp32 for integer lengths, the (>= fp32) float dtype of float lengths.

    Paper: DAPO: An Open-Source LLM Reinforcement Learning System at Scale (arXiv:2503.14476), Eq. 13.
    Peer: TRL 1.16 ``trl.rewards.get_soft_overlong_punishment``; verl 0.9.1 DAPO reward manager
        (``overlong_buffer``, penalty_factor = 1; verl has no -1 branch because it never sees |y| > L_max).
    """
    values = _lengths("lengths", lengths)
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if not isinstance(cache_length, int) or not 0 < cache_length <= max_length:
        raise ValueError(f"cache_length must be an int in (0, max_length={max_length}], got {cache_length!r}")
    expected = max_length - cache_length
    ramp = (expected - values) / cache_length
    penalty = torch.where(values <= expected, torch.zeros_like(values), ramp)
    return torch.where(values > max_length, torch.full_like(values, -1.0), penalty)


def lead_length_reward(
    correct: torch.Tensor,
    lengths: torch.Tensor,
    group_index: torch.Tensor,
    *,
    alpha: float = 0.05,
    incorrect_reward: float = -1.0,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO-LEAD length-dependent accuracy reward with the explicit penalty for wrong answers.

    Formula (per group; mu, sigma: mean and Bessel-corrected std of the lengths of its correct completions):
        z = (|o| - mu) / (sigma + epsilon)
        R(o) = exp(-alpha * z)        if o is correct
             = incorrect_reward (-1)  otherwise
    A group with one correct completion has z = 0 for it (reward 1).

    Args:
        correct: bool [B].
        lengths: [B] completion lengths in tokens.
        group_index: int64 [B], groups 0..G-1.
        alpha: length-penalty strength, 0.05 as the authors' code.
        incorrect_reward: the explicit penalty, -1 (the paper; 0 gives the reward without the penalty).
        epsilon: 1e-6 as the authors' code.

    Returns:
        float [B].

    Paper: GRPO-LEAD (arXiv:2504.09696), §3.1 length-dependent accuracy reward and §3.2 explicit penalty.
        The authors' code (main_ppo.py) also skips the length term for groups whose three shortest
        completions average <= 4000 tokens; that heuristic is not in the paper and not applied here.
    Peer: — (not in TRL or verl).
    """
    lengths_v = _lengths("lengths", lengths)
    correct = check_mask("correct", correct, (lengths_v.shape[0],))
    group_index, num_groups = check_group_index(group_index, lengths_v.shape[0])
    check_same_device(correct=correct, lengths=lengths_v, group_index=group_index)
    correct_groups = group_index[correct]
    correct_lengths = lengths_v[correct]
    mean = group_mean(correct_lengths, correct_groups, num_groups)  # nan for groups without correct answers
    std = group_std(correct_lengths, correct_groups, num_groups)
    z = (lengths_v - mean[group_index]) / (std[group_index] + check_positive("epsilon", epsilon))
    return torch.where(correct, torch.exp(-alpha * z), torch.full_like(lengths_v, float(incorrect_reward)))


# BLEU weights for 1..5-grams used by DIVER's authors (NJU-RL/DIVER verl/div_src/diversity_metric.py).
DIVER_BLEU_WEIGHTS = (0.02, 0.1, 0.15, 0.25, 0.38)


def _tokens(completion: object, max_chars: int | None) -> tuple:
    if isinstance(completion, str):
        text = completion if max_chars is None else completion[:max_chars]
        return tuple(text.split())
    if isinstance(completion, torch.Tensor):
        completion = completion.tolist()
    if isinstance(completion, Sequence) and all(isinstance(t, int) for t in completion):
        return tuple(completion)
    raise ValueError(
        "completions must be strings or sequences of token ids, "
        f"got an item of type {type(completion).__name__}"
    )


def sentence_bleu(
    reference: Sequence, hypothesis: Sequence, weights: Sequence[float] = DIVER_BLEU_WEIGHTS
) -> float:
    """Sentence BLEU of ``hypothesis`` against one ``reference`` (no smoothing), nltk's definition.

    BLEU = BP * exp(sum_n w_n log p_n), p_n = clipped n-gram matches / hypothesis n-grams,
    BP = 1 if |hyp| > |ref| else exp(1 - |ref| / |hyp|). Returns 0 when the hypothesis is empty or some
    weighted p_n is 0 (nltk then returns 0 or a value below 1e-30 with a warning).
    """
    if len(hypothesis) == 0:
        return 0.0
    log_sum = 0.0
    for n, weight in enumerate(weights, start=1):
        if weight == 0:
            continue
        hyp_ngrams = Counter(tuple(hypothesis[i : i + n]) for i in range(len(hypothesis) - n + 1))
        ref_ngrams = Counter(tuple(reference[i : i + n]) for i in range(len(reference) - n + 1))
        matches = sum(min(count, ref_ngrams[gram]) for gram, count in hyp_ngrams.items())
        total = max(1, len(hypothesis) - n + 1)
        if matches == 0:
            return 0.0
        log_sum += weight * math.log(matches / total)
    ref_len, hyp_len = len(reference), len(hypothesis)
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return brevity * math.exp(log_sum)


def textual_diversity(
    completions: Sequence[str] | Sequence[Sequence[int]],
    group_index: torch.Tensor,
    *,
    weights: Sequence[float] = DIVER_BLEU_WEIGHTS,
    max_chars: int | None = None,
    direction: str = "both",
) -> torch.Tensor:
    """DIVER textual diversity of each completion against the other completions of its group.

    Formula:
        direction="both":    sim(i, j) = (BLEU(o_j | ref o_i) + BLEU(o_i | ref o_j)) / 2
        direction="one_way": sim(i, j) = BLEU(o_i | ref o_j)   (o_i scored against each other completion)
        D_i = 1 - (1 / (n_g - 1)) * sum_{j in g, j != i} sim(i, j)        (D_i = 0 for a group of one)
    BLEU is not symmetric (brevity penalty, clipped counts); the paper defines the diversity of o_i by
    how o_i scores against the others ("one_way"); "both" (the default, kept for compatibility) averages
    the two directions so that sim is symmetric.

    Args:
        completions: B strings (split on whitespace) or B token-id sequences.
        group_index: int64 [B], groups 0..G-1.
        weights: BLEU n-gram weights; default (0.02, 0.1, 0.15, 0.25, 0.38) as the authors' code.
        max_chars: optional truncation of string completions before tokenizing (the authors' code uses 1000).
        direction: "both" or "one_way", see the formula.

    Returns:
        float32 [B] in [0, 1] (on ``group_index``'s device).

    Paper: Diversity-Incentivized Exploration for Versatile Reasoning (DIVER, arXiv:2509.26209), textual
        diversity. BLEU is implemented here (nltk's sentence_bleu without smoothing); O(n_g^2) per group.
    Peer: — (not in TRL or verl).
    """
    batch = len(completions)
    group_index, _ = check_group_index(group_index, batch)
    check_choice("direction", direction, ("both", "one_way"))
    tokens = [_tokens(c, max_chars) for c in completions]
    diversity = [0.0] * batch
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group_index.tolist()):
        members.setdefault(g, []).append(row)
    for rows in members.values():
        if len(rows) < 2:
            continue
        similarity = {row: 0.0 for row in rows}
        for a_pos, a in enumerate(rows):
            for b in rows[a_pos + 1 :]:
                b_given_a = sentence_bleu(tokens[a], tokens[b], weights)  # hypothesis o_b, reference o_a
                a_given_b = sentence_bleu(tokens[b], tokens[a], weights)
                if direction == "both":
                    similarity[a] += 0.5 * (a_given_b + b_given_a)
                    similarity[b] += 0.5 * (a_given_b + b_given_a)
                else:
                    similarity[a] += a_given_b
                    similarity[b] += b_given_a
        for row in rows:
            diversity[row] = 1.0 - similarity[row] / (len(rows) - 1)
    return torch.tensor(diversity, dtype=torch.float32, device=group_index.device)


def diver_rewards(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    completions: Sequence[str] | Sequence[Sequence[int]],
    *,
    coef: float,
    correct: torch.Tensor | None = None,
    max_chars: int | None = None,
    max_bonus: float | None = None,
    direction: str = "both",
) -> torch.Tensor:
    """DIVER: add the textual-diversity bonus to the rewards of correct completions.

    Formula:
        b_i  = coef * D_i, clipped to [0, max_bonus] when max_bonus is given   (D_i = ``textual_diversity``)
        r'_i = r_i + b_i * 1[o_i correct]
    The bonus is potential-based shaping at the terminal state (Phi = D, Phi(start) = 0) and is conditioned on
    correctness to avoid reward hacking (a wrong but diverse answer gets nothing), as in the paper.

    Args:
        rewards: float [B].
        group_index: int64 [B].
        completions: B strings or token-id sequences.
        coef: bonus scale (the authors' ``rs_scale``), >= 0.
        correct: bool [B], default ``rewards > 0``.
        max_chars: see ``textual_diversity``.
        direction: see ``textual_diversity`` (the paper's reading is "one_way"; default "both").
        max_bonus: sigma, the upper clip of the intrinsic reward (the paper clips it to [0, sigma] so that
            it never outweighs the correctness reward); None: no clip (D is in [0, 1] already).

    Returns:
        float [B].

    Paper: Diversity-Incentivized Exploration for Versatile Reasoning (arXiv:2509.26209), textual
        diversity. The authors' code additionally switches the bonus off after step 100; schedule coef in
        your trainer. The paper's equational diversity (of the math expressions of an answer) needs a
        parser of the task's formulas and is not provided.
    Peer: — (not in TRL or verl).
    """
    rewards = check_rewards(rewards)
    if len(completions) != rewards.shape[0]:
        raise ValueError(f"completions has {len(completions)} items but rewards has {rewards.shape[0]} rows")
    coef = check_positive("coef", coef, allow_zero=True)
    correct = rewards > 0 if correct is None else check_mask("correct", correct, (rewards.shape[0],))
    diversity = textual_diversity(completions, group_index, max_chars=max_chars, direction=direction)
    r = rewards.to(working_dtype(rewards.dtype))
    bonus = coef * diversity.to(device=r.device, dtype=r.dtype)
    if max_bonus is not None:
        bonus = bonus.clamp(0.0, check_positive("max_bonus", max_bonus, allow_zero=True))
    return r + bonus * correct.to(r.dtype)


KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "low_var_kl")


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate of the sampling policy against the reference, on log-probs of the sampled tokens.

    k1 = logp - ref;  abs = |logp - ref|;  k2 = (logp - ref)^2 / 2;
    k3 = exp(ref - logp) - (ref - logp) - 1;
    low_var_kl = k3 with ref - logp clamped to [-20, 20] and the result to [-10, 10] (verl's "low_var_kl",
    which verl also uses for "k3"; they agree unless a clamp binds).

    Args:
        logprobs: float [B, T] log-probs of the sampled tokens under the sampling policy.
        ref_logprobs: float [B, T] the reference policy's log-probs of the same tokens.
        estimator: one of ``KL_ESTIMATORS`` ("k1", "abs", "k2", "k3", "low_var_kl").

    Returns:
        float [B, T] per-token estimates (no masking: multiply by your mask).
    """
    check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "k2":
        return 0.5 * diff.square()
    log_ratio = -diff
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(min=-20, max=20)
        return (log_ratio.exp() - log_ratio - 1).clamp(min=-10, max=10)
    return log_ratio.exp() - log_ratio - 1


def kl_penalized_token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """KL folded into the reward per token (PPO / REINFORCE++ style): token rewards [B, T].

    Formula:
        r_{i,t} = r_i * 1[t = last valid token of row i] - kl_coef * KL_{i,t} * m_{i,t}
        KL_{i,t} = ``token_kl(logprobs, ref_logprobs, kl_estimator)``

    Args:
        rewards: float [B] sequence rewards (the verifier / reward-model score).
        mask: bool/0-1 [B, T] response mask; every row needs a valid token.
        logprobs: float [B, T] log-probs of the sampled tokens under the sampling policy (may be None when
            kl_coef == 0).
        ref_logprobs: float [B, T] the same tokens' log-probs under the reference (None when kl_coef == 0).
        kl_coef: beta >= 0.
        kl_estimator: "k1" (default, verl's "kl"), "abs", "k2", "k3", "low_var_kl".

    Returns:
        float [B, T].

    Paper: REINFORCE++ (arXiv:2501.03262) and PPO-RLHF (Ouyang et al., arXiv:2203.02155): r_t = -beta KL_t,
        plus the outcome reward at the end of the sequence.
    Peer: verl 0.9.1 ``ray_trainer.apply_kl_penalty`` (token_level_scores - beta * kl_penalty(...) * mask,
        with the score placed at the last valid token by the reward manager).
    """
    rewards = check_rewards(rewards)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"mask must be a [B={rewards.shape[0]}, T] tensor, got {getattr(mask, 'shape', mask)}"
        )
    mask = check_mask("mask", mask, tuple(mask.shape))
    check_same_device(rewards=rewards, mask=mask)
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError(
            f"mask row {int((lengths == 0).nonzero()[0])} has no valid token to carry the reward"
        )
    r = rewards.to(working_dtype(rewards.dtype))
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)  # [B]
    token_rewards = torch.zeros(mask.shape, dtype=r.dtype, device=r.device)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = r
    kl_coef = check_positive("kl_coef", kl_coef, allow_zero=True)
    if logprobs is None and ref_logprobs is None:
        if kl_coef != 0:
            raise ValueError("kl_coef > 0 needs logprobs and ref_logprobs")
        return token_rewards
    check_float("logprobs", logprobs, shape=tuple(mask.shape))
    check_float("ref_logprobs", ref_logprobs, shape=tuple(mask.shape))
    check_same_device(rewards=r, logprobs=logprobs, ref_logprobs=ref_logprobs)
    kl = token_kl(logprobs.to(r.dtype), ref_logprobs.to(r.dtype), kl_estimator)
    return token_rewards - kl_coef * kl * mask.to(r.dtype)


__all__ = [
    "DIVER_BLEU_WEIGHTS",
    "KL_ESTIMATORS",
    "dapo_overlong_penalty",
    "diver_rewards",
    "kl_penalized_token_rewards",
    "lead_length_reward",
    "sentence_bleu",
    "textual_diversity",
    "token_kl",
]
