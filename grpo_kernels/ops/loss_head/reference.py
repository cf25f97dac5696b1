"""The loss head (B of docs/design.md §1) in plain fp32 PyTorch: which formula runs, readable top to bottom.

Every other implementation (the Triton loss-head kernel, the fused one-pass path, the TRL and verl
adapters) is tested against `policy_loss_reference`. Gradients w.r.t. logprobs and entropy come from
autograd through this file. Derivations and the exact correspondence to TRL 1.16 / verl 0.9.1 are in
README.md beside it.

Layout: tokens are flat, [N], each with the id of its sequence (`seq_index`, in [0, num_seqs)).
Tokens of one sequence appear in generation order. A padded [B, T] batch is the special case
seq_index = row id; a packed batch with cu_seqlens is the other. Per-sequence quantities are segment
sums (`_seq_sum`) broadcast back to tokens (`[seq_index]`).

Conventions: mask 1 = the token is trained on. Masked tokens are replaced by 0 before any arithmetic,
so whatever their inputs hold (garbage, inf) they contribute exactly 0 to the loss and its gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...config import PolicyLossConfig
from . import variants
from .variants._base import Context, binary_kl  # noqa: F401  (binary_kl: also read by the sampler gate)
from .variants.group_dpo import group_dpo_loss  # noqa: F401  (the Triton head's finalize reads it here)


class LossHeadOutput(NamedTuple):
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logprobs and entropy
    metrics: dict[str, torch.Tensor]  # name -> detached 0-d fp32 tensor


def policy_loss_reference(
    logprobs: torch.Tensor,  # [N] log pi_theta(token), differentiable
    advantages: torch.Tensor,  # [N] per token (a per-sequence advantage broadcast to its tokens)
    mask: torch.Tensor,  # [N] bool or {0, 1}
    seq_index: torch.Tensor,  # [N] int64 in [0, num_seqs)
    num_seqs: int,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,  # [N]; None = on-policy (old = logprobs.detach())
    ref_logprobs: torch.Tensor | None = None,  # [N] reference policy, for the KL term
    rollout_logprobs: torch.Tensor | None = None,  # [N] sampler (vLLM) log-probs, for IS correction
    is_weights: torch.Tensor | None = None,  # [N] precomputed IS weights (verl rollout_is_weights)
    entropy: torch.Tensor | None = None,  # [N] policy entropy per token, differentiable
    token_weights: torch.Tensor | None = None,  # [N] per-token loss weights (process weights)
    num_tokens: float | None = None,  # global token normalizer (token-mean); None: local count
    num_sequences: float | None = None,  # global sequence normalizer (seq-mean-*); None: local count
    dp_size: int = 1,  # data-parallel ranks whose gradients get averaged
    grad_accum_steps: int = 1,  # local counts are multiplied by this (micro-batch means / GA)
    entropy_group=None,  # process group the top-entropy quantile is taken over (TRL: all processes)
) -> LossHeadOutput:
    cfg = config
    valid = mask.bool()
    m = valid.float()

    def clean(x):  # fp32, and exactly 0 on masked tokens (their gradient is then 0 too)
        return None if x is None else torch.where(valid, x.float(), torch.zeros((), device=x.device))

    def seq_sum(x):  # [N] -> [S]
        return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)

    lp = clean(logprobs)
    adv = clean(advantages)
    old = clean(old_logprobs) if old_logprobs is not None else lp.detach()
    ref = clean(ref_logprobs)
    rollout = clean(rollout_logprobs)
    # NaN sampler log-probs mark tokens the sampler could not score (TRL): no IS correction and no
    # off-policy evidence for them
    scored = None if rollout is None else ~torch.isnan(rollout)
    ent = clean(entropy)
    seq_len = seq_sum(m)  # [S] valid tokens per sequence
    seq_nonempty = (seq_len > 0).float()

    def clamp_log(x):  # the documented guard on exponents of log-ratios
        c = cfg.log_ratio_clamp
        return x if c is None else x.clamp(-c, c)

    # ---- importance ratio r (per token; sequence levels broadcast their value) -----------------
    anchor = old  # r = pi / pi_anchor
    if cfg.ratio_anchor == "rollout":  # the sampler's log-probs (SkyRL's rollout anchor, prime-rl)
        if rollout is None:
            raise ValueError("ratio_anchor='rollout' needs rollout_logprobs")
        anchor = rollout
    log_ratio = (lp - anchor) * m  # lr_t
    if cfg.ratio_level == "token":
        log_w = log_ratio
    elif cfg.ratio_level == "sequence":  # GSPO / TRL: value and gradient through the mean
        log_w = (seq_sum(log_ratio) / seq_len.clamp(min=1.0))[seq_index]
    elif cfg.ratio_level == "sequence_token":  # GSPO-token / verl gspo: sequence value, token gradient
        log_w = (seq_sum(log_ratio) / seq_len.clamp(min=1.0))[seq_index].detach() + lp - lp.detach()
    elif cfg.ratio_level == "sequence_sum":  # trajectory ratio (TIC-GRPO)
        log_w = seq_sum(log_ratio)[seq_index]
    elif cfg.ratio_level == "prefix":  # GRPO-lambda trace: sum_{k<=t} decay^(t-k) lr_k within the sequence
        log_w = _discounted_prefix_sum(log_ratio, seq_index, cfg.prefix_decay)
    elif cfg.ratio_level == "prefix_symmetric":  # sum_{k<=t} max(decay^k, decay^(t-k)) lr_k
        log_w = _symmetric_prefix_sum(log_ratio, seq_index, cfg.prefix_decay)
    else:  # pragma: no cover - config validation rejects it
        raise AssertionError(cfg.ratio_level)
    ratio = torch.exp(clamp_log(log_w)) * m
    sequence_valued = cfg.ratio_level in ("sequence", "sequence_sum")

    def level_mean(x):  # metric mean over the units the ratio lives on: tokens, or sequences (TRL)
        if sequence_valued:
            per_seq = seq_sum(x * m) / seq_len.clamp(min=1.0)
            return (per_seq * seq_nonempty).sum() / seq_nonempty.sum().clamp(min=1.0)
        return (x * m).sum() / m.sum().clamp(min=1.0)

    metrics: dict[str, torch.Tensor] = {}
    lower, upper = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high

    # ---- per-token objective (loss to minimise): the variant's own formula, variants/<loss_type>.py ---------
    variant = variants.get(cfg.loss_type)

    def sampler_is_weights():
        return _sampler_is_weights(cfg, old, rollout, scored, m, seq_sum, seq_index)

    ctx = Context(cfg=cfg, params=variant.params_of(cfg), lp=lp, adv=adv, old=old, anchor=anchor, ref=ref,
                  rollout=rollout, scored=scored, log_ratio=log_ratio, ratio=ratio, m=m, valid=valid,
                  seq_index=seq_index, seq_len=seq_len, seq_nonempty=seq_nonempty, lower=lower, upper=upper,
                  metrics=metrics, seq_sum=seq_sum, level_mean=level_mean,
                  sampler_is_weights=sampler_is_weights)  # fmt: skip
    result = variant.objective(ctx)
    objective = result.objective
    if variant.clip_metrics:  # TRL's clip statistics (for DPPO: the tokens its trust region drops)
        low, high = result.low, result.high
        metrics["clip_ratio/low_mean"] = level_mean(low)
        metrics["clip_ratio/high_mean"] = level_mean(high)
        metrics["clip_ratio/region_mean"] = level_mean(torch.maximum(low, high))
        per_seq_low = seq_sum(low * m) / seq_len.clamp(min=1.0)
        per_seq_high = seq_sum(high * m) / seq_len.clamp(min=1.0)
        nonempty = seq_nonempty.bool()
        metrics["clip_ratio/low_min"] = _masked_min(per_seq_low, nonempty, 0.0)
        metrics["clip_ratio/high_max"] = _masked_max(per_seq_high, nonempty, 0.0)

    # ---- token selection (each a {0,1} multiplier on the policy term) ----------------------------
    selection = m.clone()
    if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 off-policy sequence masking
        if rollout is not None:
            divergence = torch.where(scored, rollout - lp.detach(), torch.zeros_like(lp)) * m
        else:
            divergence = (old - lp.detach()) * m
        seq_kl = (seq_sum(divergence) / seq_len.clamp(min=1.0))[seq_index]
        keep = ((adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)).float()
        metrics["selection/off_policy_dropped_frac"] = ((1.0 - keep) * m).sum() / m.sum().clamp(min=1.0)
        selection = selection * keep
    entropy_selected = m
    if cfg.top_entropy_quantile < 1.0:  # "Beyond the 80/20 rule": train on high-entropy forks only
        entropy_selected = top_entropy_selection(ent, valid, cfg.top_entropy_quantile, entropy_group)
        metrics["selection/entropy_kept_frac"] = entropy_selected.sum() / m.sum().clamp(min=1.0)
        selection = selection * entropy_selected
    if cfg.old_prob_threshold is not None:  # Lopti: low- / high-probability token groups
        low_prob = (old.exp() < cfg.old_prob_threshold).float()
        keep = low_prob if cfg.old_prob_side == "low" else 1.0 - low_prob
        metrics["selection/old_prob_kept_frac"] = (keep * m).sum() / m.sum().clamp(min=1.0)
        selection = selection * keep

    # ---- sampler mismatch: importance weights old / rollout (TIS, MIS), or given ------------------
    weights = torch.ones_like(m)
    if cfg.is_level is not None and cfg.loss_type != "vespo":  # VESPO folds them into phi instead
        weights = _sampler_is_weights(cfg, old, rollout, scored, m, seq_sum, seq_index)
    if cfg.is_gate is not None:  # 0 where the old / sampler statistic leaves its range (OpenRLHF's gating)
        gate = _sampler_gate(cfg, old, rollout, scored, m, seq_sum, seq_index)
        metrics["is_weight/gated_frac"] = ((1.0 - gate) * m).sum() / m.sum().clamp(min=1.0)
        weights = weights * gate
    if is_weights is not None:
        weights = weights * clean(is_weights)
    if cfg.is_level is not None or cfg.is_gate is not None or is_weights is not None:
        metrics["is_weight/mean"] = (weights * m).sum() / m.sum().clamp(min=1.0)
        metrics["is_weight/min"] = _masked_min(weights, valid, 1.0)
        metrics["is_weight/max"] = _masked_max(weights, valid, 1.0)
        if cfg.is_mode == "mask" and cfg.is_level is not None:
            metrics["is_weight/masked_frac"] = ((weights == 0).float() * m).sum() / m.sum().clamp(min=1.0)
    if token_weights is not None:
        weights = weights * clean(token_weights)

    # ---- aggregation --------------------------------------------------------------------------------
    normalizers = _Normalizers(m, seq_index, seq_len, num_tokens, num_sequences, dp_size, grad_accum_steps, cfg)
    if variant.sequence_loss is not None:  # gmpo, group_dpo: a sequence-level objective
        policy_loss = variant.sequence_loss(ctx, selection, weights, normalizers)
    else:
        policy_loss = normalizers.aggregate(objective * selection * weights, cfg.loss_agg_mode)
    loss = policy_loss
    metrics["policy_loss"] = policy_loss.detach()

    if cfg.ratio_kl_coef > 0:  # Kimi-style squared log-ratio to the anchor, on every valid token (prime-rl)
        penalty = 0.5 * log_ratio * log_ratio  # d/dlp = lr_t (the anchor is data)
        metrics["ratio_kl"] = penalty.detach().sum() / m.sum().clamp(min=1.0)
        per_token = penalty if token_weights is None else penalty * clean(token_weights)
        ratio_kl_loss = normalizers.aggregate(per_token, cfg.loss_agg_mode)
        metrics["ratio_kl_loss"] = ratio_kl_loss.detach()
        loss = loss + cfg.ratio_kl_coef * ratio_kl_loss

    if ref is not None:
        kl = _kl(cfg, lp, ref) * m
        if cfg.kl_ratio_correction:  # TRL use_bias_correction_kl: the ratio before any delta cap
            kl = kl * ratio
        metrics["kl"] = kl.detach().sum() / m.sum().clamp(min=1.0)
        if cfg.kl_coef > 0:
            kl_loss = normalizers.aggregate(kl, cfg.kl_agg_mode or cfg.loss_agg_mode)
            metrics["kl_loss"] = kl_loss.detach()
            loss = loss + cfg.kl_coef * kl_loss

    if ent is not None:
        metrics["entropy"] = ent.detach().sum() / m.sum().clamp(min=1.0)
        if cfg.entropy_coef != 0:
            # the bonus acts on the tokens the entropy selection keeps (TRL: mask * entropy_mask)
            entropy_loss = normalizers.aggregate(ent * entropy_selected, cfg.entropy_agg_mode or cfg.loss_agg_mode,
                                                 count_mask=entropy_selected)  # fmt: skip
            metrics["entropy_loss"] = entropy_loss.detach()
            loss = loss - cfg.entropy_coef * entropy_loss

    metrics["ppo_kl"] = (-clamp_log(log_ratio) * m).detach().sum() / m.sum().clamp(min=1.0)
    metrics["ratio/mean"] = level_mean(ratio).detach()
    metrics["ratio/min"] = _masked_min(ratio.detach(), valid, 1.0)
    metrics["ratio/max"] = _masked_max(ratio.detach(), valid, 1.0)
    return LossHeadOutput(loss, {k: v.detach().float() for k, v in metrics.items()})


class _Normalizers:
    """Turns per-token loss terms into the scalar of each loss_agg_mode (verl's names).

    With global counts (num_tokens, num_sequences) the micro-batch losses of one optimizer step sum,
    and average over dp_size ranks, to the loss of the whole step. Without them the local counts are
    used, multiplied by grad_accum_steps (each micro-batch is a mean, accumulated steps average).
    Every local denominator is at least 1: an all-masked batch gives 0, never NaN. Given counts are taken as
    they are (the functional layer refuses any that is not a finite number > 0).
    """

    def __init__(self, m, seq_index, seq_len, num_tokens, num_sequences, dp_size, grad_accum_steps, cfg):
        self.m = m
        self.seq_index = seq_index
        self.seq_len = seq_len
        self.num_tokens = num_tokens
        self.num_sequences = num_sequences
        self.dp_size = dp_size
        self.grad_accum_steps = grad_accum_steps
        self.max_completion_length = cfg.max_completion_length
        self.length_power = cfg.length_power

    def token_count(self):
        if self.num_tokens is not None:
            return float(self.num_tokens)
        return self.m.sum().clamp(min=1.0) * self.grad_accum_steps

    def sequence_count(self):
        if self.num_sequences is not None:
            return float(self.num_sequences)
        return (self.seq_len > 0).float().sum().clamp(min=1.0) * self.grad_accum_steps

    def aggregate(self, per_token, mode, count_mask=None):
        per_token = per_token * self.m
        if mode == "token-mean":
            return per_token.sum() / self.token_count() * self.dp_size
        if mode == "token-mean-local":  # TRL entropy bonus: local mean over the tokens acted on / GA
            local = (self.m if count_mask is None else count_mask).sum().clamp(min=1.0)
            return per_token.sum() / local / self.grad_accum_steps
        if mode == "token-sum":
            return per_token.sum() * self.dp_size
        seq_totals = _segment_sum(per_token, self.seq_index, self.seq_len.shape[0])
        if mode == "seq-mean-token-sum":
            return seq_totals.sum() / self.sequence_count() * self.dp_size
        if mode == "seq-mean-token-sum-norm":
            return seq_totals.sum() / self.sequence_count() / self.max_completion_length * self.dp_size
        if mode == "seq-mean-token-mean":
            return (seq_totals / self.seq_len.clamp(min=1.0)).sum() / self.sequence_count() * self.dp_size
        if mode == "length-pow":  # sequence i weighs |o_i|^-p per token, normalised to total weight 1
            p = self.length_power
            lengths = self.seq_len.clamp(min=1.0)
            units = ((self.seq_len > 0).float() * lengths ** (1.0 - p)).sum().clamp(min=1e-30)
            return (seq_totals * lengths ** (-p)).sum() / (units * self.grad_accum_steps) * self.dp_size
        raise AssertionError(mode)  # pragma: no cover


# the variants that report TRL's clip statistics (LossVariant.clip_metrics)
CLIP_METRIC_LOSSES = tuple(name for name, v in variants.VARIANTS.items() if v.clip_metrics)


def metric_names(cfg, *, has_ref: bool, has_entropy: bool, has_is_weights: bool) -> tuple[str, ...]:
    """The metric names the loss head reports for `cfg` and the inputs present, sorted: a function of the
    config alone, so a compiled graph knows the metrics' layout without running (grpo_kernels/_custom_ops.py;
    tests check it against every configuration's eager metrics)."""
    names = {"policy_loss", "ppo_kl", "ratio/mean", "ratio/min", "ratio/max"}
    names |= variants.get(cfg.loss_type).metric_names(cfg)  # the variant's own (variants/<loss_type>.py)
    if cfg.off_policy_mask_threshold is not None:
        names.add("selection/off_policy_dropped_frac")
    if cfg.top_entropy_quantile < 1.0:
        names.add("selection/entropy_kept_frac")
    if cfg.old_prob_threshold is not None:
        names.add("selection/old_prob_kept_frac")
    if cfg.is_gate is not None:
        names.add("is_weight/gated_frac")
    if cfg.ratio_kl_coef > 0:
        names |= {"ratio_kl", "ratio_kl_loss"}
    if cfg.is_level is not None or cfg.is_gate is not None or has_is_weights:
        names |= {"is_weight/mean", "is_weight/min", "is_weight/max"}
        if cfg.is_mode == "mask" and cfg.is_level is not None:
            names.add("is_weight/masked_frac")
    if has_ref:
        names.add("kl")
        if cfg.kl_coef > 0:
            names.add("kl_loss")
    if has_entropy:
        names.add("entropy")
        if cfg.entropy_coef != 0:
            names.add("entropy_loss")
    return tuple(sorted(names))


def _segment_sum(x, seq_index, num_seqs):
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)


def _discounted_prefix_sum(x, seq_index, decay):
    """s_t = x_t + decay * s_{t-1} within each sequence (a sequence's tokens are contiguous and in
    order, so the predecessor of token j is token j - 1): a loop over positions, vectorised over
    sequences."""
    n = x.shape[0]
    if n == 0:
        return x
    idx = torch.arange(n, device=x.device)
    starts = torch.ones(n, dtype=torch.bool, device=x.device)
    starts[1:] = seq_index[1:] != seq_index[:-1]
    position = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    out = torch.zeros_like(x)
    for p in range(int(position.max()) + 1):
        at = (position == p).nonzero().squeeze(-1)
        value = x[at] if p == 0 else x[at] + decay * out[at - 1]
        out = out.index_put((at,), value)
    return out


def _positions(seq_index):
    """Position of each token within its sequence (0 at the sequence's first token), int64 [N]."""
    n = seq_index.shape[0]
    idx = torch.arange(n, device=seq_index.device)
    starts = torch.ones(n, dtype=torch.bool, device=seq_index.device)
    starts[1:] = seq_index[1:] != seq_index[:-1]
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values


def _symmetric_prefix_sum(x, seq_index, decay):
    """s_t = sum_{k<=t} max(decay^k, decay^(t-k)) x_k within each sequence (positions k, t from its start).

    For decay < 1 the larger weight is decay^k when k <= h = floor(t/2), else decay^(t-k), so
        s_t = sum_{k<=h} decay^k x_k  +  (S_t - decay^(t-h) S_h),   S = the discounted prefix sum
    (S_t - decay^(t-h) S_h = sum_{h<k<=t} decay^(t-k) x_k). Both terms are scans read at t and at h:
    O(N) work, differentiable by autograd. decay = 1 gives the plain prefix sum."""
    n = x.shape[0]
    if n == 0:
        return x
    position = _positions(seq_index)
    half = position // 2
    at_half = torch.arange(n, device=x.device) - (position - half)  # the token at position h, same sequence
    powers = torch.pow(torch.full_like(x, float(decay)), position.to(x.dtype))
    head = _discounted_prefix_sum(powers * x, seq_index, 1.0)  # sum_{k<=t} decay^k x_k
    scan = _discounted_prefix_sum(x, seq_index, decay)
    tail_scale = torch.pow(torch.full_like(x, float(decay)), (position - half).to(x.dtype))
    return head[at_half] + scan - tail_scale * scan[at_half]


def _masked_min(x, valid, empty: float):
    """Min over the valid entries; `empty` when there is none (an all-masked batch: a defined value for
    loggers that reject NaN, README "Metrics")."""
    return x[valid].min().detach().float() if valid.any() else torch.tensor(empty, device=x.device)


def _masked_max(x, valid, empty: float):
    return x[valid].max().detach().float() if valid.any() else torch.tensor(empty, device=x.device)


def _kl(cfg, lp, ref):
    """Per-token KL(pi_theta || pi_ref) estimators of Schulman's note, x = log(pi_ref / pi_theta)."""
    x = ref - lp
    name = cfg.kl_estimator
    if name == "k1":
        value = -x
    elif name == "k2":
        value = 0.5 * x * x
    elif name == "k3":  # unclamped (TRL)
        value = torch.exp(x) - x - 1.0
    elif name == "low_var_kl":  # k3 with verl's clamps
        xc = x.clamp(-20.0, 20.0)
        value = (torch.exp(xc) - xc - 1.0).clamp(-10.0, 10.0)
    elif name == "abs":
        value = x.abs()
    else:  # pragma: no cover
        raise AssertionError(name)
    if cfg.kl_straight_through:  # verl "name+": value of the estimator, gradient of k2
        k2 = 0.5 * x * x
        value = k2 - k2.detach() + value.detach()
    return value


def _sampler_is_weights(cfg, old, rollout, scored, m, seq_sum, seq_index):
    """Detached importance weights pi_old / pi_rollout (TRL vllm_importance_sampling_*):
    token level rho_t = exp(old_t - rollout_t); sequence level rho_i = exp(sum_t (old_t - rollout_t)) (their
    product); sequence_geometric rho_i = exp(sum_t (old_t - rollout_t) / |o_i|) (their geometric mean).
    "truncate" clamps rho to [is_min, is_max] (TIS); "mask" zeroes it outside (MIS / IcePop); a bound that
    is None is none."""
    if rollout is None:
        raise ValueError("is_level is set but rollout_logprobs were not given")
    log_rho = torch.where(scored, (old - rollout) * m, torch.zeros_like(old)).detach()
    if cfg.log_ratio_clamp is not None:  # the same guard as every exponent of a log-ratio
        log_rho = log_rho.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if cfg.is_level in ("sequence", "sequence_geometric"):
        log_rho = seq_sum(log_rho)
        if cfg.is_level == "sequence_geometric":
            log_rho = log_rho / seq_sum(m).clamp(min=1.0)
        log_rho = log_rho[seq_index]
        if cfg.log_ratio_clamp is not None:
            log_rho = log_rho.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    rho = torch.exp(log_rho)
    lo = 0.0 if cfg.is_min is None else cfg.is_min
    hi = float("inf") if cfg.is_max is None else cfg.is_max
    if cfg.is_mode == "truncate":
        rho = rho.clamp(min=lo, max=hi)
    else:
        rho = torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros_like(rho))
    return rho * m


def _sampler_gate(cfg, old, rollout, scored, m, seq_sum, seq_index):
    """OpenRLHF's train / rollout gating: 1 where the statistic between the sampler's and the old policy's
    probability of the sampled token lies in [is_gate_min, is_gate_max], else 0 (detached). Per token:
    ratio exp(clamp(old - rollout)), binary_kl KL_b(rollout || old), tv |e^rollout - e^old|; per sequence the
    ratio's geometric mean, the divergences' mean over the valid tokens. An unscored (NaN) sampler token counts
    as rollout = old (statistic 1, 0, 0)."""
    if rollout is None:
        raise ValueError("is_gate is set but rollout_logprobs were not given")
    with torch.no_grad():
        if cfg.is_gate == "ratio":  # in log space until the end (the geometric mean of a sequence)
            stat = torch.where(scored, (old - rollout) * m, torch.zeros_like(old))
            if cfg.log_ratio_clamp is not None:
                stat = stat.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        elif cfg.is_gate == "binary_kl":
            stat = torch.where(scored, binary_kl(rollout, old), torch.zeros_like(old)) * m
        else:
            stat = torch.where(scored, (rollout.exp() - old.exp()).abs(), torch.zeros_like(old)) * m
        if cfg.is_gate_level == "sequence":
            stat = (seq_sum(stat) / seq_sum(m).clamp(min=1.0))[seq_index]
        if cfg.is_gate == "ratio":
            stat = torch.exp(stat)
        lo = float("-inf") if cfg.is_gate_min is None else cfg.is_gate_min
        hi = float("inf") if cfg.is_gate_max is None else cfg.is_gate_max
        return ((stat >= lo) & (stat <= hi)).float() * m


def top_entropy_selection(ent, valid, quantile, group=None):
    """TRL get_high_entropy_mask: tokens whose entropy is >= the (1 - rho) quantile of the valid
    tokens' entropies (torch.quantile, linear interpolation). Returns a {0, 1} float tensor.

    `group` (a torch.distributed process group): the quantile is taken over the valid tokens of every
    process in it, as TRL gathers them across processes (a collective: every rank must call it, also a
    rank without valid tokens)."""
    local = ent.detach().float()[valid]
    if group is not None:
        local = _gather_variable(local, group)
    if local.numel() == 0 or not bool(valid.any()):
        return torch.zeros(ent.shape, dtype=torch.float32, device=ent.device)
    threshold = torch.quantile(local, 1.0 - quantile)
    return ((ent.detach() >= threshold) & valid).float()


def _gather_variable(x, group):
    """The 1-D tensors `x` of every rank of `group`, concatenated in rank order (lengths may differ).

    `group`: a process group, or the functional layer's Agreement for it (grpo_kernels/_agreement.py): the
    first all-gather (of the lengths) then also carries the ranks' agreement on the config and the global
    normalizers, and a peer's failed input checks, so every rank raises the same error."""
    import torch.distributed as dist

    from ..._agreement import Agreement

    agreement = group if isinstance(group, Agreement) else Agreement(group, "entropy_group", "the top-entropy quantile")
    world = dist.get_world_size(agreement.group)
    if world == 1:
        return x
    sizes = [row["size"] for row in agreement.exchange(x.numel())]
    padded = torch.zeros(max(sizes), dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=agreement.group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])



