#!/usr/bin/env bash
# CI step: csrc/ on CPU. Installs the CUDA 13.0 toolchain wheels (csrc/build.sh: ~115 MB downloaded), rebuilds the
# sm_90a library from the sources, fails if the committed csrc/bin/ is stale (its stamp differs from the fresh
# build's), then runs tests/test_csrc.py including the `compile` test that reads the fresh library's SASS with
# cuobjdump (WGMMA and TMA instructions). The compile dominates (csrc/README.md has the measured times).
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
# PYTHON: an interpreter with pip (the toolchain install) and the test environment (torch, pytest): the main
# chain's .ci/venv when it is active
PYTHON="${PYTHON:-python3}" bash csrc/build.sh --check
"${PYTHON:-python3}" -m pytest -q -p no:cacheprovider tests/test_csrc.py
echo "csrc step finished in $(( $(date +%s) - start )) s"
