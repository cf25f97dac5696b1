"""grpo_kernels: fused LM-head + GRPO-family policy-loss kernels with exact parity to TRL and verl.

    import grpo_kernels as gk
    cfg = gk.PolicyLossConfig.dapo()
    out = gk.fused_linear_grpo_loss(hidden, lm_head.weight, completion_ids, advantages, mask, config=cfg)
    out.loss.backward(); out.metrics["clip_ratio/region_mean"]
"""

from . import advantages
from ._backend import BackendFallbackWarning
from .config import PolicyLossConfig
from .functional import (
    DistributedNormalizerWarning,
    GRPOLossOutput,
    LogProbsOutput,
    fused_linear_grpo_loss,
    fused_linear_logprobs,
    grpo_loss,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "BackendFallbackWarning",
    "DistributedNormalizerWarning",
    "GRPOLossOutput",
    "LogProbsOutput",
    "PolicyLossConfig",
    "fused_linear_grpo_loss",
    "fused_linear_logprobs",
    "grpo_loss",
    "advantages",
    "__version__",
]
