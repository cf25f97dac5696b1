"""What `pip install -e ".[verl]"` changes on top of `pip install -e ".[train]"`: a real resolve in a scratch
virtual environment, recorded in docs/records/verl_install.json; the README's sentence next to the install
command is generated from that record (`readme_sentence`, written into the README's verl-install span and
checked by tests/test_readme_records.py).

    python tools/records/verl_install_record.py      # a few minutes: installs [train] in a venv

Steps, in a new venv: pip install torch==2.13.0 (the CPU build, as the README's first line), then
`pip install -e ".[train]"` for real, `pip list`, then `pip install --dry-run --report` of `-e ".[verl]"`.
The record keeps, from pip's report, every package the resolve would install, and which of them replace
an installed version (up or down).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import tempfile

from readme_spans import dump_record, write_span

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "verl_install.json"


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def version_key(version: str) -> tuple:
    from packaging.version import Version

    return Version(version)


def summarize(before: list[dict], report: dict) -> dict:
    """The record from `pip list --format json` before and `pip install --dry-run --report` (its JSON)."""
    installed = {normalize(p["name"]): p["version"] for p in before}
    changed, added = [], []
    for item in report["install"]:
        name, version = normalize(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "grpo-kernels":
            continue  # the package itself, reinstalled with its new extra
        if name in installed:
            if installed[name] != version:
                direction = "down" if version_key(version) < version_key(installed[name]) else "up"
                changed.append({"name": name, "from": installed[name], "to": version, "direction": direction})
        else:
            added.append({"name": name, "version": version})
    for change in changed:
        change["required_by"] = excluding_requirements(report, change["name"], change["from"])
    return {
        "changed": changed,
        "added": sorted(added, key=lambda a: a["name"]),
        "pip": report.get("pip_version"),
    }


def excluding_requirements(report: dict, name: str, installed: str) -> list[str]:
    """The requirements of the packages the resolve installs that exclude the installed version of `name`
    (why pip changes it), as "package: requirement"."""
    from packaging.requirements import Requirement

    reasons = []
    for item in report["install"]:
        for text in item["metadata"].get("requires_dist") or []:
            requirement = Requirement(text)
            if normalize(requirement.name) != name or (requirement.marker and "extra" in str(requirement.marker)):
                continue  # another package, or only under an extra of that package
            if not requirement.specifier.contains(installed, prereleases=True):
                reasons.append(f"{item['metadata']['name']}: {requirement.name}{requirement.specifier}")
    return reasons


def readme_sentence(record: dict) -> str:
    """The README's sentence on what installing [verl] on top of [train] changes (generated, never typed)."""
    def change(c):
        why = "; ".join(c["required_by"]) or "the resolver's choice"
        return f"{c['name']} {c['from']} -> {c['to']} ({why})"

    changes = ", ".join(change(c) for c in record["changed"])
    down = [c for c in record["changed"] if c["direction"] == "down"]
    verb = "downgrades" if len(down) == len(record["changed"]) else "changes"
    return (
        f"Installed on top of `[train]`, `[verl]` {verb} {changes}, and adds "
        f"{len(record['added'])} packages (ray, pyarrow, tensordict, ...): a real resolve with pip "
        f"{record['pip']} and torch {record['torch']}, recorded in `docs/records/verl_install.json` by "
        "`python tools/records/verl_install_record.py`. Use a separate environment for verl if you "
        "need the newer versions."
    )


def run(*command: str) -> str:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="verl_install_") as scratch:
        run(sys.executable, "-m", "venv", f"{scratch}/venv")
        python = f"{scratch}/venv/bin/python"
        run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
        run(python, "-m", "pip", "install", "-q", "torch==2.13.0")
        run(python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[train]")
        before = json.loads(run(python, "-m", "pip", "list", "--format", "json"))
        report_path = f"{scratch}/report.json"
        run(python, "-m", "pip", "install", "--dry-run", "-q", "--report", report_path, "-e", f"{ROOT}[verl]")
        report = json.loads(pathlib.Path(report_path).read_text())
        torch_version = next(p["version"] for p in before if normalize(p["name"]) == "torch")
    record = {
        "what": 'pip install --dry-run --report of -e ".[verl]" in a venv holding -e ".[train]" and torch 2.13.0',
        **summarize(before, report),
        "torch": torch_version,
        "python": platform.python_version(),
    }
    RECORD.write_text(dump_record(record))
    write_span("verl-install", readme_sentence(record))  # the README's sentence follows the record
    print(readme_sentence(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
