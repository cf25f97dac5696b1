"""Shared pieces of the parity suite (tests/test_parity_*.py): peer pins, inputs, comparison.

Inputs are drawn in float32. The peers whose loss code is plain PyTorch (TRL, verl) run on the same
values upcast to float64, so their result is the exact-arithmetic value of their formula up to
~1e-16; ours runs in float32 (the loss head always computes in fp32). The comparison therefore
measures our fp32 rounding only. Liger computes its log-probs in fp32 whatever the input dtype, so
both sides run in fp32 there (see test_parity_liger.py).
"""

from __future__ import annotations

import math
from importlib import metadata

import pytest
import torch

# The versions the suite is written against (pyproject: the `parity` extra). A different installed
# version skips the module with the reason: semantics move between releases (PEERS doc, part D).
PINS = {"trl": "1.16.0", "verl": "0.9.1", "liger-kernel": "0.8.5"}


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require_peer(dist: str, module: str):
    """Import a peer for a parity module, or skip the whole module saying why."""
    version = installed_version(dist)
    if version is None:
        pytest.skip(
            f"{dist} is not installed (parity pinned to {dist}=={PINS[dist]}: the [parity] extra installs it)",
            allow_module_level=True,
        )
    if version != PINS[dist]:
        pytest.skip(
            f"{dist}=={version} is installed but the parity suite is pinned to {dist}=={PINS[dist]}",
            allow_module_level=True,
        )
    return pytest.importorskip(module, reason=f"{dist}=={version} is installed but `import {module}` fails")


# ---------------------------------------------------------------------------------------------------
# Tolerances. Ours is float32; the reference side is exact to ~1e-16 (float64) unless stated.
# A float32 op rounds with relative error <= 2^-24 ~ 6e-8. The values compared are short chains
# (exp, clamp, a product, one masked sum over <= 45 terms, one division), so their relative error is
# a few ulp, tens at most: RTOL = 1e-6 (~17 ulp). A result that sums terms of both signs (advantages
# of both signs) can be small next to its terms, so the bound also has an absolute part measured
# against the magnitude of the terms: ATOL = 1e-6 x `scale`. Losses and metrics are sums of O(1)
# terms over O(1) normalizers (scale 1, or |loss| when larger); a gradient's scale is its largest
# element (grad_scale), so an element cancelling to ~0 is held to 1e-6 of the largest.
# (Measured: at 1e-7 a few dozen comparisons fail by float32 rounding, at 1e-6 none: the bound sits
# just above the rounding, and a formula difference shows up orders of magnitude above it.)
# ---------------------------------------------------------------------------------------------------
RTOL = 1e-6
ATOL = 1e-6


def assert_close(
    name: str,
    ours,
    theirs,
    *,
    scale: float = 1.0,
    rtol: float = RTOL,
    atol: float = ATOL,
    equal_nan: bool = False,
) -> None:
    """|ours - theirs| <= atol * scale + rtol * |theirs| elementwise. NaN never passes, except NaN on
    both sides with equal_nan (metrics that are undefined on both sides, e.g. a min over nothing).
    On failure, report the worst element: its index, both values and the bound."""
    ours_t = torch.as_tensor(ours).detach().double().cpu()
    theirs_t = torch.as_tensor(theirs).detach().double().cpu()
    assert ours_t.shape == theirs_t.shape, (
        f"{name}: shape {tuple(ours_t.shape)} (ours) != {tuple(theirs_t.shape)}"
    )
    both_nan = torch.isnan(ours_t) & torch.isnan(theirs_t) & equal_nan
    err = (ours_t - theirs_t).abs()
    bound = atol * scale + rtol * theirs_t.abs()
    bad = ~both_nan & ~(err <= bound)  # NaN on one side only counts as bad
    if bad.any():
        excess = torch.where(bad, torch.nan_to_num(err - bound, nan=float("inf")), torch.full_like(err, -1.0))
        flat = int(excess.reshape(-1).argmax())
        idx = (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ours_t.shape))
            if ours_t.dim()
            else ()
        )
        o, t = ours_t.reshape(-1)[flat].item(), theirs_t.reshape(-1)[flat].item()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} element(s) differ; worst at index {idx}: "
            f"ours={o!r} theirs={t!r} |diff|={abs(o - t):.3e} > tol={bound.reshape(-1)[flat].item():.3e} "
            f"(atol={atol}*scale={scale:.3g}, rtol={rtol})"
        )


def grad_scale(*grads) -> float:
    """Magnitude of a gradient tensor, for its absolute floor: the largest |element| (at least 1e-30)."""
    return max(max(float(g.detach().abs().max()) for g in grads if g is not None), 1e-30)


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
# B = 5 sequences, T = 9 positions (odd sizes). Valid lengths 9 (full), 6 with a hole at t=2 (a
# masked tool token inside a completion), 3, 0 (an all-masked completion) and 7. Positions with mask
# 0 hold ordinary finite values: they must not matter.
LENGTHS = (9, 6, 3, 0, 7)
HOLE = (1, 2)
EMPTY_ROW = 3
SEED = 5  # a draw whose sequence-mean ratios also straddle the bounds (each module checks its regimes)


def make_mask(lengths=LENGTHS, T: int = 9, hole=HOLE) -> torch.Tensor:
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    if hole is not None:
        mask[hole] = False
    return mask


def make_token_inputs(seed: int, lengths=LENGTHS, T: int = 9, hole=HOLE) -> dict[str, torch.Tensor]:
    """Per-token loss-head inputs [B, T] in float32, drawn so that every regime is visited:
    token log-ratios lr = logp - old are a per-sequence offset in [-0.5, 0.5] plus U(-1.5, 1.5), so
    ratios exp(lr) span ~[0.14, 7.4]: below 1 - eps, inside, above 1 + eps, above the dual-clip
    bound 3; sequence means straddle the clip bounds too. Advantages have both signs (per sequence,
    plus a per-token variant); the sampler's log-probs differ from old by N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)

    def u(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    mask = make_mask(lengths, T, hole)
    logp = -u(0.05, 3.0, B, T)
    offset = u(-0.5, 0.5, B, 1)
    log_ratio = offset + u(-1.5, 1.5, B, T)
    old = logp - log_ratio
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    rollout = old + 0.3 * torch.randn(B, T, generator=g)
    signs = (
        torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0][:B])
        if B <= 7
        else torch.sign(torch.randn(B, generator=g))
    )
    adv_seq = signs * u(0.3, 1.5, B)
    adv_tok = torch.randn(B, T, generator=g)
    entropy = u(0.05, 2.5, B, T)
    is_weights = u(0.5, 1.5, B, T)
    return dict(
        mask=mask, logp=logp, old=old, ref=ref, rollout=rollout, adv_seq=adv_seq, adv_tok=adv_tok,
        entropy=entropy, is_weights=is_weights,
    )  # fmt: skip


def leaf(x: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    return x.detach().to(dtype).clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------------
def trl_vllm_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """The vLLM importance-sampling ratio exactly as GRPOTrainer._generate_and_score_completions
    computes it (trl/trainer/grpo_trainer.py:2659-2707, trl 1.16.0)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio
