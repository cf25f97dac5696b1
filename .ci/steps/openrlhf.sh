#!/usr/bin/env bash
# CI step: the OpenRLHF adapter's tests (tests/test_integration_openrlhf.py, tests/test_openrlhf_suite.py) in an
# environment with OpenRLHF 0.11.2. OpenRLHF's own requirements cannot be installed on a CPU machine (flash-attn
# 2.8.3 builds only against CUDA) and pin transformers 5.15.0, deepspeed 0.19.6 and ray 2.55.0, which the
# [parity] extra's verl (transformers < 5.11) excludes. What the tests import of OpenRLHF (its models, loss and
# PPO actor modules) needs nothing beyond the [parity] environment (verl brings peft, ray, torchdata, pylatexenc;
# deepspeed 0.19.8 is there), so this step shares it: a virtual environment layered on .ci/venv (its
# site-packages on the path), with this checkout and `openrlhf==0.11.2 --no-deps` installed in the layer only
# (OpenRLHF's wheel also installs a top-level `tests` package, kept out of .ci/venv). flash_attn and vllm, which
# OpenRLHF imports at the top of two modules, are test-only stand-ins (tests/_openrlhf_support.py).
# .ci/run builds .ci/venv first; run alone, this script builds it the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
step_start=$(date +%s)

if [ ! -x .ci/venv/bin/python ]; then  # the README's test environment, as .ci/run builds it
  python3 -m venv .ci/venv
  .ci/venv/bin/python -m pip install -q --upgrade pip
  .ci/venv/bin/python -m pip install -q torch==2.13.0
  .ci/venv/bin/python -m pip install -q -e ".[test,parity]" "triton==3.6.0" "numpy<2.3"
fi

rm -rf .ci/venv-openrlhf
.ci/venv/bin/python -m venv .ci/venv-openrlhf
layer=.ci/venv-openrlhf/bin/python
base_site=$(.ci/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
layer_site=$($layer -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$layer_site/grpo_kernels_parity_environment.pth"
$layer -m pip install -q --no-deps -e .
$layer -m pip install -q --no-deps "openrlhf==0.11.2"
echo "OpenRLHF environment ready in $(( $(date +%s) - step_start )) s"

# a missing or broken OpenRLHF fails here instead of skipping (tests/_openrlhf_support.py)
GRPO_KERNELS_REQUIRE_OPENRLHF=1 GRPO_KERNELS_REQUIRE_VARIANT_PEERS=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 \
  $layer -m pytest -q -p no:cacheprovider tests/test_integration_openrlhf.py tests/test_openrlhf_suite.py \
  tests/test_variant_parity_openrlhf.py
echo "OpenRLHF step finished in $(( $(date +%s) - step_start )) s"
