"""No host read inside a call: fused_linear_grpo_loss and fused_linear_logprobs on the Triton backend (under
TRITON_INTERPRET=1) wait for the device once per call, forward and backward together, for every schedule and
what `auto` picks, padded and packed; and the kernel that applies grad_output on the device.

The count (tests/_host_reads_cases.py, one subprocess): every torch function and Tensor method that waits for
the device on CUDA (.item(), .tolist(), bool() / int() / float() of a tensor, nonzero, boolean indexing,
repeat_interleave without output_size, ...) is wrapped while a call runs; a read whose innermost frame outside
torch is in grpo_kernels/ is counted with its file:line. The one read allowed per call is
grpo_kernels/_checks.py DeviceChecks.read: the value checks' flags together with the batch's layout (the
fused schedules plan their chunks from it) or, for fused_linear_logprobs, the valid-token count that sizes
its compaction. The backward reads nothing (grad_output is applied by ops/fused/scale.py's kernel).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interpreter_runner import run_case_script, selected_cases  # noqa: E402

pytestmark = pytest.mark.interpreter

# the call's one read: the value checks with the layout (grpo_kernels/_checks.py, DeviceChecks.read)
ALLOWED = ("grpo_kernels/_checks.py:", "(read)")
# A known read left in place: top_entropy_quantile takes torch.quantile over the valid tokens' entropies (a
# boolean index: its size is the valid count) in the loss head (ops/loss_head/reference.py). A configuration
# that needs statistics of the whole batch; the reads are named here so that any other one fails.
KNOWN = {"auto_global": "grpo_kernels/ops/loss_head/reference.py:"}

SCHEDULES = ("one_pass", "one_pass_inplace", "one_pass_cublas", "one_pass_cublas_inplace", "two_pass",
             "low_memory", "one_pass_dz", "one_pass_dz_inplace")  # fmt: skip
AUTO = ("auto", "auto_sequence", "auto_global", "auto_lowmem", "auto_nograd", "scaled", "normalizers", "options",
        "batch_invariant")  # fmt: skip
CASES = [f"loss-{s}-{lay}" for lay in ("padded", "packed") for s in SCHEDULES + AUTO] + [
    f"{f}-{lay}" for lay in ("padded", "packed") for f in ("logprobs", "logprobs_nograd")
]


@pytest.fixture(scope="module")
def report(request):
    return run_case_script("_host_reads_cases.py", timeout=900, cases=selected_cases(request, ("case",)))


def _site_list(reads) -> str:
    return "; ".join(f"{site} {what}" for site, what in reads) or "none"


@pytest.mark.parametrize("case", CASES)
def test_one_host_read_per_call(case, report):
    r = report[case]
    assert "error" not in r, r["error"]
    variant = case.split("-")[1]
    known = KNOWN.get(variant)
    forward = [(site, what) for site, what in r["forward"] if not (known and site.startswith(known))]
    allowed = [x for x in forward if x[0].startswith(ALLOWED[0]) and x[0].endswith(ALLOWED[1])]
    others = [x for x in forward if x not in allowed]
    assert not others, f"{case}: host reads besides the call's one read: {_site_list(others)}"
    assert len(allowed) == 1, f"{case}: {len(allowed)} reads of the checks and layout (1 expected): {_site_list(allowed)}"
    assert not r["backward"], f"{case}: the backward reads the device: {_site_list(r['backward'])}"
    if case.startswith("loss-") and variant in SCHEDULES:
        assert r["schedule"] == [variant], r["schedule"]


@pytest.mark.parametrize("case", ["scale_exact"])  # a case of the subprocess (a selection runs only its cases)
def test_scale_kernel_matches_pytorch(case, report):
    """grad_output applied in place on the device equals PyTorch's (g.float() * s.float()).to(g.dtype): bit for
    bit in fp32 and fp16 (NaN equals NaN), and at s = 1 (the kernel returns without touching g) in every dtype.
    bf16 at s != 1: the interpreter rounds fp32 -> bf16 toward zero (its cast ignores the rounding mode), so
    here within 1 ulp; compiled, the cast is round-to-nearest-even (test_scale_kernel_compiles: cvt.rn)."""
    for key, (differ, ulps) in report[case].items():
        if key.startswith("bfloat16") and not key.endswith(" 1.0"):
            assert ulps <= 1, f"{key}: {differ} elements differ, up to {ulps} ulps"
        else:
            assert differ == 0, f"{key}: {differ} elements differ from PyTorch's (up to {ulps} ulps)"


@pytest.mark.compile
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT compiles need the real Triton JIT")
def test_scale_kernel_compiles():
    """ops/fused/scale.py's kernel compiled for every architecture (bf16; a grad_weight of V x H = 256000 x 8448
    elements, over 2^31: n specialised to int64, the offsets int64 in any case): no spills, and the fp32 ->
    bf16 cast rounds to nearest even (cvt.rn), as PyTorch's."""
    import torch

    from grpo_kernels.ops.fused import scale
    from grpo_kernels.testing import aot

    with aot.record_launches(scale) as launches:
        scale.scale_(torch.empty(8, dtype=torch.bfloat16), torch.ones(1))
    (launch,) = launches
    launch.args["n"] = 256000 * 8448  # over 2^31 elements
    rows = []
    for arch in aot.ARCHS:
        blocker = aot.target_blocker(arch)
        if blocker is not None:
            if os.environ.get("CI"):
                pytest.fail(blocker)
            continue
        result = aot.compile_launch(launch, arch)
        rows.append((arch, result.registers, result.local_memory_ops))
        assert result.local_memory_ops == 0 and not result.spills, f"sm_{arch}: spills ({result.as_dict()})"
        assert "i64" in result.signature.get("n", "i64"), result.signature
        assert "cvt.rn.bf16" in _ptx(launch, arch), f"sm_{arch}: the bf16 cast does not round to nearest even"
    assert rows, "no architecture this Triton can target"
    print("scale_by_device_scalar_kernel (arch, registers, local-memory ops):", rows)


def _ptx(launch, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from grpo_kernels.testing import aot

    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = aot._specialise(launch.kernel, launch.args, launch.num_warps,
                                                            launch.num_stages, target)  # fmt: skip
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__).asm["ptx"]  # fmt: skip
