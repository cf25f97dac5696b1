"""Bit-for-bit evidence for a refactor of the Triton kernels: the digest of the PTX code (`aot.ptx_code`: no
debug information, no scope labels of inlined calls) of every case of both compile matrices
(grpo_kernels/testing/lm_head_compile.py, loss_head_compile.py), every target architecture, and a comparison of
two such files. Run it in each tree (the package imported from that tree), then compare:

    python tools/evidence/ptx_digests.py write OUT.json [--only SUBSTRING]
    python tools/evidence/ptx_digests.py compare BEFORE.json AFTER.json

A case compiled in one tree and not the other, or with another digest, is listed and fails the comparison.
One process: the whole of both matrices takes about 10 minutes on this project's CPUs (--only: the cases whose id
contains SUBSTRING, e.g. sm90 or
dppo).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def write(out: Path, only: str | None) -> int:
    from grpo_kernels.testing import aot
    from grpo_kernels.testing import lm_head_compile as lm_head
    from grpo_kernels.testing import loss_head_compile as loss_head

    # a tree from before aot.ptx_code dropped the inlined calls' scope labels digests with them: drop them here
    # too (idempotent), in this process (workers=1: spawned workers would import the tree's own function)
    tree_ptx_code = aot.ptx_code
    aot.ptx_code = lambda ptx: "\n".join(
        line for line in tree_ptx_code(ptx).splitlines() if not re.fullmatch(r"\s*\$L__tmp\d+:\s*", line)
    )
    digests: dict[str, str] = {}
    with aot.own_triton_cache():
        lm_cases = [c for c in lm_head.cases() if only is None or only in lm_head.case_id(c)]
        # a loss-head case compiles for every architecture, its rows named <case>-sm<arch>: filtered below
        loss_cases = [n for n in loss_head.CASES if only is None or only in n] or list(loss_head.CASES)
        rows = (lm_head.run_matrix(workers=1, selected=lm_cases) if lm_cases else []) + (
            loss_head.run_matrix(names=loss_cases, workers=1) if loss_cases else [])  # fmt: skip
    for row in (r for r in rows if only is None or only in r["id"]):
        digests[f"{row['id']}"] = row.get("ptx_sha256") or f"not compiled: {row.get('error') or row.get('skipped')}"
    out.write_text(json.dumps(dict(sorted(digests.items())), indent=1))
    print(f"{len(digests)} cases -> {out}")
    return 0


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    missing = sorted(set(a) ^ set(b))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    print(f"{len(set(a) & set(b)) - len(differ)} of {len(set(a) | set(b))} cases identical; "
          f"{len(differ)} differ, {len(missing)} in one file only")  # fmt: skip
    for k in (differ + missing)[:20]:
        print(f"  {k}: {a.get(k, '(absent)')[:16]} -> {b.get(k, '(absent)')[:16]}")
    return 1 if differ or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--only", default=None)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    return write(args.out, args.only) if args.command == "write" else compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
