"""`python -m benchmarks ...`: the benchmark CLI (grpo_kernels/bench/cli.py)."""

import sys

from grpo_kernels.bench.cli import main

sys.exit(main())
