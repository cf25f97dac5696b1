#!/usr/bin/env bash
# The loss variants against the peers' own code (tests/test_variant_parity_{skyrl,openrlhf,areal}.py), in an
# environment of their own: torch, pytest, this checkout, and each peer with --no-deps plus the few small
# packages its loss module imports (SkyRL 0.4.0 declares Python >= 3.12: installed with
# --ignore-requires-python, imported through the tests' shim; ray and deepspeed, which the loss modules import
# for code the tests never call, are replaced by empty stand-ins there). A module that finds no peer fails here
# (GRPO_KERNELS_REQUIRE_VARIANT_PEERS=1) instead of skipping as it does in the main environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
python3 -m venv .ci/venv-variant-peers
# shellcheck disable=SC1091
source .ci/venv-variant-peers/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0 "numpy<2.3" pytest
python -m pip install -q --no-deps -e .
python -m pip install -q --no-deps areal==1.0.4 openrlhf==0.11.2
python -m pip install -q --no-deps --ignore-requires-python skyrl==0.4.0 skyrl-gym==0.4.0
python -m pip install -q --no-deps jaxtyping==0.3.11 wadler_lindig==0.1.8 loguru==0.7.3 cloudpathlib==0.26.0 \
  omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 PyYAML==6.0.4 pandas==3.1.1 python-dateutil==4.0.0 six==1.17.0 \
  pytz==2026.6 tzdata==2026.6 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
  typing_extensions==4.16.0 cloudpickle==3.1.3 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
echo "variant-peer environment installed in $(( $(date +%s) - start )) s"
GRPO_KERNELS_REQUIRE_VARIANT_PEERS=1 python -m pytest -q -p no:cacheprovider tests/test_variant_parity_skyrl.py \
  tests/test_variant_parity_openrlhf.py tests/test_variant_parity_areal.py
deactivate
echo "variant-peer step finished in $(( $(date +%s) - start )) s"
