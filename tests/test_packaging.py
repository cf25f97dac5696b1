"""The explicit package list in pyproject.toml covers every package folder (it is explicit because
the top-level integrations/ folder is mapped to grpo_kernels.integrations)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "grpo_kernels").rglob("__init__.py")
    } | {"grpo_kernels.integrations"}
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
    assert config["package-dir"]["grpo_kernels.integrations"] == "integrations"


def test_integrations_import_as_a_subpackage():
    import grpo_kernels.integrations as integrations

    assert pathlib.Path(integrations.__file__).resolve().parent == ROOT / "integrations"
