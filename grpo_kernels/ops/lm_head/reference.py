"""Plain fp32 PyTorch oracle for the LM-head statistics (kernel A of docs/design.md §1).

It materialises the full [N, V] logits, so it is for small shapes only: tests compare every other
implementation (the chunked PyTorch backend, the Triton kernels) against it, and its gradients come
from autograd. Derivations are in README.md beside this file.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LMHeadStats(NamedTuple):
    """Per-token statistics of softmax(z), z = (hidden @ weight.T + bias) / temperature. All fp32, [N]."""

    logprobs: torch.Tensor  # log p(target) = z_y - lse
    entropy: torch.Tensor  # H = lse - E_p[z]
    lse: torch.Tensor  # logsumexp_j z_j
    expected_logit: torch.Tensor  # E_p[z] = sum_j p_j z_j


def lm_head_stats_reference(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] int, in [0, V)
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> LMHeadStats:
    logits = hidden.float() @ weight.float().T  # [N, V]
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * logit_scale
    if softcap is not None:  # Gemma 2 / 3: the model's logits capped before the sampling temperature
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse[:, None]
    p = log_p.exp()
    expected_logit = (p * z).sum(-1)
    entropy = -(p * log_p).sum(-1)
    logprobs = log_p.gather(-1, targets.long()[:, None]).squeeze(-1)
    return LMHeadStats(logprobs, entropy, lse, expected_logit)


def lm_head_logits_grad_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_logprobs: torch.Tensor | None,  # [N]
    grad_entropy: torch.Tensor | None,  # [N]
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """dL/d(hidden @ W.T + b), the [N, V] tensor kernel C streams through (closed form, README.md):

    dz_j = g_lp (1[j=y] - p_j) + g_H p_j (E_p[z] - z_j),   dL/dlogit_j = dz_j / temperature.
    """
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    z = logits / temperature
    p = torch.softmax(z, dim=-1)
    dz = torch.zeros_like(z)
    if grad_logprobs is not None:
        onehot = torch.nn.functional.one_hot(targets.long(), z.shape[-1]).float()
        dz += grad_logprobs.float()[:, None] * (onehot - p)
    if grad_entropy is not None:
        expected_logit = (p * z).sum(-1, keepdim=True)
        dz += grad_entropy.float()[:, None] * p * (expected_logit - z)
    return dz / temperature
