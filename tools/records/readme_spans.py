"""README spans generated from records: the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` is
written by the script that measures it (main_job_record.py, lookup_turn_credit.py, verl_install_record.py)
and compared by tests/test_readme_records.py, never typed by hand."""

from __future__ import annotations

import pathlib

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _bounds(text: str, name: str) -> tuple[int, int]:
    start_marker, end_marker = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start_marker not in text or end_marker not in text:
        raise ValueError(f"README.md has no {start_marker} ... {end_marker} span")
    return text.index(start_marker) + len(start_marker), text.index(end_marker)


def read_span(name: str, path: pathlib.Path = README) -> str:
    text = path.read_text()
    start, end = _bounds(text, name)
    return text[start:end]


def write_span(name: str, content: str, path: pathlib.Path = README) -> None:
    text = path.read_text()
    start, end = _bounds(text, name)
    path.write_text(text[:start] + content + text[end:])


def dump_record(record: dict) -> str:
    """The record as indented JSON, lists of numbers on one line (per-step values stay readable)."""
    import json
    import re

    text = json.dumps(record, indent=2)
    return re.sub(r"\[\s+([-\d.e+,\s]*?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text) + "\n"  # fmt: skip
