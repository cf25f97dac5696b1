"""The memory each fused schedule holds: the model (grpo_kernels/ops/fused/memory.py) against the bytes
a run allocates, and the model at the target shape against the extra-memory goal.

The run: fused_linear_grpo_loss on the Triton backend under the interpreter (fp32, H = 64, V = 4099,
40 valid tokens in 4 chunks of at most 12, balanced to 10; and bf16 for the kernel-A one-pass schedules,
whose chunk logits are fp16 differences with fp32 offsets), its allocations counted by the profiler. Every big buffer of the
model (the fp32 grad_weight accumulator, the chunk logits, the dz slab) is there at the peak; what the
model leaves out is O(N) (per-token vectors, the forward's split partials): at most 64 bytes per token
of the batch plus 16 KiB of small allocations.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torch

from grpo_kernels.ops.fused.accuracy import max_inplace_chunks
from grpo_kernels.ops.fused.dispatch import auto_schedule_at
from grpo_kernels.ops.fused.function import stored_logits_bytes
from grpo_kernels.ops.fused.memory import EXTRA_MEMORY_GOAL, GIB, inplace_chunk_rows, schedule_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TARGET = dict(n_valid=16384, hidden=4096, vocab=151936, element_size=2)  # Qwen3-8B head, bf16
EXTRA_GOAL = 1.5 * GIB


@pytest.mark.interpreter
def test_model_matches_the_bytes_a_run_allocates():
    pytest.importorskip("triton")
    from interpreter_runner import run_case_script

    report = run_case_script("_fused_memory_cases.py", timeout=600)
    validation = report.pop("validation")
    # the finite checks hold O(rows) (per-row min / max of hidden) and O(1) for the weight: never a
    # weight-sized temporary (two V x H bools before); the model bounds what they hold
    assert validation["peak"] <= validation["model"] < validation["weight_bytes"], validation
    for schedule, r in report.items():
        # grad_hidden is allocated inside the call (and grad_weight where it is not the fp32 accumulator); the
        # bf16 runs' CPU-only fp32 copies of the GEMM fallback are not the schedule's (the case script says which)
        measured = r["peak"] - r["grads"] - r.get("cpu_upcast", 0)
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
    # kernel A's bf16 chunk: fp16 differences + an fp32 offset per 64 logits, 2560 tokens of the 768 MiB budget
    # in whole 64-token tiles (fp32 logits: 1280); the one-pass cuBLAS schedule keeps fp32 [1280, V]
    half = one.buffers["chunk logits [chunk, V] (fp32; kernel A, 16-bit: fp16 + offsets)"]
    assert half == 2560 * (2 * TARGET["vocab"] + 4 * -(-TARGET["vocab"] // 64)), half
    pytest.importorskip("triton")  # the plan's count against the bytes the buffer allocates (HalfLogits: Triton)
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    for rows, vocab in ((2560, 4096), (3, 1001), (7, 64)):  # a padded row and a ragged last group
        buf = HalfLogits.empty(rows, vocab, "meta")
        allocated = sum(t.untyped_storage().nbytes() for t in (buf.difference, buf.offset))
        assert stored_logits_bytes("one_pass", rows, vocab, 2) == allocated, (rows, vocab, allocated)
    cublas = schedule_memory("one_pass_cublas", **TARGET)
    assert cublas.buffers["chunk logits [chunk, V] (fp32; kernel A, 16-bit: fp16 + offsets)"] == 4 * 1280 * TARGET["vocab"]
    print("\n" + one.table() + "\n" + two.table() + "\n" + low.table())


@pytest.mark.parametrize("n_valid", [16384, 65536])
def test_default_schedule_within_the_extra_memory_goal(n_valid):
    """At the Qwen3-8B head "auto" takes a 3-GEMM-unit schedule within the 1.5 GiB goal: grad_weight summed
    in place in bf16, in chunks sized to fill the goal (2432 tokens with kernel A's fp16 logits, 1664 with
    cuBLAS's fp32 ones), within the chunk count whose error is no worse than PyTorch's (accuracy.py); masked
    at 16k (the gathered rows count), every token valid at 64k."""
    masked = n_valid == 16384
    chosen, reason = auto_schedule_at(n_valid, TARGET["hidden"], TARGET["vocab"], torch.bfloat16, masked=masked)
    assert chosen in ("one_pass_inplace", "one_pass_cublas_inplace"), reason
    rows = inplace_chunk_rows(n_valid, TARGET["hidden"], TARGET["vocab"], 2, EXTRA_MEMORY_GOAL, schedule=chosen)
    assert rows == {"one_pass_inplace": 2432, "one_pass_cublas_inplace": 1664}[chosen], (chosen, rows)
    assert -(-n_valid // rows) <= max_inplace_chunks(torch.bfloat16)
    peak = schedule_memory(chosen, **{**TARGET, "n_valid": n_valid}, masked=masked,
                           logits_bytes=stored_logits_bytes(chosen, rows, TARGET["vocab"], 2))  # fmt: skip
    assert peak.peak_extra <= EXTRA_GOAL == EXTRA_MEMORY_GOAL, peak.table()
    print("\n" + peak.table())


def test_dz_in_place_fits_the_goal_where_one_pass_dz_does_not():
    """one_pass_dz (kernel C's schedule) holds an fp32 [V, H] accumulator: 3.15 GiB modelled at the Qwen3-8B head,
    16k bf16 tokens. one_pass_dz_inplace sums grad_weight into the gradient buffer and stores no dz slab: within
    the 1.5 GiB goal in 4608-token chunks (4 roundings of grad_weight, within accuracy.py's bound), the most of
    any schedule. "auto" does not weigh it (no time model until a GPU has timed it)."""
    n_valid = 16384
    fp32_acc = schedule_memory("one_pass_dz", **{**TARGET, "n_valid": n_valid})
    assert fp32_acc.peak_extra > 2 * EXTRA_MEMORY_GOAL, fp32_acc.table()
    rows = inplace_chunk_rows(n_valid, TARGET["hidden"], TARGET["vocab"], 2, EXTRA_MEMORY_GOAL,
                              schedule="one_pass_dz_inplace")  # fmt: skip
    assert rows == 4608 and -(-n_valid // rows) <= max_inplace_chunks(torch.bfloat16), rows
    peak = schedule_memory("one_pass_dz_inplace", **{**TARGET, "n_valid": n_valid},
                           logits_bytes=stored_logits_bytes("one_pass_dz_inplace", rows, TARGET["vocab"], 2))  # fmt: skip
    assert peak.peak_extra <= EXTRA_MEMORY_GOAL, peak.table()
    assert not any("accumulator, fp32 [V, H]" in k for k in peak.buffers), peak.table()
    # the backward's workspace is the chunk's fp32 grad_hidden alone: no dz slab
    assert peak.buffers["dz slab [rows, V_pad] + fp32 grad_hidden rows"] == 4 * rows * TARGET["hidden"], peak.table()
    for other in ("one_pass_inplace", "one_pass_cublas_inplace"):
        assert inplace_chunk_rows(n_valid, TARGET["hidden"], TARGET["vocab"], 2, EXTRA_MEMORY_GOAL,
                                  schedule=other) < rows  # fmt: skip
    chosen, _ = auto_schedule_at(n_valid, TARGET["hidden"], TARGET["vocab"], torch.bfloat16, goal=64 * GIB)
    assert not chosen.startswith("one_pass_dz"), chosen


def test_max_extra_memory_moves_the_goal():
    # 4 GiB: the fp32-accumulating schedules fit too, and the in-place chunks grow (fewer roundings)
    chosen, reason = auto_schedule_at(16384, TARGET["hidden"], TARGET["vocab"], goal=4 * GIB)
    assert "within the 4.00 GiB extra-memory goal" in reason and "'one_pass'" in reason, reason
    assert inplace_chunk_rows(16384, TARGET["hidden"], TARGET["vocab"], 2, 4 * GIB,
                              schedule="one_pass_cublas_inplace") == 5120  # fmt: skip
    # kernel A's fp16 logits: the chunk reaches its cap (ONE_PASS_CHUNK_TOKENS)
    assert inplace_chunk_rows(16384, TARGET["hidden"], TARGET["vocab"], 2, 4 * GIB) == 8192
    # 0.5 GiB: the in-place schedules in 768-token chunks (22 chunks, within the error bound)
    chosen, reason = auto_schedule_at(16384, TARGET["hidden"], TARGET["vocab"], goal=GIB // 2)
    assert chosen == "one_pass_inplace" and "22 chunk(s) of at most 768" in reason, reason
    # 128 MiB: in-place chunks of 128 tokens would be 128 roundings (over the bound), low_memory holds
    # 0.63 GiB: nothing fits, the smallest modelled peak runs
    chosen, reason = auto_schedule_at(16384, TARGET["hidden"], TARGET["vocab"], goal=2**27)
    assert chosen == "low_memory" and "no schedule fits" in reason, reason


def test_fp16_never_accumulates_in_place_by_default():
    chosen, reason = auto_schedule_at(16384, TARGET["hidden"], TARGET["vocab"], torch.float16)
    assert chosen == "low_memory", reason


def test_auto_over_the_error_bound_leaves_the_in_place_schedules():
    # 262k tokens: 108 chunks of 2432 (158 of 1664) exceed the bound; nothing else fits 1.5 GiB: the smallest peak
    chosen, reason = auto_schedule_at(262144, TARGET["hidden"], TARGET["vocab"])
    assert not chosen.endswith("_inplace") and "no schedule fits" in reason, reason


@pytest.mark.parametrize("dtype,backend,want", [
    (torch.bfloat16, "triton", 2560),  # kernel A's fp16 store: 2 V + 4 V / 64 bytes per token
    (torch.float32, "triton", 1280),  # fp32 inputs keep fp32 logits
    (torch.bfloat16, "torch", 1280),  # the PyTorch backend never runs one pass: the default budget
])  # fmt: skip
def test_auto_without_the_time_model_plans_kernel_a_chunks(monkeypatch, dtype, backend, want):
    """A frozen head (LoRA), like the vocabulary-parallel and batch-invariant heads, skips the time model: "auto"
    then runs "one_pass", kernel A's, so its chunks are planned in kernel A's stored format (the 768 MiB budget
    holds 2560 bf16 tokens at the Qwen3-8B vocabulary, not the fp32 logits' 1280)."""
    from types import SimpleNamespace

    from grpo_kernels.ops.fused import dispatch

    class Planned(Exception):
        pass

    def planner(requested, backend, cfg, batch, chunk_tokens, host=None):
        raise Planned(chunk_tokens)

    monkeypatch.setattr(dispatch, "choose_schedule", planner)
    vocab = TARGET["vocab"]
    hidden = torch.zeros(4, 8, dtype=dtype)
    weight = torch.zeros(vocab, 8, dtype=dtype)  # requires_grad False: the frozen head
    with pytest.raises(Planned) as planned:
        dispatch.run_fused(hidden, weight, None, torch.zeros(4, dtype=torch.long), SimpleNamespace(host=object()),
                           None, SimpleNamespace(__name__="lm"), None, backend, "auto")  # fmt: skip
    assert planned.value.args[0] == want
