"""PolicyLossConfig: every scalar knob of the loss side (docs/design.md §2-§3), validated once, frozen.

All fields are runtime values for the kernels (changing one never recompiles). Per-batch data (the
global token / sequence counts used as normalizers, per-token weights) are arguments of the loss
functions, not fields here. The formulas each field selects are in grpo_kernels/ops/loss_head/reference.py
and derived in grpo_kernels/ops/loss_head/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from .ops.loss_head import variants as _variants
from .ops.loss_head.variants import cispo as _cispo
from .ops.loss_head.variants import dppo as _dppo

# Per-token objective: one file per variant in grpo_kernels/ops/loss_head/variants/ (its params, formula, Triton
# piece, metrics, presets), collected by that package's registry. "ppo_clip" covers GRPO / DAPO clip-higher /
# dual clip / TRL's delta.
LOSS_TYPES = _variants.LOSS_TYPES
# How the importance ratio r is formed from log-ratios lr_t = logp_t - old_t.
RATIO_LEVELS = (
    "token",  # r_t = exp(lr_t)
    "sequence",  # r_i = exp(mean_t lr_t), value and gradient through the mean (GSPO, TRL)
    "sequence_token",  # r_it = exp(sg[mean_t lr] + logp_t - sg[logp_t]) (GSPO-token, verl "gspo")
    "sequence_sum",  # r_i = exp(sum_t lr_t), the trajectory ratio (TIC-GRPO)
    "prefix",  # r_t = exp(sum_{k<=t} decay^(t-k) lr_k), discounted prefix accumulation (GRPO-lambda trace)
    # r_t = exp(sum_{k<=t} max(decay^k, decay^(t-k)) lr_k): GRPO-lambda's long-sequence weighting, where the
    # first tokens of a long completion keep their weight in every later trace (k counted from the start)
    "prefix_symmetric",
)
# Ratio levels the PyTorch loss head computes and the Triton kernel does not (not a streaming scan: each
# trace reads the scan at half its position); backend="auto" runs their loss head in PyTorch, saying so.
TORCH_ONLY_RATIO_LEVELS = ("prefix_symmetric",)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
    "length-pow",  # token weight |o_i|^-p / sum_j |o_j|^(1-p): p = 0 token-mean, p = 1 seq-mean-token-mean
)
# The entropy bonus may aggregate like the policy term (None, verl) or as TRL does: a token mean over
# the tokens it acts on in this call, divided by grad_accum_steps.
ENTROPY_AGG_MODES = (None, *LOSS_AGG_MODES, "token-mean-local")
CISPO_FORMS = _cispo.FORMS  # relative (verl, the paper), absolute (TRL), mask (SkyRL's rollout_is)
DPPO_DIVERGENCES = _dppo.DIVERGENCES  # binary_tv, binary_kl
# What the policy ratio r = pi / pi_anchor is measured against
RATIO_ANCHORS = (
    "old",  # old_logprobs (the policy that computed them; on-policy when None)
    "rollout",  # rollout_logprobs, the sampler's (SkyRL's rollout anchor, prime-rl, torchtitan's generator)
)
IS_LEVELS = (
    None,
    "token",  # rho_t = exp(old_t - rollout_t)
    "sequence",  # rho_i = exp(sum_t (old_t - rollout_t)), the product of the token weights
    "sequence_geometric",  # rho_i = exp(mean_t (old_t - rollout_t)), their geometric mean (AReaL, SkyRL, NeMo-RL)
)
IS_MODES = ("truncate", "mask")
# A gate on the sampler mismatch: tokens or sequences whose statistic between the sampler's and the old
# policy's probability of the sampled token leaves [is_gate_min, is_gate_max] get IS weight 0
IS_GATES = (
    None,
    "ratio",  # exp(old_t - rollout_t); per sequence their geometric mean
    "binary_kl",  # KL(Bernoulli(p_rollout) || Bernoulli(p_old)); per sequence the mean over its tokens
    "tv",  # |p_rollout - p_old|; per sequence the mean over its tokens
)
IS_GATE_LEVELS = ("token", "sequence")
OLD_PROB_SIDES = ("low", "high")


def _names_with(flag: str) -> str:
    """'a', 'b' and 'c': the loss types whose variant sets `flag`."""
    names = [repr(name) for name, v in _variants.VARIANTS.items() if getattr(v, flag)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"PolicyLossConfig: {message}")


def _finite(name: str, value: Any) -> None:
    _check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"{name} must be a finite number, got {value!r}",
    )


@dataclass(frozen=True)
class PolicyLossConfig:
    """Every scalar knob of the GRPO-family loss head, frozen and validated on construction.

    Construct directly (``PolicyLossConfig(loss_type="cispo")``), from a preset with overrides
    (``PolicyLossConfig.dapo()``, ``PolicyLossConfig.grpo(kl_coef=0.0)``, ``from_preset("gspo")``), or
    change one (``cfg.replace(clip_high=0.28)``). Each preset's docstring cites its source. The fields
    (each commented where it is declared): the per-token objective (``loss_type``, ``ratio_level``,
    clip bounds and each objective's parameters (its own params object: ``params``, or ``variant_params`` for a
    variant whose knobs have no keyword here), what the ratio is measured against (``ratio_anchor``)
    and its squared log-ratio penalty (``ratio_kl_coef``)), the KL term (``kl_coef``, ``kl_estimator``),
    the entropy term, sampler-mismatch corrections (``is_level``, ``is_gate``,
    ``off_policy_mask_threshold``), token selection, the aggregation modes, and ``temperature``. The formulas and gradients:
    grpo_kernels/ops/loss_head/README.md. An invalid value or combination raises ``ValueError`` naming it.
    """

    # --- per-token objective --------------------------------------------------------------------
    loss_type: str = "ppo_clip"
    ratio_level: str = "token"
    clip_low: float = 0.2  # lower bound 1 - clip_low (GMPO: log-ratio bound -clip_low)
    clip_high: float = 0.2  # upper bound 1 + clip_high (GMPO: log-ratio bound +clip_high)
    dual_clip: float | None = None  # c > 1: for A < 0 the loss is at most -c A (verl clip_ratio_c)
    delta: float | None = None  # TRL/INTELLECT-2 two-sided clip: the unclipped ratio is capped at delta
    # (recommended > 1 + clip_high; a smaller delta also caps ratios the clip would let through, as in TRL)
    log_ratio_clamp: float | None = 20.0  # log-ratios entering exp() are clamped to [-c, c] (verl's guard)
    cispo_form: str = "relative"  # "relative": clip(r, 1-clip_low, 1+clip_high) (verl, paper); "mask": a hard
    # zero outside (1-clip_low, 1+clip_high) (SkyRL rollout_is); "absolute": min(r, cispo_cap) (TRL)
    cispo_cap: float | None = None  # "absolute": min(r, cispo_cap) (TRL's epsilon_high, e.g. 5.0)
    dppo_divergence: str = "binary_tv"  # dppo: "binary_tv" or "binary_kl"; its bounds are clip_low (A < 0)
    # and clip_high (A > 0), SkyRL's delta_low / delta_high and prime-rl's dppo_mask_low / dppo_mask_high
    ratio_anchor: str = "old"  # r = pi / pi_anchor: "old" (old_logprobs) or "rollout" (rollout_logprobs)
    ratio_kl_coef: float = 0.0  # Kimi-style penalty ratio_kl_coef * (log r_t)^2 / 2 on every valid token
    # (token log-ratio against the anchor; prime-rl's kl_tau = ratio_kl_coef / 2)
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # SAPO gate temperature for A <= 0
    pspo_alpha: float = 0.1  # PSPO smoothing weight toward the old policy
    dcpo_max_ratio: float = 10.0  # DCPO: cap of the probability-dependent upper bound
    prefix_decay: float = 0.9  # ratio_level="prefix" / "prefix_symmetric": decay (gamma lambda) of the trace
    dpo_beta: float = 0.1  # group_dpo: DPO inverse temperature
    group_size: int | None = None  # group_dpo: completions per prompt, laid out consecutively
    vespo_k_pos: float = 2.0  # VESPO Gamma weight phi(W): shape k for A >= 0
    vespo_lambda_pos: float = 3.0  # VESPO: rate lambda for A >= 0
    vespo_k_neg: float = 3.0  # VESPO: shape k for A < 0
    vespo_lambda_neg: float = 2.0  # VESPO: rate lambda for A < 0
    # the variant's own params object (its file's frozen `Params`), for a variant whose knobs have no keyword
    # above; None: built from the keywords above (`params`)
    variant_params: Any = None
    # --- KL to the reference policy -------------------------------------------------------------
    kl_coef: float = 0.0  # beta, the weight of the KL term (0: no KL term, no reference needed)
    kl_estimator: str = "k3"  # k1, k2, k3 (unclamped, TRL), low_var_kl (k3 clamped, verl), abs
    kl_ratio_correction: bool = False  # TRL use_bias_correction_kl: KL times the (differentiable) ratio
    kl_straight_through: bool = False  # verl "<name>+": the estimator's value with k2's gradient
    kl_agg_mode: str | None = None  # aggregation of the KL term; None: loss_agg_mode (verl sapo: differs)
    # --- sampler / trainer mismatch (rollout_logprobs from vLLM etc.) -----------------------------
    is_level: str | None = None  # None (off), "token", "sequence" (product) or "sequence_geometric" IS weights
    is_mode: str = "truncate"  # "truncate" (TIS: clamp) or "mask" (MIS / IcePop: zero outside)
    is_min: float | None = None  # lower bound of the IS weight (None: none)
    is_max: float | None = 2.0  # upper bound of the IS weight (None: none; "truncate" then keeps the raw weight)
    is_gate: str | None = None  # None, "ratio", "binary_kl" or "tv": IS weight 0 where the statistic leaves
    is_gate_level: str = "token"  # the gate's unit: "token", or "sequence" (the statistic's mean / geometric mean)
    is_gate_min: float | None = None  # the gate's lower bound (ratio gate only; None: none)
    is_gate_max: float | None = None  # the gate's upper bound (None: none; a divergence gate needs one)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2 sequence mask: drop A<0 seqs with KL > delta
    # --- token selection --------------------------------------------------------------------------
    top_entropy_quantile: float = 1.0  # rho: keep tokens with entropy >= the (1 - rho) quantile
    clip_cov_ratio: float = 2e-4  # Clip-Cov: fraction of tokens detached (verl clip_cov_ratio)
    clip_cov_lb: float = 1.0  # Clip-Cov: lower covariance bound of the candidates (verl)
    clip_cov_ub: float = 5.0  # Clip-Cov: upper covariance bound of the candidates (verl)
    kl_cov_ratio: float = 2e-4  # KL-Cov: fraction of top-covariance tokens penalised (verl)
    kl_cov_coef: float = 1.0  # verl ppo_kl_coef
    old_prob_threshold: float | None = None  # Lopti: split tokens by old-policy probability
    old_prob_side: str = "low"  # which side of the split this update trains on
    # --- entropy bonus ----------------------------------------------------------------------------
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss; < 0: a penalty, as TRL allows)
    entropy_agg_mode: str | None = None  # aggregation of the entropy term; None: loss_agg_mode
    # --- aggregation ------------------------------------------------------------------------------
    loss_agg_mode: str = "token-mean"  # token-mean, seq-mean-token-mean, seq-mean-token-sum(-norm), ...
    max_completion_length: int | None = None  # the Dr. GRPO constant of seq-mean-token-sum-norm
    length_power: float = 1.0  # the exponent p of "length-pow"
    # --- LM head ----------------------------------------------------------------------------------
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check(self.loss_type in LOSS_TYPES, f"unknown loss_type {self.loss_type!r}; known: {LOSS_TYPES}")
        variant = _variants.get(self.loss_type)
        if self.variant_params is not None:
            if isinstance(self.variant_params, dict):  # read back from the config's JSON
                object.__setattr__(self, "variant_params", variant.params(**self.variant_params))
            _check(
                not variant.config_fields,
                f"loss_type={self.loss_type!r} takes its params as the keywords "
                f"{', '.join(variant.config_fields.values())}; variant_params is for a variant without keywords",
            )
            _check(
                type(self.variant_params) is variant.params,
                f"variant_params for loss_type={self.loss_type!r} must be a {variant.params.__module__}."
                f"{variant.params.__qualname__}, got {type(self.variant_params).__name__}",
            )
        _check(
            self.ratio_level in RATIO_LEVELS, f"unknown ratio_level {self.ratio_level!r}; known: {RATIO_LEVELS}"
        )
        _check(
            self.kl_estimator in KL_ESTIMATORS,
            f"unknown kl_estimator {self.kl_estimator!r}; known: {KL_ESTIMATORS}",
        )
        _check(
            self.loss_agg_mode in LOSS_AGG_MODES,
            f"unknown loss_agg_mode {self.loss_agg_mode!r}; known: {LOSS_AGG_MODES}",
        )
        _check(
            self.kl_agg_mode is None or self.kl_agg_mode in LOSS_AGG_MODES,
            f"unknown kl_agg_mode {self.kl_agg_mode!r}; known: {LOSS_AGG_MODES}",
        )
        _check(
            self.entropy_agg_mode in ENTROPY_AGG_MODES,
            f"unknown entropy_agg_mode {self.entropy_agg_mode!r}; known: {ENTROPY_AGG_MODES}",
        )
        _check(
            self.ratio_anchor in RATIO_ANCHORS, f"unknown ratio_anchor {self.ratio_anchor!r}; known: {RATIO_ANCHORS}"
        )
        _check(self.is_level in IS_LEVELS, f"unknown is_level {self.is_level!r}; known: {IS_LEVELS}")
        _check(self.is_gate in IS_GATES, f"unknown is_gate {self.is_gate!r}; known: {IS_GATES}")
        _check(
            self.is_gate_level in IS_GATE_LEVELS,
            f"unknown is_gate_level {self.is_gate_level!r}; known: {IS_GATE_LEVELS}",
        )
        _check(self.is_mode in IS_MODES, f"unknown is_mode {self.is_mode!r}; known: {IS_MODES}")
        _check(
            self.old_prob_side in OLD_PROB_SIDES,
            f"unknown old_prob_side {self.old_prob_side!r}; known: {OLD_PROB_SIDES}",
        )
        for name in (
            "clip_low", "clip_high", "sapo_tau_pos", "sapo_tau_neg", "pspo_alpha", "vespo_k_pos",
            "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "kl_coef",
            "top_entropy_quantile", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
            "kl_cov_coef", "entropy_coef", "temperature", "dcpo_max_ratio", "prefix_decay", "dpo_beta",
            "length_power", "ratio_kl_coef",
        ):  # fmt: skip
            _finite(name, getattr(self, name))
        for name in ("dual_clip", "delta", "log_ratio_clamp", "cispo_cap", "is_min", "is_max",
                     "off_policy_mask_threshold", "old_prob_threshold", "is_gate_min", "is_gate_max"):  # fmt: skip
            if getattr(self, name) is not None:
                _finite(name, getattr(self, name))
        _check(self.clip_low >= 0 and self.clip_high >= 0, "clip_low and clip_high must be >= 0")
        _check(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        _check(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        if self.dual_clip is not None:
            _check(self.dual_clip > 1.0, f"dual_clip must be > 1, got {self.dual_clip}")
            _check(self.loss_type in ("ppo_clip", "dcpo"), "dual_clip applies to loss_type 'ppo_clip' and 'dcpo' only")
        _check(0.0 <= self.prefix_decay <= 1.0, f"prefix_decay must be in [0, 1], got {self.prefix_decay}")
        _check(self.length_power >= 0, f"length_power must be >= 0, got {self.length_power}")
        # every variant's params from the flat keywords, each validated by its own file (a bad value is refused
        # whatever loss_type is), then the chosen variant's combinations and ratio levels
        for other in _variants.VARIANTS.values():
            other.flat_params(self)
        if variant.check is not None:
            variant.check(self)
        if variant.ratio_levels is not None:
            _check(
                self.ratio_level in variant.ratio_levels,
                f"loss_type={self.loss_type!r} defines its own ratio; ratio_level must be 'token'"
                if variant.ratio_levels == ("token",) else
                f"loss_type={self.loss_type!r} takes ratio_level {variant.ratio_levels}, got {self.ratio_level!r}",
            )  # fmt: skip
        if self.loss_type != "group_dpo":
            _check(self.group_size is None, "group_size is only used by loss_type='group_dpo'")
        if self.loss_type != "dppo":
            _check(
                self.dppo_divergence == "binary_tv",
                f"dppo_divergence={self.dppo_divergence!r} is only used by loss_type='dppo'",
            )
        _check(self.ratio_kl_coef >= 0, f"ratio_kl_coef must be >= 0, got {self.ratio_kl_coef}")
        if self.ratio_kl_coef > 0:
            _check(
                variant.sequence_loss is None,
                f"ratio_kl_coef adds a per-token term; loss_type={self.loss_type!r} is a sequence-level objective",
            )
        if self.delta is not None:
            _check(self.delta > 0, f"delta caps a ratio (> 0); it must be > 0, got {self.delta}")
            _check(self.loss_type == "ppo_clip", "delta applies to loss_type='ppo_clip' only")
        if self.log_ratio_clamp is not None:
            _check(self.log_ratio_clamp > 0, f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        _check(
            self.cispo_cap is None or (self.loss_type == "cispo" and self.cispo_form == "absolute"),
            "cispo_cap is only used by loss_type='cispo' with cispo_form='absolute'",
        )
        if self.is_max is not None:
            _check(self.is_max > 0, f"is_max must be > 0, got {self.is_max}")
        if self.is_min is not None:
            _check(self.is_min >= 0, f"is_min must be >= 0, got {self.is_min}")
            _check(
                self.is_max is None or self.is_min < self.is_max,
                f"need 0 <= is_min < is_max, got {self.is_min}, {self.is_max}",
            )
        if self.is_level is not None and self.is_mode == "mask":
            _check(
                self.is_min is not None or self.is_max is not None,
                "is_mode='mask' with neither is_min nor is_max would mask nothing: set a bound",
            )
        self._check_rollout_fields()
        if self.off_policy_mask_threshold is not None:
            _check(self.off_policy_mask_threshold >= 0, "off_policy_mask_threshold must be >= 0")
        _check(
            0.0 < self.top_entropy_quantile <= 1.0,
            f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}",
        )
        _check(self.clip_cov_ratio > 0 and self.kl_cov_ratio > 0, "clip_cov_ratio and kl_cov_ratio must be > 0")
        _check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb must be < clip_cov_ub")
        _check(self.kl_cov_coef >= 0, "kl_cov_coef must be >= 0")
        if self.old_prob_threshold is not None:
            _check(0 < self.old_prob_threshold < 1, "old_prob_threshold must be in (0, 1)")
        uses_norm = "seq-mean-token-sum-norm" in (self.loss_agg_mode, self.entropy_agg_mode, self.kl_agg_mode)
        if uses_norm:
            _check(
                self.max_completion_length is not None,
                "loss_agg_mode 'seq-mean-token-sum-norm' needs max_completion_length (the Dr. GRPO constant)",
            )
        if self.max_completion_length is not None:
            _check(
                isinstance(self.max_completion_length, int) and self.max_completion_length > 0,
                f"max_completion_length must be a positive int, got {self.max_completion_length!r}",
            )
            _check(uses_norm, "max_completion_length is only used by 'seq-mean-token-sum-norm'")
        if self.kl_straight_through:
            _check(self.kl_estimator != "k2", "kl_straight_through with k2 changes nothing; use kl_estimator='k2'")
        # the fields as JSON, computed once: the compiled path passes it to the custom ops as a constant string
        # (torch.compile reads the attribute of the frozen config; it would trace a json.dumps call)
        object.__setattr__(self, "_as_json", json.dumps(dataclasses.asdict(self), sort_keys=True))

    def _check_rollout_fields(self) -> None:
        """The policy ratio's anchor and the sampler-mismatch gate."""
        if self.ratio_anchor == "rollout":
            _check(
                _variants.get(self.loss_type).rollout_anchor,
                f"ratio_anchor='rollout' is defined for loss_type {_names_with('rollout_anchor')}, not "
                f"{self.loss_type!r} (the others have no ratio, or read the old policy's probabilities)",
            )
        if self.is_gate is None:
            _check(
                self.is_gate_min is None and self.is_gate_max is None and self.is_gate_level == "token",
                "is_gate_min / is_gate_max / is_gate_level are only used with is_gate set",
            )
            return
        if self.is_gate == "ratio":
            _check(
                self.is_gate_min is not None or self.is_gate_max is not None,
                "is_gate='ratio' needs is_gate_min or is_gate_max (the range of the old / rollout ratio it keeps)",
            )
            if self.is_gate_min is not None:
                _check(self.is_gate_min >= 0, f"is_gate_min must be >= 0, got {self.is_gate_min}")
            if self.is_gate_min is not None and self.is_gate_max is not None:
                _check(
                    self.is_gate_min < self.is_gate_max,
                    f"need is_gate_min < is_gate_max, got {self.is_gate_min}, {self.is_gate_max}",
                )
        else:
            _check(
                self.is_gate_min is None,
                f"is_gate={self.is_gate!r} is a divergence (>= 0), bounded above only: drop is_gate_min",
            )
            _check(
                self.is_gate_max is not None and self.is_gate_max >= 0,
                f"is_gate={self.is_gate!r} needs is_gate_max >= 0 (the largest divergence it keeps), got "
                f"{self.is_gate_max!r}",
            )

    # --- derived properties -------------------------------------------------------------------------
    @property
    def needs_global_statistics(self) -> bool:
        """True when the loss of one token depends on statistics of the whole batch (not only its own
        sequence): such variants cannot be computed chunk by chunk (fused path: two passes)."""
        return self.top_entropy_quantile < 1.0 or _variants.get(self.loss_type).global_statistics

    @property
    def token_local(self) -> bool:
        """True when every token's loss terms and gradients depend only on that token's inputs and its
        sequence's valid length: a sequence may then be cut into pieces computed apart (the fused
        one-pass schedule for completions longer than a chunk). Not so for sequence-valued ratios (GSPO,
        GMPO, TIC-GRPO: each token's gradient needs the whole sequence's log-ratio), the prefix trace (a
        scan along the sequence), sequence-level IS, sequence gates and off-policy masking (sequence sums), VESPO, and
        the batch-global variants (needs_global_statistics)."""
        return (
            self.ratio_level == "token"
            and self.is_level not in ("sequence", "sequence_geometric")
            and not (self.is_gate is not None and self.is_gate_level == "sequence")
            and self.off_policy_mask_threshold is None
            and _variants.get(self.loss_type).token_local
            and not self.needs_global_statistics
        )

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.loss_type == "group_dpo"

    @property
    def uses_rollout_logprobs(self) -> bool:
        """True when the loss reads the sampler's log-probs: the IS weights and gate (which need them), the
        rollout anchor of the ratio (needs them), the off-policy mask (which falls back to old without)."""
        return (
            self.is_level is not None
            or self.is_gate is not None
            or self.ratio_anchor == "rollout"
            or self.off_policy_mask_threshold is not None
        )

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0 or self.top_entropy_quantile < 1.0

    @property
    def params(self):
        """The loss variant's own params (a frozen dataclass of grpo_kernels/ops/loss_head/variants/<loss_type>.py):
        variant_params when given, else built from the keywords above."""
        return _variants.get(self.loss_type).params_of(self)

    def replace(self, **changes: Any) -> PolicyLossConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # --- presets: published settings, each citing its source -----------------------------------------
    @classmethod
    def grpo(cls, **overrides: Any) -> PolicyLossConfig:
        """GRPO as in DeepSeekMath (Shao et al. 2024, arXiv 2402.03300, §4.1): PPO clip eps 0.2, k3 KL
        to the reference with beta 0.04, per-sequence token mean then mean over sequences."""
        return cls._preset("grpo", overrides)

    @classmethod
    def dapo(cls, **overrides: Any) -> PolicyLossConfig:
        """DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher eps_low 0.2 / eps_high 0.28, no KL,
        token-level mean over the whole batch. (Overlong shaping and dynamic sampling live on the
        reward / batch side: grpo_kernels.advantages.)"""
        return cls._preset("dapo", overrides)

    @classmethod
    def dr_grpo(cls, max_completion_length: int = 1024, **overrides: Any) -> PolicyLossConfig:
        """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): token
        sums divided by a constant (the max completion length) and the number of sequences, no KL,
        no std in the advantage (advantages side). PPO clip eps 0.2."""
        return cls._preset("dr_grpo", dict(max_completion_length=max_completion_length, **overrides))

    @classmethod
    def bnpo(cls, **overrides: Any) -> PolicyLossConfig:
        """TRL's "bnpo" loss_type (TRL 1.16 GRPOConfig docs): token mean over the tokens of the local
        batch (pass no global num_tokens), PPO clip eps 0.2, no KL."""
        return cls._preset("bnpo", overrides)

    @classmethod
    def gspo(cls, **overrides: Any) -> PolicyLossConfig:
        """GSPO (Zheng et al. 2025, arXiv 2507.18071): length-normalised sequence ratio
        exp(mean_t log r), clip range 3e-4 / 4e-4, no KL, mean over sequences."""
        return cls._preset("gspo", overrides)

    @classmethod
    def cispo(cls, **overrides: Any) -> PolicyLossConfig:
        """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): clipped, detached IS weight times A logp. The
        paper sets no lower bound (a large eps_low) and tunes eps_high; here clip_low=1.0 (lower bound
        0: none) and clip_high=4.0 (upper bound 5, TRL's recommended cap). Token-level mean, no KL."""
        return cls._preset("cispo", overrides)

    @classmethod
    def gpg(cls, **overrides: Any) -> PolicyLossConfig:
        """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline", arXiv 2504.02546): plain
        policy gradient -A logp, no ratio, no clip, no KL, token mean."""
        return cls._preset("gpg", overrides)

    @classmethod
    def gmpo(cls, **overrides: Any) -> PolicyLossConfig:
        """GMPO (Zhao et al. 2025, arXiv 2507.20673): geometric mean of token ratios per sequence with
        sign-aware clipping of log r to (-0.4, 0.4), i.e. ratios in (e^-0.4, e^0.4); no KL."""
        return cls._preset("gmpo", overrides)

    @classmethod
    def sapo(cls, **overrides: Any) -> PolicyLossConfig:
        """SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): sigmoid gate
        with tau_pos 1.0, tau_neg 1.05, per-sequence token mean, no KL."""
        return cls._preset("sapo", overrides)

    @classmethod
    def olmo3(cls, **overrides: Any) -> PolicyLossConfig:
        """Olmo 3 Think / RL-Zero (AI2, arXiv 2512.13961; open-instruct grpo_fast.py at the release
        commit 42aa63c): token-level loss (a token mean per micro-batch: pass no global num_tokens to
        match it), no KL (beta 0), clip-higher eps_low 0.2 / eps_high 0.272, token-level truncated
        importance sampling against the inference engine's log-probs with cap 2.0. Advantages are
        centred without the std (advantage side)."""
        return cls._preset("olmo3", overrides)

    @classmethod
    def pspo(cls, **overrides: Any) -> PolicyLossConfig:
        """PSPO / GR-PSPO (Dwyer et al. 2025, "It's Not You, It's Clipping", arXiv 2509.21282): the
        current probability is smoothed toward the old one before the ratio, r~ = (1 - a) r + a, and
        replaces clipping (no min / clip); a = 0.1 (the first author's TRL PR); GRPO aggregation."""
        return cls._preset("pspo", overrides)

    @classmethod
    def dcpo(cls, **overrides: Any) -> PolicyLossConfig:
        """DCPO (Yang et al. 2025, arXiv 2509.02333, and lime-RL/DCPO): probability-dependent clip
        bounds with eps_low 0.16 / eps_high 0.2 (the paper's table), upper bound capped at 10, dual clip
        10 for A < 0 (the released scripts), "only token mean" aggregation read as seq-mean-token-sum
        (the paper's OTM formula). Smooth advantage standardisation is on the advantage side."""
        return cls._preset("dcpo", overrides)

    @classmethod
    def vespo(cls, **overrides: Any) -> PolicyLossConfig:
        """VESPO (Shen et al. 2026, arXiv 2602.10693; TRL 1.16 loss_type="vespo"): detached Gamma
        weight phi(W) of the sequence ratio, (k, lambda) = (2, 3) for A >= 0 and (3, 2) for A < 0,
        token-level mean, no KL."""
        return cls._preset("vespo", overrides)

    @classmethod
    def tic_grpo(cls, **overrides: Any) -> PolicyLossConfig:
        """TIC-GRPO (Pang et al., arXiv 2508.02833): one trajectory-level ratio exp(sum_t log r_t)
        instead of token ratios, in the PPO clipped surrogate (eps 0.2; the paper's clipping details
        could not be verified here), GRPO aggregation, no KL."""
        return cls._preset("tic_grpo", overrides)

    @classmethod
    def dppo(cls, **overrides: Any) -> PolicyLossConfig:
        """DPPO (arXiv 2602.04879, as SkyRL 0.4.0 `policy_loss_type="dppo"` and prime-rl's default loss
        implement it): PPO's ratio clip replaced by a binary trust region on the sampled token's
        probability change p - mu, binary total variation with delta_low = delta_high = 0.2 (both peers'
        defaults), the surrogate -r A on the tokens inside it; token-level mean, no KL. Both peers measure
        r and the mask against the sampler's log-probs when they have them: add ratio_anchor="rollout".
        prime-rl's default also adds the squared log-ratio penalty: ratio_kl_coef=2e-3 (its kl_tau 1e-3)."""
        return cls._preset("dppo", overrides)

    # every variant's presets (variants/<loss_type>.py PRESETS); the classmethods above are their documented names
    PRESETS = tuple(_variants.PRESETS)

    @classmethod
    def _preset(cls, name: str, overrides: dict) -> PolicyLossConfig:
        return cls(**_variants.PRESETS[name][1]).replace(**overrides)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PolicyLossConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {cls.PRESETS}")
        return cls._preset(name, overrides)
