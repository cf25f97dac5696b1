#!/usr/bin/env bash
# One command on a GPU machine, the whole verdict: the GPU test tier, the headline benchmark against
# every peer that can run, and the token sweep, each part under its own time limit, every result file
# written as soon as its part ends (a time-out keeps what was done). No network needed.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--budget SECONDS]   # on the GPU machine ($OUT is the default folder)
#   bash benchmarks/gpu/run.sh --dry-run                          # the plan and the file list, runs nothing
#   bash benchmarks/gpu/run.sh --rehearsal --out /tmp/s           # the same flow on tiny CPU shapes (CI)
#   bash benchmarks/gpu/run.sh make-wheels                        # here, before: the peers' cp312 wheels into .whl/
#
# Details (parts, files, targets): grpo_kernels/bench/gpu_session.py and benchmarks/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m grpo_kernels.bench.gpu_session "$@"
