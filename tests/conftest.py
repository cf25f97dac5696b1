# ---- the test session owns its compiler caches ---------------------------------------------------------
# Before anything imports triton or torch._inductor: Triton's cache (and its dump / override folders) and
# inductor's cache live in a temporary folder of this session, removed at its end, so nothing another program
# (or another checkout, or an older version) compiled into ~/.triton/cache or /tmp/torchinductor_$USER can
# change an outcome. Why that matters: grpo_kernels/testing/aot.py's docstring; the test: test_aot_cache.py.
# Subprocesses the tests start inherit these variables.
import atexit
import os
import shutil
import tempfile

SESSION_CACHE = tempfile.mkdtemp(prefix="grpo_kernels_test_caches_")
for _name in ("TRITON_CACHE_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
    os.environ[_name] = os.path.join(SESSION_CACHE, _name.lower().removesuffix("_dir"))
atexit.register(shutil.rmtree, SESSION_CACHE, ignore_errors=True)

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from _selection import COLLECTED_IDS, QUICK_IDS  # noqa: E402
from checkout import use_this_checkouts_integrations  # noqa: E402
from parity_helpers import PINS, installed_version  # noqa: E402

from grpo_kernels import BackendFallbackWarning  # noqa: E402

use_this_checkouts_integrations()  # see checkout.py


@pytest.fixture(autouse=True)
def _seed_and_quiet_fallback():
    # every test starts from the same RNG state; the CPU fallback notice is expected here
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        yield


from grpo_kernels.ops.fused import function as _fused_function  # noqa: E402

_CHUNK_TOKENS_DEFAULT = _fused_function.ONE_PASS_CHUNK_TOKENS  # the library's value, before any test ran


@pytest.fixture(autouse=True)
def _default_chunk_tokens():
    # case helpers set the fused schedules' chunk size to a few tokens (several chunks at small shapes); a
    # change made in this process (also by a module-scoped fixture, set up before this one) must not reach
    # the chunk plans another test computes: every test starts and ends with the library's value
    _fused_function.ONE_PASS_CHUNK_TOKENS = _CHUNK_TOKENS_DEFAULT
    yield
    _fused_function.ONE_PASS_CHUNK_TOKENS = _CHUNK_TOKENS_DEFAULT


def pytest_report_header(config):
    """torch / triton versions, and the peer versions the parity suite ran against (marker `parity`).
    pytest prints report headers only without -q; under -q pytest_sessionstart below prints the same lines."""
    return _version_lines()


def _version_lines() -> list[str]:
    import importlib.metadata as md

    base = [f"torch {torch.__version__}"]
    for dist in ("triton", "transformers"):
        try:
            base.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            base.append(f"{dist} not installed")
    peers = []
    for dist, pin in PINS.items():
        version = installed_version(dist)
        if version is None:
            peers.append(f"{dist}: not installed (pin {pin}, its parity tests skip)")
        elif version != pin:
            peers.append(f"{dist}=={version} (pin {pin}: its parity tests skip)")
        else:
            peers.append(f"{dist}=={version}")
    return ["grpo_kernels tests: " + ", ".join(base), "parity peers: " + ", ".join(peers)]


# ---- the test-run record the README's count and time come from ---------------------------------------
# GRPO_KERNELS_TEST_RECORD=path: after the run, write {passed, skipped, xfailed, failed, seconds, ...} there
# (.ci/run sets it; docs/records/tests.json is such a record, committed, and test_readme_records.py checks
# the README against it).
_session_started = []


def pytest_sessionstart(session):
    import time

    _session_started.append(time.time())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.verbosity < 0:  # -q: pytest shows no header, so the versions here
        for line in _version_lines():
            reporter.write_line(line)


# ---- the quick tier: `python -m pytest -q -m quick` -------------------------------------------------------
# tests/quick.txt lists node ids (a file, a test, or a test with its parameters; each line matches the ids
# it is a prefix of, up to a `::` or `[`); those tests get the marker `quick`. An entry that matches no test
# of a file this session collected is an error (a renamed test must not drop out of the tier unseen);
# tests/test_quick_tier.py checks what the tier covers.
QUICK_FILE = os.path.join(os.path.dirname(__file__), "quick.txt")


def quick_entries() -> list[str]:
    with open(QUICK_FILE) as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def _matches(nodeid: str, entry: str) -> bool:
    return nodeid == entry or (nodeid.startswith(entry) and nodeid[len(entry)] in ":[")


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything
def pytest_collection_modifyitems(session, config, items):
    entries = quick_entries()
    used = set()
    for item in items:
        hit = [e for e in entries if _matches(item.nodeid, e)]
        if hit:
            item.add_marker(pytest.mark.quick)
            used.update(hit)
    # a file named with a test id on the command line is collected in part: its entries are not checked
    partial = {arg.split("::", 1)[0] for arg in config.args if "::" in arg}
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    checked = {f for f in collected_files if not any(p.replace("\\", "/").endswith(f) for p in partial)}
    stale = [e for e in entries if e not in used and e.split("::", 1)[0] in checked]
    if stale:
        raise pytest.UsageError(f"tests/quick.txt: {len(stale)} entries match no test: {stale}")
    config.stash[QUICK_IDS] = [item.nodeid for item in items if item.get_closest_marker("quick")]
    config.stash[COLLECTED_IDS] = [item.nodeid for item in items]



def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import json
    import os
    import platform
    import subprocess
    import time

    path = os.environ.get("GRPO_KERNELS_TEST_RECORD")
    if not path or not _session_started:
        return
    counts = {key: len(terminalreporter.stats.get(key, [])) for key in ("passed", "skipped", "xfailed", "failed",
                                                                       "error")}  # fmt: skip
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__))  # fmt: skip
    import resource

    cpu = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for field in ("ru_utime", "ru_stime"))  # fmt: skip
    record = {
        **counts,
        "tests": sum(counts.values()),
        "seconds": round(time.time() - _session_started[0]),
        # CPU time of pytest and the subprocesses it waited for (the wall time above depends on the load)
        "cpu_seconds": round(cpu),
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        "command": " ".join(["python -m pytest", *config.invocation_params.args]),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_sha": sha.stdout.strip() or None,
    }
    with open(path, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
