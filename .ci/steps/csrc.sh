#!/usr/bin/env bash
# CI step: csrc/ on CPU. Installs the CUDA 13.0 toolchain wheels (csrc/build.sh: ~115 MB downloaded), rebuilds the
# sm_90a library from the sources, fails if the committed csrc/bin/ is stale (its stamp differs from the fresh
# build's), then runs tests/test_csrc.py including the `compile` test that reads the fresh library's SASS with
# cuobjdump (WGMMA and TMA instructions). The compile dominates (csrc/README.md has the measured times).
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
# PYTHON: an interpreter with pip (the toolchain install) and the test environment (torch, pytest). Unset (the
# side chain of .ci/run), the step makes its own small environment: the CPU torch, the package without extras.
if [ -z "${PYTHON:-}" ]; then
  python3 -m venv .ci/venv-csrc
  .ci/venv-csrc/bin/python -m pip install -q --upgrade pip
  .ci/venv-csrc/bin/python -m pip install -q torch==2.13.0
  .ci/venv-csrc/bin/python -m pip install -q --no-deps -e .
  .ci/venv-csrc/bin/python -m pip install -q "triton==3.6.0" "numpy<2.3" pytest
  PYTHON="$PWD/.ci/venv-csrc/bin/python"
  echo "csrc environment installed in $(( $(date +%s) - start )) s"
fi
PYTHON="$PYTHON" bash csrc/build.sh --check
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_csrc.py
echo "csrc step finished in $(( $(date +%s) - start )) s"
