"""The estimator registry: one calling convention for every advantage estimator.

    advantages = estimate(name, rewards, group_index, **options)

``rewards`` is a float tensor [B] (or [B, K] for multi-reward estimators, [B, S] for step rewards),
``group_index`` an int64 tensor [B] whose values cover 0..G-1. ``estimate`` validates both, rejects
options the estimator does not declare, and calls the estimator. Each estimator returns one plain
tensor whose shape ([B] or [B, T]) is fixed per estimator and listed in ``available()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._groups import check_group_index, check_rewards

# Shapes an estimator may return; part of each entry so callers know the layout without a flag.
OUTPUT_SHAPES = ("[B]", "[B, T]")


@dataclass(frozen=True)
class EstimatorSpec:
    """One registry entry.

    ``fn(rewards, group_index, *, num_groups, **options)`` receives validated ``rewards`` and an int64
    ``group_index`` covering 0..num_groups-1.
    """

    name: str  # the key of estimate(name, ...)
    fn: Callable[..., torch.Tensor]
    output: str  # "[B]" or "[B, T]"
    rewards_shape: str  # "[B]", "[B, K]" or "[B, S]"
    paper: str  # "Title (arXiv:XXXX.XXXXX)"
    peer: str  # which peer function it matches, or "—"
    summary: str  # first docstring line

    @property
    def options(self) -> tuple[str, ...]:
        params = inspect.signature(self.fn).parameters
        return tuple(p for p in params if p not in ("rewards", "group_index", "num_groups"))


_REGISTRY: dict[str, EstimatorSpec] = {}


def register(
    name: str,
    *,
    output: str = "[B]",
    rewards_shape: str = "[B]",
    paper: str = "—",
    peer: str = "—",
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator registering ``fn(rewards, group_index, *, num_groups, **options) -> Tensor`` under ``name``.

    Registering a different function under a name already taken raises ``ValueError`` (registering the
    same function twice is a no-op). Options are the keyword-only parameters of ``fn``; the first line of
    its docstring becomes the table summary.

    Args:
        name: the registry key (``estimate(name, ...)``).
        output: "[B]" (one advantage per sequence) or "[B, T]" (per token).
        rewards_shape: the rewards it takes: "[B]", "[B, K]" (several reward functions) or "[B, S]" (step
            rewards).
        paper: "Title (arXiv:XXXX.XXXXX)" for the README table.
        peer: the TRL / verl function it matches, or "—".

    Example::

        @register("my_baseline", output="[B]")
        def my_baseline(rewards, group_index, *, num_groups, shift: float = 0.0):
            \"\"\"Reward minus a constant.\"\"\"
            return rewards - shift
    """
    if output not in OUTPUT_SHAPES:
        raise ValueError(f"output must be one of {OUTPUT_SHAPES}, got {output!r}")
    if rewards_shape not in ("[B]", "[B, K]", "[B, S]"):
        raise ValueError(f"rewards_shape must be '[B]', '[B, K]' or '[B, S]', got {rewards_shape!r}")

    def decorator(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        params = inspect.signature(fn).parameters
        for required in ("rewards", "group_index", "num_groups"):
            if required not in params:
                raise ValueError(f"estimator {name!r} must accept a {required!r} parameter")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(
                f"an advantage estimator named {name!r} is already registered ({existing.fn.__qualname__})"
            )
        doc = inspect.getdoc(fn) or ""
        summary = doc.splitlines()[0].strip() if doc else name
        _REGISTRY[name] = EstimatorSpec(name, fn, output, rewards_shape, paper, peer, summary)
        return fn

    return decorator


def get(name: str) -> EstimatorSpec:
    """The registry entry for ``name``.

    Returns the ``EstimatorSpec`` (function, output shape, rewards shape, options, paper, peer); raises
    ``ValueError`` listing the known names if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; available: {sorted(_REGISTRY)}") from None


def available() -> dict[str, EstimatorSpec]:
    """All registered estimators, by name (a copy).

    ``{name: EstimatorSpec}`` sorted by name; ``spec.options`` lists each estimator's keyword options and
    ``spec.output`` its return shape."""
    return dict(sorted(_REGISTRY.items()))


def estimate(name: str, rewards: torch.Tensor, group_index: torch.Tensor, **options: object) -> torch.Tensor:
    """Advantages from the estimator registered as ``name``.

    Args:
        name: a key of ``available()``.
        rewards: float [B] (float [B, K] / [B, S] for the estimators whose ``rewards_shape`` says so);
            every entry finite.
        group_index: int64 [B]; row i belongs to group ``group_index[i]``; the values cover 0..G-1.
            Groups may be ragged; a group of one row gets advantage 0 from every group-relative estimator.
        **options: the estimator's keyword options (see its docstring); unknown names raise ``ValueError``.

    Returns:
        A tensor of the shape in the estimator's ``output`` ([B] or [B, T]).
    """
    spec = get(name)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(
            f"estimator {name!r} got unknown option(s) {unknown}; its options are {list(spec.options)}"
        )
    rewards = check_rewards(rewards, ndim=1 if spec.rewards_shape == "[B]" else 2)
    group_index, num_groups = check_group_index(group_index, rewards.shape[0])
    if group_index.device != rewards.device:
        raise ValueError(f"group_index is on {group_index.device} but rewards on {rewards.device}")
    return spec.fn(rewards, group_index, num_groups=num_groups, **options)


def registry_table_markdown() -> str:
    """The README table of every registered estimator, as Markdown.

    Generated from the registry (name, output and rewards shapes, summary, paper, peer parity);
    ``python -m grpo_kernels.advantages --markdown`` prints it and a test checks README.md against it."""
    lines = [
        "| Name | Returns | Rewards | Summary | Paper | Peer parity |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for spec in available().values():
        cells = [f"`{spec.name}`", spec.output, spec.rewards_shape, spec.summary, spec.paper, spec.peer]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
