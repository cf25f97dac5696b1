"""What `pip install -e ".[unsloth]"` changes on top of the base install (`pip install -e .` after the CPU torch):
a real resolve in a scratch virtual environment, recorded in docs/records/unsloth_install.json; the README's
sentence under "Use with Unsloth" is generated from that record (`readme_sentence`, written into the README's
unsloth-install span and checked by tests/test_readme_records.py).

    python tools/records/unsloth_install_record.py      # a few minutes: installs the base in a venv

Steps, in a new venv: pip install torch==2.13.0 (the CPU build), `pip install -e .` for real, `pip list`, then
`pip install --dry-run --report` of `-e ".[unsloth]"`. The record keeps every package the resolve would
install, and which of them replace an installed version (verl_install_record.summarize).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile

from readme_spans import dump_record, write_span
from verl_install_record import normalize, run, summarize

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "records" / "unsloth_install.json"
# GPU packages among Unsloth's requirements (named in the sentence when the resolve adds them)
GPU_STACK = ("xformers", "bitsandbytes", "torchvision", "torchao", "diffusers", "cut-cross-entropy")


def readme_sentence(record: dict) -> str:
    """The README's sentence on what installing [unsloth] on top of the base changes (generated, never typed)."""

    def change(c):
        why = "; ".join(c["required_by"]) or "the resolver's choice"
        return f"{c['name']} {c['from']} -> {c['to']} ({why})"

    changes = ", ".join(change(c) for c in record["changed"]) or "nothing installed"
    added = {a["name"]: a["version"] for a in record["added"]}
    gpu = ", ".join(f"{name} {added[name]}" for name in GPU_STACK if name in added)
    cuda = sum(1 for name in added if name.startswith(("nvidia-", "cuda-")))
    return (
        f"On top of the base install (torch {record['torch']}), `[unsloth]` changes {changes}, and adds "
        f"{len(record['added'])} packages: trl {added.get('trl', '?')}, transformers {added.get('transformers', '?')}, "
        f"Unsloth's GPU stack ({gpu}) and {cuda} CUDA runtime packages, ...: a real resolve with pip {record['pip']}, "
        "recorded in `docs/records/unsloth_install.json` by `python tools/records/unsloth_install_record.py`. "
        "That is what `pip install unsloth` gives a GPU machine; on a CPU machine, or to keep your torch, build "
        "the separate environment below."
    )


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="unsloth_install_") as scratch:
        run(sys.executable, "-m", "venv", f"{scratch}/venv")
        python = f"{scratch}/venv/bin/python"
        run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
        run(python, "-m", "pip", "install", "-q", "torch==2.13.0")
        run(python, "-m", "pip", "install", "-q", "-e", str(ROOT))
        before = json.loads(run(python, "-m", "pip", "list", "--format", "json"))
        report_path = f"{scratch}/report.json"
        run(python, "-m", "pip", "install", "--dry-run", "-q", "--report", report_path, "-e", f"{ROOT}[unsloth]")
        report = json.loads(pathlib.Path(report_path).read_text())
        torch_version = next(p["version"] for p in before if normalize(p["name"]) == "torch")
    record = {
        "what": 'pip install --dry-run --report of -e ".[unsloth]" in a venv holding -e . and torch 2.13.0',
        **summarize(before, report),
        "torch": torch_version,
        "python": platform.python_version(),
    }
    RECORD.write_text(dump_record(record))
    write_span("unsloth-install", readme_sentence(record))  # the README's sentence follows the record
    print(readme_sentence(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
