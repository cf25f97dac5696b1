"""Tier 3: a used Triton cache cannot change a compile-tier outcome.

The cause this guards against (found with test_lm_head_compile.py's warp-specialisation probe, which failed on
a machine whose ~/.triton/cache held entries other programs had left): Triton's cache key is made of the
kernel's source text and line number, not of the path of its file, while the PTX it caches names that path
in its line information. A kernel compiled by another copy of grpo_kernels (another checkout, an installed
wheel, an older version with the same kernel text) is therefore reused with the other path inside, so the
plain TMA kernel (from the cache) and its WARP_SPECIALIZE twin (compiled here) had different PTX digests.
Two defences, each tested: the digest is of the code only (aot.ptx_code), and the test session and the
compile tools compile into a cache of their own (tests/conftest.py, aot.own_triton_cache).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from grpo_kernels.testing import aot  # noqa: E402
from grpo_kernels.testing import lm_head_compile as matrix  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT compiles need the real Triton JIT"),
]


def probe_pair(stored: bool = False) -> tuple[dict, dict]:
    """The warp-specialisation test's two cases: the plain TMA kernel A and its WARP_SPECIALIZE probe."""
    cases = matrix.cases()
    plain = next(c for c in cases if c["kernel"] == "fwd_tma" and c.get("stored") == stored and not c["bias"]
                 and not c.get("softcap") and c["H"] == matrix.SHAPE["H"] and c["dtype"] == "bfloat16")  # fmt: skip
    probe = next(c for c in cases if c["kernel"] == "fwd_tma_ws" and c.get("stored") == stored)
    return plain, probe


def cached_ptx(cache: Path) -> dict[str, str]:
    """{entry folder: PTX text} of every kernel in a Triton cache folder."""
    return {p.parent.name: p.read_text() for p in cache.glob("*/*.ptx")}


def test_the_session_compiles_into_its_own_cache():
    folder = Path(triton.knobs.cache.dir).resolve()
    assert folder.is_relative_to(Path(tempfile.gettempdir()).resolve()), folder
    assert not folder.is_relative_to((Path.home() / ".triton").resolve()), folder


def test_a_cache_left_by_another_copy_changes_no_digest(tmp_path, monkeypatch):
    plain, probe = probe_pair()
    # another copy of the package, at another path, compiles the plain kernel into a cache first: what
    # another checkout or an installed grpo_kernels leaves in ~/.triton/cache
    other = tmp_path / "other_copy"
    shutil.copytree(CHECKOUT / "grpo_kernels", other / "grpo_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    used = tmp_path / "used_cache"
    script = (
        "import grpo_kernels, sys; from grpo_kernels.testing import lm_head_compile as m; "
        f"row = m.compile_case({plain!r}); assert 'error' not in row, row; print(grpo_kernels.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(other), TRITON_CACHE_DIR=str(used))
    proc = subprocess.run([sys.executable, "-c", script], cwd=other, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(other)), proc.stdout
    left = cached_ptx(used)
    assert len(left) == 1 and all(str(other) in ptx for ptx in left.values()), list(left)

    # this checkout, with that cache: the plain kernel comes from the cache (the other copy's path inside its
    # PTX), the probe is compiled here (this checkout's path) ...
    monkeypatch.setenv("TRITON_CACHE_DIR", str(used))
    rows = [matrix.compile_case(c) for c in (plain, probe)]
    assert all("error" not in r for r in rows), rows
    ptx = cached_ptx(used)
    assert len(ptx) == 2, list(ptx)
    probe_ptx = next(text for key, text in ptx.items() if key not in left)
    reused_ptx = next(iter(left.values()))
    assert str(CHECKOUT / "grpo_kernels") in probe_ptx and str(other) in reused_ptx
    assert hashlib.sha256(reused_ptx.encode()).digest() != hashlib.sha256(probe_ptx.encode()).digest(), (
        "the raw PTX texts differ (the file paths): what made the old digest differ"
    )
    # ... and still the digests agree, with each other and with a compile into a fresh cache
    assert rows[0]["ptx_sha256"] == rows[1]["ptx_sha256"], (rows[0]["id"], rows[1]["id"])
    monkeypatch.delenv("TRITON_CACHE_DIR")
    with aot.own_triton_cache() as fresh:
        fresh_row = matrix.compile_case(plain)
        assert str(other) not in "".join(cached_ptx(Path(os.environ["TRITON_CACHE_DIR"])).values())
    assert Path(fresh).parent.exists() and not Path(fresh).exists()  # removed after the block
    assert fresh_row["ptx_sha256"] == rows[0]["ptx_sha256"]


def test_ptx_code_drops_only_the_line_information():
    ptx = "\n".join([
        ".version 8.7", "\t.file\t1 \"/a/triton.py\"", ".visible .entry k()", "{", "\t.loc\t1 10 5",
        "\tst.global.b32 [%rd1], %r1;", "\tret;", "}", "\t.section\t.debug_abbrev", "\t{", ".b8 1", "\t}",
        "\t.section\t.debug_info", "\t{", ".b8 47", "\t}", "\t.section\t.debug_macinfo\t{\t}",
    ])  # fmt: skip
    assert aot.ptx_code(ptx).splitlines() == [".version 8.7", ".visible .entry k()", "{",
                                               "\tst.global.b32 [%rd1], %r1;", "\tret;", "}"]  # fmt: skip
    moved = ptx.replace("/a/triton.py", "/elsewhere/triton.py").replace(".b8 47", ".b8 101")
    assert aot.ptx_code(moved) == aot.ptx_code(ptx)
    assert aot.ptx_code(ptx.replace("st.global.b32", "st.global.b16")) != aot.ptx_code(ptx)
