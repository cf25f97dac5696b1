"""The memory each fused schedule holds: the model (grpo_kernels/ops/fused/memory.py) against the bytes
a run allocates, and the model at the target shape against the extra-memory goal.

The run: fused_linear_grpo_loss on the Triton backend under the interpreter (fp32, H = 64, V = 4099,
40 valid tokens in chunks of 12), its allocations counted by the profiler. Every big buffer of the
model (the fp32 grad_weight accumulator, the chunk logits, the dz slab) is there at the peak; what the
model leaves out is O(N) (per-token vectors, the forward's split partials): at most 64 bytes per token
of the batch plus 16 KiB of small allocations.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpo_kernels.ops.fused.memory import GIB, schedule_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TARGET = dict(n_valid=16384, hidden=4096, vocab=151936, element_size=2)  # Qwen3-8B head, bf16
EXTRA_GOAL = 1.5 * GIB


@pytest.mark.interpreter
def test_model_matches_the_bytes_a_run_allocates():
    pytest.importorskip("triton")
    from interpreter_runner import run_case_script

    report = run_case_script("_fused_memory_cases.py", timeout=600)
    for schedule, r in report.items():
        measured = r["peak"] - r["grads"]  # grad_hidden is allocated inside the call; grad_weight is fp32 here
        slack = 64 * r["tokens"] + 16 * 1024
        # the interpreter keeps a launch's tensor arguments alive until the next launch, so with
        # back-to-back backward calls (low_memory's slabs) the previous slab's dz workspace is still
        # there when the next one is allocated; a GPU launch holds no reference
        slack += r["slab_dz"]
        assert abs(measured - r["model"]) <= slack, (
            f"{schedule}: measured peak extra {measured} B, model {r['model']} B (slack {slack} B)"
        )


def test_model_at_the_target_shape():
    one = schedule_memory("one_pass", **TARGET)
    two = schedule_memory("two_pass", **TARGET)
    low = schedule_memory("low_memory", **TARGET)
    assert not any("[V, H]" in name for name in low.buffers), low.table()  # no V x H fp32 buffer
    # within the goal at the target shape and at 64k tokens when every token is valid (a masked batch
    # adds the gathered valid rows, N x H in the input dtype: 0.5 GiB at 64k)
    for n_valid in (16384, 65536):
        low_n = schedule_memory("low_memory", **{**TARGET, "n_valid": n_valid}, masked=False)
        assert low_n.peak_extra <= EXTRA_GOAL, low_n.table()
    acc = 4 * TARGET["vocab"] * TARGET["hidden"]
    assert one.buffers["grad_weight accumulator, fp32 [V, H]"] == acc == two.buffers["grad_weight accumulator, fp32 [V, H]"]
    # 1280 tokens of fp32 logits (the 768 MiB budget in whole 64-token tiles)
    assert one.buffers["chunk logits, fp32 [chunk, V]"] == 4 * 1280 * TARGET["vocab"]
    print("\n" + one.table() + "\n" + two.table() + "\n" + low.table())


@pytest.mark.xfail(strict=True, reason="the fp32 grad_weight accumulator alone is 2.3 GiB at V = 152k, H = 4096 "
                   "(fp32 accumulation across token chunks is a numerics rule); see grpo_kernels/ops/lm_head/README.md, "
                   "'Memory per schedule'")  # fmt: skip
def test_default_schedule_within_the_extra_memory_goal():
    assert schedule_memory("one_pass", **TARGET).peak_extra <= EXTRA_GOAL
