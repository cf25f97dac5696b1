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


def test_extras_transformers_ranges_intersect_and_hold_for_what_is_installed():
    """[train] and [verl] must accept a common transformers (installing both resolves, README "Install"),
    and the parity environment's transformers must satisfy every extra that names it."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ranges = {}
    for extra, requirements in extras.items():
        for text in requirements:
            req = Requirement(text)
            if req.name == "transformers":
                ranges[extra] = req.specifier
    assert {"train", "verl", "trl", "parity"} <= set(ranges), ranges
    candidates = [Version(f"5.{minor}.{patch}") for minor in range(0, 30) for patch in range(0, 10)]
    common = [v for v in candidates if v in ranges["train"] and v in ranges["verl"] and v in ranges["trl"]]
    assert common, f"no transformers 5.x satisfies [train] {ranges['train']}, [trl] {ranges['trl']} and [verl] {ranges['verl']}"
    assert str(ranges["verl"]) == str(ranges["parity"]), "the parity suite runs verl: the same range"
    try:
        installed = Version(md.version("transformers"))
    except md.PackageNotFoundError:
        return
    for extra in ("train", "trl"):
        assert installed in ranges[extra], (extra, installed, ranges[extra])
