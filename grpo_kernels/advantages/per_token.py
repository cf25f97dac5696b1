"""Per-token advantage estimators: one advantage per completion token, shape [B, T].

Layout: completions are left-aligned in [B, T] (column t is the t-th completion token) with a response
``mask`` [B, T]; masked positions always get advantage 0. Per-token inputs travel as keyword options.
"""

from __future__ import annotations

import torch

from ._groups import (
    check_choice,
    check_float,
    check_index,
    check_mask,
    check_positive,
    check_same_device,
    group_count,
    group_mean,
    group_std,
    group_sum,
    safe_divide,
    working_dtype,
)
from .outcome import _check_correct, group_normalized, normalize_by_polarity
from .registry import register
from .shaping import kl_penalized_token_rewards


def _check_token_mask(mask: object, batch: int, name: str = "mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] != batch:
        raise ValueError(
            f"{name} must be a [B={batch}, T] tensor, got {getattr(mask, 'shape', type(mask).__name__)}"
        )
    return check_mask(name, mask, tuple(mask.shape))


@register(
    "reinforce_plus_plus",
    output="[B, T]",
    paper="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models "
    "(arXiv:2501.03262)",
    peer="verl `compute_reinforce_plus_plus_outcome_advantage` (+ `apply_kl_penalty` for the KL term)",
)
def reinforce_plus_plus(
    rewards,
    group_index,
    *,
    num_groups,
    mask: torch.Tensor,
    gamma: float = 1.0,
    token_rewards: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    epsilon: float = 1e-8,
):
    """REINFORCE++: discounted return-to-go of KL-penalized token rewards, whitened over the batch's tokens.

    Formula:
        r_{i,t} = r_i * 1[t = last valid token of i] - kl_coef * KL_{i,t} + token_rewards_{i,t}
        G_{i,t} = sum_{t' >= t, valid} gamma^(number of valid tokens between) r_{i,t'}   (masked tokens are
                  skipped: the running return is carried through them, as verl)
        A_{i,t} = (G_{i,t} - mean(G)) * rsqrt(var(G) + epsilon) * m_{i,t}   (mean/var over every valid token
                  of the batch, var Bessel-corrected)
    With kl_coef = 0 and gamma = 1, G_{i,t} = r_i and A is the batch-whitened outcome reward.

    Options:
        mask: bool/0-1 [B, T] response mask (each row needs a valid token).
        gamma: discount (verl ``algorithm.gamma``), default 1.
        token_rewards: optional float [B, T] extra per-token rewards (process rewards), added as written.
        kl_coef, logprobs, ref_logprobs, kl_estimator: KL folded into the reward per token, see
            ``shaping.kl_penalized_token_rewards`` (logprobs are the sampling policy's, "old_log_probs").
        epsilon: 1e-8 inside the rsqrt, as verl's ``masked_whiten``.

    Paper: REINFORCE++ (arXiv:2501.03262): A_t = r(x, y) - beta * sum_{i >= t} KL(i), normalized over the
        batch.
    Peer: verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage`` on token_level_rewards built by
        ``apply_kl_penalty`` (score at the last valid token minus beta * kl).
    """
    mask = _check_token_mask(mask, rewards.shape[0])
    check_same_device(rewards=rewards, mask=mask)
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if kl_coef != 0 or logprobs is not None or ref_logprobs is not None:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("kl_coef needs both logprobs and ref_logprobs")
        per_token = kl_penalized_token_rewards(
            rewards, mask, logprobs, ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator
        )
    else:
        per_token = kl_penalized_token_rewards(rewards, mask, None, None, kl_coef=0.0)
    if token_rewards is not None:
        check_float("token_rewards", token_rewards, shape=tuple(mask.shape))
        per_token = per_token + token_rewards.to(per_token.dtype) * mask
    m = mask.to(per_token.dtype)
    returns = torch.zeros_like(per_token)  # [B, T]
    running = torch.zeros_like(per_token[:, 0])  # [B]
    for t in reversed(range(per_token.shape[1])):
        updated = per_token[:, t] + gamma * running
        returns[:, t] = updated * m[:, t]
        running = updated * m[:, t] + running * (1 - m[:, t])
    count = m.sum()
    if float(count) < 2:
        raise ValueError(f"mask must select at least 2 tokens to whiten, got {int(count)}")
    mean = (returns * m).sum() / count
    var = (((returns - mean) ** 2) * m).sum() / (count - 1)
    return (returns - mean) * torch.rsqrt(var + check_positive("epsilon", epsilon, True)) * m


def _check_ids_2d(
    name: str, value: object, batch: int, low: int, high: int | None, columns: int | None = None
):
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape[0] != batch:
        raise ValueError(
            f"{name} must be an int64 [B={batch}, ...] tensor, got {getattr(value, 'shape', value)}"
        )
    if columns is not None and value.shape[1] != columns:
        raise ValueError(f"{name} must have {columns} columns, got shape {tuple(value.shape)}")
    return check_index(name, value, tuple(value.shape), low=low, high=high)


@register(
    "mt_grpo",
    output="[B, T]",
    paper="Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment "
    "(arXiv:2505.11821)",
)
def mt_grpo(
    rewards,
    group_index,
    *,
    num_groups,
    turn_rewards: torch.Tensor,
    turn_ids: torch.Tensor,
    turn_coef: float = 1.0,
    coef_on: str = "turn",
    epsilon: float = 1e-4,
):
    """MT-GRPO turn-level advantage: outcome advantage plus the group-normalized reward of the token's turn.

    Formula:
        A^O_i     = (r_i - mu_g) / (sigma_g + epsilon)                    (outcome reward, ``rewards``)
        A^T_{i,k} = (R_{i,k} - mu_{g,k}) / (sigma_{g,k} + epsilon)        (reward of turn k, ``turn_rewards``)
        coef_on="turn" (default, the authors' code):
            A_{i,t} = A^O_i + turn_coef * A^T_{i,k(t)}  for a token of turn k(t) = turn_ids[i, t] >= 0
        coef_on="outcome" (the paper's formula, lambda on the outcome term of the earlier turns):
            A_{i,t} = A^T_{i,k(t)} + turn_coef * A^O_i  for k(t) < K - 1;   A_{i,t} = A^O_i on the last turn
        A_{i,t}   = 0 where turn_ids[i, t] = -1 (prompt, tool output, padding)
    The paper's two-turn case (turn 1: A^T + A^O, final turn: A^O) is turn_rewards[:, final] = 0 (a constant
    column normalizes to 0).

    Options:
        turn_rewards: float [B, K] reward of each turn (finite; give a turn a row did not reach the value
            your reward design assigns, e.g. 0).
        turn_ids: int64 [B, T] turn index of each token in 0..K-1, -1 for tokens outside the policy's turns.
        turn_coef: the weight lambda (1.0 as the authors' code ``turn_advantage_coef``).
        coef_on: which term lambda weighs, "turn" or "outcome" (see the formula). The default follows the
            released code, which produced the paper's results; with turn_coef = 1 the two agree except on
            the last turn when its turn reward varies.
        epsilon: 1e-4, the authors' TRL-based code.

    Paper: Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment
        (arXiv:2505.11821 v1; the authors' code, SiliangZeng/Multi-Turn-RL-Agent
        ``MTGRPOEnvTrainer._assign_advantages``, puts the coefficient on the turn term). The authors'
        fallback for trajectories without a tool result (a combined-reward advantage) is not reproduced:
        pass the turn rewards you want such rows to get.
    Peer: — (not in TRL or verl).
    """
    batch = rewards.shape[0]
    check_float("turn_rewards", turn_rewards, ndim=2)
    if turn_rewards.shape[0] != batch:
        raise ValueError(f"turn_rewards must have {batch} rows, got shape {tuple(turn_rewards.shape)}")
    num_turns = turn_rewards.shape[1]
    turn_ids = _check_ids_2d("turn_ids", turn_ids, batch, low=-1, high=num_turns)
    check_same_device(rewards=rewards, turn_rewards=turn_rewards, turn_ids=turn_ids)
    outcome = group_normalized(rewards, group_index, num_groups, "group", epsilon)  # [B]
    r_turn = turn_rewards.to(outcome.dtype)
    turn_adv = safe_divide(
        r_turn - group_mean(r_turn, group_index, num_groups)[group_index],
        group_std(r_turn, group_index, num_groups)[group_index] + epsilon,
    )  # [B, K]
    check_choice("coef_on", coef_on, ("turn", "outcome"))
    in_turn = turn_ids >= 0
    token_turn_adv = turn_adv.gather(1, turn_ids.clamp(min=0))  # [B, T]
    if coef_on == "turn":
        combined = outcome[:, None] + turn_coef * token_turn_adv
    else:
        last_turn = turn_ids == num_turns - 1
        combined = torch.where(
            last_turn, outcome[:, None].expand_as(token_turn_adv), token_turn_adv + turn_coef * outcome[:, None]
        )
    return torch.where(in_turn, combined, torch.zeros_like(token_turn_adv))


@register(
    "gigpo",
    output="[B, T]",
    paper="Group-in-Group Policy Optimization for LLM Agent Training (arXiv:2505.10978)",
)
def gigpo(
    rewards,
    group_index,
    *,
    num_groups,
    step_rewards: torch.Tensor,
    state_ids: torch.Tensor,
    step_ids: torch.Tensor,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    normalize_by_std: bool = False,
    epsilon: float = 1e-6,
):
    """GiGPO: episode-level group advantage plus a step-level advantage over steps that share an anchor state.

    Formula (row i = one episode, steps s = 0..n_i-1):
        A^E_i   = (R_i - mu_g) / F                              R_i = ``rewards`` (episode return)
        R_{i,s} = sum_{s' >= s} gamma^(s'-s) r_{i,s'}          (discounted step return, ``step_rewards``)
        anchor group G(g, x) = {(i, s): i in group g, state_ids[i, s] = x}
        A^S_{i,s} = (R_{i,s} - mean_{G(g,x)} R) / F
        A_{i,t}   = A^E_i + step_weight * A^S_{i, step_ids[i, t]};   0 where step_ids[i, t] = -1
        F = std + epsilon (Bessel, per group) when normalize_by_std, else 1.
    An anchor group of one step gets A^S = 0.

    Options:
        step_rewards: float [B, S] per-step rewards (entries past an episode's last step are ignored).
        state_ids: int64 [B, S] anchor-state id of each step (equal ids = identical environment state,
            compared within a prompt group only); -1 marks steps past the episode end. Valid steps must
            form a prefix 0..n_i-1.
        step_ids: int64 [B, T] the step each token was generated in, -1 for tokens of no step.
        gamma: discount, 0.95 (the paper's setting).
        step_weight: omega, 1.0.
        normalize_by_std: F = std + epsilon (True) or 1 (False, verl-agent's default ``mean_norm``).
        epsilon: 1e-6 as verl-agent.
    The paper writes both levels standardised (F = std); its released code (verl-agent) defaults to
    mean-only normalisation (``mean_norm``). The default here is the code's (normalize_by_std=False), as for
    the other methods whose released code produced the reported results; normalize_by_std=True is the
    paper's equations.

    Paper: Group-in-Group Policy Optimization for LLM Agent Training (arXiv:2505.10978), Eqs. 3-8.
        verl-agent computes the episode mean over all step rows of an episode; here each episode counts once
        (the paper's definition).
    Peer: — (verl-agent ``gigpo/core_gigpo.py`` is not part of verl 0.9.1).
    """
    batch = rewards.shape[0]
    check_float("step_rewards", step_rewards, ndim=2)
    if step_rewards.shape[0] != batch:
        raise ValueError(f"step_rewards must have {batch} rows, got shape {tuple(step_rewards.shape)}")
    num_steps = step_rewards.shape[1]
    state_ids = _check_ids_2d("state_ids", state_ids, batch, low=-1, high=None, columns=num_steps)
    step_ids = _check_ids_2d("step_ids", step_ids, batch, low=-1, high=num_steps)
    check_same_device(rewards=rewards, step_rewards=step_rewards, state_ids=state_ids, step_ids=step_ids)
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    valid_step = state_ids >= 0  # [B, S]
    if bool((valid_step[:, 1:] & ~valid_step[:, :-1]).any()):
        row = int((valid_step[:, 1:] & ~valid_step[:, :-1]).any(-1).nonzero()[0])
        raise ValueError(f"state_ids row {row}: valid steps (id >= 0) must form a prefix 0..n-1")
    used = step_ids >= 0
    if bool((used & ~valid_step.gather(1, step_ids.clamp(min=0))).any()):
        where = tuple(int(i) for i in (used & ~valid_step.gather(1, step_ids.clamp(min=0))).nonzero()[0])
        raise ValueError(
            f"step_ids{list(where)} = {int(step_ids[where])} refers to a step with state_ids = -1"
        )

    scale = "group" if normalize_by_std else "none"
    episode = group_normalized(rewards, group_index, num_groups, scale, epsilon)  # [B]
    r_step = torch.where(valid_step, step_rewards.to(episode.dtype), torch.zeros_like(episode[:, None]))
    step_return = torch.zeros_like(r_step)  # [B, S]
    running = torch.zeros_like(episode)
    for s in reversed(range(num_steps)):
        running = r_step[:, s] + gamma * running
        step_return[:, s] = running
    # Anchor key = (prompt group, state id), renumbered to 0..K-1 over valid steps.
    rows = group_index[:, None].expand_as(state_ids)[valid_step]
    states = state_ids[valid_step]
    _, anchor = torch.unique(torch.stack([rows, states], dim=1), dim=0, return_inverse=True)
    num_anchors = int(anchor.max()) + 1
    values = step_return[valid_step]
    centered = values - group_mean(values, anchor, num_anchors)[anchor]
    if normalize_by_std:
        centered = safe_divide(centered, group_std(values, anchor, num_anchors)[anchor] + epsilon)
    step_adv = torch.zeros_like(step_return)
    step_adv[valid_step] = centered
    token_step_adv = step_adv.gather(1, step_ids.clamp(min=0))  # [B, T]
    return torch.where(
        used, episode[:, None] + step_weight * token_step_adv, torch.zeros_like(token_step_adv)
    )


@register(
    "gtpo",
    output="[B, T]",
    paper="GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy (arXiv:2508.04349)",
)
def gtpo(
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
    """GTPO: token rewards shaped by the entropy share at each position, standardized per group and polarity.

    Formula (per group and position t; O+_t / O-_t = correct / wrong responses still generating at t,
    d_t = |O+_t|, h_t = |O-_t|):
        i in O+:  r~_{i,t} =  alpha1 * r_i + alpha2 * (H_{i,t} / sum_{k in O+_t} H_{k,t}) * d_t
        j in O-:  r~_{j,t} = -alpha1 - alpha2 * (1/(H_{j,t}+eps) / sum_{k in O-_t} 1/(H_{k,t}+eps)) * h_t
        normalize="per_polarity": A = (r~ - mean) / (std + epsilon) over all valid tokens of O+ of the group,
        and separately of O- (the paper's Eq. 6 as read by two independent re-implementations);
        normalize="joint": over all valid tokens of the group.
    A share with a zero denominator (all entropies 0 at t) is 0. Under "per_polarity" a polarity set whose
    shaped rewards are all equal (e.g. a group with a single wrong response and uniform h_t = 1) standardizes
    to 0: only the entropy contrast within O+ and within O- remains, not the sign of the outcome. "joint"
    keeps correct tokens above wrong ones.

    Options:
        entropy: float [B, T] per-token entropy from the kernels (>= 0).
        mask: bool/0-1 [B, T] valid (left-aligned) completion tokens.
        correct: bool [B], default ``rewards > 0``.
        alpha1, alpha2: 1.0 and 0.1, the paper's experimental values.
        normalize: see formula.
        epsilon: 1e-8, used in 1/(H + eps) and the std.

    Paper: GTPO and GRPO-S (arXiv:2508.04349), GTPO (v5 Eqs. 3, 5, 6). The paper was revised several times
        (v1 shaped only correct responses); this is the O+/O- version.
    Peer: — (not in TRL or verl).
    """
    batch = rewards.shape[0]
    mask = _check_token_mask(mask, batch)
    check_float("entropy", entropy, shape=tuple(mask.shape))
    if bool((entropy < 0).any()):
        where = tuple(int(i) for i in (entropy < 0).nonzero()[0])
        raise ValueError(f"entropy must be >= 0; entropy{list(where)} = {entropy[where].item()}")
    check_same_device(rewards=rewards, entropy=entropy, mask=mask)
    r = rewards.to(working_dtype(rewards.dtype))
    correct = _check_correct(correct, r)
    h = entropy.to(r.dtype)
    positive = mask & correct[:, None]  # [B, T]
    negative = mask & ~correct[:, None]
    inverse = 1 / (h + check_positive("epsilon", epsilon))
    pos_share = _position_share(h, positive, group_index, num_groups)
    neg_share = _position_share(inverse, negative, group_index, num_groups)
    shaped = torch.where(positive, alpha1 * r[:, None] + alpha2 * pos_share, -alpha1 - alpha2 * neg_share)
    shaped = shaped * mask
    group_of = group_index[:, None].expand_as(mask)
    polarity = correct[:, None].expand_as(mask)
    return normalize_by_polarity(shaped, mask, polarity, group_of, num_groups, normalize, epsilon)


def _position_share(weight: torch.Tensor, member: torch.Tensor, group_index: torch.Tensor, num_groups: int):
    """weight_{i,t} / sum_{k in set_t} weight_{k,t} * |set_t| for members, 0 otherwise. [B, T] -> [B, T]."""
    w = torch.where(member, weight, torch.zeros_like(weight))
    total = group_sum(w, group_index, num_groups)[group_index]  # [B, T]
    size = group_sum(member.to(weight.dtype), group_index, num_groups)[group_index]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, w / safe_total, torch.zeros_like(w)) * size


def shared_prefix_counts(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    chunk_elements: int = 1 << 25,
) -> torch.Tensor:
    """|lambda_{i,t}|: completions of i's group whose first t+1 tokens equal i's. [B, T] int64, 0 if masked.

    A completion j shares i's prefix at t when tokens 0..t are all valid in both and equal. Exact pairwise
    comparison: O(n_g^2 T) time per group, memory bounded by ``chunk_elements`` bytes per chunk of rows.
    """
    counts = torch.zeros_like(completion_ids)
    length = completion_ids.shape[1]
    for g in range(num_groups):
        rows = (group_index == g).nonzero().flatten()
        ids = completion_ids[rows]  # [n, T]
        valid = mask[rows]
        n = rows.numel()
        step = max(1, chunk_elements // max(1, n * length))
        for start in range(0, n, step):
            anchor_ids, anchor_valid = ids[start : start + step], valid[start : start + step]  # [c, T]
            same = (anchor_ids[:, None, :] == ids[None, :, :]) & anchor_valid[:, None, :] & valid[None, :, :]
            same_prefix = (
                same.to(torch.uint8).cummin(dim=-1).values
            )  # [c, n, T]: 1 while every token so far matched
            counts[rows[start : start + step]] = same_prefix.sum(dim=1, dtype=torch.long) * anchor_valid
    return counts


@register(
    "lambda_grpo",
    output="[B, T]",
    paper="GRPO is Secretly a Process Reward Model (arXiv:2509.21154)",
)
def lambda_grpo(
    rewards,
    group_index,
    *,
    num_groups,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: str = "group",
    epsilon: float = 1e-4,
):
    """λ-GRPO: each token's GRPO advantage divided by the size of its process set (shared-prefix completions).

    Formula:
        A_i = (r_i - mu_g) / (sigma_g + epsilon)              (``grpo`` with the given scale)
        lambda_{i,t} = {j in g : o_j[0..t] = o_i[0..t]}        (i's process set at t, i included)
        A_{i,t} = A_i / |lambda_{i,t}| on valid tokens, 0 elsewhere
    GRPO implicitly weights a shared prefix step by how many completions share it; dividing by |lambda|
    removes that frequency term. The per-token loss term of PPO clipping is positively homogeneous in A, so
    scaling A by 1/|lambda| equals scaling the token's loss term, which is how the paper states λ-GRPO.

    Options:
        completion_ids: int64 [B, T] left-aligned completion token ids.
        mask: bool/0-1 [B, T] valid tokens.
        scale, epsilon: as ``grpo``.

    The paper divides each token's whole loss term by |lambda|; dividing the advantage is the same for the
    policy term, but a KL-to-reference term is not divided: with kl_coef > 0 the objective differs from the
    paper's by (1 - 1/|lambda|) beta KL per shared-prefix token. The trainer's ``lambda_grpo`` preset
    therefore uses no KL term (kl_coef = 0), where the two agree exactly.

    Paper: GRPO is Secretly a Process Reward Model (arXiv:2509.21154), λ-GRPO (the process-set weights).
        Not to be confused with "λ-GRPO: Unifying the GRPO Frameworks with Learnable Token Preferences"
        (arXiv:2510.06870), a loss-side length weighting.
    Peer: — (not in TRL or verl).
    """
    batch = rewards.shape[0]
    mask = _check_token_mask(mask, batch)
    completion_ids = _check_ids_2d(
        "completion_ids", completion_ids, batch, low=0, high=None, columns=mask.shape[1]
    )
    check_same_device(rewards=rewards, completion_ids=completion_ids, mask=mask)
    advantages = group_normalized(rewards, group_index, num_groups, scale, epsilon)  # [B]
    counts = shared_prefix_counts(completion_ids, mask, group_index, num_groups).to(advantages.dtype)
    return torch.where(mask, advantages[:, None] / counts.clamp(min=1), torch.zeros_like(counts))


@register(
    "process_supervision",
    output="[B, T]",
    rewards_shape="[B, S]",
    paper="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models "
    "(arXiv:2402.03300)",
)
def process_supervision(
    rewards,
    group_index,
    *,
    num_groups,
    step_ids: torch.Tensor,
    step_mask: torch.Tensor | None = None,
    epsilon: float = 1e-6,
):
    """Process-supervision GRPO: group-normalized step rewards, a token's advantage the sum from its step on.

    Formula (``rewards`` = step rewards r_{i,j}, j = 0..S-1):
        R_g = {r_{i,j} : i in g, j a valid step of i}
        r~_{i,j} = (r_{i,j} - mean(R_g)) / (std(R_g) + epsilon)        (std Bessel-corrected)
        A_{i,t} = sum_{j >= s(t), j valid} r~_{i,j}     for a token of step s(t) = step_ids[i, t] >= 0
        A_{i,t} = 0 where step_ids[i, t] = -1
    With steps contiguous in token order this is the paper's A_{i,t} = sum_{index(j) >= t} r~_i^{index(j)}.

    Options:
        step_ids: int64 [B, T] the step each token belongs to (0..S-1), -1 for none.
        step_mask: bool/0-1 [B, S] which step rewards exist (default: all); tokens may refer to valid steps
            only.
            ``rewards`` entries of steps outside the mask are ignored but must still be finite (e.g. 0).
        epsilon: the paper has none; 1e-6 (verl's GRPO constant) keeps a constant group finite.

    Paper: DeepSeekMath (arXiv:2402.03300), §4.1.3 process supervision RL with GRPO.
    Peer: — (not in TRL or verl).
    """
    batch, num_steps = rewards.shape
    step_ids = _check_ids_2d("step_ids", step_ids, batch, low=-1, high=num_steps)
    if step_mask is None:
        step_mask = torch.ones(batch, num_steps, dtype=torch.bool, device=rewards.device)
    step_mask = check_mask("step_mask", step_mask, (batch, num_steps))
    check_same_device(rewards=rewards, step_ids=step_ids, step_mask=step_mask)
    used = step_ids >= 0
    if bool((used & ~step_mask.gather(1, step_ids.clamp(min=0))).any()):
        where = tuple(int(i) for i in (used & ~step_mask.gather(1, step_ids.clamp(min=0))).nonzero()[0])
        raise ValueError(
            f"step_ids{list(where)} = {int(step_ids[where])} refers to a step with step_mask = 0"
        )
    r = rewards.to(working_dtype(rewards.dtype))
    flat_groups = group_index[:, None].expand_as(step_mask)[step_mask]
    values = r[step_mask]
    mean = group_mean(values, flat_groups, num_groups)
    count = group_count(flat_groups, num_groups, r.dtype)
    if bool((count == 0).any()):
        raise ValueError(f"step_mask: group {int((count == 0).nonzero()[0])} has no valid step reward")
    std = group_std(values, flat_groups, num_groups)
    normalized = torch.zeros_like(r)
    normalized[step_mask] = safe_divide(values - mean[flat_groups], std[flat_groups] + epsilon)
    suffix = normalized.flip(-1).cumsum(-1).flip(-1)  # [B, S] sum over steps j >= s
    token_adv = suffix.gather(1, step_ids.clamp(min=0))
    return torch.where(used, token_adv, torch.zeros_like(token_adv))
