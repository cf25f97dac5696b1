"""`grpo-kernels train` on the base install (without the `train` extra: transformers, safetensors,
matplotlib, tqdm): --help works, and a run says which extra to install instead of a ModuleNotFoundError.
Simulated in a subprocess whose imports of those packages fail (a sys.meta_path finder that raises)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("transformers", "safetensors", "matplotlib", "tqdm")
RUNNER = f"""
import sys

class Blocker:  # as if the train extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from grpo_kernels.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", RUNNER, *args], env=env, capture_output=True, text=True, timeout=300)


def test_train_help_works_without_the_extra():
    proc = run("train", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--steps" in proc.stdout and "--resume" in proc.stdout
    assert "ModuleNotFoundError" not in proc.stderr


def test_train_without_the_extra_says_what_to_install():
    proc = run("train", "--steps", "1")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert 'pip install -e ".[train]"' in proc.stderr, proc.stderr
    for name in BLOCKED:
        assert name in proc.stderr, (name, proc.stderr)
