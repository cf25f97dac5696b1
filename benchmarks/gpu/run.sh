#!/usr/bin/env bash
# Two commands on a GPU machine, within the 15-minute lease (120 s start + 2 x (340 s + 30 s) = 860 s). Call 1:
# wheels, preflight, the GPU test tier, the headline verdict (the floor and every peer timed in turns in one
# process). Call 2 (--resume): the sweep against TRL, the gap trace, csrc/'s kernel A, the training step; later
# leases: smoke, microbenchmarks, the other schedules, the opt-in paths, a profile. Every gate and timed call
# announced, every row written the moment it is measured: a crash or a time-out costs one row (named in
# session.json). No network needed.
#
#   bash benchmarks/gpu/run.sh [--out DIR]              # call 1 on the GPU machine ($OUT is the default folder)
#   bash benchmarks/gpu/run.sh --resume DIR [--out D]  # call 2: DIR, call 1's folder copied back into the tree
#   bash benchmarks/gpu/run.sh --dry-run                # the plan of both calls, budgets and files; runs nothing
#   bash benchmarks/gpu/run.sh --rehearsal --out /tmp/s # the same flow on tiny CPU shapes (CI)
#   bash benchmarks/gpu/run.sh make-wheels              # here, before: the peers' cp312 wheels into .whl/
#
# Details (parts, files, targets): grpo_kernels/bench/gpu_session.py and benchmarks/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m grpo_kernels.bench.gpu_session "$@"
