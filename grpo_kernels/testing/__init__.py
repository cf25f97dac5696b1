"""Test helpers shipped with the package.

compare: comparisons that report the worst element (shared by the test suite and the benchmarks'
correctness gate). aot / lm_head_compile: AOT compilation of Triton launches for GPU targets on a
machine without a GPU (tier 3); imported on demand, they need triton.
"""

from .compare import assert_close, assert_no_worse_than, worst_element

__all__ = ["assert_close", "assert_no_worse_than", "worst_element"]
