#!/usr/bin/env bash
# Two commands on a GPU machine, the whole verdict in 20 minutes of device time. Call 1: preflight, a smoke
# check of every kernel and schedule, per-kernel microbenchmarks, the headline against the core peers,
# the token sweep, the GPU test tier, the opt-in kernels last. Call 2: the opt-in paths, the other peers,
# a profile. Every provider in its own process, every row written the moment it is measured: a crash or
# a time-out costs one row (named in session.json). No network needed.
#
#   bash benchmarks/gpu/run.sh [--out DIR]              # call 1 on the GPU machine ($OUT is the default folder)
#   bash benchmarks/gpu/run.sh --call 2 [--out DIR]     # call 2
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
