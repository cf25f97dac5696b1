"""The README's test counts and times: docs/records/tests.json, from the records a clean-clone `.ci/run` writes
(.ci/tests-quick.json for the quick tier, .ci/tests.json for the full suite, each by tests/conftest.py when
GRPO_KERNELS_TEST_RECORD is set), and the README's test-figures span generated from it.

    python tools/records/tests_record.py .ci/tests-quick.json .ci/tests.json           # write record + README
    python tools/records/tests_record.py --check .ci/tests-quick.json .ci/tests.json   # CI (.ci/steps/test_counts.sh)

--check compares the counts of this run (tests collected and run, skipped) with the committed record and
exits 1 when they differ, saying how to refresh it: the README's figures are of other code then. Only a
passing run of the whole README command may be recorded (no failure, no error).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from readme_spans import write_span  # noqa: E402

ROOT = HERE.parents[1]
RECORD = ROOT / "docs" / "records" / "tests.json"
COMMAND = "python tools/records/tests_record.py .ci/tests-quick.json .ci/tests.json"
COUNTED = ("tests", "skipped", "xfailed")


def minutes(seconds: float) -> str:
    return f"{max(1, round(seconds / 60))} minute" + ("s" if round(seconds / 60) > 1 else "")


def readme_sentence(record: dict) -> str:
    """The README's test-figures span."""
    quick, full = record["quick"], record["full"]

    def tier(run: dict) -> str:
        skipped = f"{run['skipped']} skip" + (f", {run['xfailed']} strict xfail" if run["xfailed"] else "")
        cpu = f", {minutes(run['cpu_seconds'])} of CPU" if run.get("cpu_seconds") else ""
        return (f"{run['tests']:,} tests ({skipped}) in {minutes(run['seconds'])} of wall time{cpu} "
                f"(run at {run['git_sha']}, load average {run.get('load_average_1min_at_end', 'not recorded')} "
                "at its end)")  # fmt: skip

    return (
        f"The quick tier: {tier(quick)}; the full suite: {tier(full)}; on {full['cpus']} CPU cores with torch "
        f"{full['torch']} (records of runs of the two commands, `docs/records/tests.json`; CI checks that the "
        "counts still hold). The skipped tests need CUDA, a vLLM engine or another trainer's environment "
        "(`.ci/run` runs those in environments of their own)"
    )


def load_runs(quick_path: str, full_path: str) -> dict:
    runs = {"quick": json.loads(pathlib.Path(quick_path).read_text()),
            "full": json.loads(pathlib.Path(full_path).read_text())}  # fmt: skip
    for name, run in runs.items():
        if run["failed"] or run["error"]:
            raise SystemExit(f"{name}: {run['failed']} failed, {run['error']} errors: only a passing run is recorded")
    return runs


def check(runs: dict) -> list[str]:
    record = json.loads(RECORD.read_text())
    problems = []
    for name in ("quick", "full"):
        for key in COUNTED:
            if runs[name][key] != record[name][key]:
                problems.append(f"{name}: {runs[name][key]} {key} in this run, {record[name][key]} in "
                                f"docs/records/tests.json (made at {record[name]['git_sha']})")  # fmt: skip
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the counts with the committed record")
    parser.add_argument("quick", help="the quick tier's run record (.ci/tests-quick.json)")
    parser.add_argument("full", help="the full suite's run record (.ci/tests.json)")
    args = parser.parse_args(argv)
    runs = load_runs(args.quick, args.full)
    if args.check:
        problems = check(runs)
        if problems:
            print("\n".join(["The README's test counts are not this code's:", *problems,
                             f"Refresh them from this run: {COMMAND}",
                             "(rewrites docs/records/tests.json and the README's test-figures span; commit both)"]),
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"test counts as recorded: quick {runs['quick']['tests']}, full {runs['full']['tests']}")
        return 0
    RECORD.write_text(json.dumps(runs, indent=2) + "\n")
    write_span("test-figures", readme_sentence(runs))
    print(f"wrote {RECORD} and the README's test-figures span")
    return 0


if __name__ == "__main__":
    sys.exit(main())
