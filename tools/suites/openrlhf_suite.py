"""Run OpenRLHF's own loss tests twice, stock and with grpo_kernels' OpenRLHF adapter swapped in, and compare
the outcome of every test.

    python tools/suites/openrlhf_suite.py [--openrlhf-tests DIR] [--out openrlhf_suite_run]

The tests are those OpenRLHF 0.11.2 ships in its wheel (a top-level `tests/` package; `--openrlhf-tests`
overrides the folder): `test_loss_aggregation.py` (PolicyLoss, aggregate_loss, the normalizers),
`test_kl_estimator_gradient.py` (compute_approx_kl) and `test_actor_entropy_temperature.py` (Actor.forward's
log-probs and entropy). They load OpenRLHF's files by path and bind the classes at import; the swapped run
replaces, after collection, each test module's `PolicyLoss` with
`grpo_kernels.integrations.openrlhf.PolicyLoss` and puts `actor_forward` on each test module's `Actor` class
(the adapter's two parts), and counts per test the adapter's PolicyLoss constructions and calls and its
actor_forward calls. `compute_approx_kl` is not replaced by the adapter (module docstring), so its tests run
OpenRLHF's code both ways.

Nothing is stubbed by this script: OpenRLHF's tests stub what they need themselves (flash-attn, peft,
deepspeed when missing; the loss tests need deepspeed importable).

Writes `OUT/openrlhf_suite.json` (versions, per-test outcomes of both runs, the first error line of each
failure, the adapter calls per test, the tests whose outcome differs, and for each the reason in
EXPECTED_DIFFERENCES) and prints a summary. Exit status 1 when an outcome differs without a reason below, or a
reason below no longer happens; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_FILES = (
    "test_loss_aggregation.py",
    "test_kl_estimator_gradient.py",
    "test_actor_entropy_temperature.py",
)

# test id -> why the swapped run differs (each names the adapter's refusal that causes it)
EXPECTED_DIFFERENCES = {
    "test_actor_entropy_temperature.py::test_entropy_matches_temperature_scaled_policy[0.5]": (
        "refused: the test's model (_TableLM) computes its logits from a table and has no LM head, which the "
        "'logprobs' part replaces"
    ),
    "test_actor_entropy_temperature.py::test_entropy_matches_temperature_scaled_policy[1.5]": (
        "refused: the test's model (_TableLM) has no LM head (as above)"
    ),
}

PLUGIN = '''
"""pytest plugin of tools/suites/openrlhf_suite.py: the swap, and the adapter calls per test."""
import json
import os

import grpo_kernels.integrations.openrlhf as gk_openrlhf

_current = [None]
_calls = {}
_swapped = {}


def _count(kind):
    if _current[0] is not None:
        per_test = _calls.setdefault(_current[0], {})
        per_test[kind] = per_test.get(kind, 0) + 1


_init = gk_openrlhf.PolicyLoss.__init__
_forward = gk_openrlhf.PolicyLoss.forward
_actor_forward = gk_openrlhf.actor_forward


def _counted_init(self, *args, **kwargs):
    _count("PolicyLoss()")
    return _init(self, *args, **kwargs)


def _counted_forward(self, *args, **kwargs):
    _count("PolicyLoss.forward")
    return _forward(self, *args, **kwargs)


def _counted_actor_forward(self, *args, **kwargs):
    _count("actor_forward")
    return _actor_forward(self, *args, **kwargs)


gk_openrlhf.PolicyLoss.__init__ = _counted_init
gk_openrlhf.PolicyLoss.forward = _counted_forward


def pytest_collection_modifyitems(session, config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        names = []
        if "PolicyLoss" in vars(module):
            module.PolicyLoss = gk_openrlhf.PolicyLoss
            names.append("PolicyLoss")
        if "Actor" in vars(module):
            gk_openrlhf.install_actor_forward(module.Actor)
            module.Actor.forward = _counted_actor_forward
            names.append("Actor.forward")
        _swapped[module.__name__] = names


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_runtest_teardown(item):
    _current[0] = None


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["OPENRLHF_SUITE_SWAP_RECORD"], "w") as f:
        json.dump({"swapped": _swapped, "calls": _calls}, f, indent=1)
'''


def default_tests_folder() -> Path:
    """The `tests/` folder OpenRLHF's wheel installs beside the package."""
    dist = importlib.metadata.distribution("openrlhf")
    for file in dist.files or ():
        if file.parts[:1] == ("tests",) and file.name == "__init__.py":
            return Path(dist.locate_file(file)).parent
    raise FileNotFoundError("the installed openrlhf has no tests/ folder; pass --openrlhf-tests")


def run_pytest(tests: Path, files, out: Path, name: str, swap: bool) -> dict:
    """Run the files with pytest in a subprocess; returns {test id: {outcome, error}} from its junit
    report."""
    report = out / f"{name}.xml"
    env = dict(os.environ)
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--junitxml={report}",
        "-o",
        "junit_family=xunit1",
        *[str(tests / f) for f in files],
    ]
    if swap:
        plugin_dir = out / "plugin"
        plugin_dir.mkdir(exist_ok=True)
        (plugin_dir / "openrlhf_suite_swap.py").write_text(textwrap.dedent(PLUGIN))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
        env["OPENRLHF_SUITE_SWAP_RECORD"] = str(out / "swap_record.json")
        args[3:3] = ["-p", "openrlhf_suite_swap"]
    started = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tests.parent, env=env, check=False)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if not report.exists():
        raise RuntimeError(f"pytest ({name}) wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        test_id = f"{Path(file).name}::{case.get('name')}"
        outcome, error = "passed", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, error = (
                    "failed",
                    (child.get("message") or "").strip().splitlines()[0][:300]
                    if (child.get("message") or "").strip()
                    else child.tag,
                )
            elif child.tag == "skipped":
                outcome, error = "skipped", (child.get("message") or "")[:300]
        results[test_id] = {"outcome": outcome, "error": error}
    return {"results": results, "seconds": round(time.time() - started, 1), "exit_status": proc.returncode}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--openrlhf-tests", type=Path, default=None, help="OpenRLHF's tests/ folder (default: the wheel's)"
    )
    parser.add_argument("--out", type=Path, default=Path("openrlhf_suite_run"))
    args = parser.parse_args(argv)
    try:
        tests = args.openrlhf_tests or default_tests_folder()
    except (importlib.metadata.PackageNotFoundError, FileNotFoundError) as exc:
        print(f"openrlhf_suite: {exc}", file=sys.stderr)
        return 2
    missing = [f for f in TEST_FILES if not (tests / f).is_file()]
    if missing:
        print(
            f"openrlhf_suite: {tests} lacks {missing}: --openrlhf-tests must be OpenRLHF's tests/ folder",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stock = run_pytest(tests, TEST_FILES, args.out, "stock", swap=False)
    swapped = run_pytest(tests, TEST_FILES, args.out, "swapped", swap=True)
    swap_record = json.loads((args.out / "swap_record.json").read_text())
    calls = {}
    for nodeid, counts in swap_record["calls"].items():
        calls[f"{Path(nodeid.split('::')[0]).name}::{nodeid.split('::', 1)[1]}"] = counts
    differ, unexplained = [], []
    for test in sorted(set(stock["results"]) | set(swapped["results"])):
        a = stock["results"].get(test, {"outcome": "absent"})
        b = swapped["results"].get(test, {"outcome": "absent"})
        if a["outcome"] != b["outcome"]:
            reason = EXPECTED_DIFFERENCES.get(test)
            differ.append(
                {
                    "test": test,
                    "stock": a["outcome"],
                    "swapped": b["outcome"],
                    "swapped_error": b.get("error"),
                    "reason": reason,
                }
            )
            if reason is None:
                unexplained.append(test)
    no_longer = sorted(set(EXPECTED_DIFFERENCES) - {d["test"] for d in differ})
    versions = {}
    for dist in ("openrlhf", "torch", "transformers", "deepspeed"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    both = [
        t
        for t, r in stock["results"].items()
        if r["outcome"] == "passed" and swapped["results"].get(t, {}).get("outcome") == "passed"
    ]
    sha = (
        subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        or None
    )
    record = {
        "versions": versions,
        "python": sys.version.split()[0],
        "grpo_kernels_git_sha": sha,
        "tests_folder": "the installed openrlhf wheel's tests/"
        if args.openrlhf_tests is None
        else str(tests),
        "files": list(TEST_FILES),
        "counts": {
            side: {
                o: sum(1 for r in run["results"].values() if r["outcome"] == o)
                for o in ("passed", "failed", "skipped")
            }
            for side, run in (("stock", stock), ("swapped", swapped))
        },
        "passed_both": len(both),
        "passed_both_through_the_adapter": sum(1 for t in both if calls.get(t)),
        "swapped_names": swap_record["swapped"],
        "adapter_calls": calls,
        "differ": differ,
        "unexplained": unexplained,
        "explained_but_not_seen": no_longer,
        "stock": stock["results"],
        "swapped": swapped["results"],
        "seconds": {"stock": stock["seconds"], "swapped": swapped["seconds"]},
    }
    (args.out / "openrlhf_suite.json").write_text(json.dumps(record, indent=1) + "\n")
    for side in ("stock", "swapped"):
        print(f"{side}: {record['counts'][side]}  ({record['seconds'][side]} s)")
    print(
        f"passed both ways: {record['passed_both']} "
        f"({record['passed_both_through_the_adapter']} through the adapter)"
    )
    for d in differ:
        print(
            f"{'DIFFERS (explained)' if d['reason'] else 'DIFFERS'} {d['test']}: "
            f"{d['stock']} -> {d['swapped']}"
            f"{'; ' + d['reason'] if d['reason'] else ''}"
        )
    for test in no_longer:
        print(f"EXPLAINED BUT NOT SEEN {test}")
    return 1 if unexplained or no_longer else 0


if __name__ == "__main__":
    sys.exit(main())
