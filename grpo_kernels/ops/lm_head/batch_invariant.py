"""Batch-invariant LM-head statistics: each token's log-prob and entropy bitwise independent of the batch.

A token's statistics are a reduction over the vocabulary of dot products over H. They stay bitwise the
same whatever else is in the batch (batch size, other sequences, padding, packing, the fused schedule's
chunking) when every reduction has one order per token, fixed in advance:

PyTorch backend  every token is computed alone (token_chunk = 1): the same [1, H] x [H, 8192] GEMM per
                 vocabulary chunk for every token, whatever its neighbours (CPU BLAS may block a
                 [n, H] GEMM differently for different n, and a row's place in the block can change its
                 summation), then the same online fold over the chunks in vocabulary order.
Triton backend   one tile configuration per device and dtype (not chosen by alignment, the same tile with
                 and without stored logits), and a fixed split of the vocabulary (SPLIT_TILES tiles per
                 split, not chosen from the SM count or N): each token's dot products run the same K loop
                 in the same tile, each split folds its tiles in order, and the merge adds the splits in
                 order. A tensor-core MMA computes each row of a tile independently of the other rows;
                 the interpreter's tl.dot (np.matmul, CPU BLAS) does not: a row's sum order depends on
                 its place in the tile, i.e. on the token's offset in the batch, so under the
                 interpreter kernel A forms the tile as per-element sums of products instead.

Gradients are deterministic (run to run) on both backends in this mode: no atomics, fixed chunking.
What cannot be batch-invariant: a loss aggregated over the batch (a token mean divides by the batch's
token count) and anything computed from it. The cost (README.md, "Batch-invariant mode"): on the PyTorch
backend one small GEMM per token instead of one per 1024 tokens; on the Triton backend the narrower
forward tile on Hopper and possibly fewer programs than SMs for small batches.
"""

from __future__ import annotations

import dataclasses

SPLIT_TILES = 32  # vocabulary tiles per split of the Triton forward in this mode (4096 columns at BN = 128)


def invariant_config(device, dtype):
    """The Triton tile configuration of the mode: the dispatcher's aligned one for the device and dtype,
    with the forward tile that can also store logits used for both forward variants (of either kernel A),
    and under the interpreter kernel A's tile product without np.matmul (row_independent_dot)."""
    from ..._backend import interpreter_enabled
    from .triton import pick_config

    base = pick_config(device, dtype, aligned=True)
    tile = base.forward_stored or base.forward
    tma_tile = base.forward_tma_stored or base.forward_tma  # the TMA kernel A likewise: one tile for both
    return dataclasses.replace(base, name=f"{base.name}-batch-invariant", forward=tile, forward_stored=None,
                               forward_tma=tma_tile, forward_tma_stored=None,
                               row_independent_dot=interpreter_enabled())  # fmt: skip


class BatchInvariant:
    """A backend module's lm_head_forward / lm_head_backward with fixed reduction orders (module docstring)."""

    def __init__(self, inner):
        self.inner = inner
        self.triton = inner.__name__.endswith(".triton")
        self.__name__ = f"{inner.__name__} (batch-invariant)"

    def _kwargs(self, hidden, kwargs, forward: bool):
        if not self.triton:
            return {**kwargs, "token_chunk": 1}
        kwargs = {**kwargs, "config": invariant_config(hidden.device, hidden.dtype)}
        if forward:
            kwargs["tiles_per_split"] = SPLIT_TILES
        return kwargs

    def lm_head_forward(self, hidden, weight, bias, targets, temperature, **kwargs):
        return self.inner.lm_head_forward(hidden, weight, bias, targets, temperature,
                                          **self._kwargs(hidden, kwargs, forward=True))  # fmt: skip

    def lm_head_backward(self, hidden, weight, bias, targets, temperature, *args, **kwargs):
        if not self.triton:  # deterministic as it is; per-token chunks would only cost time
            return self.inner.lm_head_backward(hidden, weight, bias, targets, temperature, *args, **kwargs)
        return self.inner.lm_head_backward(hidden, weight, bias, targets, temperature, *args,
                                           **self._kwargs(hidden, kwargs, forward=False))  # fmt: skip
