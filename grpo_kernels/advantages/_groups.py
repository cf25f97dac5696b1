"""Input validation and per-group statistics shared by every estimator, shaping function and filter.

Everything here is O(batch) PyTorch on whole tensors (scatter-adds over the group index), so ragged
groups cost nothing extra. Validation raises ``ValueError`` naming the argument and the offending value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are accumulated in at least fp32 (bf16/fp16 rewards are promoted)."""
    return torch.promote_types(dtype, torch.float32)


def _first_bad(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_float(
    name: str,
    value: object,
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
    finite: bool = True,
) -> torch.Tensor:
    """A floating tensor of the given shape (or rank) whose entries are all finite."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if finite and value.numel() > 0:
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            where = _first_bad(bad)
            raise ValueError(
                f"{name} must be finite; {name}[{', '.join(map(str, where))}] = {value[where].item()}"
            )
    return value


def check_mask(name: str, value: object, shape: tuple[int, ...]) -> torch.Tensor:
    """A 0/1 mask (bool, integer or float holding only 0 and 1) of the given shape, returned as bool."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if value.dtype == torch.bool:
        return value
    bad = (value != 0) & (value != 1)
    if bool(bad.any()):
        where = _first_bad(bad)
        raise ValueError(
            f"{name} must hold only 0 and 1; {name}[{', '.join(map(str, where))}] = {value[where].item()}"
        )
    return value != 0


def check_index(
    name: str, value: object, shape: tuple[int, ...], low: int, high: int | None = None
) -> torch.Tensor:
    """An integer tensor of the given shape with entries in [low, high) (high=None: no upper bound)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (it has no values): pass a cpu or cuda tensor")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise ValueError(f"{name} must be an integer tensor (int64), got dtype {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if value.numel() > 0:
        bad = value < low
        if high is not None:
            bad = bad | (value >= high)
        if bool(bad.any()):
            where = _first_bad(bad)
            bound = f"[{low}, {high})" if high is not None else f">= {low}"
            raise ValueError(
                f"{name} must be {bound}; {name}[{', '.join(map(str, where))}] = {value[where].item()}"
            )
    return value.long()


def check_group_index(group_index: object, batch: int) -> tuple[torch.Tensor, int]:
    """group_index: int [B] with values covering exactly 0..G-1. Returns (group_index as int64, G)."""
    group_index = check_index("group_index", group_index, (batch,), low=0)
    if batch == 0:
        raise ValueError("rewards must hold at least one row, got batch size 0")
    num_groups = int(group_index.max()) + 1
    present = torch.zeros(num_groups, dtype=torch.bool, device=group_index.device)
    present[group_index] = True
    if not bool(present.all()):
        missing = (~present).nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"group_index must cover every group 0..{num_groups - 1}; missing group id(s) {missing} "
            f"(renumber the groups to 0..G-1)"
        )
    return group_index, num_groups


def check_rewards(rewards: object, ndim: int | tuple[int, ...] = 1) -> torch.Tensor:
    """rewards: a finite floating tensor of rank ``ndim`` (1 for [B], 2 for [B, K])."""
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__module__}.{type(rewards).__name__}")
    if rewards.device.type == "meta":
        raise ValueError("rewards is on the meta device (it has no values): pass a cpu or cuda tensor")
    if rewards.ndim not in allowed:
        want = " or ".join({1: "[B]", 2: "[B, K]"}.get(d, f"{d}-d") for d in allowed)
        raise ValueError(f"rewards must have shape {want}, got {tuple(rewards.shape)}")
    return check_float("rewards", rewards)


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
    return float(value)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, and 0 where the denominator is 0 (a zero std with epsilon = 0 only happens
    for a constant set, whose centered numerator is 0: the documented result is advantage 0, not NaN)."""
    safe = torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return torch.where(denominator == 0, torch.zeros_like(numerator), numerator / safe)


# ---- per-group statistics (all [G] unless noted) --------------------------------------------------------


def group_count(group_index: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=dtype, device=group_index.device).index_add_(
        0, group_index, torch.ones_like(group_index, dtype=dtype)
    )


def group_sum(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    # values [B, ...] -> [G, ...]
    out = torch.zeros((num_groups, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, group_index, values)


def group_mean(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    count = group_count(group_index, num_groups, values.dtype)
    count = count.reshape(num_groups, *([1] * (values.ndim - 1)))
    return group_sum(values, group_index, num_groups) / count


def group_std(
    values: torch.Tensor, group_index: torch.Tensor, num_groups: int, unbiased: bool = True
) -> torch.Tensor:
    """Standard deviation per group (two-pass). Bessel-corrected when ``unbiased``; a group of one gives 0."""
    mean = group_mean(values, group_index, num_groups)
    centered_sq = (values - mean[group_index]) ** 2
    count = group_count(group_index, num_groups, values.dtype).reshape(num_groups, *([1] * (values.ndim - 1)))
    denominator = (count - 1).clamp(min=1) if unbiased else count
    return (group_sum(centered_sq, group_index, num_groups) / denominator).sqrt()


def group_max(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    out = torch.full((num_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, group_index, values, reduce="amax", include_self=True)


def group_min(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    out = torch.full((num_groups,), float("inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, group_index, values, reduce="amin", include_self=True)


def batch_std(values: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Std over all B entries; 0 when B == 1 (TRL returns 0 there too)."""
    if values.numel() < 2:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values.std(unbiased=unbiased)


def masked_whiten(values: torch.Tensor, weights: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(x - mean_w) * rsqrt(var_w + epsilon), weighted by integer counts ``weights`` (Bessel over sum(w)).

    With ``weights`` = tokens per sequence this is verl's token-level ``masked_whiten`` applied to a
    per-sequence value broadcast over its tokens (verl/utils/torch_functional.py:329).
    """
    total = weights.sum()
    if float(total) < 2:
        raise ValueError(
            f"whitening needs at least 2 weighted entries (tokens or sequences), got {float(total)}"
        )
    mean = (values * weights).sum() / total
    var = (((values - mean) ** 2) * weights).sum() / total * (total / (total - 1))
    return (values - mean) * torch.rsqrt(var + epsilon)
