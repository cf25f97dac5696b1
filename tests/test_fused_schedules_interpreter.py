"""Tier 2: the one-pass schedules of issue 23 (and "one_pass_dz_inplace") on the Triton backend under TRITON_INTERPRET=1 (the cases and
what they compare: tests/_fused_schedules_cases.py), against the PyTorch backend in fp32 on the same inputs.

Bounds, per element, with u the unit roundoff of the inputs' dtype (2^-24 fp32, 2^-11 fp16, 2^-8 bf16),
K = 4 chunks and B = the sum over the reduction of |dz| |operand| (computed by the cases from the reference's
dz):
  grad_weight  dz rounded to the dtype once (u B), the gradient buffer rounded once per chunk in place
               (<= u |partial sum| <= u B each, K of them) or once at the end: <= (K + 2) u B
  grad_hidden  dz rounded (u B) and the fp32 result rounded once (u B): <= 2 u B
  grad_bias    fp32 column sums of the fp32 dz, rounded once: <= u B
The interpreter stores an fp32 value to bf16 by truncation (round toward zero: up to one ulp, 2 u), where a
GPU rounds to nearest; the cases script checks it (`_interpreter` in its report), and where it truncates the
dz slab's term is 2 u B instead of u B for grad_weight and grad_hidden in bf16 (the other roundings are
torch's, to nearest; "one_pass_dz_inplace" rounds dz in its GEMM's operand load and its gradient buffer in
the grad_weight kernel's store, both the interpreter's: 2 u B each, K + 1 more u B terms). Measured:
grad_hidden of a bf16 run 2.13 u B from exact, 1 ulp beyond rounding dz to nearest
(is_sequence_geometric_mask, one_pass and one_pass_cublas alike).
plus the fp32 reassociation both backends have: 2e-5 of the gradient's largest bound (TOL, as the other
fused interpreter tests). Loss, metrics and log-probs: the statistics come from fp32 sums of exact products
on both sides, |diff| <= TOL (1 + |expected|).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import interpreter_runner  # noqa: E402
from _fused_schedules_cases import DTYPES, GRID_CONFIGS, SCHEDULES  # noqa: E402
from interpreter_runner import run_case_script  # noqa: E402
from test_loss_head import CONFIGS  # noqa: E402

pytestmark = pytest.mark.interpreter
TOL = 2e-5
CHUNKS = 4
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
ROUNDINGS = {"weight": CHUNKS + 2, "hidden": 2, "bias": 1}
READS_DZ_SLAB = {"weight": 1, "hidden": 1, "bias": 0}  # the gradients contracted from the rounded dz slab
# the backward's Triton kernels: the dz slab (dlogits kernel, cuBLAS GEMMs) or dz inside the two GEMMs (the bias
# sums, when there is a bias gradient, still come from the dlogits kernel, which then stores no slab)
DZ_IN_GEMM = {"lm_head_bwd_kernel_dlogits", "lm_head_bwd_kernel_grad_hidden_dz", "lm_head_bwd_kernel_grad_weight_dz"}


def cases(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def roundings(label: str, dname: str, report: dict, schedule: str = "") -> int:
    """u B terms of a gradient's bound: one more for the dz slab (or dz in the GEMM's operand) where the
    interpreter truncates to bf16; for the dz kernel's in-place grad_weight, whose store to the bf16 buffer is
    the interpreter's too, one more per chunk."""
    truncates = dname == "bf16" and report["_interpreter"]["bf16_store_rounds_toward_zero"]
    in_kernel_store = CHUNKS if truncates and label == "weight" and schedule == "one_pass_dz_inplace" else 0
    return ROUNDINGS[label] + (READS_DZ_SLAB[label] if truncates else 0) + in_kernel_store


@pytest.fixture(scope="module")
def report():
    return run_case_script("_fused_schedules_cases.py", timeout=1200)


def test_every_configuration_ran(report):
    names = {case.split("-")[0] for case in cases(report)}
    assert names == set(CONFIGS), set(CONFIGS) ^ names
    for name in GRID_CONFIGS:
        for dname in DTYPES:
            for schedule in SCHEDULES:
                assert f"{name}-{dname}-{schedule}" in report


def test_new_schedules_match_torch(report):
    failures = []
    for case, r in sorted(cases(report).items()):
        name, dname, schedule = case.split("-")
        cfg = CONFIGS[name]
        if cfg.needs_global_statistics:
            if f"schedule='{schedule}' is not valid here" not in r.get("refused", ""):
                failures.append(f"{case}: one pass must be refused, got {r}")
            continue
        if "refused" in r:
            failures.append(f"{case}: refused: {r['refused']}")
            continue
        got, expected = r["loss"]
        if not interpreter_runner.close(got, expected, TOL):
            failures.append(f"{case}: loss {got} vs {expected}")
        diff, scale = r["logprobs"]
        if diff > TOL * (1 + scale):
            failures.append(f"{case}: logprobs differ by {diff}")
        for key, (got, expected) in r["metrics"].items():
            if not interpreter_runner.close(got, expected, TOL):
                failures.append(f"{case}: metric {key} {got} vs {expected}")
        u = UNIT_ROUNDOFF[dname]
        for label, (got, expected, index, bound, bound_max) in r["grads"].items():
            k = roundings(label, dname, report, schedule)
            allowed = k * u * bound + TOL * bound_max
            if abs(got - expected) > allowed:
                failures.append(f"{case}: grad_{label} worst at flat index {index}: triton {got}, torch {expected}, "
                                f"allowed {allowed:.3g} ({k} u B, B = {bound:.3g})")  # fmt: skip
        cublas = "cublas" in schedule
        kernels = ["lm_head_fwd_kernel_merge", "lm_head_fwd_kernel_stats_from_logits" if cublas
                   else "lm_head_fwd_kernel_partial"]  # fmt: skip
        if r["kernels"] != sorted(kernels):
            failures.append(f"{case}: forward kernels {r['kernels']}, expected {sorted(kernels)}")
        backward = DZ_IN_GEMM if "_dz" in schedule else {"lm_head_bwd_kernel_dlogits"}
        if set(r["backward_kernels"]) != backward:
            failures.append(f"{case}: backward kernels {r['backward_kernels']}, expected {sorted(backward)}")
    assert not failures, "\n".join(failures)
