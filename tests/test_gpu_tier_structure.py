"""The GPU test tier's structure, on CPU (tests/test_gpu_tier.py runs only on a CUDA GPU): every case the
interpreter tier runs is in it, under the same test name and parameters; it carries the gpu marker and skips
without CUDA; and the GPU session runs it first after preflight (the rehearsal of that order is in
tests/test_gpu_session.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import test_fused_triton_interpreter as fused_interpreter
import test_gpu_tier as tier
import test_loss_head_triton_interpreter as loss_head_interpreter


def parameter_sets(function) -> set[tuple]:
    """Every combination of the function's @pytest.mark.parametrize values, as sorted (name, value) tuples."""
    axes = []
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        values = [v.values if hasattr(v, "values") else (v if len(names) > 1 else (v,)) for v in mark.args[1]]
        axes.append([tuple(zip(names, v)) for v in values])
    return {tuple(sorted(p for part in combo for p in part)) for combo in itertools.product(*axes)}


def _tests_of(module) -> dict:
    return {name: f for name, f in vars(module).items() if name.startswith("test_") and callable(f)}


@pytest.mark.parametrize("interpreter", [loss_head_interpreter, fused_interpreter], ids=["loss_head", "fused"])
def test_every_interpreter_case_runs_in_the_gpu_tier(interpreter):
    ours = _tests_of(tier)
    theirs = _tests_of(interpreter)
    assert sum(len(parameter_sets(f)) for f in theirs.values()) > 100  # the cases were read, not an empty list
    missing = []
    for name, function in theirs.items():
        if name not in ours:
            missing.append(name)
            continue
        lacking = parameter_sets(function) - parameter_sets(ours[name])
        missing += [f"{name}{list(p)}" for p in sorted(lacking)]
    assert not missing, f"interpreter cases the GPU tier does not run: {missing[:10]} ({len(missing)} in all)"


def test_the_gpu_tier_covers_every_schedule_auto_can_pick_and_every_input_variant():
    from grpo_kernels.ops.fused.function import SCHEDULES

    # the dz schedules (opt-in): one_pass_dz its own case, one_pass_dz_inplace with csrc's kernel C at the target
    # head and its Triton in-place epilogue in the HalfLogits test
    assert set(tier.AUTO_SCHEDULES) == set(SCHEDULES) - {"one_pass_dz", "one_pass_dz_inplace"}
    assert tier.HEADS["qwen3-8b"] == (4096, 151936) and tier.HEADS["small"][1] < 10000
    assert {"bias", "softcap", "temperature", "fp16", "fp32", "packed", "batch_invariant"} <= set(tier.VARIANTS)
    combos = parameter_sets(tier.test_every_schedule_auto_can_pick_at_small_and_target_head)
    assert len(combos) == len(tier.AUTO_SCHEDULES) * len(tier.HEADS)


def test_the_gpu_tier_is_marked_and_skips_without_cuda():
    marks = {m.name for m in tier.pytestmark}
    assert {"gpu", "skipif"} <= marks
    skip = next(m for m in tier.pytestmark if m.name == "skipif")
    assert skip.args[0] is (not torch.cuda.is_available())


def test_the_session_runs_the_tier_first_after_preflight():
    from grpo_kernels.bench import gpu_session

    for rehearsal in (False, True):
        parts = gpu_session.plan(rehearsal)
        names = [p.name for p in parts]
        assert names.index("gpu-tests") == names.index("preflight") + 1, names
        tests = parts[names.index("gpu-tests")]
        assert any(c.endswith("test_gpu_tier.py") for c in tests.command), tests.command
    lease = gpu_session.lease_plan()
    assert lease["calls"][0][:4] == ["wheels", "preflight", "gpu-tests", "headline"], lease["calls"]
