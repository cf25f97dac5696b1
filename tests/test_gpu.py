"""Tier 4: bf16 on a CUDA GPU at real shapes (skipped without CUDA; CI has none).

Ground truth: the chunked PyTorch backend on fp32 copies of the same bf16 inputs. The Triton backend
must be no worse than PyTorch's own bf16 computation (logits in bf16, then fp32 softmax), the error
users of TRL / verl accept today; the one-pass, two-pass and low-memory schedules of the fused loss must agree.
Run: `python -m pytest tests/test_gpu.py -q` on a GPU machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from grpo_kernels.testing import assert_close, assert_no_worse_than

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tier 4)"),
    # a slower fallback path (fp32-upcast GEMMs where torch lacks an fp32 out_dtype) fails the tier
    pytest.mark.filterwarnings("error::grpo_kernels._backend.SlowPathWarning"),
]

# Qwen2.5-7B's LM head (H = 3584, V = 152064) and Qwen3's vocabulary (151936) with H = 4096; 2048 tokens.
SHAPES = [pytest.param(2048, 3584, 152064, id="qwen2.5-7b"), pytest.param(2048, 4096, 151936, id="h4096-v151936")]


def make(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (3.0 / h**0.5)).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    return hidden, weight, targets


def logprobs_and_grads(backend, x, w, targets, g_lp, g_ent):
    """fused_linear_logprobs' (log-probs, entropy, grad_hidden, grad_weight) under sum(logp g_lp + H g_ent), fp32
    gradients; backend None: PyTorch's own path in the inputs' dtype (logits in that dtype, fp32 log-softmax,
    autograd), the baseline of TRL / verl users."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if backend is None:
        log_p = torch.log_softmax((x @ w.T).float(), -1)
        lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
        ent = -(log_p.exp() * log_p).sum(-1)
    else:
        out = gk.fused_linear_logprobs(x, w, targets, backend=backend)
        lp, ent = out.logprobs, out.entropy
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad.float(), w.grad.float()


def assert_logprobs_no_worse_than_pytorch(label, hidden, weight, targets, g_lp, g_ent, factor=1.0):
    """The Triton backend's log-probs, entropy and gradients (what runs at the call: the caller picks the path) no
    worse than `factor` x PyTorch's own 16-bit path against the fp32 truth on the same rounded inputs."""
    truth = logprobs_and_grads("torch", hidden.float(), weight.float(), targets, g_lp, g_ent)
    ours = logprobs_and_grads("triton", hidden, weight, targets, g_lp, g_ent)
    baseline = logprobs_and_grads(None, hidden, weight, targets, g_lp, g_ent)
    for name, a, b, t in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), ours, baseline, truth):
        assert_no_worse_than(f"{label}{name}", a, b, t, factor=factor, floor=1e-6 * t.abs().max().item())


@pytest.mark.parametrize("n,h,v", SHAPES)
def test_bf16_logprobs_and_gradients_no_worse_than_pytorch(n, h, v):
    hidden, weight, targets = make(n, h, v)
    g_lp = torch.randn(n, device="cuda")
    g_ent = torch.randn(n, device="cuda") * 0.1
    assert_logprobs_no_worse_than_pytorch("", hidden, weight, targets, g_lp, g_ent)


@pytest.mark.parametrize("config", [C.dapo(), C.grpo(), C.gspo()], ids=["dapo", "grpo", "gspo"])
def test_fused_schedules_agree_in_bf16(config):
    n_seq, length, h, v = 8, 200, 4096, 151936
    hidden, weight, targets = make(n_seq * length, h, v)
    hidden = hidden.reshape(n_seq, length, h)
    targets = targets.reshape(n_seq, length)
    mask = torch.arange(length, device="cuda")[None, :] < torch.randint(50, length + 1, (n_seq, 1), device="cuda")
    with torch.no_grad():
        lp = gk.fused_linear_logprobs(hidden, weight, targets, backend="triton").logprobs
    old = lp + 0.1 * torch.randn_like(lp)
    ref = lp + 0.1 * torch.randn_like(lp)
    adv = torch.randn(n_seq, device="cuda")
    results = {}
    for schedule in ("one_pass", "two_pass", "low_memory"):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        out = gk.fused_linear_grpo_loss(x, w, targets, adv, mask, old, ref if config.kl_coef > 0 else None,
                                        config=config, backend="triton", schedule=schedule)  # fmt: skip
        out.loss.backward()
        results[schedule] = (out.loss.detach(), x.grad.float(), w.grad.float())
    two = results["two_pass"]
    for schedule in ("one_pass", "low_memory"):  # "auto" runs low_memory at this head (memory goal)
        one = results[schedule]
        assert_close(f"{schedule} loss", one[0], two[0], atol=1e-6, rtol=1e-5)
        # one_pass reads the stored fp32 logits where two_pass recomputes them in bf16 GEMMs; low_memory
        # recomputes them per vocabulary slab and sums grad_hidden over slabs in fp32
        for name, a, b in (("grad_hidden", one[1], two[1]), ("grad_weight", one[2], two[2])):
            assert_close(f"{schedule} {name}", a, b, atol=1e-2 * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_tma_kernel_a_matches_the_cp_async_kernel_in_bf16(bias):
    """The TMA kernel A (opt-in) against the default cp.async kernel at a real head: the statistics with
    and without the stored fp32 logits (one-pass schedule), and those logits. Both fold exact bf16 products
    into fp32 over the same 64-wide K slices; they differ in tile shape (128x128 / 64x128 against 128x256 /
    128x128), so in the vocabulary splits and the order partial statistics merge: 1e-5 of the logits'
    scale bounds that fp32 reordering at V = 152k."""
    from grpo_kernels.ops.lm_head import triton as lm_triton

    n, h, v = 3000, 4096, 151936
    hidden, weight, targets = make(n, h, v)
    b = (0.1 * torch.randn(v, device="cuda")).to(torch.bfloat16) if bias else None
    runs = {}
    for kernel in ("cp.async", "tma"):
        logits = torch.empty(n, v, device="cuda")
        with lm_triton.use_forward_kernel(kernel), warnings.catch_warnings():
            warnings.simplefilter("error", lm_triton.TMAFallbackWarning)  # the TMA kernel must run here
            stats = lm_triton.lm_head_forward(hidden, weight, b, targets, 0.9, logits_out=logits)
            plain = lm_triton.lm_head_forward(hidden, weight, b, targets, 0.9)
        runs[kernel] = (stats, plain, logits)
    (s1, p1, z1), (s2, p2, z2) = runs["cp.async"], runs["tma"]
    scale = z1.abs().max().item()
    assert_close("stored logits", z2, z1, atol=1e-5 * scale, rtol=0)
    for field in ("logprobs", "entropy", "lse", "expected_logit"):
        for a, e in ((getattr(s2, field), getattr(s1, field)), (getattr(p2, field), getattr(p1, field))):
            assert_close(f"TMA {field}", a, e, atol=1e-5 * scale, rtol=0)


def test_backward_gemms_take_the_fp32_out_path():
    """The backward GEMMs must run as half-precision operands with fp32 output (cuBLAS out_dtype); the
    upcast fallback is several times slower. The results of a GPU session name the path that ran."""
    from grpo_kernels.ops.lm_head import triton as lm_triton

    hidden, weight, targets = make(256, 512, 4099)
    w = weight.clone().requires_grad_()
    out = gk.fused_linear_logprobs(hidden, w, targets, backend="triton")
    out.logprobs.sum().backward()
    assert lm_triton.gemm_path("cuda") == "fp32-out", f"backward GEMM path: {lm_triton.gemm_path('cuda')}"


@pytest.mark.parametrize("schedule", ["auto", "one_pass_cublas_inplace", "one_pass", "two_pass", "low_memory"])
def test_one_synchronising_operation_per_call(schedule):
    """On the GPU, what tests/test_host_reads.py counts on CPU: torch's sync debug mode flags every
    synchronising CUDA operation; the fused loss makes one per call (the checks with the layout), none in its
    backward (loss * 0.5: grad_output is not 1, the scale kernel runs), and fused_linear_logprobs one."""
    n, h, v = 512, 256, 4099
    hidden, weight, targets = make(n, h, v)
    mask = torch.rand(4, n // 4, device="cuda") > 0.2
    adv = torch.randn(4, device="cuda")
    x, w = hidden.reshape(4, n // 4, h).clone().requires_grad_(), weight.clone().requires_grad_()

    def synchronising(fn) -> list[str]:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return out, [str(c.message) for c in caught if "synchroniz" in str(c.message)]

    def call():
        return gk.fused_linear_grpo_loss(x, w, targets.reshape(4, -1), adv, mask, backend="triton",
                                         schedule=schedule).loss  # fmt: skip

    (call() * 0.5).backward()  # warm: the kernels compiled (and any autotuning done) before counting
    gk.fused_linear_logprobs(x, w, targets.reshape(4, -1), mask=mask, backend="triton")
    loss, forward = synchronising(call)
    _, backward = synchronising(lambda: (loss * 0.5).backward())
    assert len(forward) == 1 and not backward, (forward, backward)
    _, logprobs = synchronising(lambda: gk.fused_linear_logprobs(x, w, targets.reshape(4, -1), mask=mask,
                                                                 backend="triton"))  # fmt: skip
    assert len(logprobs) == 1, logprobs
