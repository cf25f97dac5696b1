"""The build stamp of csrc/: sha256 over the kernel sources and the build script, in name order.

csrc/build.sh embeds it in the library (grpo_csrc_build_stamp()); grpo_kernels/ops/lm_head/cutlass.py loads
this file to recompute it and treats a library whose stamp differs as stale (one warning, Triton fallback).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

STAMPED = ("*.cu", "*.cuh", "*.h", "build.sh")


def source_stamp(src_dir: Path) -> str:
    digest = hashlib.sha256()
    files = sorted({p for pattern in STAMPED for p in Path(src_dir).glob(pattern)})
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


if __name__ == "__main__":
    print(source_stamp(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent))
