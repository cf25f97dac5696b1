"""FSDP2 (fully_shard on gloo, 2 ranks) with grpo_kernels on the LM head, the head in its own FSDP unit or
in the root's, the loss computed inside the module's forward or after it on the DTensor lm_head.weight:
every sharded gradient after FSDP's reduce-scatter equals one process on the whole batch (fp32, the
same normalizers: only the summation order differs). And a ZeRO-3 partitioned parameter is refused
with the two ways out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _distributed_workers as workers  # noqa: E402
from test_distributed_tp import check  # noqa: E402

from grpo_kernels.testing.distributed import run_group  # noqa: E402

pytestmark = pytest.mark.distributed


def test_fsdp2_gradients_equal_one_process():
    """Every combination of the head in / out of its own unit and the loss in / after the forward (the
    report's keys say which), in one 2-rank group."""
    for rank, report in enumerate(run_group(workers.fsdp_all_worker, 2)):
        check(report, rank)


def test_zero3_partitioned_parameter_is_refused_with_the_ways_out():
    (message,) = run_group(workers.zero3_stub_worker, 1)
    assert "ZeRO-3" in message and "inside the model's forward" in message and "GatheredParameters" in message, message


def test_trl_adapter_refuses_an_fsdp2_head_in_its_own_unit():
    """TRL's own full_tensor() gather of such a head would drop the other ranks' gradients (Replicate
    placement); the adapter says so and what to do instead."""
    pytest.importorskip("trl", reason="needs trl: the [trl] or [parity] extra")
    (report,) = run_group(workers.trl_fsdp2_head_worker, 1)
    assert "own FSDP2 unit" in report["with_grad"] and "root FSDP unit" in report["with_grad"], report
