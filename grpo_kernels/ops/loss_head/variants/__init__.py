"""The registry of loss variants (PolicyLossConfig.loss_type): one file per variant in this folder, each defining
`VARIANT` (a `_base.LossVariant`); the registry collects every module here whose name does not start with "_".
A new variant is one new file (and one row of the tests' table, tests/test_loss_head.py CONFIGS): the recipe is
in ../README.md "Adding a variant"."""

from __future__ import annotations

import enum
import importlib
import pkgutil

from ._base import LossVariant

_modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)
            if not info.name.startswith("_")]  # fmt: skip
VARIANTS: dict[str, LossVariant] = {v.name: v for v in sorted((m.VARIANT for m in _modules), key=lambda v: v.id)}
MODULES = {m.VARIANT.name: m for m in _modules}
LOSS_TYPES = tuple(VARIANTS)  # in LossId order
# the kernel's LOSS constexpr: one named constant per variant (triton.py binds LOSS_<NAME> = LossId.<NAME>)
LossId = enum.IntEnum("LossId", {name.upper(): v.id for name, v in VARIANTS.items()})
PRESETS = {name: (v.name, kwargs) for v in VARIANTS.values() for name, kwargs in v.presets.items()}


def _check_registry() -> None:
    ids = [v.id for v in VARIANTS.values()]
    if len(set(ids)) != len(ids):
        raise AssertionError(f"loss variants share a LossId: {sorted(ids)}")
    names = [n for v in VARIANTS.values() for n in v.presets]
    if len(set(names)) != len(names):
        raise AssertionError(f"two loss variants define the same preset: {sorted(names)}")


_check_registry()


def get(loss_type: str) -> LossVariant:
    return VARIANTS[loss_type]


__all__ = ["LOSS_TYPES", "LossId", "LossVariant", "MODULES", "PRESETS", "VARIANTS", "get"]
