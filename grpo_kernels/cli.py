"""The `grpo-kernels` command: `grpo-kernels <subcommand> ...` (also `python -m grpo_kernels`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and which backend each op uses here")
    sub.add_parser("train", add_help=False, help="GRPO-family training (grpo-kernels train --help)")
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks against every peer (same as python -m benchmarks; bench --help)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        try:  # the trainer imports its extra's packages only when training, so --help works without them
            from .trainer.cli import main as train_main
        except ModuleNotFoundError as exc:  # a module of the extra imported at the top of a trainer module
            print(f"grpo-kernels train: error: needs the `train` extra ({exc.name} not installed): "
                  'pip install -e ".[train]" (from a clone; or pip install "grpo-kernels[train]")',
                  file=sys.stderr)  # fmt: skip
            return 2
        return train_main(rest)
    if args.command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest, prog="grpo-kernels bench")
    if args.command == "info":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _info()
    return 2


def _info() -> int:
    import platform

    import torch

    import grpo_kernels

    from ._backend import triton_available

    ok, why = triton_available()
    print(
        f"grpo_kernels {grpo_kernels.__version__}, python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"triton: {'available' if ok else why}")
    print(f"cuda: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
