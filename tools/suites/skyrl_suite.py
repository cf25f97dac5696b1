"""Run SkyRL's own loss tests twice, with SkyRL's policy losses and with grpo_kernels' swapped in, and compare
the outcome of every test.

    python tools/suites/skyrl_suite.py --skyrl-tests PATH/TO/SkyRL/tests [--out skyrl_suite_run]

SkyRL's tests are not part of its wheel: give the ``tests/`` folder of a SkyRL checkout near the installed
``skyrl`` (0.4.0). The files run (``TEST_FILES``) are its CPU tests of the policy losses, the off-policy
correction and the rest of ``ppo_utils``. The swapped run answers every ``PolicyLossRegistry.get(name)``
of a SkyRL type (the adapter implements them all: ``grpo_kernels.integrations.skyrl.LOSS_TYPES``) with
``GKPolicyLoss(name)``, the loss a ``gk_<name>`` selection runs, and counts its calls per test, so the
record shows which tests ran through grpo_kernels. A name that is not a SkyRL type (a loss a test
registers itself) keeps its own function in both runs.

Both runs take the Python 3.11 import shims of ``tests/trainer_support.py`` (SkyRL declares Python >= 3.12),
passed to pytest as a plugin of this file. Writes ``OUT/skyrl_suite.json`` (versions, per-test outcomes of
both runs, the first error line of each failure, the grpo_kernels calls, the tests whose outcome differs)
and prints a summary. Exit status 1 when any test's outcome differs, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILES = (
    "train/algorithms/test_losses.py",
    "train/algorithms/test_off_policy_correction.py",
    "backends/skyrl_train/utils/test_ppo_utils.py",
)
CALLS_ENV = "GRPO_KERNELS_SKYRL_SUITE_CALLS"  # where the swapped run writes its per-test call counts

# --------------------------------------------------------------------------------------------------------
# the pytest plugin (loaded in the runs with -p skyrl_suite)
# --------------------------------------------------------------------------------------------------------

_calls: dict[str, int] = {}
_current = [""]


def pytest_configure(config):
    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_support import skyrl_shims

    skyrl_shims()
    if os.environ.get("GRPO_KERNELS_SKYRL_SUITE_SWAP") == "1":
        _swap()


def _swap() -> None:
    from skyrl.backends.skyrl_train.utils import ppo_utils

    import grpo_kernels.integrations.skyrl as gk_skyrl

    registry = ppo_utils.PolicyLossRegistry
    original_get = registry.get.__func__

    class Counted(gk_skyrl.GKPolicyLoss):
        def __call__(self, *args, **kwargs):
            _calls[_current[0]] = _calls.get(_current[0], 0) + 1
            return super().__call__(*args, **kwargs)

    def get(cls, name):
        function = original_get(cls, name)
        if str(name) in gk_skyrl.LOSS_TYPES:
            return Counted(str(name))
        return function

    registry.get = classmethod(get)


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(CALLS_ENV)
    if path:
        Path(path).write_text(json.dumps(_calls))


# --------------------------------------------------------------------------------------------------------
# the harness
# --------------------------------------------------------------------------------------------------------


def outcomes(junit: Path) -> dict:
    """{test id: {"outcome": passed | failed | skipped, "error": first line}} from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, error = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                error = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else None
                break
        result[name] = {"outcome": outcome, "error": error}
    return result


def junit_name(nodeid: str) -> str:
    """pytest's node id (path::[Class::]test) -> the classname::name of its JUnit record."""
    path, *rest = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]) + "::" + rest[-1]


def run(tests: Path, files: list[str], out: Path, swapped: bool, keyword: str | None) -> tuple[dict, dict]:
    side = "swapped" if swapped else "stock"
    junit, calls = out / f"{side}.xml", out / f"{side}_calls.json"
    env = dict(os.environ, GRPO_KERNELS_SKYRL_SUITE_SWAP="1" if swapped else "0", **{CALLS_ENV: str(calls)})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-p", "skyrl_suite", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "--rootdir", str(tests), *[str(tests / f) for f in files]]  # fmt: skip
    if keyword:
        command += ["-k", keyword]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, env=env, cwd=str(tests), check=False)
    return outcomes(junit), (json.loads(calls.read_text()) if calls.exists() else {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skyrl-tests", required=True, type=Path, help="the tests/ folder of a SkyRL checkout")
    parser.add_argument("--skyrl-ref", default=None, help="which SkyRL commit the tests are from (recorded)")
    parser.add_argument("--files", nargs="*", default=list(TEST_FILES), help="test files under --skyrl-tests")
    parser.add_argument("--out", type=Path, default=Path("skyrl_suite_run"))
    parser.add_argument("-k", dest="keyword", default=None)
    args = parser.parse_args(argv)
    missing = [f for f in args.files if not (args.skyrl_tests / f).is_file()]
    if missing:
        print(f"--skyrl-tests must be SkyRL's tests/ folder: {missing} not found under {args.skyrl_tests}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    stock, _ = run(args.skyrl_tests, args.files, args.out, False, args.keyword)
    swapped, calls = run(args.skyrl_tests, args.files, args.out, True, args.keyword)
    from importlib import metadata

    def counts(side):
        return {k: sum(1 for e in side.values() if e["outcome"] == k) for k in ("passed", "failed", "skipped")}

    differ = [{"test": t, "stock": stock.get(t, {}).get("outcome"), "swapped": swapped.get(t, {}).get("outcome"),
               "error": (swapped.get(t) or {}).get("error") or (stock.get(t) or {}).get("error")}
              for t in sorted(set(stock) | set(swapped))
              if stock.get(t, {}).get("outcome") != swapped.get(t, {}).get("outcome")]  # fmt: skip
    by_test = {junit_name(nodeid): n for nodeid, n in calls.items()}
    through = sorted(t for t, e in swapped.items() if e["outcome"] == "passed" and by_test.get(t))
    record = {
        "skyrl_tests": {"ref": args.skyrl_ref, "files": args.files, "keyword": args.keyword},
        "versions": {d: metadata.version(d) for d in ("skyrl", "torch", "ray") if _installed(d)}
        | {"python": sys.version.split()[0]},
        "seconds": round(time.time() - start),
        "counts": {"stock": counts(stock), "swapped": counts(swapped)},
        "differ": differ,
        "passed_both": sum(1 for t, e in stock.items() if e["outcome"] == "passed"
                           and swapped.get(t, {}).get("outcome") == "passed"),  # fmt: skip
        "passed_both_through_grpo_kernels": len(through),
        "grpo_kernels_calls": calls,
        "stock": stock,
        "swapped": swapped,
    }
    (args.out / "skyrl_suite.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"stock {record['counts']['stock']}, swapped {record['counts']['swapped']}; "
          f"{record['passed_both']} pass both ways, {len(through)} of them through grpo_kernels")  # fmt: skip
    for d in differ:
        print(f"DIFFERS {d['test']}: stock {d['stock']}, swapped {d['swapped']}: {d['error']}")
    return 1 if differ else 0


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
