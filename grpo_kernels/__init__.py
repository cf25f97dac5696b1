"""grpo_kernels: fused LM-head + GRPO-family policy-loss kernels with exact parity to TRL and verl."""

__version__ = "0.1.0.dev0"

from . import advantages
