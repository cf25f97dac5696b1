"""Tier 2: the Triton LM-head kernels under TRITON_INTERPRET=1 on CPU, forward and every gradient.

The interpreter must be switched on before triton is first imported, and this pytest process has usually
imported triton already (other tiers), so the cases run in one subprocess
(tests/_lm_head_interpreter_cases.py, ~30 s on 2 cores) and each test here asserts on its JSON report.

Ground truth: float64 autograd on the same inputs. Tolerance (docs/design.md §4): the
kernel's max error may be at most SLACK x the error of plain PyTorch on the same inputs, plus
FLOOR x max|truth|.
* Forward statistics: the kernel takes them from fp32 accumulators of exact products whatever the input
  dtype, so the baseline is the fp32 computation on the (exactly upcast) inputs, for fp16/bf16 too.
* Gradients: the baseline is PyTorch autograd in the input dtype (half-precision logits GEMM, fp32 softmax);
  the kernel rounds dL/dlogit to the input dtype before the cuBLAS GEMMs, as PyTorch does.
bf16 runs with operands upcast to fp32 before tl.dot (the interpreter's bf16 dot is wrong), so it checks
the bf16 plumbing (workspace dtype, casts), not the GPU's bf16 MMA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _lm_head_interpreter_cases import AUTOGRAD_FIELDS, CASES, FORWARD_FIELDS  # noqa: E402
from interpreter_runner import run_case_script, selected_cases  # noqa: E402

pytestmark = pytest.mark.interpreter

SLACK = 2.0
FLOOR = 1e-6
GRADIENTS = ("grad_hidden", "grad_weight", "grad_bias")


@pytest.fixture(scope="module")
def report(request):
    return run_case_script("_lm_head_interpreter_cases.py", cases=selected_cases(request))


def _check(name: str, m: dict) -> None:
    allowed = SLACK * m["base_err"] + FLOOR * m["scale"]
    assert m["nonfinite"] == 0, f"{name}: {m['nonfinite']} non-finite values"
    assert m["max_err"] <= allowed, (
        f"{name}: max error {m['max_err']:.3e} > allowed {allowed:.3e} (= {SLACK} x torch error "
        f"{m['base_err']:.3e} + {FLOOR} x max|truth| {m['scale']:.3e}); worst element {m['worst_index']}: "
        f"expected {m['expected']:.9g}, got {m['got']:.9g}"
    )


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_lm_head_triton_interpreter(case, report):
    r = report[case["id"]]
    assert "error" not in r, r.get("error")
    for name in AUTOGRAD_FIELDS if case.get("autograd") else FORWARD_FIELDS:
        _check(name, r[name])
    # logp = (z_y - max) - log(sum) <= 0 and entropy = log(sum) - E[z - max] >= 0 hold exactly
    assert r["invariants"]["max_logprob"] <= 0.0, r["invariants"]
    assert r["invariants"]["min_entropy"] >= 0.0, r["invariants"]

    if not case.get("autograd"):  # which kernel A ran: the TMA one where asked, unless an operand is misaligned
        tma = case.get("forward_kernel") == "tma" and case.get("layout") != "strided"
        assert r["forward_kernels"][0] == ("lm_head_fwd_kernel_partial_tma" if tma else "lm_head_fwd_kernel_partial"), r
        if case.get("forward_kernel") == "tma" and not tma:
            assert any("not 16-byte aligned" in m for m in r["tma_fallback_warnings"]), r["tma_fallback_warnings"]
        else:
            assert r["tma_fallback_warnings"] == [], r["tma_fallback_warnings"]

    returned, expected = r["returned"], r["expected_returned"]
    for name in GRADIENTS:
        assert returned[name] == expected[name], (
            f"{name} returned={returned[name]}, expected {expected[name]}"
        )
        if expected[name]:
            _check(name, r[name])
    if returned["grad_hidden"]:
        assert returned["grad_hidden_dtype"] == f"torch.{case['dtype']}"
    if returned["grad_weight"]:
        assert returned["grad_weight_dtype"] == "torch.float32"  # the fp32 accumulator, cast by the caller
    if case.get("autograd"):  # LMHeadFunction casts the fp32 accumulators once, to the parameters' dtype
        assert r["autograd_dtypes"] == [f"torch.{case['dtype']}"] * (3 if case["bias"] else 2)
        kernels = set(r["kernels"])
        if case.get("logits_gemm") == "cublas" and not case["bias"] and case["dtype"] != "float16":
            # forward: cuBLAS logits + the streaming statistics kernel, never kernel A (the cuBLAS GEMMs launch
            # nothing through _launch); backward: dz streamed from the recomputed chunk
            assert "lm_head_fwd_kernel_stats_from_logits" in kernels and "lm_head_fwd_kernel_partial" not in kernels, kernels
        else:  # kernel A forward, the recomputing dlogits kernel backward
            assert "lm_head_fwd_kernel_partial" in kernels and "lm_head_fwd_kernel_stats_from_logits" not in kernels, kernels
        assert "lm_head_bwd_kernel_dlogits" in kernels, kernels
    if returned["acc_in_place"] is not None:
        assert returned["acc_in_place"], "grad_weight_acc must be accumulated into in place and returned"
    if "zero_rows" in case and "zero_rows_grad_hidden_max_abs" in r:
        # rows with g_lp = g_H = 0 contribute exactly nothing
        assert r["zero_rows_grad_hidden_max_abs"] == 0.0
