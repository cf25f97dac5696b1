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
   loss_type, both importance-sampling levels, delta, the clamped KL, the vLLM importance-sampling modes
   (token, sequence and geometric), the off-policy mask, the token_k1 rollout rejection, the sampler's
   log-probs as the old policy; and each unmapped option refused by name.
3. Training: Unsloth's generated `UnslothGRPOTrainer` (trl.GRPOTrainer after Unsloth patched TRL) and
   `GRPOKernelsTrainer` train a tiny model built here for two optimizer steps of two accumulated micro-batches
   each, num_iterations=2 (the second step off-policy), in fp32: every logged value, every parameter's gradient
   before each optimizer step and the parameters after training agree to fp32 rounding (the tolerances of
   tests/test_integration_trl.py, whose docstring derives them), with the kernel reached on every pass; the
   replacement is scoped to the adapter's trainer.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
import types
import zlib
from pathlib import Path

import pytest
import torch
from checkout import CHECKOUT
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
# trainer) instead of its CPU backend, which supports SFT only. Its generated modules (UnslothGRPOTrainer.py,
# moe_utils.py) go to UNSLOTH_COMPILE_LOCATION, by default ./unsloth_compiled_cache: here a temporary folder,
# removed at exit, and the fixture nothing_lands_in_the_checkout checks that none appeared where pytest runs.
_STRAY_CACHES = {path: path.exists() for path in {CHECKOUT / "unsloth_compiled_cache",
                                                  Path.cwd() / "unsloth_compiled_cache"}}  # fmt: skip
os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")
if "UNSLOTH_COMPILE_LOCATION" not in os.environ:
    os.environ["UNSLOTH_COMPILE_LOCATION"] = tempfile.mkdtemp(prefix="grpo_kernels_unsloth_cache_")
    atexit.register(shutil.rmtree, os.environ["UNSLOTH_COMPILE_LOCATION"], ignore_errors=True)
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
def custom_op_aliasing_warns():
    """Where the environment variable CI is set, torch turns one of its warnings into an error
    (torch._functorch.config.error_on_custom_op_aliasing defaults to bool($CI)): a compiled custom op whose output
    aliases an input. The op is inductor's own buffer-pool allocator (inductor::_alloc_from_pool) in the code it
    generates for the attention-mask function unsloth_zoo compiles (temporary_patches/misc.py), reached by the
    stock Unsloth run and by ours alike; no grpo_kernels code is compiled there. Here it stays what it is in a
    user's run, a warning, whether or not the machine calls itself a CI."""
    with torch._functorch.config.patch(error_on_custom_op_aliasing=False):
        yield


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: thread start-up dominates every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def nothing_lands_in_the_checkout():
    """After the module (the import, the generated trainer, the trainings): no unsloth_compiled_cache folder in the
    checkout or the folder pytest runs in that was not there before."""
    yield
    new = [str(path) for path, existed in _STRAY_CACHES.items() if path.exists() and not existed]
    assert not new, f"Unsloth wrote its generated modules into {new}, not UNSLOTH_COMPILE_LOCATION"


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


def old_and_sampling(settings, x):
    """The old and sampler log-probs grpo_compute_loss receives: the old policy's and the sampler's, or with
    UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD the sampler's as old (an unscored token taking the current log-prob, by
    Unsloth's own grpo_rollout_old_fill_unscored) and none as the sampler's, as grpo_accumulated_loss passes them."""
    if settings["rollout_logps_as_old"]:
        return unsloth_rl_replacements.grpo_rollout_old_fill_unscored(x["rollout"], x["new"])[0], None
    return x["old"], x["rollout"]


def unsloth_loss(settings, x, *, num_items_in_batch, ga, spg, num_processes=1):
    """Unsloth's loss on float64 copies: grpo_compute_loss, plus its entropy bonus (sum of entropy x
    grpo_entropy_bonus_weights) when entropy_coef != 0. The rollout rejection is parsed by Unsloth's own
    grpo_parse_rollout_rs. Returns the loss and d loss / d new."""
    grpo_trainer = trl.trainer.grpo_trainer.GRPOTrainer
    new = x["new"].double().requires_grad_(True)
    entropy = x["entropy"].double().requires_grad_(True)
    kwargs = {k: v for k, v in settings.items() if k not in ("beta", "entropy_coef", "temperature",
                                                             "top_entropy_quantile", "rollout_rs",
                                                             "rollout_rs_threshold", "rollout_logps_as_old",
                                                             "sample_weight")}  # fmt: skip
    kwargs.update(num_items_in_batch=num_items_in_batch, current_gradient_accumulation_steps=ga,
                  steps_per_generation=spg, num_processes=num_processes,
                  get_off_policy_mask=grpo_trainer.get_off_policy_mask, get_gamma_weights=grpo_trainer.get_gamma_weights)  # fmt: skip
    if settings["rollout_logps_as_old"]:
        kwargs["rollout_logps_as_old"] = True
    rollout_rs = unsloth_rl_replacements.grpo_parse_rollout_rs(settings["rollout_rs"], settings["rollout_rs_threshold"])
    if rollout_rs is not None:
        kwargs["rollout_rs"] = rollout_rs
    old, sampling = old_and_sampling(settings, x)
    loss = unsloth_rl_replacements.grpo_compute_loss(
        x["ref"].double(), new, old.double(), None if sampling is None else sampling.double(),
        torch.zeros_like(x["mask"], dtype=torch.long), x["mask"].double(), settings["beta"], x["adv"].double(),
        **kwargs,
    )[0]  # fmt: skip
    if settings.get("entropy_coef", 0.0):
        weights = unsloth_rl_replacements.grpo_entropy_bonus_weights(
            x["mask"].double(), None, settings["entropy_coef"], dict(kwargs, loss_type=settings["loss_type"]),
            trl_version=trl.__version__,
        )  # fmt: skip
        loss = loss + (entropy * weights).sum()
    grad_new, grad_ent = torch.autograd.grad(loss, (new, entropy), allow_unused=True)
    return loss, grad_new, grad_ent


def ours_loss(settings, x, *, num_items_in_batch, ga, spg, num_processes=1, cfg=None):
    cfg = cfg or gk_unsloth.policy_loss_config(settings)
    norms = gk_unsloth.loss_normalizers(settings, x["mask"].shape[0], num_items_in_batch, grad_accum_steps=ga,
                                        steps_per_generation=spg, num_processes=num_processes)  # fmt: skip
    new = x["new"].clone().requires_grad_(True)
    entropy = x["entropy"].clone().requires_grad_(True)
    old, sampling = old_and_sampling(settings, x)
    out = gk.grpo_loss(new, x["adv"], x["mask"], old_logprobs=old, ref_logprobs=x["ref"], rollout_logprobs=sampling,
                       entropy=entropy, config=cfg, backend="torch", **norms)  # fmt: skip
    grad_new, grad_ent = torch.autograd.grad(out.loss, (new, entropy), allow_unused=True)
    return out.loss, grad_new, grad_ent


def base_settings(**overrides):
    settings = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, max_completion_length=T_COLS, delta=None,
                    importance_sampling_level="token", beta=0.0, use_bias_correction_kl=False, use_vllm=False,
                    vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
                    vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0,
                    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                    vespo_k_neg=3.0, vespo_lambda_neg=2.0, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                    entropy_coef=0.0, temperature=1.0, rollout_rs=None, rollout_rs_threshold=None,
                    rollout_logps_as_old=False, sample_weight=False)  # fmt: skip
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
                            vllm_importance_sampling_clip_max=1.6)
       for m in gk_unsloth.VLLM_IS_MODES if not m.startswith("geometric")},  # fmt: skip
    # the geometric mean of a sequence's weights stays near 1: bounds that bind on some of the case's sequences
    # (test_the_new_cases_bounds_bind)
    **{f"vllm-is-{m}": dict(loss_type=t, use_vllm=True, vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode=m, vllm_importance_sampling_clip_min=low,
                            vllm_importance_sampling_clip_max=high)
       for m, t, low, high in (("geometric_mask", "dapo", 0.9, 1.1),
                               ("geometric_truncate", "grpo", 0.95, 1.05))},  # fmt: skip
    "vllm-is-geometric-mask-lower-only": dict(loss_type="cispo", use_vllm=True,
                                              vllm_importance_sampling_correction=True,
                                              vllm_importance_sampling_mode="geometric_mask",
                                              vllm_importance_sampling_clip_min=0.97,
                                              vllm_importance_sampling_clip_max=None),  # fmt: skip
    "vllm-is-open-upper": dict(loss_type="grpo", use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.7,
                               vllm_importance_sampling_clip_max=None),
    "vllm-is-mask-unbounded": dict(loss_type="bnpo", use_vllm=True, vllm_importance_sampling_correction=True,
                                   vllm_importance_sampling_mode="sequence_mask",
                                   vllm_importance_sampling_clip_min=None,
                                   vllm_importance_sampling_clip_max=None),  # fmt: skip
    # verl's rollout rejection token_k1 on pi_sampler / pi_old, with the IS correction (its only effect there)
    "rollout-rs-token-k1": dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
                                vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.5,
                                vllm_importance_sampling_clip_max=1.6, rollout_rs="token_k1",
                                rollout_rs_threshold="0.85_1.2"),  # fmt: skip
    "rollout-rs-token-k1-geometric": dict(loss_type="sapo", use_vllm=True, vllm_importance_sampling_correction=True,
                                          vllm_importance_sampling_mode="geometric_truncate",
                                          vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1,
                                          rollout_rs="token_k1", rollout_rs_threshold="1.15"),  # fmt: skip
    "rollout-rs-without-correction": dict(loss_type="dapo", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.01"),
    # the sampler's log-probs as the old policy (verl's bypass mode): the ratio to them, clamped to [-20, 20]; the IS
    # correction, on, has nothing to weight (a token mode: Unsloth refuses vespo with a sequence mode either way)
    **{f"rollout-as-old-{t}": dict(loss_type=t, rollout_logps_as_old=True, use_vllm=True,
                                   vllm_importance_sampling_correction=True,
                                   vllm_importance_sampling_mode="token_truncate")
       for t in ("dapo", "grpo", "cispo", "sapo", "vespo")},  # fmt: skip
    "rollout-as-old-off-policy-mask-kl": dict(loss_type="bnpo", rollout_logps_as_old=True, beta=0.04,
                                              off_policy_mask_threshold=0.02, use_vllm=True),  # fmt: skip
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
    x = case_inputs(case, settings)
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


def case_inputs(case, settings):
    """The loss inputs of a LOSS_CASES entry: sampler log-probs where the case reads them (one unscored, NaN)."""
    with_rollout = settings["use_vllm"] or settings["off_policy_mask_threshold"] is not None
    x = loss_inputs(seed=zlib.crc32(case.encode()) % 1000, with_rollout=with_rollout)
    sampler_guarded = settings["vllm_importance_sampling_correction"] or settings["rollout_logps_as_old"]
    if x["rollout"] is not None and not sampler_guarded:
        x["rollout"][1, 1] = 0.0  # the off-policy mask alone: Unsloth does not nan-guard it
    return x


def _bound_binds(values, low, high):
    """Some of `values` (the valid ones) inside [low, high] and some outside (None: no bound)."""
    inside = torch.ones_like(values, dtype=torch.bool)
    if low is not None:
        inside &= values >= low
    if high is not None:
        inside &= values <= high
    return bool(inside.any()) and bool((~inside).any())


@pytest.mark.parametrize("case", [c for c in LOSS_CASES if "geometric" in c or c.startswith("rollout-rs-token-k1")])
def test_the_new_cases_bounds_bind(case):
    """The geometric IS bounds and the token_k1 rejection bounds keep some of the test's sequences / tokens and
    drop or clamp others: the comparisons above are not vacuous."""
    settings = base_settings(**LOSS_CASES[case])
    x = case_inputs(case, settings)
    valid = x["mask"].bool()
    log_ratio = torch.where(valid, torch.nan_to_num(x["old"] - x["rollout"], nan=0.0), torch.zeros(()))
    if "geometric" in settings["vllm_importance_sampling_mode"]:
        geometric = torch.exp(log_ratio.sum(-1) / valid.sum(-1))
        assert _bound_binds(geometric, settings["vllm_importance_sampling_clip_min"],
                            settings["vllm_importance_sampling_clip_max"]), geometric  # fmt: skip
    if settings["rollout_rs"]:
        cfg = gk_unsloth.policy_loss_config(settings)
        assert _bound_binds(log_ratio.exp()[valid], cfg.is_gate_min, cfg.is_gate_max)


def test_rollout_logps_as_old_clamps_the_ratio_like_unsloth():
    """With the sampler's log-probs as old, Unsloth clamps log(pi / pi_sampler) to [-20, 20] (verl's bound); a token
    25 nats above its sampler log-prob, with A < 0 (where PPO keeps the unclipped ratio), shows the clamp: equal
    with it (value and gradient, the gradient 0 there), and far off without it."""
    settings = base_settings(loss_type="dapo", rollout_logps_as_old=True)
    x = loss_inputs(seed=5, with_rollout=True)
    x["adv"][0] = -0.7
    x["rollout"][0, 2] = x["new"][0, 2] - 25.0
    counts = dict(num_items_in_batch=float(sum(LENGTHS)), ga=1, spg=None)
    got, got_grad, _ = ours_loss(settings, x, **counts)
    want, want_grad, _ = unsloth_loss(settings, x, **counts)
    assert_close("loss", got, want, atol=0, rtol=1e-6)
    assert_close("d loss / d logp", got_grad, want_grad, atol=1e-6 * want_grad.abs().max().item(), rtol=1e-6)
    assert got_grad[0, 2] == 0 and want_grad[0, 2] == 0
    cfg = gk_unsloth.policy_loss_config(settings)
    assert cfg.log_ratio_clamp == gk_unsloth.ROLLOUT_LOG_RATIO_CLAMP and cfg.is_level is None
    old, _ = old_and_sampling(settings, x)
    unclamped = gk.grpo_loss(x["new"], x["adv"], x["mask"], old_logprobs=old, config=cfg.replace(log_ratio_clamp=None),
                             backend="torch", num_tokens=counts["num_items_in_batch"]).loss  # fmt: skip
    assert unclamped.item() > 100 * want.item() > 0


def test_seq_mean_k1_is_the_sequence_gate_but_for_unsloths_clamp():
    """Why seq_mean_k1 stays refused: grpo_kernels' sequence ratio gate (bounds 1 / upper, 1 / lower) computes it on
    ordinary inputs, but Unsloth clamps each token's log-ratio to [-20, 20] before the sequence mean: one token 25
    nats less likely at the sampler than at the old policy moves its sequence's mean apart, and the decision with it
    (Unsloth keeps the sequence, the gate drops it)."""
    settings = base_settings(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
                             vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.5,
                             vllm_importance_sampling_clip_max=1.6, rollout_rs="seq_mean_k1",
                             rollout_rs_threshold="0.07_1.2")  # fmt: skip
    assert "seq_mean_k1" in gk_unsloth.unmapped_settings(settings)[0]
    gate = gk_unsloth.policy_loss_config(dict(settings, rollout_rs=None)).replace(
        is_gate="ratio", is_gate_level="sequence", is_gate_min=1 / 1.2, is_gate_max=1 / 0.07
    )
    x = loss_inputs(seed=7, with_rollout=True)
    counts = dict(num_items_in_batch=float(sum(LENGTHS)), ga=1, spg=None)
    got, got_grad, _ = ours_loss(settings, x, cfg=gate, **counts)
    want, want_grad, _ = unsloth_loss(settings, x, **counts)
    assert_close("ordinary inputs: loss", got, want, atol=1e-6, rtol=1e-6)
    assert_close("ordinary inputs: d loss / d logp", got_grad, want_grad, atol=1e-6, rtol=1e-6)
    x["rollout"][2, 4] = x["old"][2, 4] - 25.0  # row 2 has 9 tokens: its mean moves by 5 / 9
    got, got_grad, _ = ours_loss(settings, x, cfg=gate, **counts)
    want, want_grad, _ = unsloth_loss(settings, x, **counts)
    assert bool((got_grad[2, :9] == 0).all()) and bool((want_grad[2, :9] != 0).any())


@pytest.mark.parametrize("spec", ["2.0", "1.15", "0.85_1.2", " 0.85_1.2, ", "0.5_0.5", "0", "-2", "1.2_0.8", "x", "0.5_",
                                  "1e-12_1e12", "2,3"])
def test_token_k1_thresholds_read_as_unsloth_reads_them(spec):
    """The adapter reads a token_k1 threshold (lower = 1 / upper when one number) as Unsloth's own parser does, and
    refuses by name what Unsloth refuses or what the gate cannot equal (bounds beyond e^+-20, lower = upper)."""
    try:
        ((_, log_lower, log_upper),) = unsloth_rl_replacements.grpo_parse_rollout_rs("token_k1", spec)
        theirs = (math.exp(log_lower), math.exp(log_upper))
    except (ValueError, ZeroDivisionError):  # Unsloth's refusals ("0": 1 / 0 before its check)
        theirs = None
    ours = gk_unsloth._token_k1_bounds(spec)
    assert (ours is None) == (theirs is None), (spec, ours, theirs)
    if ours is not None:
        assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
    settings = base_settings(use_vllm=True, vllm_importance_sampling_correction=True, rollout_rs="token_k1",
                             rollout_rs_threshold=spec)  # fmt: skip
    mapped = ours is not None and math.exp(-20) < ours[0] < ours[1] < math.exp(20)
    assert (gk_unsloth.unmapped_settings(settings) == []) == mapped, gk_unsloth.unmapped_settings(settings)


_IS = dict(use_vllm=True, vllm_importance_sampling_correction=True)
UNMAPPED = {
    "bias-corrected-kl": (dict(beta=0.04, use_bias_correction_kl=True), "use_bias_correction_kl=True with beta"),
    "vespo-geometric": (dict(_IS, loss_type="vespo", vllm_importance_sampling_mode="geometric_mask"),
                        "with loss_type='vespo': Unsloth refuses it"),  # fmt: skip
    "geometric-truncate-unbounded": (dict(_IS, vllm_importance_sampling_mode="geometric_truncate",
                                          vllm_importance_sampling_clip_max=None), "Unsloth's clamp raises"),  # fmt: skip
    "rollout-rs-seq-mean-k1": (dict(_IS, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
                               "clamps each token's log-ratio to [-20, 20] before the mean"),  # fmt: skip
    "rollout-rs-seq-sum-k1": (dict(_IS, rollout_rs="seq_sum_k1", rollout_rs_threshold="2"), "the product"),
    "rollout-rs-k3": (dict(_IS, rollout_rs="seq_max_k3", rollout_rs_threshold="0.1"), "k3 = r - 1 - log r"),
    "rollout-rs-two-options": (dict(_IS, rollout_rs="token_k1,token_k2", rollout_rs_threshold="2"), "one gate"),
    "rollout-rs-kl": (dict(_IS, beta=0.04, rollout_rs="token_k1", rollout_rs_threshold="2"), "KL term"),
    "rollout-rs-entropy-bonus": (dict(_IS, entropy_coef=0.01, rollout_rs="token_k1", rollout_rs_threshold="2"),
                                 "entropy bonus"),  # fmt: skip
    "rollout-rs-vespo": (dict(_IS, loss_type="vespo", vllm_importance_sampling_mode="token_mask",
                              rollout_rs="token_k1", rollout_rs_threshold="2"), "no gate for vespo"),  # fmt: skip
    "rollout-rs-wide-bounds": (dict(_IS, rollout_rs="token_k1", rollout_rs_threshold="1e-10_1e10"), "e^-20"),
    "rollout-rs-bad-threshold": (dict(_IS, rollout_rs="token_k1", rollout_rs_threshold=None), "not a token_k1"),
    "rollout-rs-as-old": (dict(rollout_logps_as_old=True, rollout_rs="token_k1", rollout_rs_threshold="2"),
                          "the current policy against the sampler"),  # fmt: skip
    "rollout-as-old-sequence": (dict(rollout_logps_as_old=True, importance_sampling_level="sequence"),
                                "before the sequence mean"),  # fmt: skip
    "rollout-as-old-vespo-geometric": (dict(_IS, rollout_logps_as_old=True, loss_type="vespo",
                                            vllm_importance_sampling_mode="geometric_truncate"),
                                       "with loss_type='vespo': Unsloth refuses it"),  # fmt: skip
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


def test_options_not_in_effect_are_not_refused():
    """As in Unsloth, the IS mode acts only with use_vllm and the correction on, the rollout rejection only where it
    has a sampler log-ratio to test (the correction on, or the sampler's log-probs as old): otherwise nothing to
    refuse, and nothing in the config."""
    for overrides in (dict(vllm_importance_sampling_mode="geometric_mask", loss_type="vespo"),
                      dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="2"),
                      dict(use_vllm=True, rollout_rs="token_k2", rollout_rs_threshold="2")):  # fmt: skip
        settings = base_settings(**overrides)
        assert gk_unsloth.unmapped_settings(settings) == [], overrides
        cfg = gk_unsloth.policy_loss_config(settings)
        assert cfg.is_level is None and cfg.is_gate is None, overrides


def test_loss_settings_read_unsloths_environment(monkeypatch):
    """loss_settings applies Unsloth's environment overrides (UNSLOTH_GRPO_VLLM_IS_MODE, _VLLM_IS_CLIP, _ROLLOUT_RS
    and its threshold, _ROLLOUT_LOGPROBS_AS_OLD) over the trainer's settings, as grpo_accumulated_loss does."""
    args = types.SimpleNamespace(loss_type="dapo", max_completion_length=8, delta=None, temperature=1.0,
                                 vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=None,
                                 vllm_importance_sampling_clip_max=3.0)  # fmt: skip
    trainer = types.SimpleNamespace(args=args, epsilon_low=0.2, epsilon_high=0.28, beta=0.0, use_vllm=True,
                                    vllm_importance_sampling_correction=True)  # fmt: skip
    monkeypatch.setenv("UNSLOTH_GRPO_VLLM_IS_MODE", "geometric_mask")
    monkeypatch.setenv("UNSLOTH_GRPO_VLLM_IS_CLIP", "0.999_1.001")
    monkeypatch.setenv("UNSLOTH_GRPO_ROLLOUT_RS", "token_k1")
    monkeypatch.setenv("UNSLOTH_GRPO_ROLLOUT_RS_THRESHOLD", "0.5_1.5")
    settings = gk_unsloth.loss_settings(trainer)
    assert settings["vllm_importance_sampling_mode"] == "geometric_mask"
    assert (settings["rollout_rs"], settings["rollout_rs_threshold"]) == ("token_k1", "0.5_1.5")
    cfg = gk_unsloth.policy_loss_config(settings)
    assert (cfg.is_level, cfg.is_mode, cfg.is_min, cfg.is_max) == ("sequence_geometric", "mask", 0.999, 1.001)
    assert (cfg.is_gate, cfg.is_gate_level, cfg.is_gate_min, cfg.is_gate_max) == ("ratio", "token", 1 / 1.5, 2.0)
    assert cfg.log_ratio_clamp is None
    monkeypatch.delenv("UNSLOTH_GRPO_ROLLOUT_RS")
    monkeypatch.setenv("UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD", "1")
    cfg = gk_unsloth.policy_loss_config(gk_unsloth.loss_settings(trainer))
    assert cfg.is_level is None and cfg.is_gate is None and cfg.log_ratio_clamp == 20.0


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
