#!/usr/bin/env bash
# CI step: today's packages. torch, Triton and transformers as pip resolves them today, with none of this
# machine's caps (its pip config caps torch at the releases on its disk; PIP_CONSTRAINT=/dev/null lifts that
# for this environment only), then the kernel, loss, trainer and TRL-adapter tests: the Triton kernels under
# the interpreter and compiled ahead of time with the newest Triton, the PyTorch backend, the trainer and the
# TRL adapter against TRL's own code. PyPI's torch for Linux x86_64 is the CUDA build (several GB with its
# nvidia-* packages; the CPU-only index is not reachable from CI's machine), so the install dominates.
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
python -m pytest -q -p no:cacheprovider \
  tests/test_lm_head.py tests/test_loss_head.py tests/test_loss_off_policy.py tests/test_fused.py \
  tests/test_lm_head_triton_host.py tests/test_lm_head_triton_interpreter.py tests/test_loss_head_triton_interpreter.py \
  tests/test_fused_triton_interpreter.py tests/test_fused_schedules_interpreter.py tests/test_dz_in_gemm_interpreter.py \
  tests/test_lm_head_compile.py tests/test_loss_head_compile.py \
  tests/test_trainer.py tests/test_trainer_methods.py tests/test_batched_sampling.py \
  tests/test_integration_trl.py tests/test_parity_trl.py
echo "newest-stack step finished in $(( $(date +%s) - start )) s"
