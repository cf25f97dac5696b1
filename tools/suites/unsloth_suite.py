"""Run Unsloth's own tests of its GRPO log-prob and loss code twice, with Unsloth's log-prob kernel and with
grpo_kernels' in its place, and compare every outcome.

    python tools/suites/unsloth_suite.py --tests PATH/TO/unsloth-zoo/tests [--ref COMMIT] [--out DIR]

PATH is the tests/ folder of an unsloth-zoo (or unsloth) checkout: the wheels ship no tests. The chosen test files
(`--files`; default unsloth-zoo's GRPO log-prob and loss tests, DEFAULT_FILES) and the folder's helpers and
conftest are copied into OUT/stock and OUT/swapped (OUT: a new temporary folder unless given), each with links
named unsloth_zoo and unsloth to the *installed* packages, so the tests run against them (also those that read
their source files); Unsloth's generated modules go to OUT/stock/unsloth_compiled_cache and
OUT/swapped/unsloth_compiled_cache (UNSLOTH_COMPILE_LOCATION), never the folder it is run from. Both runs load
a pytest plugin that records each test's outcome; in the swapped run it also puts
`grpo_kernels.integrations.unsloth.UnslothLogProbsKernel` in `unsloth_zoo.fused_losses.fused_linear.fused_linear_logprobs`
before every test (every Unsloth caller looks it up there when it runs) and counts, per test, the calls that
reached it (the stock run must reach none). Writes OUT/unsloth_suite.json: versions, the files run, per-test
outcomes of both runs (the last lines of each failure), which tests called the kernel, and the tests whose
outcome differs. Exits 1 when one differs, 2 on a bad argument or a run that recorded nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

# unsloth-zoo's test files that exercise its GRPO log-prob / loss code (unsloth_zoo.rl_replacements and the
# fused_losses it calls): the default selection
DEFAULT_FILES = (
    "test_rl_replacements_cpu.py",
    "test_grpo_chunked_reduction_dim.py",
    "test_chunked_log_softmax_device.py",
    "test_grpo_packed_raw_logits_dispatch.py",
    "test_grpo_packed_verify_raw_logits.py",
    "test_grpo_prefix_grouper_raw_logits.py",
    "test_rl_replacements_compile_disable.py",
    "test_trl_entropy_metric.py",
)

PLUGIN = '''"""pytest plugin of unsloth_suite.py: records every test's outcome and, when UNSLOTH_SUITE_SWAP=1, puts
grpo_kernels' kernel in place of Unsloth's before every test and counts the calls each test made to it."""
import json, os
os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
import unsloth_zoo.fused_losses.fused_linear as _module
from grpo_kernels.integrations.unsloth import KERNEL_NAME, UnslothLogProbsKernel

SWAP = os.environ.get("UNSLOTH_SUITE_SWAP") == "1"
KERNEL = UnslothLogProbsKernel()
OUTCOMES, CALLS, _before = {}, {}, {}


def pytest_runtest_setup(item):
    if SWAP:
        setattr(_module, KERNEL_NAME, KERNEL)  # also after a test that patched the attribute
    _before[item.nodeid] = KERNEL.calls


def pytest_runtest_teardown(item):
    calls = KERNEL.calls - _before.get(item.nodeid, KERNEL.calls)
    if calls:
        CALLS[item.nodeid] = calls


def pytest_runtest_logreport(report):
    entry = OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "error": None})
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"], entry["error"] = "skipped", str(report.longrepr)[-300:]
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["error"] = "\\n".join(str(report.longrepr).strip().splitlines()[-6:])


def pytest_collectreport(report):
    if report.failed:
        OUTCOMES[report.nodeid] = {"outcome": "error", "error": str(report.longrepr)[-600:]}


def pytest_sessionfinish(session):
    with open(os.environ["UNSLOTH_SUITE_RECORD"], "w") as f:
        json.dump({"outcomes": OUTCOMES, "calls": CALLS}, f, indent=1)
'''


def prepare(work: Path, tests: Path, files: list[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("unsloth_zoo") is None:
        raise SystemExit("unsloth_zoo is not installed")
    if work.exists():
        shutil.rmtree(work)
    (work / "tests").mkdir(parents=True)
    for path in tests.iterdir():  # helpers and conftest as they are; only the chosen test files
        if path.is_file() and (not path.name.startswith("test_") or path.name in files):
            shutil.copy2(path, work / "tests" / path.name)
    for package in ("unsloth_zoo", "unsloth"):  # located, not imported (importing needs Unsloth's setup)
        spec = importlib.util.find_spec(package)
        if spec is not None:
            (work / package).symlink_to(Path(spec.origin).parent)
    (work / "grpo_kernels_unsloth_suite.py").write_text(PLUGIN)


def run(work: Path, swapped: bool, timeout: int) -> int:
    env = dict(os.environ, UNSLOTH_IS_PRESENT="1", UNSLOTH_SUITE_RECORD=str(work / "record.json"),
               UNSLOTH_SUITE_SWAP="1" if swapped else "0",
               UNSLOTH_COMPILE_LOCATION=str(work / "unsloth_compiled_cache"),
               PYTHONPATH=os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "grpo_kernels_unsloth_suite", "tests"]
    with open(work / "pytest.log", "w") as log:
        return subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False).returncode  # fmt: skip


def compare(stock: dict, swapped: dict, calls: dict) -> dict:
    """Per-outcome counts of both runs, the tests whose outcome differs, and how many passed both ways (and of
    those, how many called grpo_kernels' kernel in the swapped run)."""
    names = sorted(set(stock) | set(swapped))
    absent = {"outcome": "absent", "error": None}
    differ = [
        {"test": n, "stock": stock.get(n, absent)["outcome"], "swapped": swapped.get(n, absent)["outcome"],
         "error": swapped.get(n, absent)["error"]}
        for n in names if stock.get(n, absent)["outcome"] != swapped.get(n, absent)["outcome"]
    ]  # fmt: skip
    counts = {}
    for side, result in (("stock", stock), ("swapped", swapped)):
        counts[side] = {}
        for entry in result.values():
            counts[side][entry["outcome"]] = counts[side].get(entry["outcome"], 0) + 1
    passed_both = [n for n in names if stock.get(n, absent)["outcome"] == "passed" == swapped.get(n, absent)["outcome"]]
    return dict(tests=len(names), counts=counts, differ=differ, kernel_calls=calls, passed_both=len(passed_both),
                passed_both_through_kernel=sum(1 for n in passed_both if n in calls))  # fmt: skip


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, type=Path, help="an unsloth-zoo or unsloth checkout's tests/ folder")
    parser.add_argument("--ref", default=None, help="the checkout's commit, recorded")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary folder)")
    parser.add_argument("--files", nargs="*", default=list(DEFAULT_FILES), help="test files to run (names)")
    parser.add_argument("--timeout", type=int, default=3000, help="seconds per run")
    args = parser.parse_args(argv)
    if not (args.tests.is_dir() and (args.tests / "conftest.py").exists()):
        print(f"--tests must be Unsloth's tests/ folder (with its conftest.py): {args.tests}", file=sys.stderr)
        return 2
    missing = [f for f in args.files if not (args.tests / f).exists()]
    if missing:
        print(f"not in {args.tests}: {missing}", file=sys.stderr)
        return 2
    out = (args.out or Path(tempfile.mkdtemp(prefix="unsloth_suite_"))).resolve()
    runs = {side: out / side for side in ("stock", "swapped")}
    for side, work in runs.items():
        prepare(work, args.tests.resolve(), args.files)
        print(f"{side}: pytest exit {run(work, swapped=side == 'swapped', timeout=args.timeout)}", flush=True)
    if not all((work / "record.json").exists() for work in runs.values()):
        print("a run recorded nothing: see OUT/stock/pytest.log and OUT/swapped/pytest.log", file=sys.stderr)
        return 2
    stock, swapped = (json.loads((runs[side] / "record.json").read_text()) for side in runs)
    if stock["calls"]:
        print(f"the stock run reached grpo_kernels' kernel: {sorted(stock['calls'])}", file=sys.stderr)
        return 2
    result = compare(stock["outcomes"], swapped["outcomes"], swapped["calls"])
    versions = {d: _installed(d) for d in ("unsloth_zoo", "unsloth", "trl", "transformers", "torch", "grpo-kernels")}
    record = dict(versions=versions, tests_folder=dict(path=str(args.tests), ref=args.ref), files=args.files,
                  **result, stock=stock["outcomes"], swapped=swapped["outcomes"])  # fmt: skip
    (out / "unsloth_suite.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{result['tests']} tests: stock {result['counts']['stock']}, swapped {result['counts']['swapped']}; "
          f"{len(result['kernel_calls'])} called grpo_kernels' kernel; {len(result['differ'])} differ")  # fmt: skip
    for entry in result["differ"]:
        print(f"DIFFERS {entry['test']}: {entry['stock']} -> {entry['swapped']}")
    print(f"record: {out / 'unsloth_suite.json'}")
    return 1 if result["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
