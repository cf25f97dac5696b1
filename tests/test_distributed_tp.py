"""Vocabulary-parallel LM head (tp_group) on spawned gloo process groups against one process on the
whole head: log-probs, entropy, fused losses (GRPO + KL, with an entropy bonus, DAPO, GSPO, CISPO),
padded and packed, every schedule, the PyTorch backend and the Triton kernels under the interpreter.
Two ranks (equal blocks) and three (uneven blocks: 50, 90, 63 rows of V = 203); the padded layout with
the first schedule, the packed one with the last (one-pass and two-pass on the Triton backend).

Tolerance: fp32 inputs; the ranks' statistics are combined in another order than one process sums
them (a log-sum-exp of per-block log-sum-exps, a sum of per-block dz W products): a few ulp of each
value, |diff| <= 2e-5 (1 + |expected|), gradients relative to their largest element, as in the
interpreter tier.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _distributed_workers as workers  # noqa: E402
from interpreter_runner import close  # noqa: E402

from grpo_kernels.testing.distributed import run_group  # noqa: E402

TOL = 2e-5
pytestmark = pytest.mark.distributed


def check(report: dict, rank: int):
    for key, (got, expected, index, scale) in report.items():
        ok = close(got, expected, TOL, scale if "/grad_" in key else None)
        assert ok, f"rank {rank} {key}: worst at flat index {index}: tp {got!r}, one process {expected!r}"


@pytest.mark.parametrize("sizes", [(102, 101), (50, 90, 63)], ids=["2-ranks", "3-ranks-uneven"])
def test_vocab_parallel_torch_backend(sizes):
    reports = run_group(workers.tp_worker, len(sizes), list(sizes), "torch", ["auto"])
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.mark.interpreter
@pytest.mark.parametrize("sizes", [(102, 101), (50, 90, 63)], ids=["2-ranks", "3-ranks-uneven"])
def test_vocab_parallel_triton_interpreter(sizes):
    pytest.importorskip("triton")
    reports = run_group(workers.tp_worker, len(sizes), list(sizes), "triton", ["one_pass", "two_pass"],
                        env={"TRITON_INTERPRET": "1"}, timeout=600)  # fmt: skip
    for rank, report in enumerate(reports):
        check(report, rank)


def test_one_rank_group_is_exactly_no_group():
    assert run_group(workers.one_rank_group_worker, 1, "torch") == [True]


def test_verl_linear_cross_entropy_under_megatron_tp():
    """verl's Megatron forward always passes the TP group, also at TP = 1 (refused before): a 2-rank
    group, and each rank's own 1-rank group."""
    pytest.importorskip("verl", reason="needs verl: the [verl] or [parity] extra")
    for rank, report in enumerate(run_group(workers.verl_lce_worker, 2)):
        check(report, rank)
