"""Data parallelism on spawned gloo process groups: each rank holds some of the sequences, gradients are
averaged over ranks (as DDP / FSDP do). With the global normalizers (num_tokens, num_sequences,
dp_size) the result is the single-process loss and gradient to fp32 rounding; without them the
token-level aggregations are not, and grpo_kernels says so once per process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _distributed_workers as workers  # noqa: E402
from interpreter_runner import close  # noqa: E402

from grpo_kernels.testing.distributed import run_group  # noqa: E402

pytestmark = pytest.mark.distributed


def test_global_normalizers_give_the_single_process_result():
    reports = run_group(workers.ddp_worker, 2, True)
    for rank, report in enumerate(reports):
        for agg, r in report.items():
            for key in ("grad_weight", "loss"):
                got, expected, index, scale = r[key]
                assert close(got, expected, 1e-5, scale), f"rank {rank} {agg} {key}: at {index}: {got} vs {expected}"
            assert r["warned"] == [], r["warned"]


def test_local_normalizers_warn_once_and_differ():
    reports = run_group(workers.ddp_worker, 2, False)
    for rank, report in enumerate(reports):
        warned = [w for r in report.values() for w in r["warned"]]
        assert len(warned) == 1, warned  # once per process, on the first call
        assert "num_tokens=" in warned[0] and "dp_size=2" in warned[0], warned[0]
        for agg in ("token-mean", "token-sum"):  # the ranks hold different token counts: not the batch loss
            got, expected, _, scale = report[agg]["grad_weight"]
            # off by far more than rounding: more than 1 % of the largest gradient element
            assert abs(got - expected) > 0.01 * scale, f"{agg}: local normalizers matched by chance"


@pytest.mark.parametrize("world", [2, 3])
def test_entropy_quantile_over_processes_gives_the_single_process_result(world):
    """top_entropy_quantile with entropy_group: the quantile over every rank's tokens (TRL's), so the
    data-parallel result is the single-process one; each rank's own quantile is not."""
    reports = run_group(workers.entropy_quantile_worker, world)
    for rank, report in enumerate(reports):
        for name in ("entropy_group", "grpo_loss"):
            for key, (got, expected, index, scale) in report[name].items():
                assert close(got, expected, 1e-5, scale), f"rank {rank} {name} {key}: at {index}: {got} vs {expected}"
        got, expected, _, scale = report["local_quantile"]["grad_weight"]
        assert abs(got - expected) > 1e-3 * scale, "the local quantile matched the global one by chance"
