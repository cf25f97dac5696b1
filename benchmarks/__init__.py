"""The benchmark suite: `python -m benchmarks` (CLI) and `python -m pytest benchmarks/` (pytest-benchmark)."""
