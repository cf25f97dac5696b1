#!/usr/bin/env bash
# CI step: the Unsloth adapter (integrations/unsloth.py) against Unsloth's own code, in an environment of its
# own: unsloth and unsloth_zoo 2026.10.9 pin trl<=1.15.0, which the parity environment's trl 1.16.0 cannot
# share. CPU torch 2.13.0 first; Unsloth and its zoo with --no-deps, because they require GPU packages
# (xformers, bitsandbytes, torchvision, diffusers, torchao, cut_cross_entropy) that this CPU step never loads;
# their remaining requirements explicitly, torch held at 2.13.0 by a constraint. Run by .ci/run; its wall time
# is printed at the end (tests/README.md, "The Unsloth adapter").
set -euo pipefail
cd "$(dirname "$0")/../.."
step_start=$(date +%s)

python3 -m venv .ci/venv-unsloth
# shellcheck disable=SC1091
source .ci/venv-unsloth/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
echo "torch==2.13.0" > .ci/unsloth-constraints.txt
python -m pip install -q --no-deps "unsloth==2026.10.9" "unsloth_zoo==2026.10.9"
python -m pip install -q -c .ci/unsloth-constraints.txt "trl==1.15.0" "transformers<=5.17.0" peft accelerate \
  "datasets<5,!=4.0.*,!=4.1.0,!=4.4.*,!=4.5.0" tyro psutil sentencepiece msgspec protobuf pillow \
  "triton==3.6.0" "numpy<2.3" pytest
python -m pip install -q --no-deps -e .
echo "Unsloth environment installed in $(( $(date +%s) - step_start )) s"

GRPO_KERNELS_REQUIRE_UNSLOTH=1 python -m pytest -q -p no:cacheprovider tests/test_integration_unsloth.py \
  tests/test_unsloth_suite.py
echo "Unsloth step finished in $(( $(date +%s) - step_start )) s"
