"""verl's fused linear cross-entropy kernel (`verl.utils.kernel.linear_cross_entropy`, verl 0.9.1) where
verl's package does not import: `import verl` pulls in Ray and tensordict (verl/protocol.py), which the GPU
machine lacks and which are too large to carry there, while the kernel itself needs only torch, Triton and
four device helpers of `verl.utils.device`.

Importing this module gives `linear_cross_entropy` and `HOW` (how it was loaded). If verl imports whole, that
is verl's own import. Otherwise verl's two kernel files are loaded from its installed folder, unchanged, under
stand-ins for what they import: `verl`, `verl.utils` and `verl.utils.kernel` as empty packages over the real
folders (so `from . import kernels` finds verl's file), and `verl.utils.device` as the four helpers answered
for CUDA (`is_cuda_available`, `get_device_name`, `get_device_capability`, `get_torch_device`). The stand-ins
stay in `sys.modules` (the kernel imports `kernels` at its first call): load this only in a process that
uses no other part of verl (the GPU session's benchmark children).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch


def _device_stand_in() -> types.ModuleType:
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda" if torch.cuda.is_available() else "cpu"

    def get_device_capability(device_id: int = 0):
        return torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else (None, None)

    device.get_device_capability = get_device_capability
    device.get_torch_device = lambda: torch.cuda
    return device


def _load():
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy, "verl imported whole"
    except ImportError as exc:
        why = f"{type(exc).__name__}: {str(exc)[:120]}"
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]  # what the failed import left half-made
    spec = importlib.util.find_spec("verl")  # the folder only: verl/__init__.py is not run
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed (pip install --no-deps verl==0.9.1 is enough for its kernel)")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "utils" / "kernel" / "linear_cross_entropy.py").exists():
        raise ImportError(f"no utils/kernel/linear_cross_entropy.py under {root}")
    for name, folder in (("verl", root), ("verl.utils", root / "utils"), ("verl.utils.kernel", root / "utils" / "kernel")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        package.__package__ = name
        sys.modules[name] = package
    sys.modules["verl.utils.device"] = _device_stand_in()
    module = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    return module.linear_cross_entropy, f"verl's kernel files from {root}, without verl's package ({why})"


linear_cross_entropy, HOW = _load()
