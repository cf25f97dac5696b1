import warnings

import pytest
import torch

from grpo_kernels import BackendFallbackWarning


@pytest.fixture(autouse=True)
def _seed_and_quiet_fallback():
    # every test starts from the same RNG state; the CPU fallback notice is expected here
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        yield


def pytest_report_header(config):
    import importlib.metadata as md

    lines = [f"torch {torch.__version__}"]
    for dist in ("triton", "trl", "verl", "liger-kernel", "transformers"):
        try:
            lines.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            lines.append(f"{dist} not installed")
    return "grpo_kernels test environment: " + ", ".join(lines)
