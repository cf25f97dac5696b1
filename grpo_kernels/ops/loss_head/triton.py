"""The loss head (B of docs/design.md §1) as one Triton kernel: per-token loss terms, aggregation weights,
metric partial sums and the per-token gradients dL/dlogp, dL/dentropy, for every variant of
reference.py (the oracle it is tested against, formula by formula). Each loss variant's per-token objective
and its gradient is a Triton piece of its file, variants/<loss_type>.py, inlined here and selected by its
constant LOSS_<NAME> (the registry's LossId enum).

One program per sequence (grid = S). A program walks its tokens in blocks, up to three times:
  pass A (when the variant needs sequence statistics): lengths, sum of log-ratios, sequence IS,
         off-policy KL, VESPO / GMPO sums, summed log-probs (group DPO);
  pass B: per token objective, KL, entropy bonus, metrics; writes the gradient of everything that
         depends on the token alone;
  pass C (sequence-valued or prefix ratios only): adds the gradient that flows through the
         sequence's ratio (a broadcast, or a reverse discounted scan for the prefix trace).
Each program writes NUM_PARTIALS partial sums for its sequence; `finalize` reduces them over
sequences (in torch: deterministic, no atomics) into the loss and the metrics, so partials of
several chunks of sequences (the fused one-pass path) concatenate exactly.

Every hyperparameter is a runtime argument; constexprs select code paths only (loss type, ratio
level, KL estimator, aggregation modes, which inputs exist). Optional bounds use sentinels
(delta = +inf when off, dual clip c = +inf, log-ratio clamp = +inf).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...config import PolicyLossConfig
from . import variants
from .variants import (LossId, _base, cispo, clip_cov, dcpo, dppo, gmpo, gpg, group_dpo, kl_cov, ppo_clip, pspo, sapo,
                       vespo)  # fmt: skip


def _bind_variant_pieces():
    """Jit every Triton piece of the variant files (variants/_base.py `triton_piece`) and bind their `tl`: done
    here, when the kernel module loads, so the variants import without Triton (config.py reads them)."""
    modules = [_base, *variants.MODULES.values()]
    jitted = {}
    for module in modules:
        module.tl = tl
        for value in list(vars(module).values()):
            if getattr(value, "__loss_head_triton_piece__", False) and id(value) not in jitted:
                jitted[id(value)] = triton.jit(value)
    for module in modules:
        for name, value in list(vars(module).items()):
            if getattr(value, "__loss_head_triton_piece__", False):
                setattr(module, name, jitted[id(value)])


_bind_variant_pieces()

# ---- code-path ids (constexpr) -------------------------------------------------------------------
# LOSS: one named constant per loss variant, from the registry's enum (variants/__init__.py LossId)
LOSS_IDS = {name: int(LossId[name.upper()]) for name in variants.LOSS_TYPES}
(LOSS_PPO_CLIP, LOSS_CISPO, LOSS_GPG, LOSS_SAPO, LOSS_PSPO, LOSS_DCPO, LOSS_VESPO, LOSS_CLIP_COV, LOSS_KL_COV, LOSS_GMPO,
 LOSS_GROUP_DPO, LOSS_DPPO) = (tl.constexpr(int(i)) for i in LossId)  # in LossId order (tests check each name)
LEVEL_IDS = {"token": 0, "sequence": 1, "sequence_token": 2, "sequence_sum": 3, "prefix": 4}
KL_IDS = {"k1": 0, "k2": 1, "k3": 2, "low_var_kl": 3, "abs": 4}
IS_LEVEL_IDS = {None: 0, "token": 1, "sequence": 2, "sequence_geometric": 3}
IS_GATE_IDS = {None: 0, "ratio": 1, "binary_kl": 2, "tv": 3}
AGG_IDS = {"token-mean": 0, "token-sum": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3,
           "seq-mean-token-mean": 4, "length-pow": 5, "token-mean-local": 6}  # fmt: skip

# ---- per-sequence partial sums written by the kernel ---------------------------------------------
(P_LOSS_PG, P_LOSS_KL, P_LOSS_ENT, P_VALID, P_RATIO_SUM, P_RATIO_MIN, P_RATIO_MAX, P_LOW, P_HIGH, P_REGION,
 P_DUAL, P_ANY, P_PPO_KL, P_KL, P_ENT, P_IS_SUM, P_IS_MIN, P_IS_MAX, P_IS_ZERO, P_OFFPOL_DROP, P_ENT_KEPT,
 P_OLDPROB_KEPT, P_COV, P_GMPO_HIGH, P_GMPO_LOW, P_SUM_LP, P_SUM_REF, P_SUM_ADV, P_ABS_LR, P_PHI, P_RATIO_KL,
 P_LOSS_RATIO_KL, P_GATED) = range(33)  # fmt: skip
NUM_PARTIALS = 36
# the columns a variant's finalize reads by name (variants/_base.py Partials)
_SLOTS = {"dual": P_DUAL, "any": P_ANY, "cov": P_COV, "abs_lr": P_ABS_LR, "phi": P_PHI, "gmpo_high": P_GMPO_HIGH,
          "gmpo_low": P_GMPO_LOW, "sum_lp": P_SUM_LP, "sum_ref": P_SUM_REF, "sum_adv": P_SUM_ADV}  # fmt: skip
PARTIALS_PER_SEQ = tl.constexpr(NUM_PARTIALS)
# normalizer slots (a small device tensor, so no host sync is needed to build it)
N_TOKENS, N_SEQUENCES, N_LENGTH_POW, N_ENT_LOCAL = range(4)

LOG_1E8 = tl.constexpr(math.log(1e-8))  # VESPO lower clamp (TRL: log(1e-8))


@triton.jit
def _compose(a1, b1, a2, b2):
    # linear maps s -> a s + b, applied first (a1, b1) then (a2, b2): the discounted-sum scan
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _agg_weight(AGG: tl.constexpr, length, norms_ptr, dp_size, max_len, length_power):
    """d(aggregated loss) / d(per-token term) for one token of a sequence with `length` valid tokens."""
    if AGG == 0:  # token-mean
        w = dp_size / tl.load(norms_ptr + 0)
    elif AGG == 1:  # token-sum
        w = dp_size + 0.0 * length
    elif AGG == 2:  # seq-mean-token-sum
        w = dp_size / tl.load(norms_ptr + 1)
    elif AGG == 3:  # seq-mean-token-sum-norm
        w = dp_size / (tl.load(norms_ptr + 1) * max_len)
    elif AGG == 4:  # seq-mean-token-mean
        w = dp_size / (tl.maximum(length, 1.0) * tl.load(norms_ptr + 1))
    elif AGG == 5:  # length-pow: |o|^-p / sum_j |o_j|^(1-p)
        w = dp_size * tl.exp(-length_power * tl.log(tl.maximum(length, 1.0))) / tl.load(norms_ptr + 2)
    else:  # token-mean-local (TRL entropy bonus)
        w = 1.0 / tl.load(norms_ptr + 3) + 0.0 * length
    return w


_binary_kl = _base.binary_kl_piece  # KL(Bernoulli(mu) || Bernoulli(p)), the sampler gate's and DPPO's


@triton.jit
def _gate_statistic(GATE: tl.constexpr, old, rollout, scored, mf, log_clamp):
    """The sampler gate's per-token statistic, 0 on masked and unscored tokens: the clamped log-ratio
    old - rollout (the ratio gate, exponentiated by the caller), KL_b(rollout || old), or |p_rollout - p_old|."""
    if GATE == 1:
        s = tl.minimum(tl.maximum(tl.where(scored, (old - rollout) * mf, 0.0), -log_clamp), log_clamp)
    elif GATE == 2:
        s = tl.where(scored, _binary_kl(rollout, old), 0.0) * mf
    else:
        s = tl.where(scored, tl.abs(tl.exp(rollout) - tl.exp(old)), 0.0) * mf
    return s


@triton.jit
def _kl_estimator(x, KL_EST: tl.constexpr, KL_ST: tl.constexpr):
    """(KL estimate, its derivative in lp) of x = ref - lp for the estimator KL_IDS names (reference._kl)."""
    if KL_EST == 0:
        kl = -x
        d_kl = 1.0 + 0.0 * x
    elif KL_EST == 1:
        kl = 0.5 * x * x
        d_kl = -x
    elif KL_EST == 2:
        kl = tl.exp(x) - x - 1.0
        d_kl = 1.0 - tl.exp(x)
    elif KL_EST == 3:
        xc = tl.minimum(tl.maximum(x, -20.0), 20.0)
        raw = tl.exp(xc) - xc - 1.0
        kl = tl.minimum(tl.maximum(raw, -10.0), 10.0)
        d_kl = (1.0 - tl.exp(xc)) * tl.where((x >= -20.0) & (x <= 20.0), 1.0, 0.0) * tl.where(
            (raw >= -10.0) & (raw <= 10.0), 1.0, 0.0
        )
    else:
        kl = tl.abs(x)
        d_kl = -tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    if KL_ST:
        d_kl = -x
    return kl, d_kl


@triton.jit
def loss_head_fwd_bwd_kernel(
    lp_ptr, adv_ptr, mask_ptr, old_ptr, ref_ptr, rollout_ptr, isw_ptr, ent_ptr, tokw_ptr, sel_ptr, cov_ptr,
    cu_ptr, norms_ptr, glp_ptr, gent_ptr, scratch_ptr, part_ptr, seqlen_ptr,
    clip_low, clip_high, dual_c, delta, log_clamp, cispo_cap, tau_pos, tau_neg, pspo_alpha, dcpo_max,
    prefix_decay, vk_pos, vl_pos, vk_neg, vl_neg, kl_coef, is_min, is_max, offpol_thr, oldprob_thr,
    kl_cov_coef, ent_coef, max_len, length_power, dp_size, ratio_kl_coef, gate_min, gate_max,
    LOSS: tl.constexpr, LEVEL: tl.constexpr, KL_EST: tl.constexpr, AGG: tl.constexpr, ENT_AGG: tl.constexpr,
    KL_AGG: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, USE_KL: tl.constexpr, KL_RATIO: tl.constexpr,
    KL_ST: tl.constexpr, IS_LEVEL: tl.constexpr, IS_MASK: tl.constexpr, HAS_ISW: tl.constexpr,
    HAS_ENT: tl.constexpr, USE_ENT_BONUS: tl.constexpr, HAS_TOKW: tl.constexpr, HAS_SEL: tl.constexpr,
    HAS_COV: tl.constexpr, OFFPOL: tl.constexpr, HAS_ROLLOUT: tl.constexpr, OLDPROB: tl.constexpr,
    CISPO_ABS: tl.constexpr, NEED_GRAD: tl.constexpr, HAS_SEQ_LEN: tl.constexpr, ANCHOR_ROLLOUT: tl.constexpr,
    CISPO_MASK: tl.constexpr, DPPO_KL: tl.constexpr, RATIO_KL: tl.constexpr, GATE: tl.constexpr,
    GATE_SEQ: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    lane = tl.arange(0, BLOCK)
    # ratio_level: 0 token, 1 sequence, 2 sequence_token, 3 sequence_sum, 4 prefix
    SEQ_RATIO: tl.constexpr = LEVEL == 1 or LEVEL == 2 or LEVEL == 3
    NEED_LEN: tl.constexpr = (AGG >= 4 or ENT_AGG == 4 or ENT_AGG == 5 or KL_AGG >= 4 or LEVEL == 1 or LEVEL == 2
                              or LOSS == LOSS_GMPO)  # fmt: skip
    # HAS_SEQ_LEN: this program holds a segment of a longer sequence (the one-pass schedule cut it across
    # chunks; only token-local objectives) and the sequence's whole valid length is given, not counted
    PASS_A: tl.constexpr = ((NEED_LEN and not HAS_SEQ_LEN) or SEQ_RATIO or IS_LEVEL == 2 or IS_LEVEL == 3 or OFFPOL
                            or LOSS == LOSS_VESPO or LOSS == LOSS_GMPO or LOSS == LOSS_GROUP_DPO or GATE_SEQ)  # fmt: skip
    # pass B reads the sampler's log-probs for token IS weights, the rollout anchor and a token gate
    ROLLOUT_B: tl.constexpr = HAS_ROLLOUT and ((IS_LEVEL == 1 and LOSS != LOSS_VESPO) or ANCHOR_ROLLOUT
                                               or (GATE != 0 and not GATE_SEQ))  # fmt: skip

    # ---------------- pass A: sequence statistics ----------------
    length = 0.0
    sum_lr = 0.0
    sum_is = 0.0
    sum_beh = 0.0
    sum_vespo = 0.0
    sum_log_is = 0.0
    sum_gmpo = 0.0
    sum_adv = 0.0
    sum_lp = 0.0
    sum_ref = 0.0
    sum_log_isw = 0.0
    sum_gate = 0.0
    any_nonneg = 0.0
    if PASS_A:
        for off in tl.range(start, end, BLOCK):
            idx = off + lane
            inb = idx < end
            m = (tl.load(mask_ptr + idx, mask=inb, other=0) != 0) & inb
            mf = m.to(tl.float32)
            lp = tl.where(m, tl.load(lp_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            if HAS_OLD:
                old = tl.where(m, tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            else:
                old = lp
            adv = tl.where(m, tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            if HAS_ROLLOUT:
                rollout = tl.where(m, tl.load(rollout_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
                scored = rollout == rollout  # NaN: the sampler could not score the token (TRL)
            if ANCHOR_ROLLOUT:  # the ratio against the sampler's log-probs
                lr = (lp - rollout) * mf
            else:
                lr = (lp - old) * mf
            length += tl.sum(mf)
            sum_lr += tl.sum(lr)
            sum_adv += tl.sum(adv * mf)
            any_nonneg = tl.maximum(any_nonneg, tl.max(tl.where(m & (adv >= 0), 1.0, 0.0)))
            if HAS_ROLLOUT:
                if IS_LEVEL == 2 or IS_LEVEL == 3:
                    d = tl.minimum(tl.maximum(tl.where(scored, (old - rollout) * mf, 0.0), -log_clamp), log_clamp)
                    sum_is += tl.sum(d)
                if GATE_SEQ:
                    sum_gate += tl.sum(_gate_statistic(GATE, old, rollout, scored, mf, log_clamp))
                if OFFPOL:
                    sum_beh += tl.sum(tl.where(scored, (rollout - lp) * mf, 0.0))
            elif OFFPOL:
                sum_beh += tl.sum((old - lp) * mf)
            if LOSS == LOSS_VESPO:  # the sequence log-ratio W (with the token IS weights TRL folds in)
                sum_vespo += vespo.block_log_ratio(lr, mf)
                if IS_LEVEL == 1:
                    sum_log_is += vespo.block_log_is(old, rollout, scored, m, mf, log_clamp, is_min, is_max, IS_MASK,
                                                     LOG_1E8)  # fmt: skip
            if LOSS == LOSS_GMPO:  # the sign-aware clipped log-ratios (and the IS weights' geometric mean)
                sum_gmpo += gmpo.block_log_ratio(lr, adv, mf, clip_low, clip_high)
                if HAS_ISW:
                    sum_log_isw += gmpo.block_log_is(isw_ptr, idx, inb, m, mf)
            if LOSS == LOSS_GROUP_DPO:  # the summed log-probs its pairing compares
                sum_lp, sum_ref = group_dpo.block_sums(lp, m, mf, ref_ptr, idx, inb, sum_lp, sum_ref)
    if HAS_SEQ_LEN:
        length = tl.load(seqlen_ptr + seq).to(tl.float32)
    len1 = tl.maximum(length, 1.0)
    seq_log_w = 0.0
    if LEVEL == 1 or LEVEL == 2:
        seq_log_w = sum_lr / len1
    elif LEVEL == 3:
        seq_log_w = sum_lr
    seq_is = 1.0
    if IS_LEVEL == 2 or IS_LEVEL == 3:
        if IS_LEVEL == 3:  # the geometric mean of the token weights
            sum_is = sum_is / len1
        seq_is = tl.exp(tl.minimum(tl.maximum(sum_is, -log_clamp), log_clamp))
        if IS_MASK:
            seq_is = tl.where((seq_is >= is_min) & (seq_is <= is_max), seq_is, 0.0)
        else:
            seq_is = tl.minimum(tl.maximum(seq_is, is_min), is_max)
    gate_seq_keep = 1.0
    if GATE_SEQ:  # the sequence's mean statistic (the ratio's geometric mean)
        gate_stat = sum_gate / len1
        if GATE == 1:
            gate_stat = tl.exp(gate_stat)
        gate_seq_keep = tl.where((gate_stat >= gate_min) & (gate_stat <= gate_max), 1.0, 0.0)
    offpol_seq_ok = 1.0
    if OFFPOL:
        offpol_seq_ok = tl.where(sum_beh / len1 <= offpol_thr, 1.0, 0.0)
    log_w_vespo = tl.minimum(tl.maximum(sum_vespo + sum_log_is, LOG_1E8), 20.0)

    w_seq = _agg_weight(AGG, length, norms_ptr, dp_size, max_len, length_power)
    w_ent = _agg_weight(ENT_AGG, length, norms_ptr, dp_size, max_len, length_power)
    w_kl = _agg_weight(KL_AGG, length, norms_ptr, dp_size, max_len, length_power)

    # GMPO: the whole sequence is one objective term
    gmpo_coef = 0.0
    loss_pg = 0.0
    if LOSS == LOSS_GMPO:
        loss_pg, gmpo_coef = gmpo.sequence_term(sum_gmpo, sum_adv, sum_log_isw, length, len1, offpol_seq_ok,
                                                any_nonneg, norms_ptr, dp_size, HAS_ISW, OFFPOL)  # fmt: skip

    # ---------------- pass B: per token ----------------
    acc_loss_pg = tl.zeros([BLOCK], tl.float32)
    acc_loss_kl = tl.zeros([BLOCK], tl.float32)
    acc_loss_ent = tl.zeros([BLOCK], tl.float32)
    acc_valid = tl.zeros([BLOCK], tl.float32)
    acc_ratio = tl.zeros([BLOCK], tl.float32)
    ratio_min = tl.full([BLOCK], float("inf"), tl.float32)
    ratio_max = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_low = tl.zeros([BLOCK], tl.float32)
    acc_high = tl.zeros([BLOCK], tl.float32)
    acc_region = tl.zeros([BLOCK], tl.float32)
    acc_dual = tl.zeros([BLOCK], tl.float32)
    acc_any = tl.zeros([BLOCK], tl.float32)
    acc_ppo_kl = tl.zeros([BLOCK], tl.float32)
    acc_kl = tl.zeros([BLOCK], tl.float32)
    acc_ent = tl.zeros([BLOCK], tl.float32)
    acc_is = tl.zeros([BLOCK], tl.float32)
    is_lo = tl.full([BLOCK], float("inf"), tl.float32)
    is_hi = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_is_zero = tl.zeros([BLOCK], tl.float32)
    acc_offpol = tl.zeros([BLOCK], tl.float32)
    acc_ent_kept = tl.zeros([BLOCK], tl.float32)
    acc_oldprob = tl.zeros([BLOCK], tl.float32)
    acc_cov = tl.zeros([BLOCK], tl.float32)
    acc_gmpo_hi = tl.zeros([BLOCK], tl.float32)
    acc_gmpo_lo = tl.zeros([BLOCK], tl.float32)
    acc_g_seq = tl.zeros([BLOCK], tl.float32)  # sum of dL/dlog_w over the sequence (sequence ratios)
    acc_abs_lr = tl.zeros([BLOCK], tl.float32)
    acc_phi = tl.zeros([BLOCK], tl.float32)
    acc_ratio_kl = tl.zeros([BLOCK], tl.float32)
    acc_loss_rkl = tl.zeros([BLOCK], tl.float32)
    acc_gated = tl.zeros([BLOCK], tl.float32)
    carry = 0.0  # prefix trace value before this block
    lower = 1.0 - clip_low
    upper = 1.0 + clip_high
    for off in tl.range(start, end, BLOCK):
        idx = off + lane
        inb = idx < end
        m = (tl.load(mask_ptr + idx, mask=inb, other=0) != 0) & inb
        mf = m.to(tl.float32)
        lp = tl.where(m, tl.load(lp_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
        if HAS_OLD:
            old = tl.where(m, tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
        else:
            old = lp
        adv = tl.where(m, tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
        if ROLLOUT_B:
            rollout = tl.where(m, tl.load(rollout_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            scored = rollout == rollout
        if ANCHOR_ROLLOUT:
            base = rollout
        else:
            base = old
        lr = (lp - base) * mf

        # importance ratio r (value) and dr / dlog_w
        if LEVEL == 0:
            log_w = lr
        elif LEVEL == 4:  # discounted prefix sum, carried across blocks
            decay = tl.where(inb, prefix_decay, 1.0)
            a_scan, b_scan = tl.associative_scan((decay, lr), 0, _compose)
            log_w = a_scan * carry + b_scan
            carry = tl.sum(tl.where(idx == tl.minimum(off + BLOCK, end) - 1, log_w, 0.0))
        else:
            log_w = seq_log_w + 0.0 * lr
        clamp_pass = tl.where((log_w >= -log_clamp) & (log_w <= log_clamp), 1.0, 0.0)
        ratio = tl.exp(tl.minimum(tl.maximum(log_w, -log_clamp), log_clamp)) * mf

        # per-token objective l_t, dl/dr (through the ratio) and dl/dlogp (direct)
        g_r = tl.zeros([BLOCK], tl.float32)
        g_direct = tl.zeros([BLOCK], tl.float32)
        objective = tl.zeros([BLOCK], tl.float32)
        low_bound = lower + 0.0 * lp
        high_bound = upper + 0.0 * lp
        metric_ratio = ratio
        # each variant's piece: variants/<loss_type>.py token_objective
        if LOSS == LOSS_PPO_CLIP or LOSS == LOSS_CLIP_COV:  # Clip-Cov: the plain clip (no delta / dual)
            objective, g_r, metric_ratio = ppo_clip.token_objective(ratio, adv, lp, lower, upper, delta,
                                                                    LOSS == LOSS_PPO_CLIP)  # fmt: skip
        elif LOSS == LOSS_DCPO:
            objective, g_r, low_bound, high_bound = dcpo.token_objective(ratio, adv, old, clip_low, clip_high,
                                                                         dcpo_max)  # fmt: skip
        elif LOSS == LOSS_CISPO:
            objective, g_direct, low_bound, high_bound, acc_any = cispo.token_objective(
                ratio, adv, lp, m, lower, upper, low_bound, high_bound, cispo_cap, acc_any, CISPO_ABS, CISPO_MASK)
        elif LOSS == LOSS_GPG:
            objective, g_direct = gpg.token_objective(adv, lp)
        elif LOSS == LOSS_SAPO:
            objective, g_r = sapo.token_objective(ratio, adv, tau_pos, tau_neg)
        elif LOSS == LOSS_PSPO:
            objective, g_r = pspo.token_objective(ratio, adv, pspo_alpha)
        elif LOSS == LOSS_VESPO:
            objective, g_direct, acc_phi = vespo.token_objective(adv, lp, mf, log_w_vespo, vk_pos, vl_pos, vk_neg,
                                                                 vl_neg, acc_phi)  # fmt: skip
        elif LOSS == LOSS_DPPO:
            objective, g_r, acc_low, acc_high, acc_region = dppo.token_objective(
                lp, base, adv, ratio, m, clip_low, clip_high, acc_low, acc_high, acc_region, DPPO_KL)
        elif LOSS == LOSS_KL_COV:
            objective, g_r, g_direct, acc_cov, acc_abs_lr = kl_cov.token_objective(
                ratio, adv, lp, lr, mf, cov_ptr, idx, inb, kl_cov_coef, acc_cov, acc_abs_lr)
        if LOSS == LOSS_CLIP_COV:
            objective, g_r, acc_cov = clip_cov.apply_keep(objective, g_r, cov_ptr, idx, inb, mf, acc_cov)
        if LOSS == LOSS_PPO_CLIP or LOSS == LOSS_DCPO:  # dual clip: for A < 0 the loss is at most -c A
            objective, g_r, acc_dual = ppo_clip.dual_clip(objective, g_r, adv, m, dual_c, acc_dual)
        if LOSS == LOSS_PPO_CLIP or LOSS == LOSS_CISPO or LOSS == LOSS_DCPO or LOSS == LOSS_CLIP_COV:
            low = tl.where(m & (ratio < low_bound) & (adv < 0), 1.0, 0.0)
            high = tl.where(m & (metric_ratio > high_bound) & (adv > 0), 1.0, 0.0)
            acc_low += low
            acc_high += high
            acc_region += tl.maximum(low, high)

        # selection multiplier (off-policy mask, top-entropy, Lopti) and IS weights
        selection = mf
        if OFFPOL:
            keep_tok = tl.maximum(offpol_seq_ok, tl.where(adv >= 0, 1.0, 0.0))
            acc_offpol += (1.0 - keep_tok) * mf
            selection = selection * keep_tok
        ent_selected = mf
        if HAS_SEL:
            ent_selected = tl.load(sel_ptr + idx, mask=inb, other=0.0).to(tl.float32) * mf
            acc_ent_kept += ent_selected
            selection = selection * ent_selected
        if OLDPROB != 0:
            low_prob = tl.where(tl.exp(old) < oldprob_thr, 1.0, 0.0)
            if OLDPROB == 1:
                keep_p = low_prob
            else:
                keep_p = 1.0 - low_prob
            acc_oldprob += keep_p * mf
            selection = selection * keep_p
        weights = 1.0 + 0.0 * lp
        if IS_LEVEL == 1 and LOSS != LOSS_VESPO:
            d = tl.where(scored, (old - rollout) * mf, 0.0)
            d = tl.minimum(tl.maximum(d, -log_clamp), log_clamp)
            rho = tl.exp(d)
            if IS_MASK:
                rho = tl.where((rho >= is_min) & (rho <= is_max), rho, 0.0)
            else:
                rho = tl.minimum(tl.maximum(rho, is_min), is_max)
            weights = rho * mf
        if (IS_LEVEL == 2 or IS_LEVEL == 3) and LOSS != LOSS_VESPO:
            weights = seq_is * mf
        if GATE != 0:  # 0 where the old / sampler statistic leaves [gate_min, gate_max]
            if GATE_SEQ:
                gate = gate_seq_keep * mf
            else:
                stat = _gate_statistic(GATE, old, rollout, scored, mf, log_clamp)
                if GATE == 1:
                    stat = tl.exp(stat)
                gate = tl.where((stat >= gate_min) & (stat <= gate_max), 1.0, 0.0) * mf
            acc_gated += (1.0 - gate) * mf
            weights = weights * gate
        if HAS_ISW:
            weights = weights * tl.where(m, tl.load(isw_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
        if IS_LEVEL != 0 or HAS_ISW or GATE != 0:
            acc_is += weights * mf
            is_lo = tl.minimum(is_lo, tl.where(m, weights, float("inf")))
            is_hi = tl.maximum(is_hi, tl.where(m, weights, float("-inf")))
            acc_is_zero += tl.where(m & (weights == 0), 1.0, 0.0)
        tokw = mf
        if HAS_TOKW:
            tokw = tl.where(m, tl.load(tokw_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            weights = weights * tokw

        # policy term and its gradient
        scale = selection * weights * w_seq
        g_logw = tl.zeros([BLOCK], tl.float32)
        g_lp = tl.zeros([BLOCK], tl.float32)
        if LOSS != LOSS_GMPO and LOSS != LOSS_GROUP_DPO:
            acc_loss_pg += objective * scale
            g_logw = g_r * scale * ratio * clamp_pass
            g_lp = g_direct * scale
        if LOSS == LOSS_GMPO:  # GMPO: through the sign-aware clipped log-ratio of each token
            g_lp, acc_gmpo_hi, acc_gmpo_lo = gmpo.token_gradient(lr, adv, m, mf, clip_low, clip_high, gmpo_coef,
                                                                 acc_gmpo_hi, acc_gmpo_lo)  # fmt: skip

        # KL to the reference
        if HAS_REF:
            ref = tl.where(m, tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            x = ref - lp
            kl, d_kl = _kl_estimator(x, KL_EST, KL_ST)
            kl = kl * mf
            if KL_RATIO:
                acc_kl += kl * ratio
                if USE_KL:
                    acc_loss_kl += kl * ratio * w_kl
                    g_lp += kl_coef * w_kl * ratio * d_kl * mf
                    g_logw += kl_coef * w_kl * kl * ratio * clamp_pass
            else:
                acc_kl += kl
                if USE_KL:
                    acc_loss_kl += kl * w_kl
                    g_lp += kl_coef * w_kl * d_kl * mf

        # Kimi-style squared log-ratio to the anchor, aggregated like the policy term, token weights applied
        if RATIO_KL:
            pen = 0.5 * lr * lr
            acc_ratio_kl += pen * mf
            acc_loss_rkl += pen * tokw * w_seq
            g_lp += ratio_kl_coef * w_seq * tokw * lr * mf

        # entropy: metric and bonus
        if HAS_ENT:
            ent = tl.where(m, tl.load(ent_ptr + idx, mask=inb, other=0.0).to(tl.float32), 0.0)
            acc_ent += ent
            if USE_ENT_BONUS:
                acc_loss_ent += ent * ent_selected * w_ent
                if NEED_GRAD:
                    tl.store(gent_ptr + idx, -ent_coef * w_ent * ent_selected * mf, mask=inb)

        # ratio metrics
        acc_valid += mf
        acc_ratio += ratio * mf
        ratio_min = tl.minimum(ratio_min, tl.where(m, ratio, float("inf")))
        ratio_max = tl.maximum(ratio_max, tl.where(m, ratio, float("-inf")))
        acc_ppo_kl += -tl.minimum(tl.maximum(lr, -log_clamp), log_clamp) * mf

        # gradient: everything that depends on this token alone
        if NEED_GRAD:
            if LEVEL == 0 or LEVEL == 2:
                g_lp += g_logw * mf
            elif LEVEL == 4:
                tl.store(scratch_ptr + idx, g_logw, mask=inb)
            else:
                acc_g_seq += g_logw
            tl.store(glp_ptr + idx, g_lp * mf, mask=inb)

    # ---------------- pass C: gradient through a sequence-valued or prefix ratio ----------------
    if NEED_GRAD and (LEVEL == 1 or LEVEL == 3):
        g_seq = tl.sum(acc_g_seq)
        if LEVEL == 1:
            g_seq = g_seq / len1
        for off in tl.range(start, end, BLOCK):
            idx = off + lane
            inb = idx < end
            m = (tl.load(mask_ptr + idx, mask=inb, other=0) != 0) & inb
            g = tl.load(glp_ptr + idx, mask=inb, other=0.0)
            tl.store(glp_ptr + idx, g + g_seq * m.to(tl.float32), mask=inb)
    if NEED_GRAD and LEVEL == 4:
        n_blocks = tl.cdiv(end - start, BLOCK)
        rev_carry = 0.0
        for i in tl.range(0, n_blocks):
            off = start + (n_blocks - 1 - i) * BLOCK
            idx = off + lane
            inb = idx < end
            m = (tl.load(mask_ptr + idx, mask=inb, other=0) != 0) & inb
            g_logw = tl.load(scratch_ptr + idx, mask=inb, other=0.0)
            decay = tl.where(inb, prefix_decay, 1.0)
            a_scan, b_scan = tl.associative_scan((decay, g_logw), 0, _compose, reverse=True)
            total = a_scan * rev_carry + b_scan  # sum_{t >= k} decay^(t-k) g_logw_t
            rev_carry = tl.sum(tl.where(lane == 0, total, 0.0))
            g = tl.load(glp_ptr + idx, mask=inb, other=0.0)
            tl.store(glp_ptr + idx, g + total * m.to(tl.float32), mask=inb)

    # ---------------- partial sums of this sequence ----------------
    out = part_ptr + seq * PARTIALS_PER_SEQ
    tl.store(out + 0, tl.sum(acc_loss_pg) + loss_pg)
    tl.store(out + 1, tl.sum(acc_loss_kl))
    tl.store(out + 2, tl.sum(acc_loss_ent))
    tl.store(out + 3, tl.sum(acc_valid))
    tl.store(out + 4, tl.sum(acc_ratio))
    tl.store(out + 5, tl.min(ratio_min))
    tl.store(out + 6, tl.max(ratio_max))
    tl.store(out + 7, tl.sum(acc_low))
    tl.store(out + 8, tl.sum(acc_high))
    tl.store(out + 9, tl.sum(acc_region))
    tl.store(out + 10, tl.sum(acc_dual))
    tl.store(out + 11, tl.sum(acc_any))
    tl.store(out + 12, tl.sum(acc_ppo_kl))
    tl.store(out + 13, tl.sum(acc_kl))
    tl.store(out + 14, tl.sum(acc_ent))
    tl.store(out + 15, tl.sum(acc_is))
    tl.store(out + 16, tl.min(is_lo))
    tl.store(out + 17, tl.max(is_hi))
    tl.store(out + 18, tl.sum(acc_is_zero))
    tl.store(out + 19, tl.sum(acc_offpol))
    tl.store(out + 20, tl.sum(acc_ent_kept))
    tl.store(out + 21, tl.sum(acc_oldprob))
    tl.store(out + 22, tl.sum(acc_cov))
    tl.store(out + 23, tl.sum(acc_gmpo_hi))
    tl.store(out + 24, tl.sum(acc_gmpo_lo))
    tl.store(out + 25, sum_lp)
    tl.store(out + 26, sum_ref)
    tl.store(out + 27, sum_adv)
    tl.store(out + 28, tl.sum(acc_abs_lr))
    tl.store(out + 29, tl.sum(acc_phi))
    tl.store(out + 30, tl.sum(acc_ratio_kl))
    tl.store(out + 31, tl.sum(acc_loss_rkl))
    tl.store(out + 32, tl.sum(acc_gated))


# ==================================================================================================
# host side
# ==================================================================================================

DEFAULT_BLOCK = 256  # tokens per step of a program; every accumulator is a [BLOCK] fp32 vector


def _float_or(value, default):
    return default if value is None else float(value)


def normalizer_tensor(valid, seq_len, cfg: PolicyLossConfig, num_tokens, num_sequences, grad_accum_steps,
                      entropy_selected):  # fmt: skip
    """The denominators of the aggregation modes, as a device tensor (no host sync):
    [tokens, sequences, length-pow units, local entropy tokens]; every entry >= 1 (or > 0)."""
    m = valid.float()
    if num_tokens is not None:
        n_tok = torch.full((), float(num_tokens), device=valid.device)  # validated finite > 0
    else:
        n_tok = m.sum().clamp(min=1.0) * grad_accum_steps
    nonempty = (seq_len > 0).float()
    if num_sequences is not None:
        n_seq = torch.full((), float(num_sequences), device=valid.device)  # validated finite > 0
    else:
        n_seq = nonempty.sum().clamp(min=1.0) * grad_accum_steps
    units = (nonempty * seq_len.clamp(min=1.0) ** (1.0 - cfg.length_power)).sum().clamp(min=1e-30)
    units = units * grad_accum_steps
    ent_local = (m if entropy_selected is None else entropy_selected).sum().clamp(min=1.0) * grad_accum_steps
    return torch.stack([n_tok, n_seq, units, ent_local]).float()


def kernel_code_paths(cfg: PolicyLossConfig, *, has_old, has_ref, has_isw, has_ent, has_tokw, has_sel, has_cov,
                      has_rollout, need_grad, has_seq_len=False) -> dict:
    """The constexpr arguments of the kernel for a config and the inputs present (one compiled
    variant per distinct dict; hyperparameter values never appear here)."""
    return dict(
        LOSS=LOSS_IDS[cfg.loss_type], LEVEL=LEVEL_IDS[cfg.ratio_level], KL_EST=KL_IDS[cfg.kl_estimator],
        AGG=AGG_IDS[cfg.loss_agg_mode], ENT_AGG=AGG_IDS[cfg.entropy_agg_mode or cfg.loss_agg_mode],
        KL_AGG=AGG_IDS[cfg.kl_agg_mode or cfg.loss_agg_mode],
        HAS_OLD=has_old, HAS_REF=has_ref, USE_KL=has_ref and cfg.kl_coef > 0, KL_RATIO=cfg.kl_ratio_correction,
        KL_ST=cfg.kl_straight_through, IS_LEVEL=IS_LEVEL_IDS[cfg.is_level],
        IS_MASK=cfg.is_mode == "mask", HAS_ISW=has_isw, HAS_ENT=has_ent,
        USE_ENT_BONUS=has_ent and cfg.entropy_coef != 0, HAS_TOKW=has_tokw, HAS_SEL=has_sel, HAS_COV=has_cov,
        OFFPOL=cfg.off_policy_mask_threshold is not None, HAS_ROLLOUT=has_rollout,
        OLDPROB=0 if cfg.old_prob_threshold is None else (1 if cfg.old_prob_side == "low" else 2),
        CISPO_ABS=cfg.cispo_form == "absolute", NEED_GRAD=need_grad, HAS_SEQ_LEN=has_seq_len,
        ANCHOR_ROLLOUT=cfg.ratio_anchor == "rollout", CISPO_MASK=cfg.cispo_form == "mask",
        DPPO_KL=cfg.loss_type == "dppo" and cfg.dppo_divergence == "binary_kl", RATIO_KL=cfg.ratio_kl_coef > 0,
        GATE=IS_GATE_IDS[cfg.is_gate], GATE_SEQ=cfg.is_gate is not None and cfg.is_gate_level == "sequence",
    )  # fmt: skip


# The register ceiling each launch gives ptxas: the architecture's maximum, i.e. no cap. Without an explicit
# one, the ptxas triton 3.6 runs for sm_100a (CUDA 12.9) settles on 64 registers for this 4-warp kernel and
# spills a value in the tic_grpo path (3 local-memory loads / stores); with it, 84 registers and no spill.
MAX_REGISTERS = 255


def _launch(kernel, grid, args, num_warps, num_stages, max_registers=None):
    """The one place kernels are launched (the AOT compile tier records launches here)."""
    # FP fusion explicitly on: the statistics and dz are written as FMAs (Triton 3.10 turns the default off)
    options = {} if max_registers is None else {"maxnreg": max_registers}
    kernel[grid](**args, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True, **options)


def loss_head_triton(
    logprobs, advantages, valid, cu_seqlens, seq_index, num_seqs, cfg: PolicyLossConfig, *,
    old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, is_weights=None, entropy=None,
    token_weights=None, num_tokens=None, num_sequences=None, dp_size=1, grad_accum_steps=1,
    need_grad_logprobs=True, need_grad_entropy=False, block=None, norms=None, finalize=True, seq_lengths=None,
    entropy_group=None,
):  # fmt: skip
    """Run the kernel on flat [N] inputs (validated by the functional layer).

    Returns (loss 0-d, metrics dict, grad_logprobs [N] | None, grad_entropy [N] | None, partials [S, NUM_PARTIALS]).
    The gradients are those of `loss` (multiply by grad_output in the autograd backward).
    For a chunk of the batch's sequences (the fused one-pass path): pass the batch's `norms`
    (normalizer_tensor) and finalize=False, then `finalize_partials` on the concatenated partials of
    all chunks; loss and metrics are then None here. `seq_lengths` [num_seqs] fp32: the whole valid
    length of the sequence each segment belongs to, when the segments are pieces of longer sequences
    (token-local objectives only, PolicyLossConfig.token_local; their partials are merged by
    `merge_segment_partials`). `entropy_group`: the top-entropy quantile over these processes' tokens.
    """
    from .reference import top_entropy_selection

    device = logprobs.device
    n = logprobs.shape[0]
    m = valid.float()
    seq_len = torch.zeros(num_seqs, device=device).index_add(0, seq_index, m)
    need_grad = need_grad_logprobs or need_grad_entropy

    # selections that need statistics of the whole batch are made here, in torch (as the reference)
    entropy_selected = None
    if cfg.top_entropy_quantile < 1.0:
        entropy_selected = top_entropy_selection(entropy, valid, cfg.top_entropy_quantile, entropy_group)
    cov = None  # the host-chosen tokens of Clip-Cov (kept) / KL-Cov (penalised)
    if cfg.loss_type in ("clip_cov", "kl_cov"):
        cov = variants.MODULES[cfg.loss_type].host_selection(cfg, cfg.params, logprobs, advantages, old_logprobs,
                                                             valid)  # fmt: skip
    if norms is None:
        norms = normalizer_tensor(valid, seq_len, cfg, num_tokens, num_sequences, grad_accum_steps, entropy_selected)

    def ptr(x):
        return x.contiguous() if x is not None else logprobs  # a dummy pointer for absent inputs

    use_ent_bonus = entropy is not None and cfg.entropy_coef != 0
    g_lp = torch.empty(n, dtype=torch.float32, device=device) if need_grad else logprobs
    g_ent = torch.zeros(n, dtype=torch.float32, device=device) if (need_grad and use_ent_bonus) else logprobs
    scratch = torch.empty(n, dtype=torch.float32, device=device) if (need_grad and cfg.ratio_level == "prefix") \
        else logprobs  # fmt: skip
    partials = torch.empty(num_seqs, NUM_PARTIALS, dtype=torch.float32, device=device)
    inf = float("inf")
    if num_seqs > 0:
        args = dict(
            lp_ptr=ptr(logprobs), adv_ptr=ptr(advantages), mask_ptr=valid.to(torch.uint8), old_ptr=ptr(old_logprobs),
            ref_ptr=ptr(ref_logprobs), rollout_ptr=ptr(rollout_logprobs), isw_ptr=ptr(is_weights),
            ent_ptr=ptr(entropy), tokw_ptr=ptr(token_weights), sel_ptr=ptr(entropy_selected), cov_ptr=ptr(cov),
            cu_ptr=cu_seqlens, norms_ptr=norms, glp_ptr=g_lp, gent_ptr=g_ent, scratch_ptr=scratch,
            part_ptr=partials, seqlen_ptr=seq_lengths.float().contiguous() if seq_lengths is not None else logprobs,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_c=_float_or(cfg.dual_clip, inf),
            delta=_float_or(cfg.delta, inf), log_clamp=_float_or(cfg.log_ratio_clamp, inf),
            cispo_cap=_float_or(cfg.cispo_cap, inf), tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg,
            pspo_alpha=cfg.pspo_alpha, dcpo_max=cfg.dcpo_max_ratio, prefix_decay=cfg.prefix_decay,
            vk_pos=cfg.vespo_k_pos, vl_pos=cfg.vespo_lambda_pos, vk_neg=cfg.vespo_k_neg,
            vl_neg=cfg.vespo_lambda_neg, kl_coef=cfg.kl_coef, is_min=_float_or(cfg.is_min, 0.0),
            is_max=_float_or(cfg.is_max, inf), offpol_thr=_float_or(cfg.off_policy_mask_threshold, inf),
            oldprob_thr=_float_or(cfg.old_prob_threshold, 0.0), kl_cov_coef=cfg.kl_cov_coef,
            ent_coef=cfg.entropy_coef, max_len=float(cfg.max_completion_length or 1),
            length_power=cfg.length_power, dp_size=float(dp_size), ratio_kl_coef=cfg.ratio_kl_coef,
            gate_min=_float_or(cfg.is_gate_min, -inf), gate_max=_float_or(cfg.is_gate_max, inf),
            **kernel_code_paths(cfg, has_old=old_logprobs is not None, has_ref=ref_logprobs is not None,
                                has_isw=is_weights is not None, has_ent=entropy is not None,
                                has_tokw=token_weights is not None, has_sel=entropy_selected is not None,
                                has_cov=cov is not None, has_rollout=rollout_logprobs is not None,
                                need_grad=need_grad, has_seq_len=seq_lengths is not None),
            BLOCK=block or DEFAULT_BLOCK,
        )  # fmt: skip
        _launch(loss_head_fwd_bwd_kernel, (num_seqs,), args, num_warps=4, num_stages=1, max_registers=MAX_REGISTERS)

    if not finalize:
        if cfg.loss_type == "group_dpo":
            raise ValueError("group_dpo pairs sequences across the batch: it cannot be finalised per chunk")
        return None, None, g_lp if need_grad_logprobs else None, \
            g_ent if (need_grad_entropy and use_ent_bonus) else None, partials  # fmt: skip
    metrics: dict[str, torch.Tensor] = {}
    loss, extra_grad = _finalize(partials, seq_len, cfg, metrics, dp_size, grad_accum_steps, need_grad,
                                 entropy is not None, ref_logprobs is not None, is_weights is not None)  # fmt: skip
    if need_grad and extra_grad is not None:  # group DPO: the gradient of each sequence's summed log-probs
        g_lp = g_lp + extra_grad[seq_index] * m
    return (
        loss,
        metrics,
        g_lp if need_grad_logprobs else None,
        g_ent if (need_grad_entropy and use_ent_bonus) else None,
        partials,
    )


# partial-sum columns that combine by min / max across the segments of one sequence (the others add)
_MIN_COLUMNS = (P_RATIO_MIN, P_IS_MIN)
_MAX_COLUMNS = (P_RATIO_MAX, P_IS_MAX)


def merge_segment_partials(partials, segment_seq, num_seqs):
    """[num_segments, NUM_PARTIALS] partials of sequence pieces -> [num_seqs, NUM_PARTIALS] per sequence: sums add, the
    min / max columns take min / max (each column's empty value is its identity: 0, +inf, -inf)."""
    merged = torch.zeros(num_seqs, partials.shape[1], dtype=partials.dtype, device=partials.device)
    merged.index_add_(0, segment_seq, partials)
    index = segment_seq[:, None]
    for cols, how, identity in ((_MIN_COLUMNS, "amin", float("inf")), (_MAX_COLUMNS, "amax", float("-inf"))):
        for c in cols:
            column = torch.full((num_seqs,), identity, dtype=partials.dtype, device=partials.device)
            merged[:, c] = column.scatter_reduce(0, index[:, 0], partials[:, c], how, include_self=True)
    return merged


def finalize_partials(partials, seq_len, cfg, *, dp_size, grad_accum_steps, has_entropy, has_ref, has_is_weights):
    """(loss, metrics) of the batch from the per-sequence partials of all its chunks (no group DPO)."""
    metrics: dict[str, torch.Tensor] = {}
    loss, _ = _finalize(partials, seq_len, cfg, metrics, dp_size, grad_accum_steps, False, has_entropy, has_ref,
                        has_is_weights)  # fmt: skip
    return loss, metrics


def _finalize(partials, seq_len, cfg, metrics, dp_size, grad_accum_steps, need_grad, has_ent, has_ref, has_isw):
    """Reduce the per-sequence partials into the loss and the metrics of reference.py (same keys,
    same definitions). Returns (loss, per-sequence gradient of the summed log-probs or None)."""
    from .reference import CLIP_METRIC_LOSSES

    p = partials
    nonempty = seq_len > 0
    n_valid = p[:, P_VALID].sum()
    denom = n_valid.clamp(min=1.0)
    sequence_valued = cfg.ratio_level in ("sequence", "sequence_sum")
    lengths = seq_len.clamp(min=1.0)

    def token_mean(col):
        return p[:, col].sum() / denom

    def level_mean(col):
        if sequence_valued:
            per_seq = p[:, col] / lengths
            return (per_seq * nonempty).sum() / nonempty.float().sum().clamp(min=1.0)
        return token_mean(col)

    extra_grad = None
    policy_loss = p[:, P_LOSS_PG].sum()
    variant = variants.get(cfg.loss_type)
    if variant.finalize is not None:  # the variant's own metrics (variants/<loss_type>.py finalize)
        view = _base.Partials(columns=p, slots=_SLOTS, cfg=cfg, metrics=metrics, seq_len=seq_len,
                              token_mean=lambda name: token_mean(_SLOTS[name]),
                              level_mean=lambda name: level_mean(_SLOTS[name]), need_grad=need_grad,
                              grad_accum_steps=grad_accum_steps, dp_size=dp_size)  # fmt: skip
        result = variant.finalize(view)
        if result is not None:  # a policy term formed from the partial sums (group DPO)
            policy_loss, extra_grad = result
    if cfg.loss_type in CLIP_METRIC_LOSSES:
        metrics["clip_ratio/low_mean"] = level_mean(P_LOW)
        metrics["clip_ratio/high_mean"] = level_mean(P_HIGH)
        metrics["clip_ratio/region_mean"] = level_mean(P_REGION)
        metrics["clip_ratio/low_min"] = _seq_min(p[:, P_LOW] / lengths, nonempty, 0.0)
        metrics["clip_ratio/high_max"] = _seq_max(p[:, P_HIGH] / lengths, nonempty, 0.0)
    if cfg.off_policy_mask_threshold is not None:
        metrics["selection/off_policy_dropped_frac"] = token_mean(P_OFFPOL_DROP)
    if cfg.top_entropy_quantile < 1.0:
        metrics["selection/entropy_kept_frac"] = token_mean(P_ENT_KEPT)
    if cfg.old_prob_threshold is not None:
        metrics["selection/old_prob_kept_frac"] = token_mean(P_OLDPROB_KEPT)
    if cfg.is_gate is not None:
        metrics["is_weight/gated_frac"] = token_mean(P_GATED)
    if cfg.is_level is not None or cfg.is_gate is not None or has_isw:
        metrics["is_weight/mean"] = token_mean(P_IS_SUM)
        metrics["is_weight/min"] = _seq_min(p[:, P_IS_MIN], nonempty, 1.0)
        metrics["is_weight/max"] = _seq_max(p[:, P_IS_MAX], nonempty, 1.0)
        if cfg.is_mode == "mask" and cfg.is_level is not None:
            metrics["is_weight/masked_frac"] = token_mean(P_IS_ZERO)
    loss = policy_loss
    metrics["policy_loss"] = policy_loss
    if cfg.ratio_kl_coef > 0:
        metrics["ratio_kl"] = token_mean(P_RATIO_KL)
        ratio_kl_loss = p[:, P_LOSS_RATIO_KL].sum()
        metrics["ratio_kl_loss"] = ratio_kl_loss
        loss = loss + cfg.ratio_kl_coef * ratio_kl_loss
    if has_ref:
        metrics["kl"] = token_mean(P_KL)
        if cfg.kl_coef > 0:
            kl_loss = p[:, P_LOSS_KL].sum()
            metrics["kl_loss"] = kl_loss
            loss = loss + cfg.kl_coef * kl_loss
    if has_ent:
        metrics["entropy"] = token_mean(P_ENT)
        if cfg.entropy_coef != 0:
            entropy_loss = p[:, P_LOSS_ENT].sum()
            metrics["entropy_loss"] = entropy_loss
            loss = loss - cfg.entropy_coef * entropy_loss
    metrics["ppo_kl"] = token_mean(P_PPO_KL)
    metrics["ratio/mean"] = level_mean(P_RATIO_SUM)
    metrics["ratio/min"] = _seq_min(p[:, P_RATIO_MIN], nonempty, 1.0)
    metrics["ratio/max"] = _seq_max(p[:, P_RATIO_MAX], nonempty, 1.0)
    return loss.detach(), extra_grad


def _seq_min(values, nonempty, empty: float):
    """Min over non-empty sequences; `empty` for an all-masked batch (as reference._masked_min). On the
    device without a host read (a boolean index would wait for the device to learn its size): the empty
    sequences are +inf, and `empty` replaces the result where no sequence is non-empty."""
    return _seq_extreme(values, nonempty, empty, float("inf"), torch.amin)


def _seq_max(values, nonempty, empty: float):
    return _seq_extreme(values, nonempty, empty, float("-inf"), torch.amax)


def _seq_extreme(values, nonempty, empty: float, identity: float, reduce):
    if values.numel() == 0:  # no sequence at all (the shape is known on the host)
        return torch.tensor(empty, dtype=values.dtype, device=values.device)
    extreme = reduce(torch.where(nonempty, values, torch.full_like(values, identity)))
    return torch.where(nonempty.any(), extreme, torch.full_like(extreme, empty))
