"""Tier 4, first in a GPU session: every kernel path the interpreter tier checks, now on the hardware.

The interpreter tier (tests/test_loss_head_triton_interpreter.py, tests/test_fused_triton_interpreter.py)
runs the Triton kernels on CPU; this module runs the same cases, by the same names, on a CUDA GPU against the
fp32 reference (tests/test_gpu_tier_structure.py checks on CPU that no interpreter case is missing here):

  * the loss head, grpo_loss(backend="triton") against backend="torch" (the fp32 reference), for every
    configuration of test_loss_head.CONFIGS, padded and packed, and the NaN sampler log-prob cases;
  * the fused loss, fused_linear_grpo_loss(backend="triton") against backend="torch" on the same fp32
    inputs (bias, temperature 0.8, chunks of 7 valid tokens), for every configuration, both layouts, the
    one-pass and two-pass schedules, one_pass_dz, the low-memory schedule, long completions cut across
    chunks, "auto" over and within the memory goal, and the TMA kernel A;
  * GPU only: every schedule "auto" can pick, at a small head and at Qwen3-8B's (H = 4096, V = 151936,
    320 tokens), in bf16; and the input variants (bias, soft-cap, temperature != 1, fp16, fp32 inputs,
    packed layout, batch_invariant) at the target head; fused_linear_logprobs' opt-in cuBLAS logits path there.

Tolerances. fp32 inputs (the interpreter cases): the kernels' fp32 products run as tf32x3 (about fp32's
rounding), so only summation order differs, as under the interpreter: the interpreter tier's bounds,
1e-5 (1 + |expected|) for the loss head and 2e-5 for the fused loss (gradients relative to their largest
element). 16-bit inputs at real heads: no worse than twice PyTorch's own 16-bit path (logits in the input
dtype, fp32 log-softmax: what TRL and verl users accept today) against the fp32 truth on the same rounded
inputs, the measure tests/test_gpu.py uses; the factor 2 covers the in-place schedules, which round the
running grad_weight to the weight's dtype once per chunk where PyTorch rounds once.

Sized to run in well under 90 s on an H200 (a few hundred tokens per case; most of the time is compiling
the kernels' specialisations). Run: `python -m pytest tests/test_gpu_tier.py -q` on a GPU machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused
from grpo_kernels.testing import assert_no_worse_than

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_loss_head import CONFIGS, UNSCORED_CASES, batch  # noqa: E402
from test_gpu import assert_logprobs_no_worse_than_pytorch  # noqa: E402

_saved_chunk = fused.ONE_PASS_CHUNK_TOKENS
import _fused_interpreter_cases as fused_cases  # noqa: E402  (its inputs() and run(); it sets the chunk size)

fused.ONE_PASS_CHUNK_TOKENS = _saved_chunk  # restored: each test below sets what it needs
# kept from the case module: grad_weight buffers the first GEMM overwrites start NaN-filled
# (lm_head.triton.uninitialized), so every fused test here also shows that no schedule reads one before writing it

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tier 4)"),
]
LOSS_HEAD_TOL = 1e-5  # the interpreter tier's (fp32 inputs: summation order only)
FUSED_TOL = 2e-5
LAYOUTS = ("padded", "packed")
# "auto" picks among these (ops/fused/function.py: choose_schedule, the time model and the memory goal);
# the dz schedules are opt-in only and run in test_one_pass_dz_in_gemm_matches_torch and, with csrc's kernel C,
# test_csrc_kernels_a_and_c_in_the_fused_loss_at_the_target_head
AUTO_SCHEDULES = tuple(s for s in fused.SCHEDULES if not s.startswith("one_pass_dz"))
HEADS = {"small": (512, 4099), "qwen3-8b": (4096, 151936)}
TARGET_TOKENS = 320


def close(got, expected, tol, scale=None) -> bool:
    if got is None:
        return False
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return abs(got - expected) <= tol * (1.0 + abs(expected if scale is None else scale))


def cuda(d: dict) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


# ------------------------------------------------------------------------------------------------
# the loss head: tests/test_loss_head_triton_interpreter.py's cases
# ------------------------------------------------------------------------------------------------
LOSS_HEAD_CASES = [f"{name}-{layout}" for name in sorted(CONFIGS) for layout in LAYOUTS] + [
    f"{name}-nan-rollout" for name in UNSCORED_CASES
]


def run_loss_head(cfg, d, backend, layout):
    """grpo_loss on the batch of test_loss_head (the interpreter's case script, on CUDA tensors)."""
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    kwargs = dict(old_logprobs=d["old"], ref_logprobs=d["ref"] if cfg.needs_reference else None,
                  rollout_logprobs=d["rollout"] if cfg.uses_rollout_logprobs else None, entropy=ent, config=cfg,
                  backend=backend)  # fmt: skip
    mask = d["mask"]
    if layout == "packed":
        lengths = mask.sum(-1)
        kwargs["cu_seqlens"] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        adv = d["adv"] if d["adv"].dim() == 1 else d["adv"][mask]
        for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            if kwargs[key] is not None:
                kwargs[key] = kwargs[key][mask]
        lp_in, mask_in = lp[mask], torch.ones(int(lengths.sum()), dtype=torch.bool, device=mask.device)
        kwargs["entropy"] = ent[mask]
    else:
        adv, lp_in, mask_in = d["adv"], lp, mask
    torch.manual_seed(5)  # clip_cov draws a random subset
    out = gk.grpo_loss(lp_in, adv, mask_in, **kwargs)
    grads = torch.autograd.grad(out.loss, [lp, ent], allow_unused=True)
    return out, [torch.zeros_like(lp) if g is None else g for g in grads]


@pytest.mark.parametrize("case", LOSS_HEAD_CASES)
def test_triton_loss_head_matches_reference(case):
    name, _, layout = case.partition("-")
    cfg = CONFIGS[name]
    if layout == "nan-rollout":
        d = cuda(batch(per_token_adv=True, seed=13))
        d["rollout"][0, 2] = float("nan")
        d["rollout"][4, 0] = float("nan")
        layout = "padded"
    else:
        d = cuda(batch(per_token_adv=layout == "padded" and cfg.loss_type not in ("gmpo", "group_dpo"), seed=11))
    ref, g_ref = run_loss_head(cfg, d, "torch", layout)
    tri, g_tri = run_loss_head(cfg, d, "triton", layout)
    assert close(tri.loss.item(), ref.loss.item(), LOSS_HEAD_TOL), f"{case} loss: triton {tri.loss.item()!r}, reference {ref.loss.item()!r}"
    for label, a, b in (("dL/dlogp", g_tri[0], g_ref[0]), ("dL/dentropy", g_tri[1], g_ref[1])):
        diff = (a - b).abs().nan_to_num(nan=float("inf"))
        i = int(diff.reshape(-1).argmax())
        got, expected = a.reshape(-1)[i].item(), b.reshape(-1)[i].item()
        assert close(got, expected, LOSS_HEAD_TOL), f"{case} {label}: worst at flat index {i}: triton {got}, reference {expected}"
    for key, value in ref.metrics.items():
        got = tri.metrics[key].item() if key in tri.metrics else None
        assert close(got, value.item(), LOSS_HEAD_TOL), f"{case} metric {key}: triton {got!r}, reference {value.item()!r}"
    assert not set(tri.metrics) - set(ref.metrics), f"{case}: metrics the reference does not have"


# ------------------------------------------------------------------------------------------------
# the fused loss: tests/test_fused_triton_interpreter.py's cases
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fused_inputs():
    return cuda(fused_cases.inputs())


@contextlib.contextmanager
def chunk_tokens(n: int):
    saved = fused.ONE_PASS_CHUNK_TOKENS
    fused.ONE_PASS_CHUNK_TOKENS = n
    try:
        yield
    finally:
        fused.ONE_PASS_CHUNK_TOKENS = saved


def fused_case(case, cfg, d, layout, schedule, chunk=7):
    """Triton against the PyTorch backend on the same fp32 inputs; returns the refusal's text, if refused."""
    with chunk_tokens(chunk):
        ref, g_ref = fused_cases.run(cfg, d, "torch", "two_pass", layout)
        try:
            out, g = fused_cases.run(cfg, d, "triton", schedule, layout)
        except ValueError as exc:
            return str(exc)
    assert close(out.loss.item(), ref.loss.item(), FUSED_TOL), f"{case} loss: triton {out.loss.item()!r}, torch {ref.loss.item()!r}"
    for label, a, b in zip(("hidden", "weight", "bias"), g, g_ref):
        got, expected, index, scale = fused_cases.worst(a, b)
        assert close(got, expected, FUSED_TOL, scale), f"{case} grad_{label}: worst at flat index {index}: triton {got}, torch {expected}"
    got, expected, index, _ = fused_cases.worst(out.logprobs, ref.logprobs)
    assert close(got, expected, FUSED_TOL), f"{case} logprobs at {index}: triton {got}, torch {expected}"
    for key, value in ref.metrics.items():
        got = out.metrics[key].item() if key in out.metrics else None
        assert close(got, value.item(), FUSED_TOL), f"{case} metric {key}: triton {got!r}, torch {value.item()!r}"
    return None


@pytest.mark.parametrize("schedule", ["one_pass", "two_pass"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_triton_matches_torch(name, layout, schedule, fused_inputs):
    refused = fused_case(f"{name}-{layout}-{schedule}", CONFIGS[name], fused_inputs, layout, schedule)
    if schedule == "one_pass" and CONFIGS[name].needs_global_statistics:
        assert refused and "needs statistics of the whole batch" in refused, refused
    else:
        assert refused is None, refused


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_pass_dz_in_gemm_matches_torch(name, fused_inputs):
    refused = fused_case(f"{name}-packed-one_pass_dz", CONFIGS[name], fused_inputs, "packed", "one_pass_dz")
    if CONFIGS[name].needs_global_statistics:
        assert refused and "schedule='one_pass_dz' is not valid here" in refused, refused
    else:
        assert refused is None, refused


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_pass_cuts_long_completions_of_token_local_objectives(name, fused_inputs):
    cfg = CONFIGS[name]
    refused = fused_case(f"{name}-packed-one_pass-long", cfg, fused_inputs, "packed", "one_pass", chunk=3)
    if cfg.needs_global_statistics:
        assert refused and "needs statistics of the whole batch" in refused, refused
    elif not cfg.token_local:
        assert refused and "is not token-local" in refused, refused
    else:
        assert refused is None, refused


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_low_memory_schedule_matches_torch(name, fused_inputs, monkeypatch):
    monkeypatch.setattr(fused, "LOW_MEMORY_SLAB_BYTES", 1)  # 128-column slabs of V = 203, as the interpreter's
    assert fused_case(f"{name}-packed-low_memory", CONFIGS[name], fused_inputs, "packed", "low_memory") is None


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo"])
def test_auto_takes_the_low_memory_schedule_over_the_memory_goal(name, fused_inputs, monkeypatch):
    import grpo_kernels.ops.fused.memory as memory

    monkeypatch.setattr(memory, "EXTRA_MEMORY_GOAL", 0)
    assert fused_case(f"{name}-packed-auto-over-goal", CONFIGS[name], fused_inputs, "packed", "auto") is None


def test_auto_within_the_memory_goal_takes_the_fastest_fitting_schedule(fused_inputs):
    assert fused_case("grpo-packed-auto-within-goal", CONFIGS["grpo"], fused_inputs, "packed", "auto") is None


@pytest.mark.parametrize("schedule", ["one_pass", "two_pass"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo"])
def test_tma_kernel_a_matches_torch(name, schedule, fused_inputs):
    from grpo_kernels.ops.lm_head import triton as lm_triton

    with lm_triton.use_forward_kernel("tma"):
        refused = fused_case(f"{name}-packed-{schedule}-tma", CONFIGS[name], fused_inputs, "packed", schedule)
    assert refused is None, refused


# ------------------------------------------------------------------------------------------------
# GPU only: the schedules at real heads, and the input variants, in 16-bit
# ------------------------------------------------------------------------------------------------
def real_inputs(h, v, dtype, seed=0, n_seq=4, packed=False):
    """n_seq sequences of up to TARGET_TOKENS / n_seq tokens (ragged), GRPO's per-token inputs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    length = TARGET_TOKENS // n_seq
    hidden = torch.randn(n_seq, length, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (3.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n_seq, length), device="cuda", generator=g)
    lengths = torch.tensor([length, length - 7, length // 2, length - 1], device="cuda")[:n_seq]
    mask = torch.arange(length, device="cuda")[None, :] < lengths[:, None]
    with torch.no_grad():
        lp = gk.fused_linear_logprobs(hidden.float(), weight.float(), targets, backend="torch").logprobs
    old = lp + 0.2 * torch.randn(lp.shape, device="cuda", generator=g)
    ref = lp + 0.1 * torch.randn(lp.shape, device="cuda", generator=g)
    adv = torch.randn(n_seq, device="cuda", generator=g)
    d = dict(hidden=hidden, weight=weight, targets=targets, mask=mask, old=old, ref=ref, adv=adv, bias=None, extra={})
    if packed:
        d["extra"] = {"cu_seqlens": torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])}
        for key in ("hidden", "targets", "old", "ref"):
            d[key] = d[key][mask]
        d["mask"] = torch.ones(int(lengths.sum()), dtype=torch.bool, device="cuda")
    return d


def fused_grads(d, cfg, backend, dtype=None, **kwargs):
    """(loss, grad_hidden, grad_weight[, grad_bias]) as fp32; `dtype`: the inputs cast first (fp32 truth)."""
    cast = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.to(dtype))
    leaves = [None if x is None else cast(x).clone().requires_grad_() for x in (d["hidden"], d["weight"], d["bias"])]
    out = gk.fused_linear_grpo_loss(leaves[0], leaves[1], d["targets"], d["adv"], d["mask"], d["old"], d["ref"],
                                    bias=leaves[2], config=cfg, backend=backend, **d["extra"], **kwargs)  # fmt: skip
    out.loss.backward()
    return [out.loss.detach().float().reshape(1)] + [x.grad.float() for x in leaves if x is not None]


def pytorch_16bit(d, cfg, softcap=None):
    """PyTorch's own path: logits in the input dtype, fp32 log-softmax (soft-cap in fp32), the loss head."""
    leaves = [None if x is None else x.clone().requires_grad_() for x in (d["hidden"], d["weight"], d["bias"])]
    logits = leaves[0] @ leaves[1].T
    if leaves[2] is not None:
        logits = logits + leaves[2]
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / cfg.temperature, -1)
    lp = log_p.gather(-1, d["targets"][..., None]).squeeze(-1)
    out = gk.grpo_loss(lp, d["adv"], d["mask"], d["old"], d["ref"], config=cfg, backend="torch", **d["extra"])
    out.loss.backward()
    return [out.loss.detach().float().reshape(1)] + [x.grad.float() for x in leaves if x is not None]


def check_against_truth(label, d, cfg, truth, ours, softcap=None):
    baseline = pytorch_16bit(d, cfg, softcap)
    for name, a, b, t in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), ours, baseline, truth):
        assert_no_worse_than(f"{label} {name}", a, b, t, factor=2.0, floor=1e-6 * t.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_first_gemm_overwrites_grad_weight_by_cublas(dtype):
    """The dz slab's grad_weight GEMM for the first chunk (accumulate_grad_weight=False): into an fp32 accumulator
    by torch.mm(out_dtype=float32, out=) and into a 16-bit buffer by addmm_(beta=0), a NaN-filled buffer ends
    exactly as the same call adding into zeros; and the fp32-out GEMM took the call (not the zero-fill fallback)."""
    from grpo_kernels.ops.lm_head import triton as tri

    g = torch.Generator(device="cuda").manual_seed(3)
    n, h, v = 300, 512, 4099
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    stats = tri.lm_head_forward(x, w, None, y, 1.0)
    g_lp, g_h = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    for acc_dtype in (torch.float32, dtype):
        fresh = torch.full((v, h), float("nan"), dtype=acc_dtype, device="cuda")
        added = torch.zeros((v, h), dtype=acc_dtype, device="cuda")
        for acc, accumulate in ((fresh, False), (added, True)):
            tri.lm_head_backward(x, w, None, y, 1.0, stats.lse, stats.expected_logit, g_lp, g_h,
                                 need_grad_hidden=False, grad_weight_acc=acc, accumulate_grad_weight=accumulate)
        differ = (fresh != added) & ~(fresh.isnan() & added.isnan())
        assert not fresh.isnan().any() and not differ.any(), (
            f"{dtype} into {acc_dtype}: {int(fresh.isnan().sum())} NaNs, {int(differ.sum())} elements differ")
    assert tri._MM_INTO_FP32_OK.get("cuda") is True, "torch.mm(out_dtype=float32, out=) failed: zero-fill fallback"


def test_logprobs_cublas_logits_path_at_the_target_head(monkeypatch):
    """fused_linear_logprobs' opt-in cuBLAS logits GEMM (use_logits_gemm("cublas")) at the Qwen3-8B head in bf16,
    320 tokens in chunks of 128 (two full, one ragged), forward and backward: its fp32 grad_weight accumulator
    starts NaN-filled (uninitialized, kept from the case module) and is written by the first chunk's GEMM (beta =
    0), the others add. Log-probs, entropy and both gradients no worse than PyTorch's own bf16 path (bf16 logits,
    fp32 log-softmax) against the fp32 truth on the same bf16 inputs: this path keeps fp32 logits, so the bar is
    test_gpu.py's (factor 1)."""
    from grpo_kernels.ops.lm_head import triton as tri

    monkeypatch.setattr(tri, "logits_chunk_rows", lambda *args, **kwargs: 128)
    h, v = HEADS["qwen3-8b"]
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(TARGET_TOKENS, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * (3.0 / h**0.5)).bfloat16()
    y = torch.randint(0, v, (TARGET_TOKENS,), device="cuda", generator=g)
    g_lp = torch.randn(TARGET_TOKENS, device="cuda", generator=g)
    g_h = torch.randn(TARGET_TOKENS, device="cuda", generator=g)
    with tri.use_logits_gemm("cublas"):
        assert tri._cublas_logits(x, None), "bf16 without a bias must take the cuBLAS logits path"
        assert_logprobs_no_worse_than_pytorch("cuBLAS logits ", x, w, y, g_lp, g_h)


@pytest.mark.parametrize("schedule", AUTO_SCHEDULES)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_every_schedule_auto_can_pick_at_small_and_target_head(head, schedule):
    h, v = HEADS[head]
    cfg = gk.PolicyLossConfig.dapo().replace(kl_coef=0.04)
    d = real_inputs(h, v, torch.bfloat16)
    truth = fused_grads(d, cfg, "torch", torch.float32)
    ours = fused_grads(d, cfg, "triton", schedule=schedule)
    check_against_truth(f"{head} {schedule}", d, cfg, truth, ours)


VARIANTS = {  # name -> (input dtype, config changes, call keywords, packed, bias)
    "bias": (torch.bfloat16, {}, {}, False, True),
    # at temperature 0.7: the soft cap's constant cap_in cap_out = 1 / T is not 1 (kernel C folds it into the
    # token coefficients)
    "softcap": (torch.bfloat16, {"temperature": 0.7}, {"softcap": 30.0}, False, False),
    "temperature": (torch.bfloat16, {"temperature": 0.7}, {}, False, False),
    "fp16": (torch.float16, {}, {}, False, False),
    "fp32": (torch.float32, {}, {}, False, False),
    "packed": (torch.bfloat16, {}, {}, True, False),
    "batch_invariant": (torch.bfloat16, {}, {"batch_invariant": True}, False, False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_input_variants_at_the_target_head(variant):
    dtype, changes, kwargs, packed, bias = VARIANTS[variant]
    h, v = HEADS["qwen3-8b"]
    cfg = gk.PolicyLossConfig.grpo().replace(kl_coef=0.04, **changes)
    d = real_inputs(h, v, dtype, seed=1, packed=packed)
    if bias:
        d["bias"] = (0.1 * torch.randn(v, device="cuda")).to(dtype)
    # the truth computes the same function: the logit transform, not the Triton-only reduction order switch
    truth = fused_grads(d, cfg, "torch", torch.float32, **{k: v for k, v in kwargs.items() if k != "batch_invariant"})
    ours = fused_grads(d, cfg, "triton", **kwargs)
    if dtype == torch.float32:  # fp32 operands (tf32x3): summation order against the fp32 truth
        for name, a, t in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), ours, truth):
            err = (a - t).abs().max().item()
            assert err <= FUSED_TOL * (1 + t.abs().max().item()), f"fp32 {name}: worst |diff| {err:.3g}"
        return
    check_against_truth(variant, d, cfg, truth, ours, kwargs.get("softcap"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_logits_keep_the_fp32_stores_accuracy_at_the_target_head(dtype):
    """Kernel A's fp16 stored logits (HalfLogits) against the fp32 store at the Qwen3-8B head, 256 tokens, on
    the hardware: the interpreter test's bar (tests/test_half_logits_interpreter.py) with float64 truth:
    forward statistics bitwise equal, gradients' normwise error at most 2x the fp32 store's, through the dz
    slab and through dz_in_gemm; and dz_in_gemm's in-place grad_weight is its fp32 sum rounded once."""
    from _half_logits_cases import float64_truth, normwise

    from grpo_kernels.ops.lm_head import triton as tri

    h, v = HEADS["qwen3-8b"]
    n, dt = 256, getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(n, h, device="cuda", generator=g).to(dt)
    w = (torch.randn(v, h, device="cuda", generator=g) * (3.0 / h**0.5)).to(dt)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_h = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    fp32_store, half_store = torch.empty(n, v, device="cuda"), tri.HalfLogits.empty(n, v, "cuda")
    stats = tri.lm_head_forward(x, w, None, y, 1.0, logits_out=fp32_store)
    stats16 = tri.lm_head_forward(x, w, None, y, 1.0, logits_out=half_store)
    assert all(torch.equal(a, b) for a, b in zip(stats, stats16)), "the statistics changed with the store's format"
    args = (x, w, None, y, 1.0, stats.lse, stats.expected_logit, g_lp, g_h)
    truth = float64_truth(x, w, None, y, 1.0, None, g_lp, g_h)
    reference = tri.lm_head_backward(*args, stored_logits=fp32_store, need_grad_bias=False)
    for dz_in_gemm in (False, True):
        got = tri.lm_head_backward(*args, stored_logits=half_store, need_grad_bias=False, dz_in_gemm=dz_in_gemm)
        for name, a, r, t in zip(("grad_hidden", "grad_weight"), got, reference, truth):
            half, fp32 = normwise(a, t), normwise(r, t)
            assert half <= 2 * fp32, f"{dtype} dz_in_gemm={dz_in_gemm} {name}: {half:.3g} > 2 x {fp32:.3g}"
    # schedule="one_pass_dz_inplace" on Triton's kernel: grad_weight summed into a 16-bit gradient buffer is, element
    # for element, the fp32 accumulator's result (same kernel, same order) added to it and rounded to nearest once
    start = (torch.randn(v, h, device="cuda", generator=g) * 1e-3).to(dt)
    wide = tri.lm_head_backward(*args, stored_logits=half_store, need_grad_bias=False, need_grad_hidden=False,
                                dz_in_gemm=True)[1]  # fmt: skip
    narrow = start.clone()
    tri.lm_head_backward(*args, stored_logits=half_store, need_grad_bias=False, need_grad_hidden=False,
                         dz_in_gemm=True, grad_weight_acc=narrow)  # fmt: skip
    differ = narrow != (start.float() + wide).to(dt)
    assert not differ.any(), f"{dtype}: {int(differ.sum())} in-place grad_weight elements are not one rounding"


# ------------------------------------------------------------------------------------------------
# csrc/ (last in the file: a kernel that hangs loses only this test): the fused loss with csrc's kernel A and
# kernel C at the target head, against the float64 truth and PyTorch's own 16-bit path
# ------------------------------------------------------------------------------------------------
CSRC_GATE_WAIT_S = 120  # longer than the session's gate limit (it writes a verdict when it kills the gate)


def csrc_gate_verdict(path: str | None, wait_s: float = CSRC_GATE_WAIT_S) -> dict | None:
    """In the GPU session the csrc gate runs beside this tier and writes its verdict into its JSON (the path in
    gpu_session.CSRC_GATE_ENV); None outside the session. Waits for the verdict: a gate that hung or crashed
    must stop csrc's tests before they hang a worker too."""
    if not path:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            verdict = json.loads(Path(path).read_text()).get("verdict")
            if verdict:
                return verdict
        if time.monotonic() > deadline:
            return {"status": "hung", "reason": f"no verdict in {path} after {wait_s:.0f} s"}
        time.sleep(0.5)


@pytest.mark.parametrize(("dtype", "schedule"), [("bfloat16", "one_pass_dz"), ("float16", "one_pass_dz"),
                                                ("bfloat16", "one_pass_dz_inplace")])  # fmt: skip
def test_csrc_kernels_a_and_c_in_the_fused_loss_at_the_target_head(dtype, schedule, monkeypatch):
    """GRPO_KERNELS_CSRC=1, schedule="one_pass_dz" (and its in-place grad_weight in bf16, the variant within the
    memory goal): kernel A's epilogue stores the fp16 logits, kernel C forms dz from them in both backward GEMMs;
    the same bar as every schedule (no worse than 2x PyTorch's own 16-bit error against the fp32 truth), and both
    csrc kernels must have run (a silent Triton fallback fails)."""
    from grpo_kernels.bench.gpu_session import CSRC_GATE_ENV, CSRC_GATE_STOPS
    from grpo_kernels.ops.lm_head import cutlass

    gate = csrc_gate_verdict(os.environ.get(CSRC_GATE_ENV))
    if gate and gate["status"] in CSRC_GATE_STOPS:
        pytest.fail(f"not run: the csrc gate {gate['status']} ({gate['reason']})")
    dt = getattr(torch, dtype)
    h, v = HEADS["qwen3-8b"]
    d = real_inputs(h, v, dt, seed=4)
    if not cutlass.applies(d["hidden"][0], d["weight"], None) or cutlass.load() is None:
        pytest.skip(f"csrc's kernels do not apply here: {cutlass.why_not() or 'not an sm_90 device'}")
    ran = {"a": 0, "c": 0}
    forward, backward = cutlass.forward_partials, cutlass.dz_gemms_csrc

    def counted_forward(*a, **k):
        ran["a"] += 1
        return forward(*a, **k)

    def counted_backward(*a, **k):
        ran["c"] += 1
        return backward(*a, **k)

    monkeypatch.setattr(cutlass, "forward_partials", counted_forward)
    monkeypatch.setattr(cutlass, "dz_gemms_csrc", counted_backward)
    monkeypatch.setenv(cutlass.ENV_SWITCH, "1")
    cfg = gk.PolicyLossConfig.dapo().replace(kl_coef=0.04)
    truth = fused_grads(d, cfg, "torch", torch.float32)
    ours = fused_grads(d, cfg, "triton", schedule=schedule)
    assert ran["a"] > 0 and ran["c"] > 0, f"csrc kernels ran {ran} times: the Triton path answered"
    check_against_truth(f"csrc {dtype} {schedule}", d, cfg, truth, ours)
