"""Loading SkyRL 0.4.0 and torchtitan 0.3.0 in the tests: the import shims live here, never in the adapters.

* SkyRL declares Python >= 3.12. On 3.11 (this project's CI) ``skyrl/backends/__init__.py`` fails: it
  imports the Tinker API types, which give pydantic a ``typing.TypedDict`` (pydantic wants
  ``typing_extensions.TypedDict`` below 3.12). ``skyrl.backends`` is made a bare package here (the
  loss, model-wrapper and worker modules below it import fine). Its FSDP model wrapper imports
  ``flash_attn.bert_padding`` at module level, used only for sample packing: a stub stands in (as
  SkyRL's own CPU tests run without flash-attn), raising if called.
* torchtitan's ``torchtitan/experiments/rl/__init__.py`` imports vLLM; the tests only need its losses:
  ``torchtitan.experiments.rl`` is made a bare package. The adapter imports neither.

Each ``require_*`` skips the calling module, naming what to install, when the trainer is absent; with
``GRPO_KERNELS_REQUIRE_TRAINERS=1`` (CI's trainers step, .ci/steps/trainers.sh) it fails instead.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

SKYRL_PIN = "0.4.0"
TORCHTITAN_PIN = "0.3.0"
SKYRL_INSTALL = ("skyrl==0.4.0 is not installed: bash .ci/steps/trainers.sh builds its environment (README, "
                 "'Use with SkyRL')")
TORCHTITAN_INSTALL = ('torchtitan==0.3.0 is not installed: pip install -e ".[torchtitan]" (README, '
                      "'Use with torchtitan')")


def _absent(reason: str):
    if os.environ.get("GRPO_KERNELS_REQUIRE_TRAINERS") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _bare_package(name: str, folder: Path) -> None:
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) is None:
        return
    module = types.ModuleType(name)
    module.__path__ = [str(folder)]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [str(folder)]
    sys.modules[name] = module


def skyrl_shims() -> None:
    """The Python 3.11 shims (see the module docstring); a no-op where SkyRL imports as it is."""
    import skyrl

    if sys.version_info < (3, 12):
        _bare_package("skyrl.backends", Path(skyrl.__file__).parent / "backends")
    try:
        import flash_attn.bert_padding  # noqa: F401
    except ImportError:
        import transformers  # noqa: F401  (its availability checks read flash_attn's spec: before the stub)

        def stub(*args, **kwargs):
            raise NotImplementedError("flash_attn stub (tests/trainer_support.py): sample packing needs flash-attn")

        package = types.ModuleType("flash_attn")
        package.__path__ = []
        package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
        padding = types.ModuleType("flash_attn.bert_padding")
        padding.pad_input = padding.unpad_input = stub
        sys.modules["flash_attn"], sys.modules["flash_attn.bert_padding"] = package, padding


def require_skyrl():
    version = _version("skyrl")
    if version is None:
        _absent(SKYRL_INSTALL)
    if version != SKYRL_PIN:
        _absent(f"skyrl=={version} is installed; the adapter is pinned to {SKYRL_PIN}")
    skyrl_shims()
    from skyrl.backends.skyrl_train.utils import ppo_utils

    return ppo_utils


def torchtitan_shims() -> None:
    import torchtitan

    _bare_package("torchtitan.experiments.rl", Path(torchtitan.__file__).parent / "experiments" / "rl")


def require_torchtitan():
    version = _version("torchtitan")
    if version is None:
        _absent(TORCHTITAN_INSTALL)
    if version != TORCHTITAN_PIN:
        _absent(f"torchtitan=={version} is installed; the adapter is pinned to {TORCHTITAN_PIN}")
    torchtitan_shims()
    from torchtitan.experiments.rl import losses

    return losses
