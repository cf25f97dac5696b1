"""Tier 3: the loss-head Triton kernel compiled ahead of time for sm_90, sm_80, sm_100a and sm_120 (the
architectures of grpo_kernels.testing.aot.TARGETS), without a GPU, in every code path of
grpo_kernels/testing/loss_head_compile.py (every value of every constexpr at least once). Asserted: each
compiles through the whole toolchain to a cubin, writes its results (st.global), spills nothing (no
local-memory load or store in the SASS) and fits the architecture's shared memory per block. An
architecture the installed Triton cannot target is skipped with the reason naming the version (a failure
in CI). The report goes to benchmarks/results/compile_report_loss_head.{md,json} when
GRPO_KERNELS_WRITE_REPORTS=1, else to pytest's tmp dir."""

from __future__ import annotations

import os

import pytest
from interpreter_runner import compile_report_rows

pytest.importorskip("triton")

from grpo_kernels.testing import loss_head_compile as matrix  # noqa: E402

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT compiles need the real Triton JIT"),
]


@pytest.fixture(scope="module")
def rows(request, tmp_path_factory):
    # a selection of the compile tests (the quick tier, -k) compiles only the cases it reads
    return compile_report_rows(request, tmp_path_factory, lambda selected: matrix.run_matrix(names=selected),
                               matrix.write_report)  # fmt: skip


@pytest.mark.parametrize("arch", matrix.ARCHS)
@pytest.mark.parametrize("case", sorted(matrix.CASES))
def test_loss_head_kernel_compiles_without_spills(case, arch, rows):
    r = rows[f"{case}-sm{arch}"]
    if "skipped" in r:
        if os.environ.get("CI") == "true":  # CI's triton 3.6 and 3.9 target every architecture
            pytest.fail(f"CI's Triton must target every architecture of the compile tier: {r['skipped']}")
        pytest.skip(r["skipped"])
    assert "error" not in r, r["error"]
    assert r["registers"] > 0
    assert r["global_stores"] > 0, f"{r['id']}: no st.global in the PTX (an empty kernel body?)"
    assert not r["spills"], (
        f"{r['id']}: REG {r['registers']} STACK {r['stack']} LOCAL {r['local']}, "
        f"{r['local_memory_ops']} local-memory loads / stores in the SASS"
    )
    assert r["shared_fits"], f"{r['id']}: {r['shared']} B of shared memory"


def test_cases_cover_every_code_path():
    """Every value of every constexpr of the kernel appears in at least one compiled case."""
    from grpo_kernels.ops.loss_head import triton as kernel

    seen: dict[str, set] = {}
    for name in matrix.CASES:
        for key, value in matrix.record_case(name).constexprs().items():
            seen.setdefault(key, set()).add(value)
    assert seen["LOSS"] == set(kernel.LOSS_IDS.values())
    assert seen["LEVEL"] == set(kernel.LEVEL_IDS.values())
    assert seen["KL_EST"] == set(kernel.KL_IDS.values())
    assert seen["AGG"] | seen["ENT_AGG"] | seen["KL_AGG"] == set(kernel.AGG_IDS.values())
    assert seen["IS_LEVEL"] == set(kernel.IS_LEVEL_IDS.values()) and seen["OLDPROB"] == {0, 1, 2}
    assert seen["GATE"] == set(kernel.IS_GATE_IDS.values())
    for flag in ("HAS_OLD", "HAS_REF", "USE_KL", "KL_RATIO", "KL_ST", "IS_MASK", "HAS_ISW", "HAS_ENT",
                 "USE_ENT_BONUS", "HAS_TOKW", "HAS_SEL", "HAS_COV", "OFFPOL", "HAS_ROLLOUT", "CISPO_ABS",
                 "HAS_SEQ_LEN", "ANCHOR_ROLLOUT", "CISPO_MASK", "DPPO_KL", "RATIO_KL", "GATE_SEQ"):  # fmt: skip
        assert seen[flag] == {False, True}, flag
