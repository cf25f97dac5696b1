"""The quick tier (`python -m pytest -q -m quick`, the README's first test command; tests/quick.txt) covers
every module: every test file but those that need what a CPU machine lacks, every Triton kernel, every fused
schedule and every loss configuration. Read from this session's collection (tests/conftest.py stores which
tests are `quick`), so it runs where the whole tests/ folder was collected: the quick and the full command."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from _selection import COLLECTED_IDS, QUICK_IDS

pytestmark = pytest.mark.quick  # the check belongs to the tier it checks
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# the peers whose tests are in the tier, installed by the README's test environment ([test,parity])
PARITY_PEERS = ("trl", "verl", "liger_kernel")

NOT_QUICK = {  # test files without a quick test, and why
    "test_gpu.py": "needs CUDA (tier 4)",
    "test_gpu_tier.py": "needs CUDA (tier 4; its structure is checked on CPU by test_gpu_tier_structure.py)",
    "test_vllm_engine.py": "needs a vLLM engine (its own environment, README 'vLLM rollouts')",
    "test_vllm_trainer.py": "needs a vLLM engine (its own environment)",
    "test_integration_trl_vllm.py": "needs a vLLM engine (its own environment)",
    "test_integration_skyrl.py": "needs SkyRL (its own environment, .ci/steps/trainers.sh)",
    "test_integration_skyrl_step.py": "needs SkyRL (its own environment, .ci/steps/trainers.sh)",
    "test_skyrl_suite.py": "needs SkyRL (its own environment, .ci/steps/trainers.sh)",
    "test_integration_torchtitan.py": "needs torchtitan (its own environment, .ci/steps/trainers.sh)",
    "test_integration_openrlhf.py": "needs OpenRLHF (its own environment layer, .ci/steps/openrlhf.sh)",
    "test_openrlhf_suite.py": "needs OpenRLHF (its own environment layer, .ci/steps/openrlhf.sh)",
    "test_variant_parity_openrlhf.py": "needs OpenRLHF (its own environment layer, .ci/steps/openrlhf.sh)",
    "test_variant_parity_skyrl.py": "needs SkyRL (its own environment, .ci/steps/trainers.sh)",
    "test_variant_parity_areal.py": "needs AReaL's loss module (installed in .ci/steps/trainers.sh)",
    "test_integration_unsloth.py": "needs Unsloth (its own environment, .ci/steps/unsloth.sh)",
    "test_unsloth_suite.py": "needs Unsloth (its own environment, .ci/steps/unsloth.sh)",
}

# every Triton kernel of the package -> a quick test that runs it (under the interpreter)
KERNELS = {
    "lm_head_fwd_kernel_partial": "tests/test_lm_head_triton_interpreter.py::test_lm_head_triton_interpreter",
    "lm_head_fwd_kernel_merge": "tests/test_lm_head_triton_interpreter.py::test_lm_head_triton_interpreter",
    "lm_head_bwd_kernel_dlogits": "tests/test_lm_head_triton_interpreter.py::test_lm_head_triton_interpreter",
    "lm_head_fwd_kernel_partial_tma": "tests/test_fused_triton_interpreter.py::test_tma_kernel_a_matches_torch",
    "lm_head_fwd_kernel_stats_from_logits": "tests/test_fused_schedules_interpreter.py",
    "lm_head_bwd_kernel_grad_hidden_dz": "tests/test_dz_in_gemm_interpreter.py::test_dz_in_gemm_equals_the_slab_path",
    "lm_head_bwd_kernel_grad_weight_dz": "tests/test_dz_in_gemm_interpreter.py::test_dz_in_gemm_equals_the_slab_path",
    "loss_head_fwd_bwd_kernel": "tests/test_loss_head_triton_interpreter.py::test_triton_loss_head_matches_reference",
    "scale_by_device_scalar_kernel": "tests/test_host_reads.py::test_scale_kernel_matches_pytorch",
}

# every fused schedule -> a quick test that runs it on the Triton kernels (interpreter)
SCHEDULES = {
    "auto": "tests/test_fused_triton_interpreter.py::test_auto_takes_the_low_memory_schedule_over_the_memory_goal",
    "one_pass": "tests/test_fused_triton_interpreter.py::test_fused_triton_matches_torch[grpo-padded-one_pass]",
    "two_pass": "tests/test_fused_triton_interpreter.py::test_fused_triton_matches_torch[grpo-packed-two_pass]",
    "low_memory": "tests/test_fused_triton_interpreter.py::test_low_memory_schedule_matches_torch",
    "one_pass_dz": "tests/test_fused_triton_interpreter.py::test_one_pass_dz_in_gemm_matches_torch",
    "one_pass_inplace": "tests/test_fused_schedules_interpreter.py::test_new_schedules_match_torch",
    "one_pass_cublas": "tests/test_fused_schedules_interpreter.py::test_new_schedules_match_torch",
    "one_pass_cublas_inplace": "tests/test_fused_schedules_interpreter.py::test_new_schedules_match_torch",
    "one_pass_dz_inplace": "tests/test_fused_schedules_interpreter.py::test_new_schedules_match_torch",
}

# every loss configuration of the test grid (test_loss_head.CONFIGS: every loss type, KL, IS mode,
# aggregation) runs in these quick tests, one parametrization each
PER_CONFIGURATION = ("tests/test_loss_head.py::test_masked_tokens_contribute_exactly_zero",
                     "tests/test_fused.py::test_fused_equals_composition")  # fmt: skip


@pytest.fixture(scope="module")
def quick(request) -> list[str]:
    # the whole folder: no path on the command line (pyproject's testpaths) or the folder itself; a file whose
    # tests all skip at import (another environment's) has no collected test and is in NOT_QUICK
    paths = [Path(str(a).split("::", 1)[0]).resolve() for a in request.config.args]
    if not request.config.stash.get(COLLECTED_IDS, []) or any(p not in (ROOT, TESTS) for p in paths):
        pytest.skip("collect the whole tests/ folder (python -m pytest -m quick) to check what the tier covers")
    absent = [m for m in PARITY_PEERS if importlib.util.find_spec(m) is None]
    if absent:  # their files skip at import, so their quick tests are not collected (the newest-stack tier)
        pytest.skip(f"the tier's coverage is checked where every quick file collects ([test,parity]); absent: {absent}")
    return request.config.stash[QUICK_IDS]


def in_tier(quick_ids: list[str], prefix: str) -> bool:
    return any(i == prefix or (i.startswith(prefix) and i[len(prefix)] in ":[") for i in quick_ids)


def test_every_test_file_is_in_the_tier(quick):
    files = {i.split("::", 1)[0] for i in quick}
    missing = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py")
                     if f"tests/{p.name}" not in files and p.name not in NOT_QUICK)  # fmt: skip
    assert not missing, f"test files with no line in tests/quick.txt (add one, or a reason to NOT_QUICK): {missing}"
    stale = sorted(name for name in NOT_QUICK if f"tests/{name}" in files or not (TESTS / name).exists())
    assert not stale, f"NOT_QUICK lists files that are in the tier or do not exist: {stale}"


def test_every_triton_kernel_is_in_the_tier(quick):
    source = "".join(p.read_text() for p in (ROOT / "grpo_kernels").rglob("*.py"))
    kernels = set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def ([a-z]\w*)\(", source))  # public kernels
    assert kernels == set(KERNELS), f"kernels without a quick test / listed but gone: {kernels ^ set(KERNELS)}"
    for kernel, test in KERNELS.items():
        assert in_tier(quick, test), f"{kernel}: {test} is not in tests/quick.txt"


def test_every_fused_schedule_is_in_the_tier(quick):
    from grpo_kernels.ops.fused.function import SCHEDULES as LIBRARY

    assert set(LIBRARY) == set(SCHEDULES), f"schedules without a quick test: {set(LIBRARY) ^ set(SCHEDULES)}"
    for schedule, test in SCHEDULES.items():
        assert in_tier(quick, test), f"schedule {schedule}: {test} is not in tests/quick.txt"


def test_every_loss_configuration_is_in_the_tier(quick):
    from test_loss_head import CONFIGS

    from grpo_kernels.config import LOSS_TYPES

    assert {c.loss_type for c in CONFIGS.values()} >= set(LOSS_TYPES), "a loss type the grid lacks"
    for prefix in PER_CONFIGURATION:
        ran = {i[len(prefix) + 1 : -1] for i in quick if i.startswith(prefix + "[")}
        assert ran >= set(CONFIGS), f"{prefix}: configurations not in the tier: {sorted(set(CONFIGS) - ran)}"


def test_the_trainer_and_the_adapters_are_in_the_tier(quick):
    for prefix in ("tests/test_trainer.py::test_smoke_run_writes_metrics_plot_and_loadable_checkpoints",
                   "tests/test_integration_trl.py::test_training_matches_trl[grpo-fused]",
                   "tests/test_integration_verl.py::test_gk_mode_equals_verl"):  # fmt: skip
        assert in_tier(quick, prefix), prefix
