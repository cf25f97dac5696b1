"""Tier 1: the chunked PyTorch LM head (ops/lm_head/chunked.py) and fused_linear_logprobs.

Ground truth is float64 on the same (rounded) inputs; fp32 results must be within float rounding of it,
half-precision inputs must be no worse than PyTorch's own computation in that dtype.
"""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.ops.lm_head import chunked
from grpo_kernels.testing import assert_close, assert_no_worse_than


def truth(hidden, weight, targets, bias, temperature):
    """float64 log-probs and entropy with autograd (the ground truth)."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    log_p = torch.log_softmax(z / temperature, dim=-1)
    logprobs = log_p.gather(-1, targets[:, None].long()).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def make(n, h, v, dtype=torch.float32, bias=True, scale=1.0):
    hidden = (torch.randn(n, h) * scale).to(dtype)
    weight = (torch.randn(v, h) / h**0.5 * 4).to(dtype)  # logits of O(4): peaked but not one-hot
    b = (torch.randn(v) * 0.5).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,))
    return hidden, weight, b, targets


# Grid: a tiny case, odd sizes that cross the tile edges (token_chunk=16, vocab_chunk=777 below), and
# the real vocabularies (Llama 2 32000, Llama 3 128256, Qwen 2.5 151936) with small N and H for CPU.
SHAPES = [
    pytest.param(1, 8, 7, id="N1-H8-V7"),
    pytest.param(37, 48, 1001, id="N37-H48-V1001"),
    pytest.param(33, 16, 32000, id="N33-H16-V32000"),
    pytest.param(9, 16, 128256, id="N9-H16-V128256"),
    pytest.param(17, 16, 151936, id="N17-H16-V151936"),
]


@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_forward_and_backward_fp32(n, h, v, bias, temperature):
    hidden, weight, b, targets = make(n, h, v, bias=bias)
    stats = chunked.lm_head_forward(hidden, weight, b, targets, temperature, token_chunk=16, vocab_chunk=777)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    lp_ref, ent_ref = truth(hd, wd, targets, bd, temperature)
    # fp32 rounding of logits of magnitude |z| ~ 10 and sums over V terms
    assert_close("logprobs", stats.logprobs, lp_ref, atol=2e-5, rtol=1e-5)
    assert_close("entropy", stats.entropy, ent_ref, atol=2e-5, rtol=1e-5)

    g_lp, g_ent = torch.randn(n), torch.randn(n)
    (lp_ref * g_lp.double() + ent_ref * g_ent.double()).sum().backward()
    gh, gw, gb = chunked.lm_head_backward(
        hidden, weight, b, targets, temperature, stats.lse, stats.expected_logit, g_lp, g_ent,
        token_chunk=16, vocab_chunk=777,
    )  # fmt: skip
    scale_h = hd.grad.abs().max().item()
    assert_close("grad_hidden", gh, hd.grad, atol=1e-5 * scale_h, rtol=1e-4)
    assert_close("grad_weight", gw, wd.grad, atol=1e-5 * wd.grad.abs().max().item(), rtol=1e-4)
    if bias:
        assert_close("grad_bias", gb, bd.grad, atol=1e-5 * bd.grad.abs().max().item(), rtol=1e-4)
    else:
        assert gb is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_no_worse_than_pytorch(dtype):
    # bf16 logits have spacing 0.125 at |z| in [16, 32): a naive PyTorch path that rounds the logits to
    # the input dtype before log_softmax errs by ~0.1; fp32 accumulation must do much better.
    hidden, weight, b, targets = make(29, 64, 3001, dtype=dtype, scale=3.0)
    stats = chunked.lm_head_forward(hidden, weight, b, targets, 1.0, token_chunk=8, vocab_chunk=500)
    lp_true, ent_true = truth(hidden, weight, targets, b, 1.0)
    naive_logits = (hidden @ weight.T + b).float()  # what F.linear in the model dtype gives
    naive_lp = torch.log_softmax(naive_logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    naive_ent = torch.distributions.Categorical(logits=naive_logits).entropy()
    assert_no_worse_than("logprobs", stats.logprobs, naive_lp, lp_true, factor=0.1)
    assert_no_worse_than("entropy", stats.entropy, naive_ent, ent_true, factor=0.1)


def test_logprobs_invariant_to_constant_logit_shift():
    hidden, weight, b, targets = make(21, 32, 999)
    base = gk.fused_linear_logprobs(hidden, weight, targets, b, backend="torch")
    shifted = gk.fused_linear_logprobs(hidden, weight, targets, b + 7.25, backend="torch")
    assert_close("logprobs", shifted.logprobs, base.logprobs, atol=1e-5, rtol=0)
    assert_close("entropy", shifted.entropy, base.entropy, atol=1e-5, rtol=0)


def test_fused_linear_logprobs_padded_mask_and_ignore_index():
    b_, t_, h_, v_ = 3, 6, 16, 257
    hidden = torch.randn(b_, t_, h_, requires_grad=True)
    weight = torch.randn(v_, h_, requires_grad=True)
    bias = torch.randn(v_, requires_grad=True)
    targets = torch.randint(0, v_, (b_, t_))
    mask = torch.rand(b_, t_) > 0.4
    targets[~mask] = -100  # masked positions hold ignore_index (TRL's labels)
    targets[0, 0] = -100
    out = gk.fused_linear_logprobs(hidden, weight, targets, bias, temperature=0.9, backend="torch")
    valid = targets != -100
    assert out.logprobs.shape == (b_, t_) and out.entropy.shape == (b_, t_)
    assert bool((out.logprobs[~valid] == 0).all()) and bool((out.entropy[~valid] == 0).all())
    g = torch.randn(b_, t_)
    (out.logprobs * g + out.entropy * g.flip(0)).sum().backward()

    hd, wd, bd = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    lp_t, ent_t = truth(hd.reshape(-1, h_)[valid.reshape(-1)], wd, targets[valid], bd, 0.9)
    assert_close("logprobs", out.logprobs[valid], lp_t, atol=2e-5, rtol=1e-5)
    (lp_t * g[valid].double() + ent_t * g.flip(0)[valid].double()).sum().backward()
    assert_close("grad_hidden", hidden.grad, hd.grad, atol=1e-4, rtol=1e-4)
    assert bool((hidden.grad[~valid] == 0).all()), "masked rows must get exactly zero gradient"
    assert_close("grad_weight", weight.grad, wd.grad, atol=1e-4, rtol=1e-4)
    assert_close("grad_bias", bias.grad, bd.grad, atol=1e-4, rtol=1e-4)


def test_entropy_not_requested_and_logged_only():
    hidden, weight, b, targets = make(11, 16, 101)
    out = gk.fused_linear_logprobs(hidden, weight, targets, compute_entropy=False, backend="torch")
    assert out.entropy is None
    # entropy computed but only logged: its gradient never materialises and nothing breaks
    w = weight.clone().requires_grad_()
    out = gk.fused_linear_logprobs(hidden, w, targets, backend="torch")
    out.logprobs.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_frozen_weight_gets_no_gradient():
    hidden, weight, _, targets = make(8, 16, 50)
    hidden.requires_grad_()
    out = gk.fused_linear_logprobs(hidden, weight, targets, backend="torch")
    out.logprobs.sum().backward()
    assert weight.grad is None and hidden.grad is not None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(targets=torch.tensor([0, 5, 50])), r"targets has 1 id\(s\) outside \[0, 50\).*index \(2,\): 50"),
        (dict(targets=torch.tensor([0, -3, 1])), r"outside \[0, 50\)"),
        (dict(weight=torch.randn(50, 7)), "last dimension must equal weight.shape"),
        (dict(targets=torch.tensor([0, 1])), "targets must have the shape"),
        (dict(bias=torch.randn(49)), "bias must have the shape"),
        (dict(weight=torch.randn(50, 16, dtype=torch.float64)), "share one dtype"),
        (dict(temperature=0.0), "temperature must be a finite number > 0"),
        (dict(temperature=torch.tensor(1.0)), "temperature must be a Python float"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(hidden=torch.zeros(3, 16).index_fill(1, torch.tensor([5]), float("inf"))), r"hidden has 3 non-finite.*index \(0, 5\): inf"),
        (dict(targets=torch.tensor([0.0, 1.0, 2.0])), "integer tensor of token ids"),
        (dict(mask=torch.tensor([0, 2, 1])), "mask must hold only 0 and 1"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    args = dict(hidden=torch.randn(3, 16), weight=torch.randn(50, 16), targets=torch.tensor([0, 1, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_logprobs(**args)


def test_out_of_range_ids_at_masked_positions_are_allowed():
    hidden, weight, _, _ = make(3, 16, 50)
    targets = torch.tensor([0, 999, 2])
    out = gk.fused_linear_logprobs(hidden, weight, targets, mask=torch.tensor([1, 0, 1]), backend="torch")
    assert out.logprobs[1] == 0


def test_triton_backend_on_cpu_tensors_is_refused():
    hidden, weight, _, targets = make(3, 16, 50)
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        gk.fused_linear_logprobs(hidden, weight, targets, backend="triton")
