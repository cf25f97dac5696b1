"""``python -m grpo_kernels.advantages --markdown`` prints the README table of every registered estimator;
``--write README.md`` replaces the table between the advantages-table markers in that file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .registry import registry_table_markdown

START = "<!-- advantages-table:start -->"
END = "<!-- advantages-table:end -->"


def replace_table(text: str, table: str) -> str:
    """``text`` with the block between the START and END markers replaced by ``table``."""
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ValueError(f"the file must contain {START} followed by {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_kernels.advantages", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the estimator table")
    group.add_argument("--write", metavar="README", type=Path, help="rewrite the table in this file")
    args = parser.parse_args(argv)
    table = registry_table_markdown()
    if args.markdown:
        sys.stdout.write(table)
    else:
        args.write.write_text(replace_table(args.write.read_text(), table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
