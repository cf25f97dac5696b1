"""Tier 2: dz formed inside the backward GEMMs (schedule="one_pass_dz", lm_head_backward(dz_in_gemm=True))
against the dz-slab path, under TRITON_INTERPRET=1, for fp32 / fp16 / bf16, with and without bias, each
upstream-gradient combination and the soft-cap.

The two paths compute the same dz in fp32 from the same stored logits and the same per-token statistics;
they differ only in (1) where dz is rounded to the operand dtype (the slab when written, the GEMM's
operand when loaded: the same rounding of the same value, at most one unit apart if fused multiply-adds
differ), (2) the order of the fp32 sums (V terms for grad_hidden, n for grad_weight), and (3) for
grad_hidden the final rounding to the hidden dtype. So per element

    |slab - fused| <= (u_op + 2 K u32) (|dz| @ |operand|) + 2 u_op |result|

with K the summed length and |dz| bounded in float64 from the stored logits; the report holds the worst
ratio to that bound, which must be <= 1. The fused-loss level is tested in test_fused_triton_interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interpreter_runner import run_case_script, selected_cases  # noqa: E402

pytestmark = pytest.mark.interpreter

CASES = [f"{d}-{b}-{g}{c}" for d in ("float32", "float16", "bfloat16") for b in ("nobias", "bias")
         for g in ("both", "logprobs", "entropy") for c in ("", "-softcap")]  # fmt: skip
# csrc's kernel C through triton.lm_head_backward's `dz_gemms` hook (its torch spec) against the Triton dz
# kernels on the same fp16 store, adding into fp32 accumulators; the bound is the one above without the final
# rounding to the hidden dtype, plus one fp32 rounding of each accumulator's sum
CASES += [f"csrc-{d}-bias-both{c}" for d in ("float16", "bfloat16") for c in ("", "-softcap")]
# grad_weight summed in place into a 16-bit buffer (schedule="one_pass_dz_inplace"), by the Triton kernel and by
# kernel C's spec: each exactly its fp32-accumulator run rounded once (test_grad_weight_in_place_rounds_once)
IN_PLACE_CASES = [f"inplace-{d}" for d in ("float16", "bfloat16")]
# the first chunk's call overwrites grad_weight_acc (test_first_call_overwrites_the_accumulator): operand dtype x
# backward path (the dz GEMMs by Triton or by csrc's spec, the dz slab's cuBLAS GEMM) x accumulator dtype
OVERWRITE_CASES = [f"overwrite-{d}-{p}-acc-{a}" for d in ("float32", "float16", "bfloat16")
                   for p in ("dz-triton", "slab", *(("dz-spec",) if d != "float32" else ()))
                   for a in sorted({"float32", d})]  # fmt: skip


@pytest.fixture(scope="module")
def report(request):
    return run_case_script("_dz_in_gemm_cases.py", timeout=900, cases=selected_cases(request))


@pytest.mark.parametrize("case", IN_PLACE_CASES)
def test_grad_weight_in_place_rounds_once(case, report):
    """The in-place accumulator (the weight's dtype) gets old + this call's sum computed in fp32 and rounded once:
    element for element the fp32-accumulator run's result rounded to nearest (or, for the interpreter's bf16
    store, toward zero), for the Triton kernel and for csrc's spec; and most elements move (not a no-op)."""
    r = report[case]
    for who in ("triton", "spec"):
        assert r[f"{who}_mismatches"] == 0, (
            f"{case}: {who}: {r[f'{who}_mismatches']} elements are not the fp32 sum rounded once; first (flat index, "
            f"in place, fp32): {r.get(f'{who}_first_mismatch')}"
        )
        assert r[f"{who}_changed"] > 0.5, f"{case}: {who}: only {r[f'{who}_changed']:.2f} of the buffer changed"


@pytest.mark.parametrize("case", OVERWRITE_CASES)
def test_first_call_overwrites_the_accumulator(case, report):
    """accumulate_grad_weight=False (the one-pass schedules' first chunk, whose buffer is not zero-filled): a
    NaN-filled grad_weight_acc ends exactly as the same call adding into zeros, so nothing read it; with no
    upstream gradient (no GEMM runs) it ends all zeros. A call that read the buffer would leave NaNs."""
    r = report[case]
    assert r["nan"] == 0 and r["mismatches"] == 0, (
        f"{case}: {r['nan']} NaNs and {r['mismatches']} elements differ from the call adding into zeros")
    assert r["nonzero"] > 0.5, f"{case}: only {r['nonzero']:.2f} of the gradient is nonzero (a vacuous case)"
    assert r["no_upstream_nonzero"] == 0, f"{case}: {r['no_upstream_nonzero']} elements left nonzero without upstream"


@pytest.mark.parametrize("case", CASES)
def test_dz_in_gemm_equals_the_slab_path(case, report):
    r = report[case]
    for grad in ("grad_hidden", "grad_weight"):
        assert r[grad] <= 1.0, f"{case}: {grad} differs by {r[grad]:.3g} x its derived bound"
    if "grad_bias_equal" in r:
        assert r["grad_bias_equal"], f"{case}: the bias gradient differs"
    assert r["zero_row_hidden"] == 0.0, f"{case}: a row without upstream gradient got {r['zero_row_hidden']}"
