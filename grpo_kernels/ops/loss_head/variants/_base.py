"""What a loss variant declares (one file per variant in this folder, collected by __init__.py).

A variant file holds its own frozen params dataclass (mapped from PolicyLossConfig's backward-compatible
keywords, or given whole as ``PolicyLossConfig(variant_params=...)``), its fp32 formula (called by
reference.py with a `Context`), its Triton per-token piece(s) (functions marked `triton_piece`, inlined into
the kernel of ../triton.py, which dispatches on the variant's constant), its metric names, presets, AOT
compile cases and the names other trainers use for it.

Nothing here imports triton or grpo_kernels.config: this package is read by config.py (the names, the params)
and must import without triton (the PyTorch backend on any platform). `tl` below is bound to triton.language,
and the pieces are jitted, by ../triton.py when the kernel module is imported (`bind_triton`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

tl: Any = None  # triton.language, bound by bind_triton (the pieces read it only when Triton compiles them)


def triton_piece(fn):
    """Mark a function as Triton device code: `bind_triton` replaces it by `triton.jit(fn)` in its module and in
    every variant module that imported it (Triton inlines it into the kernel)."""
    fn.__loss_head_triton_piece__ = True
    return fn


@dataclass(frozen=True)
class NoParams:
    """A variant without knobs of its own."""


@dataclass(frozen=True)
class Objective:
    """What a variant's reference formula returns: the per-token objective l_t [N] (None for a sequence-level
    variant, whose `sequence_loss` gives the policy term) and, for the variants that report TRL's clip
    statistics, the {0, 1} float masks of the tokens clipped (or dropped) below with A < 0 and above with A > 0."""

    objective: torch.Tensor | None
    low: torch.Tensor | None = None
    high: torch.Tensor | None = None


@dataclass
class Context:
    """The per-token quantities the loss head has formed before the objective ([N] fp32, masked tokens 0)."""

    cfg: Any  # PolicyLossConfig
    params: Any  # the variant's params
    lp: torch.Tensor  # log-probs (differentiable)
    adv: torch.Tensor
    old: torch.Tensor  # old log-probs (lp.detach() on-policy)
    anchor: torch.Tensor  # what the ratio is measured against (old or rollout)
    ref: torch.Tensor | None  # reference log-probs (None when not given)
    rollout: torch.Tensor | None
    scored: torch.Tensor | None  # bool: the sampler scored the token (rollout not NaN)
    log_ratio: torch.Tensor  # (lp - anchor) m
    ratio: torch.Tensor  # exp(clamp(log_w)) m at the configured ratio level
    m: torch.Tensor  # float mask
    valid: torch.Tensor  # bool mask
    seq_index: torch.Tensor
    seq_len: torch.Tensor  # [S]
    seq_nonempty: torch.Tensor  # [S] float
    lower: float  # 1 - clip_low
    upper: float  # 1 + clip_high
    metrics: dict
    seq_sum: Callable  # [N] -> [S]
    level_mean: Callable  # metric mean over the ratio's units (tokens, or sequences for a sequence ratio)
    sampler_is_weights: Callable  # () -> the configured sampler IS weights [N] (reference._sampler_is_weights)


@dataclass
class Partials:
    """The Triton loss head's per-sequence partial sums of a batch, as a variant's `finalize` reads them
    (../triton.py `_finalize`: the common metrics are reduced there, a variant's own here)."""

    columns: torch.Tensor  # [S, NUM_PARTIALS] fp32
    slots: dict  # column name -> index (../triton.py P_*)
    cfg: Any
    metrics: dict  # the metrics being built: a variant adds its own
    seq_len: torch.Tensor  # [S] valid tokens per sequence
    token_mean: Callable  # column name -> mean over the valid tokens
    level_mean: Callable  # column name -> mean over the ratio's units (tokens, or non-empty sequences)
    need_grad: bool
    grad_accum_steps: int
    dp_size: int

    def column(self, name: str) -> torch.Tensor:
        return self.columns[:, self.slots[name]]


def require(condition: bool, message: str) -> None:
    """A variant's validation: the error PolicyLossConfig raises for a bad value or combination."""
    if not condition:
        raise ValueError(f"PolicyLossConfig: {message}")


def clip_masks(ratio, metric_ratio, lower, upper, adv):
    """TRL's clip statistics: clipped below with A < 0, above with A > 0 (the ratio the upper bound reads may be
    the delta-capped one)."""
    return ((ratio < lower) & (adv < 0)).float(), ((metric_ratio > upper) & (adv > 0)).float()


@dataclass(frozen=True)
class LossVariant:
    """One loss variant: the registry's row (see this module's docstring)."""

    name: str  # PolicyLossConfig.loss_type
    id: int  # its constant in LossId (the kernel's LOSS constexpr): stable, unique
    doc: str  # one line: the formula
    objective: Callable[[Context], Objective]  # the fp32 reference formula
    params: type = NoParams  # frozen dataclass of its own knobs
    config_fields: dict = field(default_factory=dict)  # params field -> PolicyLossConfig keyword (compatible name)
    metrics: Callable[[Any], set] | None = None  # cfg -> metric names it adds to the common ones
    clip_metrics: bool = False  # reports clip_ratio/{low,high,region}_mean, low_min, high_max (Objective.low/high)
    sequence_loss: Callable | None = None  # sequence-level objective (gmpo, group_dpo): replaces the token term
    token_local: bool = True  # each token's terms depend on its own inputs and its sequence's length only
    global_statistics: bool = False  # needs statistics of the whole batch (no chunk-by-chunk computation)
    ratio_levels: tuple | None = None  # the ratio levels it takes (None: every level)
    rollout_anchor: bool = False  # ratio_anchor="rollout" is defined for it
    presets: dict = field(default_factory=dict)  # name -> (PolicyLossConfig keywords, source it cites)
    compile_cases: dict = field(default_factory=dict)  # name -> (keywords or {"preset": name, ...}, inputs)
    peer_names: dict = field(default_factory=dict)  # trainer -> its name for this variant
    check: Callable[[Any], None] | None = None  # cfg -> raises ValueError on a combination it does not define
    # Partials -> None (its metrics added), or (policy loss, dL/d(summed log-probs) [S] | None) for a variant
    # whose policy term is formed from the partial sums (group_dpo)
    finalize: Callable | None = None

    def flat_params(self, cfg):
        """The params built from PolicyLossConfig's flat keywords (validated by the params' __post_init__)."""
        return self.params(**{name: getattr(cfg, keyword) for name, keyword in self.config_fields.items()})

    def params_of(self, cfg):
        """The variant's params of a config: given whole (cfg.variant_params), else from the flat keywords."""
        given = getattr(cfg, "variant_params", None)
        return given if given is not None else self.flat_params(cfg)

    def metric_names(self, cfg) -> set:
        names = set() if self.metrics is None else set(self.metrics(cfg))
        if self.clip_metrics:
            names |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                      "clip_ratio/high_max"}  # fmt: skip
        return names


def params_from_json(variant: LossVariant, value):
    """variant_params read back from the config's JSON (a dict of its fields)."""
    if value is None or dataclasses.is_dataclass(value):
        return value
    return variant.params(**value)


# ---- Triton helpers shared by the pieces and the kernel (jitted by bind_triton) ------------------------------
@triton_piece
def min_weight(a, b):
    """d min(a, b) / da, as torch computes it: 1 if a < b, 0 if a > b, 1/2 on a tie."""
    return tl.where(a < b, 1.0, tl.where(a > b, 0.0, 0.5))


@triton_piece
def max_weight(a, b):
    """d max(a, b) / da: 1 if a > b, 0 if a < b, 1/2 on a tie."""
    return tl.where(a > b, 1.0, tl.where(a < b, 0.0, 0.5))


@triton_piece
def binary_kl_piece(mu_lp, lp):
    """KL(Bernoulli(mu) || Bernoulli(p)) of one token's probabilities mu = e^mu_lp, p = e^lp (binary_kl below:
    the same operations in the same order; log-probs above 0 read as 0)."""
    mu_lp = tl.minimum(mu_lp, 0.0)
    lp = tl.minimum(lp, 0.0)
    mu = tl.exp(mu_lp)
    p = tl.exp(lp)
    return mu * (mu_lp - lp) + (1.0 - mu) * tl.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))


def binary_kl(mu_lp, lp):
    """KL(Bernoulli(mu) || Bernoulli(p)), mu = e^mu_lp, p = e^lp: the two policies' probabilities of the
    sampled token against the rest of the vocabulary. The first term from the log-probs, 1e-8 inside the
    second's logarithm (finite at mu = 1 or p = 1), as SkyRL's DPPO writes it. A log-prob rounded above 0
    is read as 0 (a probability above 1 would make the logarithm's argument negative)."""
    mu_lp, lp = mu_lp.clamp(max=0.0), lp.clamp(max=0.0)
    mu, p = mu_lp.exp(), lp.exp()
    return mu * (mu_lp - lp) + (1.0 - mu) * torch.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))
