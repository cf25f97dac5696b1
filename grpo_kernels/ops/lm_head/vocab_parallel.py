"""Vocabulary-parallel LM head: each rank of a process group holds a contiguous block of the weight's rows.

Rank r holds rows [start_r, start_r + V_r) of the full [V, H] head (blocks in group order, sizes may
differ); hidden states and target ids (global) are the same on every rank. `VocabParallel` wraps a
backend module (chunked.py or triton.py: lm_head_forward / lm_head_backward) so every caller (the
autograd Function, both fused schedules) runs unchanged on the local block, with O(tokens)
communication:

forward   each rank: local statistics of its block (lse_r, E_r[z], the target logit where it owns
          the target); then all-reduce MAX of lse_r -> M, and one all-reduce SUM of
          [exp(lse_r - M), exp(lse_r - M) E_r[z], z_y owned] -> S, sum, z_y:
              lse = M + log S,  E_p[z] = sum_r exp(lse_r - lse) E_r[z],  logp = z_y - lse,  H = lse - E_p[z]
          identical on every rank (README.md, "Vocabulary-parallel").
backward  dz_j = g_lp (1[j = y] - p_j) + g_H p_j (E_p[z] - z_j) with the GLOBAL lse and E_p[z]: each
          rank forms its own columns (the one-hot term only where it owns y: a target id outside the
          block never matches a local column), grad_weight / grad_bias are the local block's, and
          grad_hidden = sum_r dz_r W_r is all-reduced (SUM, in fp32) inside.

Every rank must make the same sequence of calls (collectives): the fused schedules plan their chunks
from `planning_vocab` (the largest block), not the local one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import LMHeadStats

NOT_HERE = -1  # local target id of a token whose target another rank holds: matches no column


class VocabParallel:
    """A backend module's lm_head_forward / lm_head_backward on this rank's block of the vocabulary."""

    def __init__(self, inner, group, vocab_sizes: list[int], rank: int):
        self.inner = inner
        self.group = group
        self.vocab_sizes = list(vocab_sizes)
        self.rank = rank
        self.vocab_start = sum(vocab_sizes[:rank])
        self.local_vocab = vocab_sizes[rank]
        self.vocab_total = sum(vocab_sizes)
        self.planning_vocab = max(vocab_sizes)  # chunk plans must agree on every rank
        self.__name__ = f"{inner.__name__} (vocab-parallel, rank {rank} of {len(vocab_sizes)})"

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global ids -> ids in this block, NOT_HERE where another rank holds the target."""
        local = targets - self.vocab_start
        return torch.where((local >= 0) & (local < self.local_vocab), local, torch.full_like(local, NOT_HERE))

    @torch.no_grad()
    def lm_head_forward(self, hidden, weight, bias, targets, temperature, **kwargs) -> LMHeadStats:
        local = self.local_targets(targets)
        if self.local_vocab == 0:  # an empty block: no mass (lse_r = -inf), owns no target; joins the collectives
            zeros = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            stats = LMHeadStats(zeros, zeros, torch.full_like(zeros, float("-inf")), zeros)
        else:
            stats = self.inner.lm_head_forward(hidden, weight, bias, local, temperature, **kwargs)
        owned = local != NOT_HERE
        # z_y where this rank holds y; 0 elsewhere (where: the backend's value there may be NaN)
        target_logit = torch.where(owned, stats.logprobs + stats.lse, torch.zeros_like(stats.lse))
        global_max = stats.lse.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=self.group)
        weight_r = torch.exp(stats.lse - global_max)  # in [0, 1]: exp(lse_r - M)
        # a block with no probability mass (no rows, or every logit -inf) has lse_r = -inf and E_r[z]
        # undefined (NaN): it adds exactly nothing, not 0 x NaN
        weighted_logit = torch.where(weight_r > 0, weight_r * stats.expected_logit, torch.zeros_like(weight_r))
        sums = torch.stack([weight_r, weighted_logit, target_logit])  # [3, N]
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        lse = global_max + torch.log(sums[0])
        expected_logit = sums[1] / sums[0]
        return LMHeadStats(sums[2] - lse, lse - expected_logit, lse, expected_logit)

    @torch.no_grad()
    def lm_head_backward(self, hidden, weight, bias, targets, temperature, lse, expected_logit, grad_logprobs,
                         grad_entropy, need_grad_hidden=True, need_grad_weight=True, need_grad_bias=True,
                         grad_weight_acc=None, grad_bias_acc=None, *, grad_hidden_acc=None, **kwargs):  # fmt: skip
        partial = None
        if need_grad_hidden:  # this block's share of grad_hidden, in fp32 so the sum is rounded once
            partial = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        if self.local_vocab == 0:  # an empty block: empty gradients, no share of grad_hidden
            if need_grad_weight and grad_weight_acc is None:
                grad_weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_grad_bias and grad_bias_acc is None:
                grad_bias_acc = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        else:
            _, grad_weight_acc, grad_bias_acc = self.inner.lm_head_backward(
                hidden, weight, bias, self.local_targets(targets), temperature, lse, expected_logit, grad_logprobs,
                grad_entropy, need_grad_hidden, need_grad_weight, need_grad_bias, grad_weight_acc, grad_bias_acc,
                grad_hidden_acc=partial, **kwargs,
            )  # fmt: skip
        grad_hidden = None
        if need_grad_hidden:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
            if grad_hidden_acc is not None:
                grad_hidden_acc += partial
                grad_hidden = grad_hidden_acc
            else:
                grad_hidden = partial.to(hidden.dtype)
        return grad_hidden, grad_weight_acc, grad_bias_acc
