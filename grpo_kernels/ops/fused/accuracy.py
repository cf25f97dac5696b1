"""How many chunks the in-place schedules may round grad_weight over and stay as accurate as PyTorch.

The in-place schedules ("one_pass_inplace", "one_pass_cublas_inplace", "one_pass_dz_inplace") keep grad_weight
in the weight's dtype and round it once per chunk; their error against float64 grows with the chunk count K. What
benchmarks/grad_weight_error.py measured (docs/records/grad_weight_error.json, bf16, H = 4096,
V = 151936, N = 16k and 64k; the op README's table): the excess over fp32 accumulation,
e_inplace(K)^2 - e_fp32^2, grows no faster than linearly in K. The bound below is the largest K for
which that excess, extrapolated linearly from the measurement with the largest excess per chunk,
keeps e_inplace at or below the error of plain PyTorch bf16 autograd of the same head (bf16 logits, one
GEMM rounded once) in the least favourable measured run:

    K_max = floor((min e_pytorch^2 - max e_fp32^2) / max_K ((e_inplace(K)^2 - e_fp32^2) / K))

tests/test_readme_records.py recomputes it from the record. bf16 only: fp16's 5 exponent bits would
flush a small gradient's increments to zero (grad_weight entries of ~1e-8 are common), so "auto" never
accumulates an fp16 gradient in place (the schedule stays available by name); fp32 weights accumulate
in fp32 whatever the schedule.
"""

from __future__ import annotations

import torch

MAX_INPLACE_CHUNKS_BF16 = 74  # from docs/records/grad_weight_error.json (max_chunks_from_record; tested)


def max_inplace_chunks(dtype: torch.dtype) -> int:
    """The most chunks an in-place schedule may round a `dtype` grad_weight over in "auto" (0: never)."""
    return MAX_INPLACE_CHUNKS_BF16 if dtype == torch.bfloat16 else 0


def max_chunks_from_record(record: dict) -> int:
    """K_max of the docstring from a grad_weight_error record."""
    pytorch = min(r["rel_l2"]["PyTorch bf16"] for r in record["runs"])
    per_chunk, fp32 = 0.0, 0.0
    for r in record["runs"]:
        for chunk, count in r["chunks"].items():
            e_fp32 = r["rel_l2"][f"fp32 acc, {chunk}-token chunks"]
            e_in = r["rel_l2"][f"bf16 in place, {chunk}-token chunks"]
            fp32 = max(fp32, e_fp32)
            per_chunk = max(per_chunk, (e_in**2 - e_fp32**2) / count)
    return int((pytorch**2 - fp32**2) / per_chunk) if per_chunk > 0 else 0
