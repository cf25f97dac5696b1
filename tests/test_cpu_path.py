"""Tier 1: how the PyTorch backend (ops/lm_head/chunked.py) computes on a CPU: its GEMMs, the logits it keeps
between the fused loss's passes, and what it holds in memory.

Ground truth is float64 autograd on the same (rounded) inputs. bf16 gradients are held elementwise to a bound
derived from the rounding steps the backend takes (README.md beside chunked.py, "The PyTorch backend"):
the logits are fp32 sums of exact bf16 products, dz is rounded once to bf16 (relative error <= u = 2^-8), the
GEMMs add their K products in fp32 (relative to the sum of magnitudes: <= K 2^-24), and the result is rounded
once to bf16 (<= u |g|):

    |g - g64| <= u |g64| + (u + (K + H + 64) 2^-24) sum_k |dz_k| |x_k| / T

with x the other operand (W for grad_hidden, the hidden states for grad_weight) and K the reduction length
(V or N). Rounding the logits to bf16 (what a GEMM with a bf16 output does) or rounding dz twice breaks it.
"""

from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.ops.fused import function as fused
from grpo_kernels.ops.lm_head import chunked
from grpo_kernels.testing.memory import peak_allocated_bytes

U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest)
U_FP32 = 2.0**-24


def make(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 4 / h**0.5).to(dtype)  # logits ~ N(0, 16)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def float64_truth(hidden, weight, targets, g_lp, g_ent, temperature):
    """log-probs, entropy, dz / T [N, V] and both gradients in float64 from the same (rounded) inputs."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    z = (h @ w.T) / temperature
    log_p = torch.log_softmax(z, -1)
    lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    (lp * g_lp.double()).sum().backward(retain_graph=True) if g_ent is None else (
        lp * g_lp.double() + ent * g_ent.double()).sum().backward(retain_graph=True)  # fmt: skip
    p = log_p.detach().exp()
    dz = -p * g_lp.double()[:, None]
    dz[torch.arange(len(targets)), targets] += g_lp.double()
    if g_ent is not None:
        ez = (p * z.detach()).sum(-1, keepdim=True)
        dz += g_ent.double()[:, None] * p * (ez - z.detach())
    return lp.detach(), ent.detach(), dz / temperature, h.grad, w.grad


def assert_within(name, got, truth, bound):
    err = (got.double() - truth).abs()
    ratio = err / bound
    worst = int(ratio.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), truth.shape))
    assert float(ratio.max()) <= 1.0, (
        f"{name}: error {float(err.flatten()[worst]):.3e} at {idx} exceeds its bound {float(bound.flatten()[worst]):.3e} "
        f"(truth {float(truth.flatten()[worst]):.6e}, got {float(got.double().flatten()[worst]):.6e})"
    )


def bf16_gradient_bounds(dz64, hidden, weight, grad_h64, grad_w64):
    n, v = dz64.shape
    hsize = hidden.shape[1]
    mag_h = dz64.abs() @ weight.double().abs()  # sum over V of |dz| |W|: [N, H]
    mag_w = dz64.abs().T @ hidden.double().abs()  # sum over N of |dz| |x|: [V, H]
    bound_h = U_BF16 * grad_h64.abs() + (U_BF16 + (v + hsize + 64) * U_FP32) * mag_h
    bound_w = U_BF16 * grad_w64.abs() + (U_BF16 + (n + hsize + 64) * U_FP32) * mag_w
    return bound_h, bound_w


# odd sizes: ragged vocabulary tiles (vocab_chunk 500), ragged halves of the kept logits (N odd), one row
@pytest.mark.parametrize("n,h,v", [(37, 48, 1001), (1, 16, 700), (64, 64, 3001)])
@pytest.mark.parametrize("kept", [False, True], ids=["recomputed", "kept"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logprob-grad", "with-entropy-grad"])
def test_bf16_gradients_within_the_rounding_bound(n, h, v, kept, entropy, monkeypatch):
    monkeypatch.setattr(chunked, "FIRST_ROWS_BYTES", 2 * v)  # one row through the buffer: the ramp runs
    hidden, weight, targets = make(n, h, v, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g) if entropy else None
    temperature = 0.7
    store = chunked.LogitsStore(n, v, torch.bfloat16, hidden.device) if kept else None
    stats = chunked.lm_head_forward(hidden, weight, None, targets, temperature, vocab_chunk=500, logits_out=store)
    gh, gw, _ = chunked.lm_head_backward(hidden, weight, None, targets, temperature, stats.lse, stats.expected_logit,
                                         g_lp, g_ent, vocab_chunk=500, stored_logits=store)  # fmt: skip
    assert gh.dtype == gw.dtype == torch.bfloat16  # rounded once, no fp32 [V, H] handed back
    lp64, ent64, dz64, gh64, gw64 = float64_truth(hidden, weight, targets, g_lp, g_ent, temperature)
    # the statistics are fp32 sums of exact products: fp32-level, not bf16-level
    assert_within("logprobs", stats.logprobs, lp64, 64 * U_FP32 * (1 + lp64.abs() + 20))
    assert_within("entropy", stats.entropy, ent64, 64 * U_FP32 * (1 + ent64.abs() + 20))
    bound_h, bound_w = bf16_gradient_bounds(dz64, hidden, weight, gh64, gw64)
    assert_within("grad_hidden", gh, gh64, bound_h)
    assert_within("grad_weight", gw, gw64, bound_w)


def test_bf16_logits_rounded_to_bf16_would_break_the_bound():
    """The bound can fail: logits rounded to bf16 before the softmax (a bf16-output GEMM) exceed it."""
    n, h, v = 37, 48, 1001
    hidden, weight, targets = make(n, h, v, torch.bfloat16)
    g_lp = torch.randn(n, generator=torch.Generator().manual_seed(1))
    z16 = (hidden @ weight.T).float()  # bf16 logits
    p = torch.softmax(z16.double(), -1)
    dz = (-p * g_lp.double()[:, None])
    dz[torch.arange(n), targets] += g_lp.double()
    gw = (dz.bfloat16().double().T @ hidden.double()).bfloat16()
    _, _, dz64, gh64, gw64 = float64_truth(hidden, weight, targets, g_lp, None, 1.0)
    _, bound_w = bf16_gradient_bounds(dz64, hidden, weight, gh64, gw64)
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within("grad_weight", gw, gw64, bound_w)


def test_kept_logits_give_the_recomputed_results():
    """fp32: with one token chunk and one vocabulary tile the kept-logits backward makes the very same GEMMs as
    the recomputing one (bit for bit); with several, one GEMM over every tile / chunk instead of their fp32 sum
    (a few ulp). bf16: the same dz rounding either way, the sums in another order (one bf16 ulp)."""
    for n, v, chunk, exact in ((40, 300, 1024, True), (70, 1001, 16, False)):
        hidden, weight, targets = make(n, 32, v, torch.float32)
        g_lp, g_ent = torch.randn(n), torch.randn(n)
        results = []
        for kept in (False, True):
            store = chunked.LogitsStore(n, v, torch.float32, hidden.device) if kept else None
            stats = chunked.lm_head_forward(hidden, weight, None, targets, 0.9, token_chunk=chunk, vocab_chunk=256,
                                            logits_out=store)  # fmt: skip
            grads = chunked.lm_head_backward(hidden, weight, None, targets, 0.9, stats.lse, stats.expected_logit,
                                             g_lp, g_ent, token_chunk=chunk, vocab_chunk=256 if not exact else 8192,
                                             stored_logits=store)[:2]  # fmt: skip
            results.append((stats, grads))
        (s0, g0), (s1, g1) = results
        for a, b in zip(s0, s1):  # the forward keeps its arithmetic: bit for bit
            assert torch.equal(a, b)
        for a, b in zip(g0, g1):
            if exact:
                assert torch.equal(a, b)
            else:
                scale = a.abs().max()
                assert (a - b).abs().max() <= 16 * U_FP32 * scale, float((a - b).abs().max() / scale)
    n, v = 33, 1001
    hidden, weight, targets = make(n, 64, v, torch.bfloat16)
    g_lp = torch.randn(n)
    out = []
    for kept in (False, True):
        store = chunked.LogitsStore(n, v, torch.bfloat16, hidden.device) if kept else None
        stats = chunked.lm_head_forward(hidden, weight, None, targets, 1.0, logits_out=store)
        out.append(chunked.lm_head_backward(hidden, weight, None, targets, 1.0, stats.lse, stats.expected_logit, g_lp,
                                            None, stored_logits=store)[:2])  # fmt: skip
    for a, b in zip(*out):
        ulp = 2.0 ** (torch.floor(torch.log2(torch.maximum(a.double().abs(), b.double().abs()).clamp(min=1e-30))) - 7)
        assert ((a.double() - b.double()).abs() <= ulp).all()


def test_a_bf16_gemm_on_this_cpu_sums_in_fp32():
    """The kept-logits backward takes grad_hidden = dz @ W and grad_weight = dz^T @ X as bf16 GEMMs over the
    whole vocabulary / every token, which must add their products in fp32 and round once: the result equals the
    float64 product rounded to bf16 but at the rare ties of fp32's own rounding."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 20000, generator=g) * 1e-3).bfloat16()
    b = torch.randn(20000, 96, generator=g).bfloat16()
    for x, y in ((a, b), (a.T.contiguous().T, b)):  # [N, V] x [V, H]; and a transposed operand
        once = (x.double() @ y.double()).bfloat16()
        got = x @ y
        assert got.dtype == torch.bfloat16
        assert (got != once).float().mean() < 0.01, "the bf16 GEMM rounds inside the sum (no fp32 accumulation)"
    xt = a.T  # [V, N] transposed view, as dz^T
    c = torch.randn(64, 96, generator=g).bfloat16()
    assert ((xt @ c) != (xt.double() @ c.double()).bfloat16()).float().mean() < 0.01


def test_exact_bf16_math_is_exact_and_restored():
    before = torch.backends.mkldnn.matmul.fp32_precision if chunked.bf16_math_available() else None
    a = torch.randn(64, 512).bfloat16().float()
    b = torch.randn(512, 80).bfloat16().float()
    with chunked.exact_bf16_math():
        inside = a @ b
    exact = (a.double() @ b.double())
    # products of bf16 values are exact in fp32: only the fp32 sum's rounding remains
    assert ((inside.double() - exact).abs() <= 512 * U_FP32 * (a.double().abs() @ b.double().abs())).all()
    if before is not None:
        assert torch.backends.mkldnn.matmul.fp32_precision == before
    with chunked.exact_bf16_math():
        pass
    x = torch.randn(64, 512)  # not bf16 values: a GEMM outside the block keeps fp32's precision
    y = torch.randn(512, 80)
    err = ((x @ y).double() - x.double() @ y.double()).abs().max()
    assert err <= 512 * U_FP32 * (x.double().abs() @ y.double().abs()).max()


def test_bf16_fused_loss_holds_no_fp32_weight_sized_buffer(monkeypatch):
    """The fused loss on bf16 operands (PyTorch backend): its peak is the kept logits (4 N V bytes) plus the
    gradients plus small buffers: no fp32 [V, H] accumulator or fp32 copy of the weight (4 V H bytes)."""
    n, h, v = 24, 512, 8192  # an fp32 [V, H] (16 MiB) dwarfs the kept logits (0.75 MiB)
    # small weight slices and element-wise blocks, so that the bound below is tight at this size
    monkeypatch.setattr(chunked, "HALF_TILE_BYTES", 2**18)
    monkeypatch.setattr(chunked, "ELEMENTWISE_BLOCK", 2**15)
    hidden, weight, targets = make(n, h, v, torch.bfloat16)
    hidden = hidden.view(2, 12, h).requires_grad_()
    weight = weight.requires_grad_()
    adv = torch.randn(2)
    mask = torch.ones(2, 12, dtype=torch.bool)
    old = -torch.rand(2, 12)

    def call():
        out = gk.fused_linear_grpo_loss(hidden, weight, targets.view(2, 12), adv, mask, old, backend="torch")
        out.loss.backward()
        return out.loss

    _, peak, _ = peak_allocated_bytes(call)
    grads = hidden.numel() * 2 + weight.numel() * 2
    extra = peak - grads
    assert extra < 4 * v * h // 4, f"peak beyond the gradients {extra} B: an fp32 [V, H] buffer is {4 * v * h} B"
    # the kept logits, one fp32 weight slice, the fold's two scratch blocks, the fp32 hidden rows, O(N) vectors
    assert extra <= 4 * n * v + 2**18 + 2 * 4 * 2**15 + 4 * n * h + 2**17, extra
    # the recomputing path (the fused_linear_logprobs autograd backward) holds none either
    hidden.grad = weight.grad = None

    def logprobs_call():
        out = gk.fused_linear_logprobs(hidden.view(n, h), weight, targets, backend="torch")
        out.logprobs.sum().backward()
        return out.logprobs

    _, peak, _ = peak_allocated_bytes(logprobs_call)
    assert peak - grads < 4 * v * h // 4, peak - grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_keeps_the_logits_only_within_the_budget(dtype, monkeypatch, caplog):
    """The PyTorch backend's two-pass schedule keeps A's logits for C when they fit TORCH_LOGITS_BYTES and
    recomputes them otherwise; both give the loss and gradients to rounding, and the log says which ran."""
    import logging

    n, h, v = 48, 32, 1001
    hidden, weight, targets = make(n, h, v, dtype)
    adv = torch.randn(4)
    mask = torch.rand(4, 12) < 0.8
    old = -torch.rand(4, 12)
    results = {}
    for budget in (fused.TORCH_LOGITS_BYTES, 0):
        monkeypatch.setattr(fused, "TORCH_LOGITS_BYTES", budget)
        from grpo_kernels.ops.fused import dispatch

        monkeypatch.setattr(dispatch, "TORCH_LOGITS_BYTES", budget)
        x = hidden.view(4, 12, h).clone().requires_grad_()
        w = weight.clone().requires_grad_()
        with caplog.at_level(logging.DEBUG, logger="grpo_kernels"):
            caplog.clear()
            out = gk.fused_linear_grpo_loss(x, w, targets.view(4, 12), adv, mask, old, backend="torch")
        out.loss.backward()
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("logits kept for C" in said) == (budget > 0), said
        results[budget > 0] = (out.loss, x.grad, w.grad)
    for a, b in zip(results[True], results[False]):
        scale = b.abs().max().clamp(min=1e-30)
        tol = 16 * U_FP32 if dtype == torch.float32 else U_BF16  # bf16: one ulp of the largest element
        assert (a - b).abs().max() <= tol * scale


def test_logits_store_rejects_a_wrong_buffer():
    with pytest.raises(ValueError, match="stored logits must be fp32"):
        chunked.LogitsStore.wrap(torch.zeros(4, 10, dtype=torch.bfloat16), 4, 10)
    with pytest.raises(ValueError, match="holds"):
        chunked.LogitsStore.wrap(chunked.LogitsStore(3, 10, torch.float32, "cpu"), 4, 10)
