"""LM-head statistics and their backward in plain PyTorch, tile by tile (the `backend="torch"` path).

Never allocates an [N, V] tensor: logits exist one [token_chunk, vocab_chunk] tile at a time, the
softmax statistics are folded online in fp32, and the backward recomputes each tile. This is the
reference the Triton kernels are checked against at real sizes, and the backend used on CPU.

Both functions share their signatures with the Triton launchers in triton.py, so the autograd
Function (function.py) and the fused loss (ops/fused) can call either.
"""

from __future__ import annotations

import torch

from .reference import LMHeadStats

# Tile sizes: a [1024, 8192] fp32 tile is 32 MiB, small enough for any CPU or GPU, large enough that
# the per-tile Python overhead is negligible next to the matmul.
DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 8192
# the logit of a forbidden token (a -inf bias): exp of it minus any lse is exactly 0; the Triton kernels' value
# (triton.py: 2^101 below every logit the functional layer lets through, |z| <= 2^100)
NEG_BIG = -(2.0**102)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result accumulated in fp32, whatever the input dtype.

    On CUDA the half-precision GEMM writes fp32 directly (out_dtype); elsewhere the operands are upcast.
    """
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return a.float() @ b.float()


def _logits_tile(hidden_rows, weight_cols, bias_cols, inv_temperature, softcap=None):
    # [n, H] @ [H, v] -> [n, v] fp32, then + bias, then / T (or, soft-capped, cap_out tanh(cap_in x)) in fp32
    tile = matmul_fp32(hidden_rows, weight_cols.T)
    if bias_cols is not None:
        tile += bias_cols.float()
    if softcap is None:
        tile *= inv_temperature
    else:
        cap_in, cap_out = softcap
        tile = torch.tanh(tile * cap_in) * cap_out
    # a -inf bias forbids its token: NEG_BIG instead keeps p = exp(z - lse) = 0 exactly while p * z and
    # p * (E_p[z] - z) stay 0 (with -inf they would be 0 * inf = NaN)
    return tile.clamp_(min=NEG_BIG)


@torch.no_grad()
def lm_head_forward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] int64 in [0, V)
    temperature: float,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    softcap: tuple[float, float] | None = None,
) -> LMHeadStats:
    """Per-token logprob, entropy, lse and E_p[z] of z = (hidden @ weight.T + bias) / temperature.

    Online fold per row over vocabulary tiles, relative to the running max m:
      s = sum_j exp(z_j - m),  u = sum_j exp(z_j - m) (z_j - m)
    so that lse = m + log s, E_p[z] = m + u / s and H = log s - u / s (no cancellation of large
    numbers: every term is relative to the max).
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / float(temperature)
    logprobs = torch.empty(n_tokens, dtype=torch.float32, device=device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    expected_logit = torch.empty_like(logprobs)
    for r0 in range(0, n_tokens, token_chunk):
        rows = slice(r0, min(r0 + token_chunk, n_tokens))
        h = hidden[rows]
        y = targets[rows]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        s = torch.zeros(n, dtype=torch.float32, device=device)
        u = torch.zeros_like(s)
        z_target = torch.zeros_like(s)
        for c0 in range(0, vocab, vocab_chunk):
            c1 = min(c0 + vocab_chunk, vocab)
            z = _logits_tile(h, weight[c0:c1], None if bias is None else bias[c0:c1], inv_t, softcap)
            m_new = torch.maximum(m, z.max(dim=-1).values)
            alpha = torch.exp(m - m_new)  # 0 on the first tile (m = -inf)
            # rescale (s, u) from max m to m_new: (z - m_new) = (z - m) + (m - m_new)
            u = alpha * (u + torch.nan_to_num(m - m_new, neginf=0.0) * s)
            s = alpha * s
            e = torch.exp(z - m_new[:, None])
            s += e.sum(-1)
            u += (e * (z - m_new[:, None])).sum(-1)
            m = m_new
            in_tile = (y >= c0) & (y < c1)
            if in_tile.any():
                idx = in_tile.nonzero().squeeze(-1)
                z_target[idx] = z[idx, y[idx] - c0]
        log_s = torch.log(s)
        lse[rows] = m + log_s
        # z_target - lse; a row of forbidden tokens only (every logit at NEG_BIG = -2^102, where m + log_s
        # rounds to m) relative to the max first, which keeps log_s: -log V there, as the Triton kernels give.
        # Every other row keeps z - lse's rounding (the peers' parity tests compare to a few ulp)
        logprobs[rows] = torch.where(m <= NEG_BIG, (z_target - m) - log_s, z_target - lse[rows])
        expected_logit[rows] = m + u / s
        entropy[rows] = log_s - u / s
    return LMHeadStats(logprobs, entropy, lse, expected_logit)


@torch.no_grad()
def lm_head_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N]
    temperature: float,
    lse: torch.Tensor,  # [N] fp32, from the forward
    expected_logit: torch.Tensor,  # [N] fp32, from the forward
    grad_logprobs: torch.Tensor | None,  # [N] fp32, dL/dlogprob
    grad_entropy: torch.Tensor | None,  # [N] fp32, dL/dentropy
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
    grad_weight_acc: torch.Tensor | None = None,  # [V, H] fp32, accumulated into when given
    grad_bias_acc: torch.Tensor | None = None,  # [V] fp32, accumulated into when given
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    grad_hidden_acc: torch.Tensor | None = None,  # [N, H] fp32, accumulated into when given
    softcap: tuple[float, float] | None = None,  # (cap_in, cap_out): z = cap_out tanh(cap_in x)
):
    """Recompute each logits tile and stream dL/dz through it:

      dz_j = g_lp (1[j=y] - p_j) + g_H p_j (E_p[z] - z_j);   dL/dlogit = dz / T
      grad_hidden = dlogit @ W,  grad_weight += dlogit.T @ hidden,  grad_bias += sum_rows dlogit

    Returns (grad_hidden in hidden's dtype or None, grad_weight_acc fp32 or None, grad_bias_acc fp32
    or None). grad_weight / grad_bias stay fp32 so that callers chunking over tokens accumulate in
    fp32 and cast once. With `grad_hidden_acc` the fp32 grad_hidden is added into it and returned in
    its place (callers chunking over the vocabulary: the fused low-memory schedule).
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / float(temperature)
    need_grad_bias = need_grad_bias and bias is not None
    grad_hidden = None
    if need_grad_hidden:
        grad_hidden = grad_hidden_acc if grad_hidden_acc is not None else torch.empty_like(hidden)
    if need_grad_weight and grad_weight_acc is None:
        grad_weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    if need_grad_bias and grad_bias_acc is None:
        grad_bias_acc = torch.zeros(vocab, dtype=torch.float32, device=device)
    if grad_logprobs is None and grad_entropy is None:
        if grad_hidden is not None and grad_hidden_acc is None:
            grad_hidden.zero_()
        return grad_hidden, grad_weight_acc if need_grad_weight else None, grad_bias_acc
    for r0 in range(0, n_tokens, token_chunk):
        rows = slice(r0, min(r0 + token_chunk, n_tokens))
        h = hidden[rows]
        y = targets[rows]
        g_lp = None if grad_logprobs is None else grad_logprobs[rows].float()[:, None]
        g_h = None if grad_entropy is None else grad_entropy[rows].float()[:, None]
        row_lse = lse[rows][:, None]
        row_ez = expected_logit[rows][:, None]
        gh_acc = torch.zeros(h.shape, dtype=torch.float32, device=device) if need_grad_hidden else None
        h32 = h.float() if need_grad_weight else None
        for c0 in range(0, vocab, vocab_chunk):
            c1 = min(c0 + vocab_chunk, vocab)
            w = weight[c0:c1]
            z = _logits_tile(h, w, None if bias is None else bias[c0:c1], inv_t, softcap)
            p = torch.exp(z - row_lse)
            dz = torch.zeros_like(z)
            if g_h is not None:
                dz += g_h * p * (row_ez - z)
            if g_lp is not None:
                dz -= g_lp * p
                in_tile = (y >= c0) & (y < c1)
                idx = in_tile.nonzero().squeeze(-1)
                dz[idx, y[idx] - c0] += g_lp[idx, 0]
            if softcap is None:
                dz *= inv_t  # dL/dlogit
            else:  # dz/dx = cap_in cap_out (1 - tanh^2), tanh = z / cap_out (clamped: NEG_BIG columns have p = 0)
                cap_in, cap_out = softcap
                dz *= cap_in * cap_out * (1.0 - (z / cap_out).clamp(-1.0, 1.0) ** 2)
            if gh_acc is not None:
                gh_acc += dz @ w.float()
            if need_grad_weight:
                grad_weight_acc[c0:c1] += dz.T @ h32
            if need_grad_bias:
                grad_bias_acc[c0:c1] += dz.sum(0)
        if grad_hidden_acc is not None and need_grad_hidden:
            grad_hidden_acc[rows] += gh_acc
        elif grad_hidden is not None:
            grad_hidden[rows] = gh_acc.to(hidden.dtype)
    return grad_hidden, grad_weight_acc if need_grad_weight else None, grad_bias_acc
