"""LM-head statistics from hidden states: kernels A (forward) and C (backward) of docs/design.md §1."""

from .reference import LMHeadStats, lm_head_stats_reference


def get_impl(backend: str):
    """The module implementing lm_head_forward / lm_head_backward for a resolved backend."""
    if backend == "torch":
        from . import chunked

        return chunked
    if backend == "triton":
        from . import cutlass

        if cutlass.enabled():  # GRPO_KERNELS_CSRC=1: csrc/'s kernel A where it applies, Triton's elsewhere
            return cutlass
        from . import triton as triton_impl

        return triton_impl
    raise ValueError(f"unknown resolved backend {backend!r}")


__all__ = ["LMHeadStats", "lm_head_stats_reference", "get_impl"]
