"""Every bad input of the catalogue (tests/_bad_input_catalogue.py) is refused the same way eager and under
torch.compile(fullgraph=True): the same exception type, a message that names the argument, and (except
where compile refuses what eager would use: process groups, tensor normalizers) the same message.

Compiled: a fresh dynamo cache per case (no recompile limit falls back to eager silently), the aot_eager
backend (the op's fake implementation and the refuse op traced as inductor would, without generating
code), and a compile counter proving the call ran as one traced graph rather than eagerly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bad_input_catalogue import DIFFERENT_MESSAGE, bad_call, cases  # noqa: E402

CASES = cases()


def call(function: str, args: dict):
    out = getattr(gk, function)(**args)
    return out.logprobs.sum() if function == "fused_linear_logprobs" else out.loss


def raised(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return error
    return None


@pytest.mark.parametrize("function,name,value,case_id", CASES, ids=[c[3] for c in CASES])
def test_refused_alike_eager_and_compiled(function, name, value, case_id):
    from torch._dynamo.testing import CompileCounterWithBackend

    args = bad_call(function, name, value)
    eager = raised(lambda: call(function, args))
    assert eager is not None, f"{case_id}: eager accepted {name}={value!r}"
    assert isinstance(eager, ValueError), f"{case_id}: eager raised {type(eager).__name__}: {eager}"
    assert name in str(eager), f"{case_id}: eager's message does not name {name}: {eager}"

    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in args.items() if k not in tensors}

    def step(**inputs):
        return call(function, {**inputs, **constants})

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = raised(lambda: torch.compile(step, backend=counter, fullgraph=True)(**tensors))
    assert compiled is not None, f"{case_id}: compiled call accepted {name}={value!r}"
    assert type(compiled) is type(eager), (
        f"{case_id}: compiled raised {type(compiled).__name__} ({str(compiled)[:300]}), eager {type(eager).__name__}"
    )
    assert name in str(compiled), f"{case_id}: compiled message does not name {name}: {compiled}"
    tensor_count = isinstance(value, torch.Tensor) and name in ("num_tokens", "num_sequences")
    if name not in DIFFERENT_MESSAGE and not tensor_count:
        assert str(compiled) == str(eager), f"{case_id}: compiled {compiled!s} vs eager {eager!s}"
    assert counter.frame_count == 1, f"{case_id}: the call was not traced as one graph ({counter.frame_count})"


def test_catalogue_covers_every_argument():
    """Each argument of the three functions has at least one case (checked against their signatures)."""
    import inspect

    covered = {(c[0], c[1]) for c in CASES}
    missing = []
    for function in ("fused_linear_logprobs", "grpo_loss", "fused_linear_grpo_loss"):
        for name in inspect.signature(getattr(gk, function)).parameters:
            if (function, name) not in covered:
                missing.append(f"{function}({name})")
    assert not missing, f"no bad-input case for: {missing}"
