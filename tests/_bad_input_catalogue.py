"""The bad-input catalogue of the three public functions: every argument, each way it can be wrong (wrong
Python type, wrong tensor type / shape / dtype, value out of range, non-finite values, combinations a
config refuses). Used by tests/test_compile_bad_inputs.py, which runs each case eager and under
torch.compile. Each case: (function, changes to a valid call, the argument the error must name,
whether the compiled message must equal eager's word for word)."""

from __future__ import annotations

import numpy as np
import torch

from grpo_kernels import PolicyLossConfig as C

B, T, H, V = 2, 5, 8, 31
NAN, INF = float("nan"), float("inf")


def valid_call(function: str) -> dict:
    """A valid call's arguments (seeded): hidden [B, T, H], weight [V, H], targets / mask [B, T]."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.randn(B, generator=g)
    logprobs = -torch.rand(B, T, generator=g) * 3
    if function == "fused_linear_logprobs":
        return dict(hidden=hidden, weight=weight, targets=targets, bias=torch.randn(V, generator=g) * 0.1,
                    mask=mask, backend="torch")  # fmt: skip
    if function == "grpo_loss":
        return dict(logprobs=logprobs, advantages=advantages, mask=mask, old_logprobs=logprobs - 0.01,
                    config=C.dapo(), backend="torch")  # fmt: skip
    return dict(hidden=hidden, weight=weight, targets=targets, advantages=advantages, mask=mask,
                old_logprobs=logprobs - 0.01, config=C.dapo(), backend="torch")  # fmt: skip


def _with_value(name, index, value, _unused):
    def make(args):
        x = args[name].clone()
        x.view(-1)[index] = value
        return x

    return make


LOGPROBS, LOSS, FUSED = "fused_linear_logprobs", "grpo_loss", "fused_linear_grpo_loss"
# changes: name -> value, or name -> callable(valid args) -> value
SCALARS = {  # shared by the functions that take them
    "temperature": ["1.0", True, torch.tensor(1.0), 0.0, -1.0, INF, NAN],
    "softcap": ["30", True, torch.tensor(30.0), 0.0, -3.0, INF, NAN, 1e35],  # 1e35: above the logit limit
    "logit_scale": [None, "2", False, 0.0, -1.0, INF, NAN, 1e35],
    "ignore_index": [-100.0, True, "x", None],
    "compute_entropy": [1, "yes", None],
    "check_finite": [None, 0, "no"],
    "batch_invariant": [1, None],
    "backend": ["cuda", None, 3],
    "schedule": ["fast", None],
    "max_extra_memory": ["1GiB", 1.5, -1, True],  # bytes: an int >= 0 (or None)
    "num_tokens": ["8", True, 0, -1.5, INF, NAN, torch.tensor(INF), torch.ones(2)],
    "num_sequences": ["2", 0, -1, INF, NAN, 1],
    "dp_size": [1.5, 0, True, "2", INF, NAN, None],
    "grad_accum_steps": [0, 2.5, NAN, INF, None, False],
    "config": [{"loss_type": "dapo"}, "dapo", 3],
}
TAKES = {
    LOGPROBS: ("temperature", "softcap", "logit_scale", "ignore_index", "compute_entropy", "check_finite",
               "batch_invariant", "backend"),
    LOSS: ("check_finite", "backend", "num_tokens", "num_sequences", "dp_size", "grad_accum_steps", "config"),
    FUSED: ("softcap", "logit_scale", "check_finite", "batch_invariant", "backend", "schedule", "max_extra_memory",
            "num_tokens", "num_sequences", "dp_size", "grad_accum_steps", "config"),
}  # fmt: skip

TENSORS = {  # bad tensor arguments: (function(s), name, value or maker)
    "hidden": [[[1.0] * H] * 3, torch.randn(B, T, H + 1), torch.ones(B, T, H, dtype=torch.int32),
               lambda a: _with_value("hidden", 3, INF, None)(a), torch.randn(B, T, H).numpy()],
    "weight": [np.ones((V, H), dtype=np.float32), torch.randn(V * H), torch.randn(V, H, dtype=torch.float64),
               lambda a: _with_value("weight", 7, NAN, None)(a)],
    "targets": [torch.randn(B, T), torch.full((B, T), V), torch.zeros(B, T + 1, dtype=torch.long), [[0] * T] * B],
    "bias": [[0.0] * V, torch.randn(V - 1), torch.zeros(V).index_fill_(0, torch.tensor([4]), NAN),
             torch.zeros(V).index_fill_(0, torch.tensor([4]), INF), torch.randn(V, dtype=torch.float64)],
    "mask": [[[1] * T] * B, np.ones((B, T), dtype=bool), torch.ones(B, T + 1, dtype=torch.bool),
             torch.full((B, T), 2), torch.ones(B, T, dtype=torch.complex64)],
    "logprobs": [[[0.0] * T] * B, torch.zeros(B, T, dtype=torch.long),
                 lambda a: _with_value("logprobs", 0, NAN, None)(a), torch.zeros(B * T)],
    "advantages": [[1.0, 2.0], torch.randn(B + 1), lambda a: _with_value("advantages", 1, INF, None)(a),
                   torch.ones(B, dtype=torch.long)],
    "old_logprobs": [[[0.0] * T] * B, torch.zeros(B, T + 1), lambda a: _with_value("old_logprobs", 0, NAN, None)(a)],
    "ref_logprobs": [torch.zeros(B, T + 1), "ref"],
    "rollout_logprobs": [torch.zeros(B, T)],  # given but nothing uses it (no is_level / off-policy mask)
    "is_weights": [torch.ones(B, T + 2), [1.0]],
    "token_weights": [torch.ones(B + 1, T), lambda a: _with_value("old_logprobs", 0, NAN, None)(a)],
    "cu_seqlens": [[0, 5, 10], torch.tensor([0, 5, 10])],  # with the padded layout: refused
    "entropy": [[[0.5] * T] * B, torch.ones(B, T + 1)],
}  # fmt: skip
TENSOR_TAKERS = {
    LOGPROBS: ("hidden", "weight", "targets", "bias", "mask"),
    LOSS: ("logprobs", "advantages", "mask", "old_logprobs", "ref_logprobs", "rollout_logprobs", "is_weights",
           "token_weights", "cu_seqlens", "entropy"),
    FUSED: ("hidden", "weight", "targets", "bias", "advantages", "mask", "old_logprobs", "ref_logprobs",
            "rollout_logprobs", "is_weights", "token_weights", "cu_seqlens"),
}  # fmt: skip
# where the compiled message may differ from eager's (both name the argument): what compile cannot take
DIFFERENT_MESSAGE = {"tp_group", "entropy_group"}


def cases() -> list[tuple[str, str, object, str]]:
    """(function, argument, bad value or maker, id) for every entry above, and the process groups."""
    out = []
    for function in (LOGPROBS, LOSS, FUSED):
        for name in TAKES[function]:
            for i, value in enumerate(SCALARS[name]):
                out.append((function, name, value, f"{function}-{name}-{i}"))
        for name in TENSOR_TAKERS[function]:
            for i, value in enumerate(TENSORS[name]):
                out.append((function, name, value, f"{function}-{name}-{i}"))
    out.append((LOGPROBS, "tp_group", object(), f"{LOGPROBS}-tp_group"))
    out.append((FUSED, "tp_group", object(), f"{FUSED}-tp_group"))
    out.append((LOSS, "entropy_group", "world", f"{LOSS}-entropy_group"))
    out.append((FUSED, "entropy_group", "world", f"{FUSED}-entropy_group"))
    return out


def bad_call(function: str, name: str, value) -> dict:
    args = valid_call(function)
    args[name] = value(args) if callable(value) else value
    return args
