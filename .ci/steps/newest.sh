#!/usr/bin/env bash
# CI step: today's packages. torch, Triton and transformers as pip resolves them today, with none of this
# machine's caps (its pip config caps torch at the releases on its disk; PIP_CONSTRAINT=/dev/null lifts that
# for this environment only), then the kernel, loss, trainer and TRL-adapter tests: the quick tier on this
# stack and the AOT compile matrices with the newest Triton (this step replaces the triton-3.9 tier). PyPI's
# torch for Linux x86_64 is the CUDA build (several GB with its nvidia-* packages; the CPU-only index is not
# reachable from CI's machine), so the install dominates.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
python3 -m venv .ci/venv-newest
# shellcheck disable=SC1091
source .ci/venv-newest/bin/activate
export PIP_CONSTRAINT=/dev/null
python -m pip install -q --upgrade pip
python -m pip install -q torch triton transformers
python -m pip install -q -e ".[test,train,trl]"
python -c "import torch, triton, transformers, trl; print(f'newest stack: torch {torch.__version__}, triton \
{triton.__version__}, transformers {transformers.__version__}, trl {trl.__version__}')"
echo "newest-stack environment installed in $(( $(date +%s) - start )) s"
# the quick tier (every kernel under the interpreter, every schedule and loss configuration, the trainer, the
# TRL adapter against TRL's own code; verl's and Liger's parity tests skip: not installed here) and the two
# compile matrices in full (register allocation and shared memory move between Triton versions). The records'
# step-by-step rewards are of the versions the main environment pins: their prefix re-runs are left out here.
python -m pytest -q -p no:cacheprovider -m quick -k "not prefix_repeats"
python -m pytest -q -p no:cacheprovider tests/test_lm_head_compile.py tests/test_loss_head_compile.py
echo "newest-stack step finished in $(( $(date +%s) - start )) s"
