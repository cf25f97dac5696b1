"""The layout of kernel A's stored logits in fp16 (HalfLogits, README.md §5 "Stored logits in fp16"), in one
place and without Triton: the kernels (triton_common.py), the host buffer (triton.py HalfLogits), the memory
and byte models (ops/fused) and csrc's epilogue spec (cutlass.py) all read it from here.

Each logit is stored as the fp16 difference d = z - m from an fp32 offset m kept once per STORED_GROUP
columns; d is clamped at HALF_DIFF_MIN, fp16's most negative finite value.
"""

from __future__ import annotations

STORED_GROUP = 64  # columns per fp32 offset
HALF_DIFF_MIN = -65504.0  # fp16's most negative finite value


def row_stride(vocab: int) -> int:
    """fp16 elements per row of the differences: V rounded up to 16 bytes (the TMA store's row stride)."""
    return -(-vocab // 8) * 8


def num_groups(vocab: int) -> int:
    """fp32 offsets per row."""
    return -(-vocab // STORED_GROUP)


def row_bytes(vocab: int, padded: bool = True) -> int:
    """Bytes of one token's stored logits: 2 per logit (the row padded to 16 bytes unless padded=False, what a
    budget in whole rows counts) + 4 per offset."""
    return 2 * (row_stride(vocab) if padded else vocab) + 4 * num_groups(vocab)
