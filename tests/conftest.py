import warnings

import pytest
import torch
from checkout import use_this_checkouts_integrations
from parity_helpers import PINS, installed_version

from grpo_kernels import BackendFallbackWarning

use_this_checkouts_integrations()  # see checkout.py


@pytest.fixture(autouse=True)
def _seed_and_quiet_fallback():
    # every test starts from the same RNG state; the CPU fallback notice is expected here
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        yield


def pytest_report_header(config):
    """torch / triton versions, and the peer versions the parity suite ran against (marker `parity`)."""
    import importlib.metadata as md

    base = [f"torch {torch.__version__}"]
    for dist in ("triton", "transformers"):
        try:
            base.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            base.append(f"{dist} not installed")
    peers = []
    for dist, pin in PINS.items():
        version = installed_version(dist)
        if version is None:
            peers.append(f"{dist}: not installed (pin {pin}, its parity tests skip)")
        elif version != pin:
            peers.append(f"{dist}=={version} (pin {pin}: its parity tests skip)")
        else:
            peers.append(f"{dist}=={version}")
    return ["grpo_kernels tests: " + ", ".join(base), "parity peers: " + ", ".join(peers)]
