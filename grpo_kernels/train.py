"""`python -m grpo_kernels.train [options]`: the same as `grpo-kernels train [options]`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
