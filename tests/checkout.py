"""Run the tests against this source tree's integrations/ folder, whatever else is installed.

pyproject maps the top-level integrations/ folder to `grpo_kernels.integrations`. With PYTHONPATH=.
`grpo_kernels` comes from this tree, but `grpo_kernels.integrations` does not exist on disk under
grpo_kernels/, so an editable install of *another* checkout (its import finder answers for that
name) would supply its own integrations/ instead. conftest.py calls `use_this_checkouts_integrations`
before any test module imports; subprocesses start with `PYTHON_PREAMBLE` (and PYTHONPATH=CHECKOUT).
An installed, non-editable grpo_kernels is left alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
INTEGRATIONS = CHECKOUT / "integrations"


def use_this_checkouts_integrations() -> None:
    import grpo_kernels

    if Path(grpo_kernels.__file__).resolve().parent != CHECKOUT / "grpo_kernels":
        return  # testing an installed grpo_kernels
    loaded = sys.modules.get("grpo_kernels.integrations")
    if loaded is not None and Path(loaded.__file__).resolve().parent == INTEGRATIONS:
        return
    for name in [
        n
        for n in sys.modules
        if n == "grpo_kernels.integrations" or n.startswith("grpo_kernels.integrations.")
    ]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "grpo_kernels.integrations",
        INTEGRATIONS / "__init__.py",
        submodule_search_locations=[str(INTEGRATIONS)],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_kernels.integrations"] = module
    spec.loader.exec_module(module)
    grpo_kernels.integrations = module


PYTHON_PREAMBLE = (
    f"import sys; sys.path.insert(0, {str(CHECKOUT / 'tests')!r}); sys.path.insert(0, {str(CHECKOUT)!r})\n"
    "import checkout; checkout.use_this_checkouts_integrations()\n"
)
