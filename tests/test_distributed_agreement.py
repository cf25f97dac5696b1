"""Ranks that disagree are refused together and clearly; ranks that agree compute exactly; nothing hangs.

The probe (tests/_rank_agreement_probe.py) runs every case of its catalogue in ONE spawned gloo group per
test (each case in its own sub-group whose collectives time out after 10 s; the harness kills the group
past a watchdog limit), so a hang fails the test in bounded time instead of waiting. Cases: hidden,
targets, temperature, soft-cap, logit scale, config, advantages, old log-probs, normalizers or schedule
differing across the ranks of tp_group; the whole head on every rank; a rank with an empty block of the
vocabulary; every rank all-masked, one rank all-masked, masks differing by one token; a bad input on one
rank only; the fingerprint switch set on one rank only; under entropy_group (data-parallel ranks with the
top-entropy quantile): config, num_tokens, num_sequences, dp_size differing, a bad input on one rank,
a rank without the quantile, a rank without valid tokens. Verdicts: "clear" (every rank raised the same
message, naming the cause), "exact" (loss, metrics, log-probs, entropy, grad_hidden and the rank's block
of grad_weight equal to float64 autograd on one process, to fp32 rounding as in
tests/test_distributed_tp.py), "wrong" (a silent wrong result, a refused valid input, an unclear or
differing error) and "hang" (a collective timed out). The counts are printed (`pytest -s`); the same
run from the command line: `python tests/_rank_agreement_probe.py --world 2 [--backend triton]`.

The fingerprint itself (grpo_kernels/_agreement.py) is tested on one process: bitwise-equal inputs always
agree (whatever the thread count or chunking), any one changed element or a permutation disagrees.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _rank_agreement_probe as probe  # noqa: E402

from grpo_kernels import _agreement  # noqa: E402


def _run(world, backend, env=None):
    counts, rows = probe.run_probe(world, backend, env=env)
    print(f"\nrank-agreement probe, world={world}, backend={backend}: {counts}")
    bad = [f"{verdict}: {name}: {detail}" for verdict, name, detail in rows if verdict in ("wrong", "hang")]
    assert not bad, "\n".join(bad)
    assert counts["clear"] + counts["exact"] == counts["cases"] == len(probe.catalogue())
    return counts


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_probe_torch_backend(world):
    _run(world, "torch")


@pytest.mark.distributed
@pytest.mark.interpreter
@pytest.mark.slow
def test_probe_triton_interpreter():
    pytest.importorskip("triton")
    _run(2, "triton", env={"TRITON_INTERPRET": "1"})


# -- the probe's verdicts can fail --------------------------------------------------------------------


def test_classify_catches_silent_wrong_results_hangs_and_unclear_errors():
    exact_case, error_case = "tp_loss/agree", "tp_loss/hidden_differs"
    right = {"result": {"loss": [0.5, 0.5]}}
    assert probe.classify(exact_case, [right, right])[0] == "exact"
    assert probe.classify(exact_case, [right, {"result": {"loss": [0.51, 0.5]}}])[0] == "wrong"
    assert probe.classify(exact_case, [right, {"result": {"loss": [float("nan"), 0.5]}}])[0] == "wrong"
    named = {"error": "ValueError", "message": "the ranks disagree on hidden", "timeout": False}
    assert probe.classify(error_case, [named, named])[0] == "clear"
    assert probe.classify(error_case, [named, right])[0] == "wrong"  # a rank returned a loss
    riddle = {"error": "RuntimeError", "message": "Connection closed by peer", "timeout": False}
    assert probe.classify(error_case, [named, riddle])[0] == "wrong"  # messages differ
    assert probe.classify(error_case, [riddle, riddle])[0] == "wrong"  # does not name the cause
    hung = {"error": "RuntimeError", "message": "Timed out waiting 10000ms for recv", "timeout": True}
    assert probe.classify(error_case, [named, hung])[0] == "hang"


# -- the fingerprint -------------------------------------------------------------------------------


def _fp(x):
    return int(_agreement.fingerprint(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.bool])  # fmt: skip
def test_fingerprint_equal_bits_agree_any_change_disagrees(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 13, generator=g) * 5).to(dtype)
    assert _fp(x) == _fp(x.clone()) == _fp(x.t().contiguous().t())  # bits, not the memory layout
    for index in (0, 45, 90):  # first, middle, last element
        y = x.clone().reshape(-1)
        y[index] = ~y[index] if dtype == torch.bool else y[index] + 1
        assert _fp(y.reshape(7, 13)) != _fp(x), f"a change at {index} went unseen"
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]
    if not torch.equal(swapped, x):
        assert _fp(swapped) != _fp(x), "two rows swapped went unseen"
    assert _fp(x.reshape(13, 7)) != _fp(x), "the shape is part of the fingerprint"


def test_fingerprint_does_not_depend_on_threads_or_chunking(monkeypatch):
    x = torch.randn(3000, 50)
    expected = _fp(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _fp(x) == expected
    finally:
        torch.set_num_threads(threads)
    # a tensor longer than one chunk: the chunks' sums are combined exactly (integers)
    monkeypatch.setattr(_agreement, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(_agreement, "_weights", {})
    chunked = _fp(x)
    y = x.clone()
    y[-1, -1] += 1  # in the last chunk
    assert _fp(y) != chunked
    z = x.clone().reshape(-1)
    z[:4096], z[4096:8192] = x.reshape(-1)[4096:8192], x.reshape(-1)[:4096]  # two chunks swapped
    assert _fp(z.reshape(3000, 50)) != chunked


def test_block_sample_tells_the_whole_head_from_its_blocks():
    w = torch.randn(203, 16)
    assert int(_agreement.block_sample(w)) == int(_agreement.block_sample(w.clone()))
    assert int(_agreement.block_sample(w[:101])) != int(_agreement.block_sample(w[101:]))
    assert _agreement.block_sample(w[:0]) == 0


def test_fingerprint_is_the_same_integer_on_the_cuda_path(monkeypatch):
    """CPU sums with torch.dot, CUDA with a product and a sum (no int64 dot there): exact integers, equal."""
    x = torch.randn(5000, 9).to(torch.bfloat16)
    expected = _fp(x)
    monkeypatch.setattr(_agreement, "_dot", lambda a, b: (a * b).sum())
    assert _fp(x) == expected


def test_readme_names_the_probes_size():
    readme = " ".join((HERE.parent / "README.md").read_text().split())
    assert f"A probe of {len(probe.catalogue())} cases per run" in readme
