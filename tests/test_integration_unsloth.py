"""The Unsloth adapter (grpo_kernels.integrations.unsloth) against Unsloth's own code (unsloth and unsloth_zoo
2026.10.9, trl 1.15.0), on CPU.

Runs in the Unsloth environment only (.ci/steps/unsloth.sh builds it): Unsloth pins trl <= 1.15.0, so it cannot
share the parity environment's trl 1.16.0. Elsewhere the module skips, saying so.

1. The kernel: `UnslothLogProbsKernel` and Unsloth's own `fused_linear_logprobs` (its PyTorch path on CPU) against
   a float64 reference of the same formula (logit scale multiply / divide, soft-cap, temperature, bias, mask,
   entropy), values and the gradients of hidden, weight and bias. Tolerances: `fp32_bounds` derives them from
   fp32's unit roundoff u = 2^-24 and the sums involved (a logit is a dot product of H terms: rounding at most
   (H + 2) u sum_k |h_k w_k| (Higham, Accuracy and Stability, 3.1), then the transform and 1 / T; a log-prob or
   entropy sums V exponentials), never widened to pass.
2. The loss options: `policy_loss_config` + `loss_normalizers` with `grpo_kernels.grpo_loss` against Unsloth's
   `grpo_compute_loss` (and its entropy bonus weights) on the same log-probs, value and gradient, for every
   loss_type, both importance-sampling levels, delta, the clamped KL, the vLLM importance-sampling modes, the
   off-policy mask; and each unmapped option refused by name.
3. Training: Unsloth's generated `UnslothGRPOTrainer` (trl.GRPOTrainer after Unsloth patched TRL) and
   `GRPOKernelsTrainer` train a tiny model built here for two optimizer steps of two accumulated micro-batches
   each, num_iterations=2 (the second step off-policy), in fp32: every logged value, every parameter's gradient
   before each optimizer step and the parameters after training agree to fp32 rounding (the tolerances of
   tests/test_integration_trl.py, whose docstring derives them), with the kernel reached on every pass; the
   replacement is scoped to the adapter's trainer.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from parity_helpers import installed_version


def _skip_or_fail(reason: str, allow_module_level: bool = True) -> None:
    """Skip the module, or fail it where Unsloth must be there (GRPO_KERNELS_REQUIRE_UNSLOTH=1: the CI step)."""
    if os.environ.get("GRPO_KERNELS_REQUIRE_UNSLOTH") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


UNSLOTH_VERSION = "2026.10.9"
_ENVIRONMENT = (
    "the Unsloth environment that .ci/steps/unsloth.sh builds (unsloth pins trl<=1.15.0, so it cannot share the "
    "parity environment's trl 1.16.0)"
)
for _dist in ("unsloth", "unsloth_zoo"):
    _found = installed_version(_dist)
    if _found is None:
        _skip_or_fail(f"{_dist} is not installed: these tests run in {_ENVIRONMENT}", allow_module_level=True)
    if _found != UNSLOTH_VERSION:
        _skip_or_fail(f"{_dist}=={_found} is installed; these tests are pinned to {UNSLOTH_VERSION}: {_ENVIRONMENT}",
                    allow_module_level=True)  # fmt: skip

# Unsloth on a machine without a GPU: UNSLOTH_ALLOW_CPU=1 imports its GPU code path (what generates the GRPO
# trainer) instead of its CPU backend, which supports SFT only; its generated modules go to a temporary folder.
os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="grpo_kernels_unsloth_cache_"))
import unsloth  # noqa: E402, F401  (patches TRL and transformers: first)
import unsloth.models.rl as unsloth_rl  # noqa: E402

unsloth_rl._patch_trl_rl_trainers_impl("grpo_trainer")  # what Unsloth does on a GPU machine at import

import grpo_kernels.integrations.unsloth as gk_unsloth  # noqa: E402
import trl  # noqa: E402
import unsloth_zoo.fused_losses.fused_linear as unsloth_kernel_module  # noqa: E402
import unsloth_zoo.rl_replacements as unsloth_rl_replacements  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.parity

UNSLOTH_KERNEL = unsloth_kernel_module.fused_linear_logprobs  # Unsloth's own, as imported
U = 2.0**-24  # fp32 unit roundoff


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: thread start-up dominates every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------
# 1. The kernel against Unsloth's and against float64
# ---------------------------------------------------------------------------------------------------
def reference64(h, w, t, b, mask, temperature, mul, div, cap):
    """Unsloth's formula in float64: z = c tanh(s (h W^T + b) / c) / T (s = mul / div, each 0: absent)."""
    x = h.double() @ w.double().T
    if b is not None:
        x = x + b.double()
    scale = (mul or 1.0) / (div or 1.0)
    x = x * scale
    if cap:
        x = cap * torch.tanh(x / cap)
    z = x / temperature
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if mask is not None:
        logp, entropy = logp * mask, entropy * mask
    return logp, entropy, z


def fp32_bounds(h, w, b, z, temperature, mul, div):
    """Bounds on the fp32 rounding of one log-prob / entropy from these inputs (see the module docstring).

    dz: one logit's error, (H + 2) u sum_k |h_k w_k| (+ u |b|) times |s| / T, plus the transform's few
    roundings of |z|; a log-prob moves by at most 2 dz (its logit and the log-sum-exp) plus the rounding of
    a sum of V exponentials and a log, (V + 8) u; an entropy by the same times (1 + max |z|)."""
    H, V = w.shape[1], w.shape[0]
    scale = abs((mul or 1.0) / (div or 1.0))
    absdot = h.double().abs().reshape(-1, H) @ w.double().abs().T
    if b is not None:
        absdot = absdot + b.double().abs()
    dz = ((H + 2) * U * absdot.max().item() * scale + 4 * U * z.abs().max().item()) / temperature
    logp_tol = 2 * dz + (V + 8) * U
    return logp_tol, logp_tol * (1 + z.abs().max().item())


KERNEL_CASES = {
    # name: (N rows as a shape, H, V, temperature, mul, div, cap, bias, mask)
    "plain": ((37,), 24, 101, 1.0, 0.0, 0.0, 0.0, False, False),
    "gemma-softcap-scale-temperature": ((2, 19), 32, 67, 0.7, 1.5, 0.0, 5.0, True, False),
    "granite-divide-masked": ((3, 11), 16, 53, 1.3, 0.0, 4.0, 0.0, True, True),
}


def kernel_inputs(case, dtype, seed=0):
    shape, H, V, temperature, mul, div, cap, with_bias, with_mask = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, H, generator=g) * 1.5).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.4).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if with_bias else None
    t = torch.randint(0, V, shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.3) if with_mask else None
    return h, w, b, t, mask, dict(temperature=temperature, logit_scale_multiply=mul, logit_scale_divide=div,
                                  logit_softcapping=cap)  # fmt: skip


def run_kernel(kernel, h, w, b, t, mask, kw, upstream):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    logp, entropy = kernel(h, w, t, bias=b, mask=mask, return_entropy=True, **kw)
    ((logp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    return logp, entropy, h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_float64_and_unsloths_kernel_fp32(case):
    """fp32 inputs: ours and Unsloth's both within fp32 rounding of the float64 truth, values and gradients."""
    h, w, b, t, mask, kw = kernel_inputs(case, torch.float32)
    g = torch.Generator().manual_seed(1)
    upstream = (torch.randn(t.shape, generator=g), torch.randn(t.shape, generator=g) * 0.3)
    h64 = h.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    b64 = None if b is None else b.double().requires_grad_(True)
    mask64 = None if mask is None else mask.double()
    logp64, ent64, z64 = reference64(h64, w64, t, b64, mask64, kw["temperature"], kw["logit_scale_multiply"],
                                     kw["logit_scale_divide"], kw["logit_softcapping"])  # fmt: skip
    ((logp64 * upstream[0].double()).sum() + (ent64 * upstream[1].double()).sum()).backward()
    logp_tol, ent_tol = fp32_bounds(h, w, b, z64, kw["temperature"], kw["logit_scale_multiply"],
                                    kw["logit_scale_divide"])  # fmt: skip
    ours = run_kernel(gk_unsloth.UnslothLogProbsKernel(), h, w, b, t, mask, kw, upstream)
    theirs = run_kernel(UNSLOTH_KERNEL, h, w, b, t, mask, kw, upstream)
    grads64 = (h64.grad, w64.grad, None if b64 is None else b64.grad)
    for who, (logp, ent, *grads) in (("grpo_kernels", ours), ("unsloth", theirs)):
        assert logp.dtype == torch.float32 and logp.shape == t.shape
        assert_close(f"{who} logprobs", logp, logp64, atol=logp_tol, rtol=0)
        assert_close(f"{who} entropy", ent, ent64, atol=ent_tol, rtol=0)
        for name, got, truth in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, grads64, strict=True):
            if truth is None:
                continue
            # each element: the upstream-weighted sum of per-logit gradients, each off by at most the
            # log-prob / entropy bound relative to its size: the bound times the largest element
            scale = truth.abs().max().item()
            assert_close(f"{who} {name}", got, truth, atol=(logp_tol + ent_tol) * scale * 4, rtol=0)
    if mask is not None:  # rows outside the mask: 0 and no gradient
        assert bool((ours[0][~mask] == 0).all()) and bool((ours[2][~mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_keeps_fp32_logits(dtype):
    """Half-precision inputs: ours keeps the logits in fp32 (error within fp32 rounding of the float64 truth of the
    same rounded inputs); Unsloth's PyTorch path (CPU, and GPUs without an fp32-output GEMM) rounds the logits to
    the half dtype first, so its error is of half precision's order. Measured, not assumed: asserted below."""
    h, w, b, t, _, kw = kernel_inputs("gemma-softcap-scale-temperature", dtype)
    logp64, _, z64 = reference64(h.double(), w.double(), t, None if b is None else b.double(), None,
                                 kw["temperature"], kw["logit_scale_multiply"], kw["logit_scale_divide"],
                                 kw["logit_softcapping"])  # fmt: skip
    logp_tol, _ = fp32_bounds(h, w, b, z64, kw["temperature"], kw["logit_scale_multiply"], kw["logit_scale_divide"])
    with torch.no_grad():
        ours = gk_unsloth.UnslothLogProbsKernel()(h, w, t, bias=b, **kw)
        theirs = UNSLOTH_KERNEL(h, w, t, bias=b, **kw)
    assert_close("grpo_kernels logprobs", ours, logp64, atol=logp_tol, rtol=0)
    half_u = torch.finfo(dtype).eps / 2
    err_theirs = (theirs.double() - logp64).abs().max().item()
    err_ours = (ours.double() - logp64).abs().max().item()
    # outside fp32's worst-case rounding bound, and ten times ours: the logits were rounded to the half dtype
    assert err_theirs > max(logp_tol, 10 * err_ours), (dtype, err_theirs, err_ours, logp_tol)
    # and bounded by half precision's rounding of each logit (2 |z| u_half per log-prob, plus its sums)
    assert err_theirs <= 4 * half_u * (z64.abs().max().item() + 1) * 4


def test_kernel_follows_autocast_like_unsloths():
    """Under autocast the projection runs in autocast's dtype (Unsloth's _compute_dtype), with fp32 statistics."""
    h, w, b, t, _, kw = kernel_inputs("plain", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        ours = gk_unsloth.UnslothLogProbsKernel()(h, w, t, bias=b, **kw)
    logp64, _, z64 = reference64(h.bfloat16().double(), w.bfloat16().double(), t, None, None, 1.0, 0.0, 0.0, 0.0)
    logp_tol, _ = fp32_bounds(h, w, b, z64, 1.0, 0.0, 0.0)
    assert_close("logprobs under bf16 autocast", ours, logp64, atol=logp_tol, rtol=0)


def test_kernel_entropy_requires_grad_false_detaches_and_empty_input_stays_connected():
    h, w, _, t, _, kw = kernel_inputs("plain", torch.float32)
    h.requires_grad_(True)
    kernel = gk_unsloth.UnslothLogProbsKernel()
    _, entropy = kernel(h, w, t, return_entropy=True, entropy_requires_grad=False, **kw)
    assert not entropy.requires_grad
    empty = kernel(h[:0], w.requires_grad_(True), t[:0], **kw)
    assert empty.shape == (0,) and empty.requires_grad
    empty.sum().backward()
    assert h.grad is not None and bool((w.grad == 0).all())
    assert kernel.calls == 2


def test_kernel_batch_invariant_option_reaches_grpo_kernels():
    """grpo_kernels_batch_invariant: a row's log-prob and entropy scored alone are bitwise those it gets among
    others (grpo_kernels' batch-invariant mode, which the option must reach)."""
    h, w, b, t, _, kw = kernel_inputs("gemma-softcap-scale-temperature", torch.float32)
    kernel = gk_unsloth.UnslothLogProbsKernel(gk_unsloth.KernelOptions(backend="torch", batch_invariant=True))
    with torch.no_grad():
        batch_logp, batch_ent = kernel(h, w, t, bias=b, return_entropy=True, **kw)
        alone_logp, alone_ent = kernel(h[1, 3:9], w, t[1, 3:9], bias=b, return_entropy=True, **kw)
    assert torch.equal(alone_logp, batch_logp[1, 3:9]) and torch.equal(alone_ent, batch_ent[1, 3:9])


@pytest.mark.parametrize("flag", ["return_mean_logits", "return_log_sum_sq_probs", "return_is_top1"])
def test_kernel_refuses_statistics_it_does_not_compute(flag):
    h, w, _, t, _, kw = kernel_inputs("plain", torch.float32)
    with pytest.raises(NotImplementedError, match=flag):
        gk_unsloth.UnslothLogProbsKernel()(h, w, t, **{flag: True}, **kw)


def test_use_grpo_kernels_swaps_the_module_attribute_and_restores_it():
    assert unsloth_kernel_module.fused_linear_logprobs is UNSLOTH_KERNEL
    with gk_unsloth.use_grpo_kernels(backend="torch") as kernel:
        assert unsloth_kernel_module.fused_linear_logprobs is kernel
        with gk_unsloth.use_grpo_kernels() as inner:  # re-entrant: the outer kernel stays
            assert inner is kernel
        # Unsloth's GRPO scorer reaches it through its call-time import
        h, w, _, t, _, _ = kernel_inputs("plain", torch.float32)
        unsloth_rl_replacements.grpo_chunked_hidden_states_logprobs(h.unsqueeze(0), w, t.unsqueeze(0))
        assert kernel.calls == 1
    assert unsloth_kernel_module.fused_linear_logprobs is UNSLOTH_KERNEL
    with pytest.raises(ValueError, match="backend"), gk_unsloth.use_grpo_kernels(backend="cuda"):
        pass


def test_bypass_reasons_name_what_routes_around_the_kernel(monkeypatch):
    assert gk_unsloth.bypass_reasons() == []
    monkeypatch.setenv("UNSLOTH_VLLM_FP32_LM_HEAD", "1")
    monkeypatch.setenv("UNSLOTH_GRPO_CHUNKED_LOGPROBS", "0")
    reasons = gk_unsloth.bypass_reasons()
    assert any("UNSLOTH_VLLM_FP32_LM_HEAD" in r for r in reasons)
    assert any("UNSLOTH_GRPO_CHUNKED_LOGPROBS" in r for r in reasons)


# ---------------------------------------------------------------------------------------------------
# 2. The loss options against Unsloth's grpo_compute_loss
# ---------------------------------------------------------------------------------------------------
LENGTHS = (7, 3, 9, 1, 5, 8)
T_COLS = 9


def loss_inputs(seed: int, with_rollout: bool):
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.zeros(B, T_COLS)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    new = -torch.rand(B, T_COLS, generator=g) * 3 - 0.05
    old = new + torch.randn(B, T_COLS, generator=g) * 0.35  # ratios well outside the clip range
    ref = new + torch.randn(B, T_COLS, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    rollout = old + torch.randn(B, T_COLS, generator=g) * 0.2 if with_rollout else None
    if rollout is not None:
        rollout[1, 1] = float("nan")  # a token the sampler did not score (TRL / Unsloth: IS ratio 1)
    entropy = torch.rand(B, T_COLS, generator=g) * 2
    return dict(new=new, old=old, ref=ref, adv=adv, mask=mask, rollout=rollout, entropy=entropy)


def unsloth_loss(settings, x, *, num_items_in_batch, ga, spg, num_processes=1):
    """Unsloth's loss on float64 copies: grpo_compute_loss, plus its entropy bonus (sum of entropy x
    grpo_entropy_bonus_weights) when entropy_coef != 0. Returns the loss and d loss / d new."""
    grpo_trainer = trl.trainer.grpo_trainer.GRPOTrainer
    new = x["new"].double().requires_grad_(True)
    entropy = x["entropy"].double().requires_grad_(True)
    kwargs = {k: v for k, v in settings.items() if k not in ("beta", "entropy_coef", "temperature",
                                                             "top_entropy_quantile", "rollout_rs",
                                                             "rollout_logps_as_old", "sample_weight")}  # fmt: skip
    kwargs.update(num_items_in_batch=num_items_in_batch, current_gradient_accumulation_steps=ga,
                  steps_per_generation=spg, num_processes=num_processes,
                  get_off_policy_mask=grpo_trainer.get_off_policy_mask, get_gamma_weights=grpo_trainer.get_gamma_weights)  # fmt: skip
    rollout = None if x["rollout"] is None else x["rollout"].double()
    loss = unsloth_rl_replacements.grpo_compute_loss(
        x["ref"].double(), new, x["old"].double(), rollout, torch.zeros_like(x["mask"], dtype=torch.long),
        x["mask"].double(), settings["beta"], x["adv"].double(), **kwargs,
    )[0]  # fmt: skip
    if settings.get("entropy_coef", 0.0):
        weights = unsloth_rl_replacements.grpo_entropy_bonus_weights(
            x["mask"].double(), None, settings["entropy_coef"], dict(kwargs, loss_type=settings["loss_type"]),
            trl_version=trl.__version__,
        )  # fmt: skip
        loss = loss + (entropy * weights).sum()
    grad_new, grad_ent = torch.autograd.grad(loss, (new, entropy), allow_unused=True)
    return loss, grad_new, grad_ent


def ours_loss(settings, x, *, num_items_in_batch, ga, spg, num_processes=1):
    cfg = gk_unsloth.policy_loss_config(settings)
    norms = gk_unsloth.loss_normalizers(settings, x["mask"].shape[0], num_items_in_batch, grad_accum_steps=ga,
                                        steps_per_generation=spg, num_processes=num_processes)  # fmt: skip
    new = x["new"].clone().requires_grad_(True)
    entropy = x["entropy"].clone().requires_grad_(True)
    out = gk.grpo_loss(new, x["adv"], x["mask"], old_logprobs=x["old"], ref_logprobs=x["ref"],
                       rollout_logprobs=x["rollout"], entropy=entropy, config=cfg, backend="torch", **norms)  # fmt: skip
    grad_new, grad_ent = torch.autograd.grad(out.loss, (new, entropy), allow_unused=True)
    return out.loss, grad_new, grad_ent


def base_settings(**overrides):
    settings = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, max_completion_length=T_COLS, delta=None,
                    importance_sampling_level="token", beta=0.0, use_bias_correction_kl=False, use_vllm=False,
                    vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
                    vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0,
                    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                    vespo_k_neg=3.0, vespo_lambda_neg=2.0, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                    entropy_coef=0.0, temperature=1.0, rollout_rs=None, rollout_logps_as_old=False,
                    sample_weight=False)  # fmt: skip
    settings.update(overrides)
    return settings


LOSS_CASES = {
    **{f"{t}-token": dict(loss_type=t) for t in gk_unsloth.LOSS_AGG_MODE},
    **{f"{t}-sequence": dict(loss_type=t, importance_sampling_level="sequence") for t in ("grpo", "dapo", "luspo")},
    "dapo-delta-kl": dict(loss_type="dapo", delta=1.4, beta=0.04),
    "grpo-sequence-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1),
    "bnpo-big-kl": dict(loss_type="bnpo", beta=0.5),  # the KL clamps bind where ref - new > 2.5
    "bias-corrected-kl-without-beta": dict(loss_type="dapo", use_bias_correction_kl=True),
    "off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "entropy-bonus-grpo": dict(loss_type="grpo", entropy_coef=0.03),
    "entropy-bonus-dapo": dict(loss_type="dapo", entropy_coef=-0.02),
    **{f"vllm-is-{m}": dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode=m, vllm_importance_sampling_clip_min=0.5,
                            vllm_importance_sampling_clip_max=1.6) for m in gk_unsloth.VLLM_IS_MODES},  # fmt: skip
    "vllm-is-open-upper": dict(loss_type="grpo", use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.7,
                               vllm_importance_sampling_clip_max=None),
    "vespo-vllm-is": dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=True,
                          vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5),
    "off-policy-mask-rollout": dict(loss_type="cispo", off_policy_mask_threshold=0.02, use_vllm=True,
                                    vllm_importance_sampling_correction=True),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_policy_loss_config_computes_unsloths_loss(case, training):
    settings = base_settings(**LOSS_CASES[case])
    assert gk_unsloth.unmapped_settings(settings) == []
    x = loss_inputs(seed=hash(case) % 1000, with_rollout=settings["use_vllm"] or settings["off_policy_mask_threshold"]
                    is not None)  # fmt: skip
    if x["rollout"] is not None and not settings["vllm_importance_sampling_correction"]:
        x["rollout"][1, 1] = 0.0  # the off-policy mask alone: Unsloth does not nan-guard it
    counts = dict(num_items_in_batch=float(sum(LENGTHS)) * 2, ga=2 if training else 1, spg=4 if training else None)
    got, got_grad, got_ent_grad = ours_loss(settings, x, **counts)
    want, want_grad, want_ent_grad = unsloth_loss(settings, x, **counts)
    scale = max(1.0, abs(want.item()))
    assert_close(f"{case} loss", got, want, atol=1e-6 * scale, rtol=1e-6)
    assert_close(f"{case} d loss / d logp", got_grad, want_grad, atol=1e-6 * want_grad.abs().max().item(), rtol=1e-6)
    if want_ent_grad is not None and settings["entropy_coef"]:
        assert_close(f"{case} d loss / d entropy", got_ent_grad, want_ent_grad,
                     atol=1e-6 * want_ent_grad.abs().max().item(), rtol=1e-6)  # fmt: skip


UNMAPPED = {
    "geometric_mask": (dict(use_vllm=True, vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode="geometric_mask"), "geometric-mean sequence IS"),
    "geometric_truncate": (dict(use_vllm=True, vllm_importance_sampling_correction=True,
                                vllm_importance_sampling_mode="geometric_truncate"), "geometric-mean sequence IS"),
    "bias-corrected-kl": (dict(beta=0.04, use_bias_correction_kl=True), "use_bias_correction_kl=True with beta"),
    "rollout-rs": (dict(rollout_rs="seq_mean_k3"), "UNSLOTH_GRPO_ROLLOUT_RS"),
    "rollout-as-old": (dict(rollout_logps_as_old=True), "UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD"),
    "sample-weight": (dict(sample_weight=True), "UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE"),
    "unknown-loss": (dict(loss_type="gmpo"), "loss_type='gmpo'"),
}


@pytest.mark.parametrize("case", list(UNMAPPED))
def test_unmapped_options_are_refused_by_name(case):
    overrides, name = UNMAPPED[case]
    settings = base_settings(**overrides)
    problems = gk_unsloth.unmapped_settings(settings)
    assert len(problems) == 1 and name in problems[0], problems
    with pytest.raises(ValueError, match="cannot map"):
        gk_unsloth.policy_loss_config(settings)
    if case.startswith("geometric"):
        assert f"vllm_importance_sampling_mode={case}" in gk_unsloth.AWAITING_VARIANTS


def test_geometric_mode_without_the_correction_is_not_in_effect():
    """The IS mode only acts with use_vllm and the correction on, as in Unsloth: otherwise nothing to refuse."""
    settings = base_settings(vllm_importance_sampling_mode="geometric_mask")
    assert gk_unsloth.unmapped_settings(settings) == []


# ---------------------------------------------------------------------------------------------------
# 3. Training: UnslothGRPOTrainer with and without the adapter
# ---------------------------------------------------------------------------------------------------
WORDS = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(13)]
PROMPTS = ["a b c", "d e", "f g h i", "j k", "l m a", "b"]
LEARNING_RATE = 0.2
VALUE_RTOL, VALUE_ATOL = 1e-5, 1e-6
GRAD_TOL = 1e-5
NOT_COMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(kind: str):
    import transformers

    common = dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  pad_token_id=0, eos_token_id=1, bos_token_id=None, initializer_range=0.3)  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "granite":  # Unsloth's logit_scale_divide = logits_scaling
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0))
    if kind == "gemma2":  # Unsloth's logit_softcapping = final_logit_softcapping
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8,
                                                                         final_logit_softcapping=3.0))  # fmt: skip
    raise ValueError(kind)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_tokenizer()
    dirs = {}
    for kind in ("qwen2", "granite", "gemma2"):
        make_model(kind).save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        dirs[kind] = str(root / kind)
    return dirs


def reward_letters(completions, **kwargs):
    return [float(c.count("a") + 0.5 * c.count("b")) - 0.1 * len(c.split()) for c in completions]


class GradientRecorder(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def load_model(path):
    """The saved tiny model as Unsloth's loader hands it to a trainer: its for_training / for_inference switches
    (unsloth_zoo's CPU loader attaches them) and the float32 stamp a dtype=torch.float32 load sets (Unsloth then
    trains in float32 instead of fp16 autocast)."""
    import transformers
    from unsloth_zoo.cpu.loader import FastCPUModel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    FastCPUModel._attach(model)
    model._unsloth_user_float32 = True
    return model


def train(trainer_class, path, tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, gradient_accumulation_steps=2, num_iterations=2, learning_rate=LEARNING_RATE, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, fp16=False, seed=0, disable_tqdm=True, loss_type="dapo", beta=0.04,
        use_bias_correction_kl=False,
    )  # fmt: skip
    settings.update(overrides)
    recorder = GradientRecorder()
    trainer = trainer_class(model=load_model(path), reward_funcs=reward_letters, args=trl.GRPOConfig(**settings),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer(),
                            callbacks=[recorder])  # fmt: skip
    trainer.train()
    return trainer, recorder


TRAIN_CASES = {
    # name: (model, GRPOConfig overrides, what some kernel call must have received). Each reaches a different
    # Unsloth log-prob route: the entropy bonus the recompute scorer with the entropy's gradient, the top-entropy
    # mask the entropy without it; Granite's logits_scaling arrives as logit_scale_divide, Gemma 2's soft-cap as
    # logit_softcapping, the temperature as itself.
    "qwen2-dapo-kl": ("qwen2", {}, {}),
    "qwen2-grpo-sequence-delta": ("qwen2", dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5,
                                                beta=0.0), {}),  # fmt: skip
    "qwen2-bnpo-entropy-bonus": ("qwen2", dict(loss_type="bnpo", entropy_coef=0.05),
                                 dict(return_entropy=True, entropy_requires_grad=True)),  # fmt: skip
    "qwen2-cispo-top-entropy": ("qwen2", dict(loss_type="cispo", top_entropy_quantile=0.5, beta=0.0),
                                dict(return_entropy=True, entropy_requires_grad=False)),  # fmt: skip
    "granite-temperature": ("granite", dict(loss_type="dr_grpo", temperature=0.7),
                            dict(logit_scale_divide=4.0, temperature=0.7)),  # fmt: skip
    "gemma2-softcap": ("gemma2", dict(loss_type="sapo"), dict(logit_softcapping=3.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_matches_unsloths_trainer(case, model_dirs, tmp_path, monkeypatch):
    kind, overrides, expected_call = TRAIN_CASES[case]
    calls_before = dict(unsloth_kernel_module.CALLS)
    stock, stock_grads = train(trl.GRPOTrainer, model_dirs[kind], tmp_path / "stock", **overrides)
    assert unsloth_kernel_module.CALLS["logprobs"] > calls_before["logprobs"], "the stock run used Unsloth's kernel"
    seen = []
    kernel_call = gk_unsloth.UnslothLogProbsKernel.__call__

    def recording(self, hidden, weight, targets, **kwargs):
        seen.append(kwargs)
        return kernel_call(self, hidden, weight, targets, **kwargs)

    monkeypatch.setattr(gk_unsloth.UnslothLogProbsKernel, "__call__", recording)
    ours, our_grads = train(gk_unsloth.GRPOKernelsTrainer, model_dirs[kind], tmp_path / "ours", **overrides)
    assert isinstance(ours, trl.GRPOTrainer) and type(stock).__name__ == "UnslothGRPOTrainer"
    assert ours.grpo_kernels_kernel.calls == len(seen) > 0
    assert any(all(call.get(k) == v for k, v in expected_call.items()) for call in seen), (expected_call, seen[:3])
    assert unsloth_kernel_module.fused_linear_logprobs is UNSLOTH_KERNEL  # restored after every step
    # every logged value
    assert len(stock.state.log_history) == len(ours.state.log_history)
    for step, (want, got) in enumerate(zip(stock.state.log_history, ours.state.log_history, strict=True)):
        assert set(want) == set(got), (step, set(want) ^ set(got))
        for key, value in want.items():
            if key in NOT_COMPARED or not isinstance(value, (int, float)):
                continue
            assert math.isclose(got[key], value, rel_tol=VALUE_RTOL, abs_tol=VALUE_ATOL), (step, key, got[key], value)
    # every gradient before each optimizer step: step s starts from parameters that differ by the learning rate
    # times the earlier steps' differences (tests/test_integration_trl.py, grad_tolerance)
    assert len(stock_grads.steps) == len(our_grads.steps) == 2
    for step, (want, got) in enumerate(zip(stock_grads.steps, our_grads.steps, strict=True)):
        assert set(want) == set(got)
        largest = max(g.abs().max().item() for g in want.values())
        tol = GRAD_TOL * (1 + 2 * step) * largest
        for name in want:
            assert_close(f"step {step} grad {name}", got[name], want[name], atol=tol, rtol=GRAD_TOL)
    # the parameters after training
    want_params = dict(stock.model.named_parameters())
    largest = max(p.abs().max().item() for p in want_params.values())
    for name, param in ours.model.named_parameters():
        assert_close(f"param {name}", param, want_params[name],
                     atol=1e-6 * largest + LEARNING_RATE * 3 * GRAD_TOL * largest, rtol=0)  # fmt: skip


def test_loss_settings_read_the_trainers_options(model_dirs, tmp_path):
    """loss_settings reads what the generated trainer hands its loss, Unsloth's defaults included."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, use_cpu=True, report_to=[], loss_type="cispo", beta=0.02,
                          use_bias_correction_kl=False, epsilon_high=4.0, top_entropy_quantile=0.8)  # fmt: skip
    trainer = trl.GRPOTrainer(model=load_model(model_dirs["qwen2"]), reward_funcs=reward_letters, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer())  # fmt: skip
    settings = gk_unsloth.loss_settings(trainer)
    assert settings["loss_type"] == "cispo" and settings["beta"] == 0.02 and settings["epsilon_high"] == 4.0
    assert settings["top_entropy_quantile"] == 0.8 and not settings["use_vllm"]
    cfg = gk_unsloth.policy_loss_config(settings)
    assert (cfg.loss_type, cfg.cispo_form, cfg.cispo_cap, cfg.kl_estimator) == ("cispo", "absolute", 4.0, "low_var_kl")


def test_fused_mode_and_bad_options_are_refused(model_dirs, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, use_cpu=True, report_to=[])  # fmt: skip
    common = dict(model=load_model(model_dirs["qwen2"]), reward_funcs=reward_letters, args=args,
                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match="re-implement unsloth_zoo's grpo_accumulated_loss"):
        gk_unsloth.GRPOKernelsTrainer(grpo_kernels_mode="fused", **common)
    with pytest.raises(ValueError, match="grpo_kernels_backend"):
        gk_unsloth.GRPOKernelsTrainer(grpo_kernels_backend="cuda", **common)


def test_bypassing_setting_is_refused_when_the_trainer_is_built(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("UNSLOTH_VLLM_FP32_LM_HEAD", "1")
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, use_cpu=True, report_to=[])  # fmt: skip
    with pytest.raises(ValueError, match="UNSLOTH_VLLM_FP32_LM_HEAD"):
        gk_unsloth.GRPOKernelsTrainer(model=load_model(model_dirs["qwen2"]), reward_funcs=reward_letters, args=args,
                                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                      processing_class=make_tokenizer())  # fmt: skip


def test_trainer_class_needs_unsloths_patched_trl(monkeypatch):
    class GRPOTrainer:  # TRL's own, as before Unsloth patched it
        pass

    monkeypatch.setattr(trl, "GRPOTrainer", GRPOTrainer)
    with pytest.raises(RuntimeError, match="Import unsloth"):
        gk_unsloth._unsloth_grpo_trainer()
