#!/usr/bin/env bash
# CI step: the SkyRL 0.4.0 and torchtitan 0.3.0 adapters, in one environment of their own (their pins do
# not clash with each other; SkyRL's transformers <= 5.16.1 and the [parity] extra's < 5.11 would share
# 5.10.x, but SkyRL's tokenizers >= 0.23.1 and transformers 5.10's <= 0.23.0 would not, and SkyRL needs its
# own ray pin). SkyRL declares Python >= 3.12 and CI runs 3.11: it is installed with
# --ignore-requires-python and --no-deps, then its imports one by one, as tests/trainer_support.py says;
# the tests shim the two imports that fail on 3.11 (never the adapter). Runs:
#   tests/test_integration_skyrl.py       every gk_<type> against SkyRL's own losses, refusals, pickling
#   tests/test_integration_skyrl_step.py  the FSDP head and SkyRL's PolicyWorkerBase micro-step, every mode
#   tests/test_skyrl_suite.py             the harness that runs SkyRL's own loss tests swapped
#   tests/test_integration_torchtitan.py  GRPOKernelsLoss against DAPOLoss / ChunkedLossWrapper, two steps
#   tests/test_variant_parity_{skyrl,areal}.py  the loss variants against SkyRL's and AReaL's own code
# Called by .ci/run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
step_start=$(date +%s)
python3 -m venv .ci/venv-trainers
# shellcheck disable=SC1091
source .ci/venv-trainers/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps -e .
python -m pip install -q "triton==3.6.0" "numpy<2.3" pytest "transformers>=5.6.1,<=5.10.4" safetensors \
  "ray==2.57.0" omegaconf jaxtyping loguru cloudpathlib pandas "peft==0.18.1" "datasets>=4.0.0" cloudpickle
python -m pip install -q --no-deps --ignore-requires-python "skyrl==0.4.0"
python -m pip install -q --no-deps skyrl-gym "torchtitan==0.3.0" "spmd_types==0.2.3" tyro docstring_parser
python -m pip install -q --no-deps "areal==1.0.4"  # the loss variants' AReaL oracle (its loss module needs torch only)
echo "trainers environment installed in $(( $(date +%s) - step_start )) s"
GRPO_KERNELS_REQUIRE_TRAINERS=1 GRPO_KERNELS_REQUIRE_VARIANT_PEERS=1 python -m pytest -q -p no:cacheprovider \
  tests/test_integration_skyrl.py tests/test_integration_skyrl_step.py tests/test_skyrl_suite.py \
  tests/test_integration_torchtitan.py tests/test_variant_parity_skyrl.py tests/test_variant_parity_areal.py
deactivate
echo "trainers step finished in $(( $(date +%s) - step_start )) s"
