"""Tier 3: the LM-head Triton kernels compiled ahead of time for sm_90, sm_80, sm_100a (B200) and sm_120
(RTX 50xx), without a GPU.

Every kernel in the tile configurations each architecture's dispatcher picks (and, on sm_90 / sm_80, the
other's) goes through the whole Triton toolchain down to a cubin (grpo_kernels/testing/lm_head_compile.py
holds the matrix, ~190 compiles); cuobjdump reports registers, shared memory and the SASS's local-memory
accesses. Asserted: everything compiles; the configurations the dispatcher picks spill nothing, fit the
architecture's shared memory per block and use its tensor-core instruction (aot.TARGETS: wgmma, mma.sync,
tcgen05.mma, mma.sync); every kernel is compiled for every architecture; 2-D operands are addressed with
int64 offsets; and the host-side planning at N = 65536, V = 256000 (recorded on meta tensors, nothing
allocated) keeps every launch argument and grid inside int32 and the workspace inside its budget. An
architecture the installed Triton cannot target is skipped with the reason naming the version (and fails
in CI, whose Triton versions target them all).

The report goes to benchmarks/results/compile_report_lm_head.{md,json} when GRPO_KERNELS_WRITE_REPORTS=1,
else to pytest's tmp dir; `python -m grpo_kernels.testing.lm_head_compile` regenerates the committed one.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from interpreter_runner import compile_report_rows  # noqa: E402

from grpo_kernels.testing import aot  # noqa: E402
from grpo_kernels.testing import lm_head_compile as matrix  # noqa: E402

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="AOT compiles need the real Triton JIT"
    ),
]

CASES = matrix.cases()
MMA = {arch: target.mma for arch, target in aot.TARGETS.items()}
INT32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def rows(request, tmp_path_factory):
    # a selection of the compile tests (the quick tier, -k) compiles only the cases it reads
    return compile_report_rows(request, tmp_path_factory, lambda selected: matrix.run_matrix(selected=selected),
                               matrix.write_report)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[matrix.case_id(c) for c in CASES])
def test_lm_head_kernel_compiles(case, rows):
    r = _compiled(rows, case)
    assert r["registers"] > 0
    # a kernel can compile to nothing (an empty body): every one of these writes its results
    assert r["global_stores"] > 0, f"{r['id']}: no st.global in the PTX"
    if case["picked"]:
        assert not r["spills"], (
            f"{r['id']}: REG {r['registers']} STACK {r['stack']} LOCAL {r['local']}, {r['local_memory_ops']} "
            "local-memory loads / stores in the SASS -- a configuration the dispatcher picks must not spill"
        )
        limit = aot.TARGETS[case["arch"]].block_shared_kib
        assert r["shared_fits"], f"{r['id']}: {r['shared']} B of shared memory, sm_{case['arch']} allows {limit} KiB"
        if case["kernel"] in matrix.STREAM_KERNELS:  # streams the logits cuBLAS wrote: no GEMM here
            assert r["mma"] == "none", f"{r['id']}: expected no MMA, got {r['mma']}"
        elif case["kernel"] == "bwd" and case.get("stored"):
            # reads the logits the forward stored: the one-pass schedule's backward does no GEMM here
            assert r["mma"] == "none", f"{r['id']}: expected no MMA, got {r['mma']}"
        elif case["kernel"] != "merge":
            assert r["mma"] == MMA[case["arch"]], (
                f"{r['id']}: expected {MMA[case['arch']]} in the PTX, got {r['mma']}"
            )


def _compiled(rows, case) -> dict:
    """The case's row; skips (naming the Triton version) where this Triton cannot target its architecture."""
    r = rows[matrix.case_id(case)]
    if "skipped" in r:
        _skip_or_fail_in_ci(r["skipped"])
    assert "error" not in r, r["error"]
    return r


def _skip_or_fail_in_ci(reason: str) -> None:
    if os.environ.get("CI") == "true":  # CI installs triton 3.6 and 3.9: both target every architecture
        pytest.fail(f"CI's Triton must target every architecture of the compile tier: {reason}")
    pytest.skip(reason)


def test_every_kernel_is_compiled_for_every_architecture():
    """aot.ARCHS is the one list of targets: each kernel of the matrix is compiled for each of them, in the
    same code paths of its picked configurations (the TMA kernel A where the picked tiles have TMA entries;
    the WARP_SPECIALIZE probe where it is asked)."""

    def paths(arch):
        return {matrix.case_id({**c, "arch": 0, "config": ("", c["config"][1])}) for c in CASES
                if c["arch"] == arch and c["picked"] and c["kernel"] not in matrix.TMA_KERNELS}  # fmt: skip

    assert set(matrix.ARCHS) == set(aot.TARGETS) == {90, 80, 100, 120}
    reference = paths(90)
    for arch in matrix.ARCHS:
        assert paths(arch) == reference, (arch, paths(arch) ^ reference)
        has_tma = tri_configs()[(matrix.ARCH_CLASS[arch], "16bit")].forward_tma is not None
        assert any(c["kernel"] == "fwd_tma" and c["arch"] == arch for c in CASES) == has_tma, arch


def tri_configs():
    from grpo_kernels.ops.lm_head import triton as tri

    return tri.CONFIGS


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_installed_triton_targets_the_architecture(arch):
    """Says, per architecture, whether the installed Triton compiles for it (the other tests skip with this
    reason where it does not)."""
    reason = aot.target_blocker(arch)
    if reason is not None:
        _skip_or_fail_in_ci(reason)


def test_target_blocker_names_the_version():
    assert aot.target_blocker(90, "3.2.0") is None
    reason = aot.target_blocker(100, "3.2.0")
    assert reason is not None and "triton 3.2.0" in reason and "sm_100a" in reason
    reason = aot.target_blocker(120, "3.6.0", ("/x/ptxas", (12, 6)))
    assert reason is not None and "triton 3.6.0" in reason and "CUDA 12.6" in reason and "sm_120a" in reason
    assert aot.target_blocker(120, "3.6.0", ("/x/ptxas", (12, 8))) is None


TMA_CASES = [c for c in CASES if c["kernel"] in matrix.TMA_KERNELS]


@pytest.mark.parametrize("case", TMA_CASES, ids=[matrix.case_id(c) for c in TMA_CASES])
def test_tma_kernel_a_moves_operands_by_tma_and_fits_two_ctas_per_sm(case, rows):
    """The TMA kernel A (use_forward_kernel("tma")): its operands arrive by TMA (cp.async.bulk.tensor), the
    stored logits leave by a TMA store, it still holds its wgmma and its partials' stores, and two CTAs fit
    on an SM (registers and shared memory) so one's epilogue overlaps the other's MMAs, except with the
    soft-cap (uncapped registers: one CTA, as the cp.async kernel A always runs). On sm_100a likewise with
    tcgen05.mma, its accumulator in tensor memory (counted in CTAs per SM)."""
    r = _compiled(rows, case)
    assert r["tma"], f"{r['id']}: no cp.async.bulk.tensor in the PTX"
    assert r["tma_store"] == bool(case["stored"]), f"{r['id']}: TMA store {r['tma_store']}, stored logits {case['stored']}"
    assert r["mma"] == MMA[case["arch"]] and r["global_stores"] > 0 and not r["spills"], r
    assert r["ctas_per_sm"] >= (1 if case["softcap"] and not case["stored"] else 2), (
        f"{r['id']}: {r['ctas_per_sm']} CTA(s) per SM at {r['registers']} registers x {r['num_warps']} warps, "
        f"{r['shared'] / 1024:.0f} KiB of shared memory"
    )


@pytest.mark.parametrize("stored", [False, True], ids=["stats", "stored-logits"])
def test_warp_specialize_is_ignored_on_sm90(stored, rows):
    """WARP_SPECIALIZE=True on the vocabulary-tile loop of the TMA kernel A compiles to the very same PTX as
    without it (Triton's sm_90 warp specialisation does not take this loop), and not to an empty body. The
    lm_head README says so; if this fails, Triton has started to specialise the loop: time it on a GPU."""
    plain = next(r for r in rows.values() if r["kernel"] == "fwd_tma" and r["stored"] == stored and r["arch"] == 90
                 and not r["bias"] and not r["softcap"] and r["H"] == matrix.SHAPE["H"] and r["dtype"] == "bfloat16")  # fmt: skip
    probe = next(r for r in rows.values() if r["kernel"] == "fwd_tma_ws" and r["stored"] == stored and r["arch"] == 90)
    assert probe["mma"] == "wgmma" and probe["global_stores"] > 0, probe
    assert probe["ptx_sha256"] == plain["ptx_sha256"], (probe["id"], plain["id"])


def _huge_launches(bias: bool):
    from grpo_kernels.ops.lm_head import triton as tri

    config = tri.CONFIGS[("sm90", "16bit")]
    return config, matrix.record_lm_head_launches(65536, 8192, 256000, "bfloat16", config, bias=bias)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_lm_head_huge_shape_planning_fits_int32(bias):
    """N = 65536, H = 8192, V = 256000 (N * V = 1.7e10 > 2^31), planned and launched on meta tensors."""
    from grpo_kernels.ops.lm_head import triton as tri

    config, launches = _huge_launches(bias)
    names = [la.name for la in launches]
    assert names[:2] == ["lm_head_fwd_kernel_partial", "lm_head_fwd_kernel_merge"]
    bwd = [la for la in launches if la.name == "lm_head_bwd_kernel_dlogits"]
    plan = tri.plan_backward(
        65536,
        256000,
        8192,
        2,
        config.backward.block_m,
        tri.DEFAULT_WORKSPACE_BYTES,
        store_dlogits=True,
        need_bias_grad=bias,
        need_hidden_grad=True,
    )
    assert len(bwd) == plan.num_chunks > 1
    assert sum(la.args["n_rows"] for la in bwd) == 65536
    assert plan.workspace_bytes <= tri.DEFAULT_WORKSPACE_BYTES
    for la in launches:
        assert all(0 < g <= INT32_MAX for g in la.grid), (la.name, la.grid)
        for name, value in la.args.items():
            if isinstance(value, int) and not isinstance(value, bool):
                assert abs(value) <= INT32_MAX, f"{la.name}.{name} = {value} would be passed as int64"
    # the whole [N, V] problem never exists: the workspace is one chunk, the forward partials are O(N)
    t = config.forward
    fwd = tri.plan_forward(65536, 256000, t.block_m, t.block_n, tri.DEFAULT_NUM_SMS, t.group_m)
    assert fwd.partial_bytes(65536) < 64 * 2**20
    assert plan.rows_per_chunk * plan.workspace_row_stride < 65536 * 256000


# 2-D operands: base + row * stride must be computed in 64 bits (V * H = 2.1e9 > 2^31 at V = 256000,
# H = 8192). [N]- and [V]-vectors are indexed by values < 2^31 and may stay 32-bit.
WIDE_POINTERS = {
    "lm_head_fwd_kernel_partial": {
        "hidden_ptr",
        "weight_ptr",
        "part_max_ptr",
        "part_sum_ptr",
        "part_dev_ptr",
    },
    "lm_head_fwd_kernel_merge": {"part_max_ptr", "part_sum_ptr", "part_dev_ptr"},
    "lm_head_bwd_kernel_dlogits": {"hidden_ptr", "weight_ptr", "dlogits_ptr", "bias_grad_part_ptr"},
}
STORED_POINTERS = {"lm_head_fwd_kernel_partial": {"logits_ptr"}, "lm_head_bwd_kernel_dlogits": {"stored_ptr"}}


@pytest.mark.parametrize("kernel", sorted(WIDE_POINTERS))
def test_lm_head_row_offsets_are_int64(kernel):
    from grpo_kernels.testing.aot import compile_launch

    _, launches = _huge_launches(bias=True)
    launch = next(la for la in launches if la.name == kernel)
    widths = matrix.first_offset_widths(compile_launch(launch, 90).ttir)
    for ptr in WIDE_POINTERS[kernel]:
        assert widths.get(ptr) == {"i64"}, f"{kernel}: {ptr} is first offset by {widths.get(ptr)}, needs i64"


@pytest.mark.parametrize("stored", [True, "half"], ids=["fp32", "half"])
@pytest.mark.parametrize("kernel", sorted(STORED_POINTERS))
def test_stored_logits_offsets_are_int64(kernel, stored):
    """The one-pass schedule's logits buffer [N, V] (fp32, or fp16 differences with their [N, V / 64] fp32
    offsets) is addressed with int64 offsets (N * V > 2^31)."""
    from grpo_kernels.ops.lm_head import triton as tri
    from grpo_kernels.testing.aot import compile_launch

    launches = matrix.record_lm_head_launches(16384, 4096, 256000, "bfloat16", tri.CONFIGS[("sm90", "16bit")],
                                              stored=stored)  # fmt: skip
    launch = next(la for la in launches if la.name == kernel)
    assert launch.args["STORE_LOGITS" if kernel.startswith("lm_head_fwd") else "FROM_STORED"] is True
    assert launch.args["HALF_LOGITS"] is (stored == "half")
    widths = matrix.first_offset_widths(compile_launch(launch, 90).ttir)
    for ptr in STORED_POINTERS[kernel] | ({"offset_ptr"} if stored == "half" else set()):
        assert widths.get(ptr) == {"i64"}, f"{kernel}: {ptr} is first offset by {widths.get(ptr)}, needs i64"


# dz inside the backward GEMMs (schedule="one_pass_dz"): the stored logits [n, V] and the 2-D operands are
# addressed in 64 bits too, at the same huge shape
DZ_WIDE_POINTERS = {
    "lm_head_bwd_kernel_grad_hidden_dz": {"stored_ptr", "offset_ptr", "weight_ptr", "out_ptr"},
    "lm_head_bwd_kernel_grad_weight_dz": {"stored_ptr", "offset_ptr", "hidden_ptr", "acc_ptr"},
}


@pytest.mark.parametrize("kernel", sorted(DZ_WIDE_POINTERS))
def test_dz_in_gemm_row_offsets_are_int64(kernel):
    from grpo_kernels.ops.lm_head import triton as tri
    from grpo_kernels.testing.aot import compile_launch

    config = tri.CONFIGS[("sm90", "16bit")]
    launches = matrix.record_lm_head_launches(65536, 8192, 256000, "bfloat16", config, bias=True, stored="half",
                                              dz_in_gemm=True)  # fmt: skip
    dlogits = [la for la in launches if la.name == "lm_head_bwd_kernel_dlogits"]
    assert dlogits and not any(la.args["STORE_DLOGITS"] for la in dlogits)  # only the bias sums: no dz slab
    launch = next(la for la in launches if la.name == kernel)
    assert all(0 < g <= INT32_MAX for g in launch.grid), launch.grid
    widths = matrix.first_offset_widths(compile_launch(launch, 90).ttir)
    for ptr in DZ_WIDE_POINTERS[kernel]:
        assert widths.get(ptr) == {"i64"}, f"{kernel}: {ptr} is first offset by {widths.get(ptr)}, needs i64"
