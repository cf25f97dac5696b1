"""csrc/ (the CUTLASS sm_90a kernel A, grpo_kernels/ops/lm_head/cutlass.py) without a GPU.

1. The epilogue's arithmetic: per-tile partials and their merge (`tile_partials`, `merge_partials`) in float64
   equal the full-row float64 log-softmax / entropy / lse / E_p[z] to float64 rounding, and in fp32 (the kernel's
   arithmetic up to summation order) stay within `stats_error_bound`, a bound that a wrong fold exceeds.
   Derivation of the fp32 bound, per row, with eps = 2^-24: rounding z to fp32 moves every statistic by at most
   2 eps max|z| (z_y and lse each by eps max|z|); inside a tile d = z - m and d log2 e carry eps |d| each and
   ex2 a few ulp, so each term e = exp(d) has a relative error <= ~3 eps (1 + |d|); a sum of L terms adds L eps
   relative; the merge's rescales exp(m_k - m') are terms of the same kind. log s and u / s (|u / s| <= spread)
   thus err by <= eps (L + 4)(1 + spread) ... (3 + 1) of that is taken: 4 eps (L + 8)(1 + spread), with
   L = block_n + num_tiles the longest summation path (a thread's columns, the quad shuffles, the tiles).
2. The library's build: the committed csrc/bin/ matches the sources (stamp) and its ptxas report shows no spills
   and registers / shared memory within sm_90's limits; with the toolchain present (csrc/build.sh), its SASS
   holds WGMMA (HGMMA), TMA (UTMALDG) and the training store's fp16 packs (F2FP) (marker `compile`); the
   store's arithmetic (`tile_half_logits`, ABI 2) reconstructs float64 logits within the HalfLogits bound; the
   kernels' index maps (csrc/tiles_sm90.cuh) checked by a host program built with the same toolchain (`compile`).
3. The loader: importing grpo_kernels loads nothing; a missing or stale library falls back with one warning.
"""

from __future__ import annotations

import ctypes
import gzip
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from grpo_kernels.ops.lm_head import cutlass
from grpo_kernels.ops.lm_head.reference import LMHeadStats

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
BIN = CSRC / "bin"
LIB = BIN / "libgrpo_kernels_sm90a.so"
TOOLCHAIN = Path(os.environ.get("GRPO_CSRC_TOOLCHAIN", "/tmp/grpo-csrc-toolchain"))
# the soft cap of the kernel C spec tests: a cap of 20 at temperature 0.7, (cap_in, cap_out) = (1 / 20, 20 / 0.7), so
# that the constant of its gradient factor, cap_in cap_out = 1 / 0.7, is not 1 (as it is for any cap at T = 1)
SOFTCAP = (0.05, 20.0 / 0.7)


def _full_row(z64: torch.Tensor, targets: torch.Tensor) -> LMHeadStats:
    lse = torch.logsumexp(z64, -1)
    logp = z64 - lse[:, None]
    p = logp.exp()
    ok = (targets >= 0) & (targets < z64.shape[1])
    lp = torch.full_like(lse, float("nan"))
    lp[ok] = logp[ok].gather(1, targets[ok][:, None]).squeeze(1)
    expected = (p * z64).sum(-1)
    return LMHeadStats(lp, lse - expected, lse, expected)


def _logits(n: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale
    z[0, 3] += 60.0  # a confident row (logp of another target far below 0)
    z[1, :] = -(2.0**102)  # a row of forbidden tokens but one (NEG_BIG, as the kernels write them)
    z[1, vocab - 1] = 0.5
    return z


def _worst(err: torch.Tensor, bound: torch.Tensor) -> str:
    ratio = err / bound
    i = int(ratio.nan_to_num(0.0).argmax())
    return f"row {i}: error {err[i].item():.3e} vs bound {bound[i].item():.3e} (ratio {ratio[i].item():.3f})"


CASES = [(37, 1001, 256, 3.0), (9, 4097, 128, 8.0), (16, 700, 7, 30.0)]  # ragged last tiles, a 1-tile row


@pytest.mark.parametrize("n,vocab,block_n,scale", CASES)
def test_float64_partials_and_merge_equal_the_full_row(n, vocab, block_n, scale):
    z = _logits(n, vocab, scale, seed=vocab)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    targets[2], targets[3] = -1, vocab  # outside [0, V): NaN log-prob, as the kernels
    got = cutlass.merge_partials(*cutlass.tile_partials(z, targets, block_n))
    want = _full_row(z, targets)
    for name in LMHeadStats._fields:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.isnan(), w.isnan()), f"{name}: NaN where the full row has none (or the reverse)"
        ok = ~w.isnan() & (w.abs() < 1e29)  # the forbidden row's lse / E_p[z] sit at -2^102: compared relatively
        bound = 1e-12 * (1 + z.abs().amax(1).clamp(max=1e3))
        err = (g - w).abs()
        assert (err[ok] <= bound[ok]).all(), f"{name}: {_worst(err[ok], bound[ok])}"
        big = ~w.isnan() & ~ok
        assert torch.allclose(g[big], w[big], rtol=1e-15), f"{name}: {g[big]} vs {w[big]}"


@pytest.mark.parametrize("n,vocab,block_n,scale", CASES)
def test_fp32_partials_and_merge_within_the_rounding_bound(n, vocab, block_n, scale):
    z = _logits(n, vocab, scale, seed=vocab + 1)
    z[1] = torch.randn(vocab, dtype=torch.float64)  # the bound is for finite rows (the forbidden row: above)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2))
    got = cutlass.merge_partials(*cutlass.tile_partials(z.float(), targets, block_n))
    want = _full_row(z, targets)
    bound = cutlass.stats_error_bound(z, block_n)
    for name in LMHeadStats._fields:
        err = (getattr(got, name).double() - getattr(want, name)).abs()
        assert (err <= bound).all(), f"{name}: {_worst(err, bound)}"
    assert (got.logprobs <= 0).all() and (got.entropy >= 0).all()  # the invariants of README §1


@pytest.mark.parametrize("n,vocab,block_n,scale", CASES[:2])
def test_the_epilogue_fp16_store_reconstructs_within_the_format_bound(n, vocab, block_n, scale):
    """The training forward's store (ABI 2), as csrc's epilogue writes it (`tile_half_logits`: fp16 z - m_t with
    m_t the row's max over its tile, once per 64 columns): m + d against float64 z within the HalfLogits bound
    2^-11 (lse - z) (fp16's rounding of d; m_t <= lse) + 2^-24 (|z| + |m|) (fp32's of z - m and m + d), a
    forbidden token (NEG_BIG) clamped to m_t - 65504 (p = 0 either way), the offsets the tiles' maxima."""
    z64 = _logits(n, vocab, scale, seed=11)
    z = z64.float()
    difference, offset = cutlass.tile_half_logits(z, block_n)
    assert difference.dtype == torch.float16 and difference.shape == (n, vocab)
    assert offset.shape == (n, -(-vocab // 64))
    m = offset.repeat_interleave(64, dim=1)[:, :vocab].double()
    z16 = m + difference.double()
    lse = torch.logsumexp(z64, -1)[:, None]
    live = z64 > -1e30
    bound = 2.0**-11 * (lse - z64) + 2.0**-24 * (z64.abs() + m.abs()) + 2.0**-24 * z64.abs()
    ratio = torch.where(live, (z16 - z64).abs() / bound, torch.zeros_like(z64))
    worst = int(ratio.argmax())
    assert ratio.max() <= 1.0, f"logit {divmod(worst, vocab)}: ratio {ratio.max().item():.3f} to its bound"
    assert (z16[~live] - lse.expand_as(z64)[~live]).max() < -60000  # the forbidden tokens of row 1
    tiles = torch.full((n, -(-vocab // block_n) * block_n), cutlass.PAD_LOGIT, dtype=torch.float32)
    tiles[:, :vocab] = z
    tile_max = tiles.view(n, -1, block_n).amax(-1)
    for col in range(0, vocab, 64):
        assert torch.equal(offset[:, col // 64], tile_max[:, col // block_n]), f"group at column {col}"


def test_the_bound_catches_a_wrong_fold():
    # the merge without re-centring the deviation sum ((m - m') s dropped) must break the bound: it can fail
    z = _logits(16, 3000, 4.0, seed=5)
    z[1] = torch.randn(3000, dtype=torch.float64)
    targets = torch.zeros(16, dtype=torch.long)
    m, s, d, t = cutlass.tile_partials(z.float(), targets, 256)
    bad_d = d.clone()
    bad_d[1:] += (m[1:] - m.amax(0)) * s[1:]  # the same as dropping the term from every fold but the first
    bad = cutlass.merge_partials(m, s, bad_d, t)
    want = _full_row(z, targets)
    bound = cutlass.stats_error_bound(z, 256)
    assert ((bad.entropy.double() - want.entropy).abs() > bound).any()


# ---- 1b. kernel C: dz formed from the fp16 store in the backward GEMMs' operand load ----------------------


def _autograd_dz(acc64, targets, g_lp, g_h, inv_t, softcap):
    """dL/dacc in float64 by autograd, L = sum g_lp log p_y + sum g_H H(p), p = softmax(z(acc)) with
    z = acc / T, or z = cap_out tanh(cap_in acc) with a soft cap (T = 1 there)."""
    acc = acc64.clone().requires_grad_(True)
    z = softcap[1] * torch.tanh(softcap[0] * acc) if softcap is not None else acc * inv_t
    logp = torch.log_softmax(z, -1)
    loss = torch.zeros((), dtype=torch.float64)
    if g_lp is not None:
        loss = loss + (g_lp.double() * logp.gather(1, targets[:, None]).squeeze(1)).sum()
    if g_h is not None:
        loss = loss + (g_h.double() * -(logp.exp() * logp).sum(-1)).sum()
    (grad,) = torch.autograd.grad(loss, acc)
    return z.detach(), grad


@pytest.mark.parametrize("grads", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("capped", [False, True], ids=["temperature", "softcap"])
def test_kernel_c_dz_is_the_float64_gradient(grads, capped):
    """The spec of kernel C's operand (`token_coefficients` + `dz_from_stored`, the arithmetic of
    token_coef_kernel and dz_chunk), run in float64 on exact logits, equals autograd's dL/dacc: the
    coefficients' 1 / T, the target term, the soft cap's factor, and exactly 0 for a token without upstream
    gradient (its lse replaced by DEAD_LSE)."""
    g = torch.Generator().manual_seed(5)
    n, vocab, inv_t = 11, 301, 1.0 / 0.7
    acc = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_lp = torch.randn(n, generator=g, dtype=torch.float64) if grads in ("both", "logprobs") else None
    g_h = torch.randn(n, generator=g, dtype=torch.float64) if grads in ("both", "entropy") else None
    for t in (g_lp, g_h):
        if t is not None:
            t[4] = 0.0  # a token without upstream gradient
    softcap = SOFTCAP if capped else None
    z, want = _autograd_dz(acc, targets, g_lp, g_h, inv_t, softcap)
    lse = torch.logsumexp(z, -1)
    mean_z = (torch.softmax(z, -1) * z).sum(-1)
    coef, target = cutlass.token_coefficients(lse, mean_z, g_lp, g_h, targets, 1.0 if capped else inv_t,
                                              softcap=softcap)  # fmt: skip
    # z split as the kernel reads it (an offset per 64 columns, here each group's max, and the differences)
    offset = torch.stack([g.max(1).values for g in z.split(64, 1)], 1).repeat_interleave(64, 1)[:, :vocab]
    got = cutlass.dz_from_stored(z - offset, offset, coef, target, softcap)
    assert torch.equal(got[4], torch.zeros(vocab, dtype=torch.float64)), "a dead token's dz is not exactly 0"
    err = (got - want).abs()
    worst = int(err.argmax())
    assert err.max() <= 1e-12 * want.abs().max(), f"dz{divmod(worst, vocab)}: {got.flatten()[worst]} vs {want.flatten()[worst]}"


def _kernel_c_case(dtype, capped, seed=3):
    """Logits of the _logits kind (a confident row, a row of forbidden tokens), a head, upstream gradients and
    the fp32 statistics the forward hands the backward; the csrc epilogue's fp16 store of those logits."""
    from grpo_kernels.ops.lm_head.transform import gradient_factor
    from grpo_kernels.ops.lm_head.triton import HalfLogits, dz_scale

    n, vocab, hidden = 37, 1001, 48  # ragged against the 64-column groups and the 256-column tiles
    g = torch.Generator().manual_seed(seed)
    z64 = _logits(n, vocab, 3.0, seed)
    if capped:  # logits inside the soft cap's range
        z64 = SOFTCAP[1] * torch.tanh(z64 / SOFTCAP[1])
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[1] = vocab - 1  # the one allowed token of the forbidden row
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    g_lp[5] = g_h[5] = 0.0
    lse64 = torch.logsumexp(z64, -1)
    mean64 = (torch.softmax(z64, -1) * z64).sum(-1)
    inv_t = 1.0 if capped else 1.0 / 0.7
    softcap = SOFTCAP if capped else None
    scale = None
    if dtype == torch.float16:  # the fp16 operand's power-of-two scale (triton.lm_head_backward's)
        scale = dz_scale(lse64.float(), mean64.float(), g_lp, g_h, gradient_factor(inv_t, softcap))
    difference, offset = cutlass.tile_half_logits(z64.float(), 256)
    store = HalfLogits(difference, offset)
    return dict(z64=z64, x=x, w=w, y=y, g_lp=g_lp, g_h=g_h, lse64=lse64, mean64=mean64, inv_t=inv_t,
                softcap=softcap, scale=scale, store=store)  # fmt: skip


def _run_reference(c, store, **overrides):
    out_h = torch.zeros(c["x"].shape, dtype=torch.float32)
    acc_w = torch.zeros(c["w"].shape, dtype=torch.float32)
    args = dict(stored_logits=store, hidden=c["x"], weight=c["w"], targets=c["y"], lse=c["lse64"].float(),
                expected_logit=c["mean64"].float(), grad_logprobs=c["g_lp"], grad_entropy=c["g_h"],
                inv_temperature=c["inv_t"], softcap=c["softcap"], dz_scale=c["scale"], grad_hidden_out=out_h,
                accumulate_hidden=False, grad_weight_acc=acc_w)  # fmt: skip
    args.update(overrides)
    cutlass.dz_gemms_reference(**args)
    return out_h, acc_w


def _float64_dz(c):
    coef, target = cutlass.token_coefficients(c["lse64"], c["mean64"], c["g_lp"].double(), c["g_h"].double(),
                                              c["y"], c["inv_t"], softcap=c["softcap"])  # fmt: skip
    z = c["z64"]
    dz = cutlass.dz_from_stored(z, torch.zeros_like(z), coef, target, c["softcap"])
    p = torch.exp2(z * cutlass.LOG2E - coef[:, :1])
    return dz, cutlass.dz_magnitude(z, coef, target), p * coef[:, 2:3].abs()


def _kernel_c_bound(c, z_used):
    """Per-element bound on |reference - float64| for grad_hidden = dz W and grad_weight = dz^T X, derived
    from what the reference does to dz: (a) z from the store differs from the float64 logit by delta (measured
    here: fp16's rounding of z - m_t and fp32's of m + d), and lse / E_p[z] are fp32-rounded (2^-24 |lse|,
    2^-24 |E|); dz's sensitivity to a shift of z_j is <= |dz|_max + p_j |c_H| (d/dz_j of p_j (c_H (E - z_j)
    - c_lp)), to lse |dz|_max, so |d dz| <= (mag + p |c_H|) D e^D, D = delta + 2^-23 (|lse| + |E| + |z|)
    (e^D: p's second order); with a soft cap (mag and c_H holding its constant cap_in cap_out) plus mag 2 |t| /
    cap_out delta (the slope of its factor 1 - t^2); (b) the fp32 arithmetic, 16 units of mag; (c) rounding to
    the operand dtype, u_op |dz| (fp16 also its subnormal spacing 2^-25 / S absolute); (d) the GEMM's fp32 sums,
    2 K u32 (mag |operand|)."""
    z = c["z64"]
    live = z > -1e30
    delta = torch.where(live, (z_used.double() - z).abs(), torch.zeros_like(z))
    _, mag, p_ch = _float64_dz(c)
    u32 = 2.0**-24
    dd = delta + 2 * u32 * (c["lse64"].abs()[:, None] + c["mean64"].abs()[:, None] + z.abs())
    dd = torch.where(live, dd, torch.zeros_like(dd))  # a forbidden token: p = 0 from either logit (mag = 0)
    err = (mag + p_ch) * dd * torch.exp(dd)
    if c["softcap"] is not None:  # mag holds the cap's constant cap_in cap_out (token_coefficients' factor)
        cap_out = c["softcap"][1]
        t = (z / cap_out).clamp(-1, 1)
        err = err + mag * 2 * t.abs() / cap_out * delta
    u_op = 2.0**-8 if c["x"].dtype == torch.bfloat16 else 2.0**-11
    err = err + 16 * u32 * mag + u_op * (mag + err)
    if c["scale"] is not None:
        err = err + 2.0**-25 / float(c["scale"][0])
    w, x = c["w"].double().abs(), c["x"].double().abs()
    n, vocab = z.shape
    bound_h = err @ w + 2 * vocab * u32 * (mag @ w)
    bound_w = err.T @ x + 2 * n * u32 * (mag.T @ x)
    return bound_h, bound_w


def _ratio(got, want, bound, what):
    ratio = (got.double() - want).abs() / bound.clamp(min=1e-300)  # a zero bound (a row with dz = 0) wants 0
    worst = int(ratio.argmax())
    return ratio.max().item(), f"{what}{divmod(worst, got.shape[1])}: {got.flatten()[worst].item():.6g} vs {want.flatten()[worst].item():.6g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("capped", [False, True], ids=["temperature", "softcap"])
def test_kernel_c_from_the_fp16_store_within_its_bound(dtype, capped):
    """Kernel C's arithmetic (`dz_gemms_reference`) on csrc's fp16 store (`tile_half_logits`, 256-column
    tiles) against float64 gradients, element by element within `_kernel_c_bound`; and, normwise, at most
    2x the error of the same arithmetic on fp32 logits (issue 34's bar for the fp16 store)."""
    c = _kernel_c_case(dtype, capped)
    dz64, _, _ = _float64_dz(c)
    want_h = dz64 @ c["w"].double()
    want_w = dz64.T @ c["x"].double()
    got_h, got_w = _run_reference(c, c["store"])
    bound_h, bound_w = _kernel_c_bound(c, c["store"].reconstruct())
    for got, want, bound, what in ((got_h, want_h, bound_h, "grad_hidden"), (got_w, want_w, bound_w, "grad_weight")):
        worst, where = _ratio(got, want, bound, what)
        assert worst <= 1.0, f"{where}: {worst:.3f} of its bound"
    # the same arithmetic on the fp32 logits (the store's reference point)
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    # the fp32 logits as the differences from a zero offset (the reference widens the differences to fp32)
    fp32_store = HalfLogits(c["z64"].float(), torch.zeros_like(c["store"].offset))
    f32_h, f32_w = _run_reference(c, fp32_store)
    for got, ref, want, what in ((got_h, f32_h, want_h, "grad_hidden"), (got_w, f32_w, want_w, "grad_weight")):
        e_half = ((got.double() - want).norm() / want.norm()).item()
        e_f32 = ((ref.double() - want).norm() / want.norm()).item()
        assert e_half <= 2 * e_f32, f"{what}: normwise {e_half:.3g} from the fp16 store, {e_f32:.3g} from fp32"


def test_kernel_c_bound_catches_a_wrong_offset():
    """The bound can fail: the offsets of the neighbouring 64-column group (a wrong group index in the
    kernel's offset load) put grad_hidden far outside it."""
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    c = _kernel_c_case(torch.bfloat16, False)
    store = c["store"]
    wrong = HalfLogits(store.difference, store.offset.roll(1, dims=1))
    got_h, _ = _run_reference(c, wrong)
    dz64, _, _ = _float64_dz(c)
    bound_h, _ = _kernel_c_bound(c, store.reconstruct())
    worst, where = _ratio(got_h, dz64 @ c["w"].double(), bound_h, "grad_hidden")
    assert worst > 10.0, f"a wrong offset group stayed within the bound: {where}, {worst:.3f}"


def test_kernel_c_reference_accumulates_as_the_triton_contract():
    """grad_hidden_out is overwritten unless accumulate_hidden, grad_weight_acc unless accumulate_weight (the
    contract of triton.lm_head_backward's dz GEMMs, which the csrc launcher follows); an overwritten buffer's
    content is not read (NaN-filled, it ends as the fresh result)."""
    c = _kernel_c_case(torch.bfloat16, False)
    h1, w1 = _run_reference(c, c["store"])
    base_h, base_w = torch.full_like(h1, 0.5), torch.full_like(w1, -0.25)
    h2, w2 = base_h.clone(), base_w.clone()
    _run_reference(c, c["store"], grad_hidden_out=h2, grad_weight_acc=w2, accumulate_hidden=True)
    assert torch.allclose(h2, h1 + 0.5, rtol=0, atol=2.0**-20 * (h1.abs().max() + 1))
    assert torch.allclose(w2, w1 - 0.25, rtol=0, atol=2.0**-20 * (w1.abs().max() + 1))
    h3 = base_h.clone()
    _run_reference(c, c["store"], grad_hidden_out=h3, grad_weight_acc=None)
    assert torch.equal(h3, h1)
    for dtype in (torch.float32, torch.bfloat16):  # the first chunk's call: fp32 or in place
        w4 = torch.full_like(w1, float("nan"), dtype=dtype)
        _run_reference(c, c["store"], grad_hidden_out=None, grad_weight_acc=w4, accumulate_weight=False)
        assert torch.equal(w4, w1.to(dtype)), f"{dtype}: {int((w4 != w1.to(dtype)).sum())} elements differ"


def test_kernel_c_one_launch_fills_the_tail_of_grad_hidden():
    """Why both dz GEMMs run in one launch (ABI 6), counted in K-tile steps (`dz_gemms_makespan`): grad_hidden has
    few tiles over the whole vocabulary, grad_weight many short ones. At the target head (H 4096, V 151,936) on
    132 SMs, a 2,432-token chunk: grad_hidden 19 x 16 = 304 tiles of 2,374 steps (3 waves, the third on 40 SMs),
    grad_weight 1,187 x 16 = 18,992 tiles of 38 steps (144 waves). Two launches: 3 x 2,374 + 144 x 38 steps; one:
    within one grad_weight tile (38 steps) of the work bound, since grad_weight's tiles start on the 92 SMs the
    third wave leaves."""
    v, h, sms = 151936, 4096, 132
    two = cutlass.dz_gemms_makespan(2432, v, h, sms, one_launch=False)
    one = cutlass.dz_gemms_makespan(2432, v, h, sms)
    assert two == 3 * 2374 + 144 * 38
    work = (304 * 2374 + 18992 * 38) / sms  # every SM busy to the end
    assert work <= one <= work + 38, (one, work)
    assert two / one > 1.15
    # never worse, over chunk sizes of the schedules (a single M tile to the in-place chunks) and SM counts
    for n in (1, 64, 200, 1664, 2341, 2560, 4096, 4608):
        for count in (108, 132, 148):
            one, two = (cutlass.dz_gemms_makespan(n, v, h, count, one_launch=x) for x in (True, False))
            tiles_h, tiles_w = -(-n // 128) * 16, -(-v // 128) * 16
            assert two == -(-tiles_h // count) * -(-v // 64) + -(-tiles_w // count) * -(-n // 64), (n, count)
            bound = max(-(-v // 64), (tiles_h * -(-v // 64) + tiles_w * -(-n // 64)) / count)  # longest tile, work
            assert bound <= one <= min(two, bound + -(-n // 64)), (n, count, one, two, bound)  # within a short tile


# ---- 2. the committed build ---------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# The GPU session's csrc gate (benchmarks/gpu/csrc_check.py --gate) on CPU: the library replaced by the spec
# ------------------------------------------------------------------------------------------------
def _csrc_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("csrc_check", ROOT / "benchmarks" / "gpu" / "csrc_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec_forward_stats(lib, hidden, weight, bias, targets, temperature, softcap=None, *, variant="cooperative",
                        logits_out=None, lost_tile=False, shifted_offsets=False):  # fmt: skip
    """What kernel A computes, by its spec: fp32 z with the epilogue's transform (the torch backend's, forbidden
    tokens at NEG_BIG), the tile partials and their merge, the fp16 store. The two flags plant the bugs the gate
    must catch: the last vocabulary tile lost in the merge, offsets one group off."""
    from grpo_kernels.ops.lm_head import chunked

    z = hidden.float() @ weight.float().T
    chunked._transform_(z, bias, 1.0 / temperature, softcap)
    m, s, d, t = cutlass.tile_partials(z, targets, 256)
    if lost_tile:
        m, s, d = m[:-1], s[:-1], d[:-1]
    if logits_out is not None:
        difference, offset = cutlass.tile_half_logits(z, 256)
        logits_out.difference.copy_(difference)
        logits_out.offset.copy_(offset.roll(1, dims=1) if shifted_offsets else offset)
    return cutlass.merge_partials(m, s, d, t)


@pytest.mark.parametrize("planted", [None, "lost tile", "shifted offsets", "soft cap dropped in C"])
def test_the_csrc_gate_passes_the_spec_and_catches_planted_bugs(planted, monkeypatch):
    """The gate's checks with the library replaced by the spec (kernel A: `_spec_forward_stats`; kernel C:
    cutlass.dz_gemms_reference): every case within its derived bound, on the small heads (every transform, bf16
    and fp16) and a smaller wide head; each planted bug fails exactly the cases it touches (a bound so loose
    that it passed them would be no gate: a vocabulary tile of 139 columns lost in the merge fails every case)."""
    import functools

    check = _csrc_check_module()
    monkeypatch.setattr(check, "WIDE_HEAD", (200, 64, 20011))  # the GPU's 640 x 512 x 151936 takes minutes here
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    forward = functools.partial(_spec_forward_stats, lost_tile=planted == "lost tile",
                                shifted_offsets=planted == "shifted offsets")  # fmt: skip
    monkeypatch.setattr(cutlass, "forward_stats", forward)

    def kernel_c(lib, **args):
        if planted == "soft cap dropped in C":
            args["softcap"] = None
        return cutlass.dz_gemms_reference(**args)

    monkeypatch.setattr(cutlass, "dz_gemms_csrc", kernel_c)
    result, phases = {}, []
    check.gate(None, phases.append, result, torch.device("cpu"))
    rows = result["gate"]
    assert phases == ["kernel A checked", "kernel C checked"] and result["gate_ok"] == (planted is None)
    assert len(rows) == 3 * len(check.gate_cases(torch.device("cpu")))  # A's two variants and C, per case
    failed = {r["case"] for r in rows if not r["ok"]}
    if planted is None:
        worst = max(rows, key=lambda r: r.get("store_worst_ratio", 0))
        assert not failed, [r for r in rows if not r["ok"]][0]
        assert 0.1 < worst["store_worst_ratio"] <= 1, worst  # the store's bound is tight enough to bite
        return
    expected = {
        "lost tile": {r["case"] for r in rows if r["case"].startswith("A-")},
        "shifted offsets": {r["case"] for r in rows if r["case"].startswith("A-")},
        "soft cap dropped in C": {r["case"] for r in rows if r["case"].startswith("backward-")
                                  and "softcap" in r["case"]},  # fmt: skip
    }[planted]
    assert failed == expected, sorted(failed ^ expected)


def test_committed_library_matches_the_sources():
    assert LIB.is_file(), "csrc/bin/libgrpo_kernels_sm90a.so is missing: run `bash csrc/build.sh` and commit"
    want = cutlass.source_stamp(CSRC)
    assert (BIN / "stamp.txt").read_text().strip() == want, "csrc/bin is stale: rerun `bash csrc/build.sh`"
    assert want.encode() in LIB.read_bytes(), "the library does not embed the sources' stamp"


def test_ptxas_report_no_spills_and_within_sm90_limits():
    report = (BIN / "ptxas.txt").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'\n(.*?)(?=Compiling entry|\Z)", report, re.S)
    assert len(kernels) >= 10, f"expected kernel A's 4 GEMMs and merge, kernel C's 4 dz GEMM kernels and coefficients, got {len(kernels)}"
    for name, body in kernels:
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"(\d+) bytes smem", body)
        assert spill and spill.groups() == ("0", "0"), f"{name[:80]}: spills {spill and spill.groups()}"
        assert regs and int(regs.group(1)) <= 255, f"{name[:80]}: {regs and regs.group(1)} registers"
        assert smem is None or int(smem.group(1)) <= 232448, f"{name[:80]}: {smem.group(1)} bytes of static smem"


@pytest.mark.compile
def test_sass_has_wgmma_and_tma():
    cuobjdump = TOOLCHAIN / "nvidia" / "cu13" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip(f"no toolchain at {TOOLCHAIN} (run `bash csrc/build.sh`, .ci/steps/csrc.sh)")
    env = dict(os.environ, PATH=f"{cuobjdump.parent}:{os.environ['PATH']}")
    sass = subprocess.run([str(cuobjdump), "-sass", str(LIB)], capture_output=True, text=True, env=env, check=True)
    functions = re.split(r"\n\s*Function : ", sass.stdout)[1:]
    gemms = [f for f in functions if "GemmUniversal" in f.split("\n", 1)[0]]
    assert len(gemms) == 4, f"expected 4 GEMM kernels (bf16 / fp16 x cooperative / ping-pong), got {len(gemms)}"
    for f in gemms:
        head = f.split("\n", 1)[0][:80]
        assert "HGMMA" in f, f"{head}: no WGMMA (HGMMA) instruction"
        assert "UTMALDG" in f, f"{head}: no TMA load (UTMALDG)"
        assert "F2FP" in f, f"{head}: no fp32 -> fp16 pack (F2FP): the training forward's fp16 store is missing"
        # the bias is loaded 8 columns at a time (two 16-bit loads per column: the bf16 and fp16 branches of
        # load_bias) between the target-logit stores, not one column per store (csrc/README.md, kernel A)
        ops = re.findall(r"\b(LDG\.E(?:\.U16|\.64|\.128)?|STG\.E(?:\.64)?)\s", f)
        between_stores = [list(group) for is_store, group in itertools.groupby(ops, lambda o: o[0] == "S")
                          if not is_store]  # fmt: skip
        bias_runs = [run.count("LDG.E.U16") for run in between_stores if "LDG.E.U16" in run]
        assert bias_runs and min(bias_runs) >= 16, f"{head}: 16-bit bias loads between stores {bias_runs[:8]}"
    # kernel C: bf16 / fp16 x (grad_weight in fp32, in place), each kernel holding both dz GEMMs (grad_hidden's tiles,
    # then grad_weight's, in one launch), dz formed in the kernel from the fp16 store
    dz_gemms = [f for f in functions if "dz_gemms_kernel" in f.split("\n", 1)[0]]
    assert len(dz_gemms) == 4, f"expected 4 dz GEMM kernels, got {len(dz_gemms)}"
    for f in dz_gemms:
        head = f.split("\n", 1)[0][:80]
        for instruction, what in (("HGMMA", "WGMMA"), ("UTMALDG", "TMA load"), ("MUFU.EX2", "exp2 of dz's p"),
                                  ("STS.128", "16-byte store of the dz chunk"),
                                  ("FENCE.VIEW.ASYNC.S", "the proxy fence before WGMMA reads dz"),
                                  ("LDS.128", "16-byte load of the fp16 logits chunk")):  # fmt: skip
            assert instruction in f, f"{head}: no {what} ({instruction})"
        # both GEMMs' main loops are there: four m64n256k16 WGMMAs per K tile in each (measured: 8 lines)
        assert f.count("HGMMA") >= 8, f"{head}: {f.count('HGMMA')} HGMMA lines, not two GEMMs' worth"
    # the accumulating epilogues load the old values in batches before storing (csrc/README.md, "Adding into the
    # output"): every run of 8-byte global loads (fp32 pairs: grad_hidden, and grad_weight in fp32) is 16 long, and
    # the in-place kernels load 32 16-bit pairs (4-byte loads) in a row before their 4-byte stores. Alternating one
    # by one (the seventh session's build: runs of 1) made a thread wait for 64 memory round trips in sequence.
    for f in dz_gemms:
        head = f.split("\n", 1)[0][:80]
        ops = re.findall(r"\b(LDG\.E(?:\.64|\.128)?|STG\.E(?:\.64)?)\s", f)
        runs = [(op, len(list(group))) for op, group in itertools.groupby(ops)]
        wide_loads = [k for op, k in runs if op == "LDG.E.64"]
        assert wide_loads and min(wide_loads) >= 16, f"{head}: runs of 8-byte loads {wide_loads}, not batches of 16"
        if "Lb1E" in head:
            batched = [k for (op, k), (nxt, _) in zip(runs, runs[1:]) if op == "LDG.E" and nxt == "STG.E"]
            assert batched and min(batched) >= 32, f"{head}: runs of 4-byte loads before 4-byte stores {batched}"
    # the in-place epilogue (a template flag: DzConfig<..., true> in the mangled name, "Lb1E") reads and writes
    # the 16-bit gradient buffer 4 bytes at a time (two columns) and packs the rounded pair (F2FP); fp32 outputs
    # move 8 bytes (grad_hidden's in every kernel: measured 128 8-byte stores per GEMM, two epilogue copies of 64
    # column pairs); each thread's 64 column pairs add 64 packs per epilogue copy to the dz chunks' (added into and
    # written over: measured 192 against 64)
    heads = {f.split("\n", 1)[0]: f for f in dz_gemms}
    in_place = {h: f for h, f in heads.items() if "Lb1E" in h}
    assert len(in_place) == 2, f"expected the bf16 and fp16 in-place grad_weight kernels, got {len(in_place)}"
    for head, f in in_place.items():
        fp32_twin = heads[head.replace("Lb1E", "Lb0E")]
        four, twin_four = len(re.findall(r"STG\.E ", f)), len(re.findall(r"STG\.E ", fp32_twin))
        eight, twin_eight = f.count("STG.E.64"), fp32_twin.count("STG.E.64")
        assert four > 0 and twin_four == 0, f"{head[:80]}: 4-byte stores {four}, its fp32 twin {twin_four}"
        assert 0 < eight < twin_eight, (
            f"{head[:80]}: {eight} 8-byte stores against its fp32 twin's {twin_eight}: grad_hidden's alone expected")
        packs, twin_packs = f.count("F2FP"), fp32_twin.count("F2FP")
        assert packs >= twin_packs + 2 * 64, (
            f"{head[:80]}: {packs} F2FP, its fp32 twin {twin_packs}: not two rounding epilogues (added into, written over)")
    committed = gzip.decompress((BIN / "sass.txt.gz").read_bytes()).decode()
    assert committed.count("HGMMA") == sass.stdout.count("HGMMA"), "csrc/bin/sass.txt.gz is not this library's"


def _opcode(instruction: str) -> str:
    """The opcode of one SASS instruction, without its predicate ("@!P0 FFMA.SAT R1, ..." -> "FFMA.SAT")."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def _sass_functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {mangled name: [(address, instruction)]} (predicates kept, `;` and encodings dropped)."""
    out = {}
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [(int(a, 16), x.strip()) for a, x in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", part)]
    return out


def _k_loops(code: list[tuple[int, str]]) -> list[dict]:
    """The innermost loops holding WGMMAs (HGMMA) of one kernel, each with its static size and the instructions of
    one iteration on the common path: a forward branch over a block that loads global memory (the next K tile's
    per-token data) falls through, one over a block without memory access or exponential (the target term, the
    mask past V: one chunk in V / 8, the last vocabulary tile) is taken; any other forward branch is reported."""
    addr = [a for a, _ in code]
    at = {a: i for i, a in enumerate(addr)}
    loops = []
    for i, (a, x) in enumerate(code):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", x)
        # a loop's end: a conditional branch back (a barrier's retry path, placed after the loops, jumps back into
        # one unconditionally) over one K tile's four WGMMAs
        if m and x.startswith("@") and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            j = at[int(m.group(1), 16)]
            if sum("HGMMA" in y for _, y in code[j : i + 1]) == 4:
                loops.append((j, i))
    loops = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    out = []
    for j, i in loops:
        k, path = j, []
        while k <= i:
            x = code[k][1]
            path.append(x)
            m = re.search(r"BRA\s+0x([0-9a-f]+)", x)
            if m and k < i and x.startswith("@"):
                target = int(m.group(1), 16)
                if addr[k] < target <= addr[i]:
                    block = " ".join(y for _, y in code[k + 1 : at[target]])
                    if "LDG" in block:
                        pass  # the next K tile's loads: every tile but the last
                    elif not re.search(r"MUFU|LDS|STS|HGMMA", block):
                        k = at[target]  # a rare block, skipped
                        continue
                    else:
                        raise AssertionError(f"unexpected branch at {addr[k]:#x} over a block with {block[:200]}")
            k += 1
        ops = [_opcode(x) for x in path]
        out.append({"static": i - j + 1, "path": len(path), "mufu": ops.count("MUFU.EX2"),
                    "fsetp": sum(o.startswith("FSETP") for o in ops), "softcap": "FFMA.SAT" in ops})  # fmt: skip
    return out


def test_kernel_c_k_loop_fits_under_the_mma():
    """Kernel C's consumer K loop, read in the committed SASS (csrc/bin/sass.txt.gz, the library's: the SASS test
    checks it): per K tile a consumer thread forms 32 dz values and its warpgroup issues four m64n256k16 WGMMAs,
    2 x 128 x 256 x 64 x 2 FLOP for the CTA, 1,024 cycles of an H100 SM's tensor cores (4,096 FLOP per cycle). Its
    8 consumer warps share the SM's 4 schedulers, one instruction per cycle each: the transform overlaps the MMAs
    only if one iteration issues at most 1,024 x 4 / 8 = 512 instructions per thread. Counted on the common path
    (`_k_loops`), without a soft cap: 308 (grad_hidden) and 364 (grad_weight) in this build, 720 and 796 before the
    exponent and the coefficient were folded into two FMAs per element (csrc/README.md, kernel C); with one (the
    loop holding the factor's FFMA.SAT, one per element): 408 and 491, 532 and 615 before its constant went into
    the token coefficients and its clamp into the FMA. Also: one MUFU.EX2 per dz element and no FSETP (ex2.approx
    without .ftz wraps each MUFU in a range test and two multiplies)."""
    functions = _sass_functions(gzip.decompress((BIN / "sass.txt.gz").read_bytes()).decode())
    kernels = {name: code for name, code in functions.items() if "dz_gemms_kernel" in name}
    assert len(kernels) == 4, f"expected 4 dz GEMM kernels, got {len(kernels)}"
    for name, code in kernels.items():
        loops = _k_loops(code)
        assert len(loops) == 4, f"{name[:80]}: {len(loops)} K loops, not 4 (grad_hidden / grad_weight x soft cap)"
        assert sum(lp["softcap"] for lp in loops) == 2, f"{name[:80]}: soft-cap loops {[lp['softcap'] for lp in loops]}"
        for lp in loops:
            assert lp["mufu"] == 32, f"{name[:80]}: {lp['mufu']} MUFU.EX2 per K tile, expected 32 (one per dz element)"
            assert lp["fsetp"] == 0, f"{name[:80]}: {lp['fsetp']} FSETP in the K loop (ex2 without .ftz?)"
            kind = "soft-cap" if lp["softcap"] else "plain"
            assert lp["path"] <= 512, f"{name[:80]}: {kind} loop, {lp['path']} instructions per K tile and thread, " \
                                      "over the MMA's 512"


def test_exponentials_are_one_mufu_each():
    """Every exponential in the library (kernel A's statistics and soft cap, the merge, kernel C's p) is
    `ex2.approx.ftz`: one MUFU.EX2. Without .ftz ptxas puts a range test (FSETP ... -126) and two predicated
    multiplies around each, 3 more instructions per element of an epilogue or a K loop (the eighth session's build:
    one per MUFU, 512 in each kernel A GEMM, 120 in each kernel C, 10 in the merge)."""
    text = gzip.decompress((BIN / "sass.txt.gz").read_bytes()).decode()
    guards = re.findall(r"FSETP\.GEU\.AND [^;]*-126", text)
    assert not guards, f"{len(guards)} exp2 range tests (ex2.approx without .ftz), e.g. {guards[0]}"
    assert text.count("MUFU.EX2") > 0


def test_soft_cap_division_is_one_reciprocal():
    """Kernel A's soft cap forms tanh(u) / u as (1 - e) / ((1 + e) |u|) per element above |u| = 1/4 (Triton's
    `_softcap`). Its divisor lies in [1/4, 33], where Triton's fp32 `/` (div.full.f32) is a MUFU.RCP and an FMUL;
    csrc's `div_approx` is those two. The IEEE `/` of CUDA C++ compiled to Newton steps, an FCHK range test and a
    call to a slow-path subroutine per element (the ninth session's build: 128 of each per GEMM kernel, ~56
    instructions per element in the soft-cap epilogue's code against ~44 now, both branches counted). Asserted in
    the committed SASS: no FCHK or call in kernel A's GEMM kernels, and one MUFU.RCP per element of a thread's
    128-element share of the tile."""
    functions = _sass_functions(gzip.decompress((BIN / "sass.txt.gz").read_bytes()).decode())
    gemms = {name: [_opcode(x) for _, x in code] for name, code in functions.items() if "GemmUniversal" in name}
    assert len(gemms) == 4, f"expected kernel A's 4 GEMM kernels, got {len(gemms)}"
    for name, ops in gemms.items():
        slow = [o for o in ops if o == "FCHK" or o.startswith("CALL")]
        assert not slow, f"{name[:80]}: {len(slow)} FCHK / CALL (an IEEE division's slow path)"
        assert ops.count("MUFU.RCP") == 128, f"{name[:80]}: {ops.count('MUFU.RCP')} MUFU.RCP, expected 128"


@pytest.mark.compile
def test_tile_maps_hold_on_the_host(tmp_path):
    """csrc/tests/tile_layouts.cu, compiled with the toolchain's nvcc and run on the CPU: the index maps of
    csrc/tiles_sm90.cuh that the kernels compile (the accumulator fragments kernels A and C reduce and store; the
    16-byte chunks kernel C's consumers read from the fp16 logits tile and write into the dz tile: each element once,
    aligned, conflict-free per shared-memory phase, written by the warpgroup whose WGMMAs read it; the TMA stage's
    byte count). A wrong map would show on a GPU only as wrong numbers or a hang; the program prints the first
    violated check with its coordinates (its header lists the checks; remapping the chunks breaks them)."""
    nvcc = TOOLCHAIN / "nvidia" / "cu13" / "bin" / "nvcc"
    if not nvcc.is_file():
        pytest.skip(f"no toolchain at {TOOLCHAIN} (run `bash csrc/build.sh`, .ci/steps/csrc.sh)")
    cutlass_include = TOOLCHAIN / "cutlass_library" / "source" / "include"
    exe = tmp_path / "tile_layouts"
    env = dict(os.environ, PATH=f"{nvcc.parent}:{os.environ['PATH']}")
    build = subprocess.run([str(nvcc), "-std=c++17", "-O1", "-arch=sm_90a", "--expt-relaxed-constexpr",
                            f"-I{cutlass_include}", f"-L{nvcc.parent.parent / 'lib'}", "-o", str(exe),
                            str(CSRC / "tests" / "tile_layouts.cu")], env=env, capture_output=True, text=True)  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    ok = [line for line in run.stdout.splitlines() if line.startswith("ok  ")]
    # 4 kernel A fragments, 2 kernel C epilogue fragments, kernel C's chunk maps for 2 GEMMs x 2 dtypes
    assert len(ok) == 10, run.stdout


# ---- 3. the loader ------------------------------------------------------------------------------------


def test_import_loads_nothing():
    code = (
        "import grpo_kernels, grpo_kernels.functional, grpo_kernels.ops.lm_head.cutlass as c\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libgrpo_kernels' not in maps, 'library mapped at import'\n"
        "assert c._state == {}, c._state\n"
    )
    env = dict(os.environ, GRPO_KERNELS_CSRC="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


@pytest.fixture
def fresh_state():
    cutlass.reset()
    yield
    cutlass.reset()


def test_missing_library_falls_back_with_one_warning(fresh_state, monkeypatch, tmp_path):
    from grpo_kernels.ops.lm_head import chunked
    from grpo_kernels.ops.lm_head import triton as triton_impl

    monkeypatch.setenv(cutlass.ENV_SWITCH, "1")
    monkeypatch.setenv(cutlass.ENV_LIBRARY, str(tmp_path / "absent.so"))
    monkeypatch.setattr(cutlass, "applies", lambda *a, **k: True)  # as on an H100 with bf16 operands
    calls = []

    def fallback(*args, **kwargs):
        calls.append(kwargs)
        return chunked.lm_head_forward(*args)

    monkeypatch.setattr(triton_impl, "lm_head_forward", fallback)
    hidden, weight = torch.randn(5, 16), torch.randn(40, 16)
    targets = torch.randint(0, 40, (5,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = cutlass.lm_head_forward(hidden, weight, None, targets, 1.0)
        cutlass.lm_head_forward(hidden, weight, None, targets, 1.0)
    ours = [w for w in caught if "csrc" in str(w.message)]
    assert len(ours) == 1 and "absent.so is missing" in str(ours[0].message), [str(w.message) for w in caught]
    assert len(calls) == 2
    want = chunked.lm_head_forward(hidden, weight, None, targets, 1.0)
    assert torch.equal(first.logprobs, want.logprobs)


def test_switch_off_never_looks_for_the_library(fresh_state, monkeypatch):
    from grpo_kernels.ops.lm_head import chunked
    from grpo_kernels.ops.lm_head import triton as triton_impl

    monkeypatch.delenv(cutlass.ENV_SWITCH, raising=False)
    monkeypatch.setattr(triton_impl, "lm_head_forward", lambda *a, **k: chunked.lm_head_forward(*a))
    hidden, weight, targets = torch.randn(3, 8), torch.randn(10, 8), torch.tensor([0, 4, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cutlass.lm_head_forward(hidden, weight, None, targets, 1.0)
    assert cutlass._state == {}


def test_stale_library_falls_back_with_one_warning(fresh_state, tmp_path):
    if not LIB.is_file():
        pytest.skip("no built library")
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src, ignore=shutil.ignore_patterns("bin"))
    (src / "lm_head_fwd_sm90.cu").write_text((src / "lm_head_fwd_sm90.cu").read_text() + "\n// edited\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cutlass.load(LIB, src) is None
        assert cutlass.load(LIB, src) is None
    assert len(caught) == 1 and "is stale" in str(caught[0].message), [str(w.message) for w in caught]


def test_current_library_loads_on_a_cpu_machine(fresh_state):
    # dlopen needs no driver (the CUDA runtime is linked statically and opens libcuda lazily)
    if not LIB.is_file():
        pytest.skip("no built library")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = cutlass.load(LIB, CSRC)
    assert lib is not None and lib.grpo_csrc_lm_head_fwd_block_n(0) == 256
    assert lib.grpo_csrc_lm_head_fwd_block_n(1) == 256
    # dynamic shared memory of each GEMM CTA (pipeline stages) within sm_90's 227 KB per block
    for variant in cutlass.VARIANTS.values():
        for dtype in cutlass.DTYPES.values():
            smem = lib.grpo_csrc_lm_head_fwd_smem_bytes(variant, dtype)
            assert 0 < smem <= 232448, f"variant {variant} dtype {dtype}: {smem} bytes of shared memory"
    # kernel C: its stages (fp16 logits + B tile) and the double-buffered dz tile, 128 x 256 x 64 tiles whose
    # K tile is one offset group of the fp16 store
    tile = (ctypes.c_int * 3)()
    lib.grpo_csrc_lm_head_bwd_tile(tile)
    assert list(tile) == [128, 256, 64]
    for op in (0, 1):
        for dtype in cutlass.DTYPES.values():
            smem = lib.grpo_csrc_lm_head_bwd_smem_bytes(op, dtype)
            assert 0 < smem <= 232448, f"dz GEMM op {op} dtype {dtype}: {smem} bytes of shared memory"


def test_the_switch_routes_the_triton_backend_through_csrc(monkeypatch):
    """GRPO_KERNELS_CSRC=1: the Triton backend's LM-head module is cutlass.py (csrc's kernel A where it applies,
    Triton's own otherwise, both statistics-only calls of fused_linear_logprobs and of the fused loss's
    two-pass / low-memory forward); unset or 0: Triton's module, and the library is never looked for."""
    from grpo_kernels.ops import lm_head
    from grpo_kernels.ops.lm_head import triton as triton_impl

    from grpo_kernels.ops.fused.function import _is_triton

    monkeypatch.setenv(cutlass.ENV_SWITCH, "1")
    assert lm_head.get_impl("triton") is cutlass
    # the fused loss treats it as the Triton backend: grad_output applied on the device (no host read), the
    # low-memory schedule's sized dz workspace
    assert _is_triton(cutlass)
    # the training forward's store qualifies only as a HalfLogits (csrc writes no fp32 logits), and only on CUDA
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    assert not cutlass.applies(x, w, None, torch.zeros(8, 128))
    assert not cutlass.applies(x, w, None, HalfLogits.empty(8, 128, "cpu"))  # a CPU tensor
    for off in ("0", ""):
        monkeypatch.setenv(cutlass.ENV_SWITCH, off)
        assert lm_head.get_impl("triton") is triton_impl
    assert lm_head.get_impl("torch").__name__.endswith("chunked")


def test_the_switch_routes_dz_in_gemm_backwards_through_kernel_c(fresh_state, monkeypatch):
    """With the switch on, a `dz_in_gemm` backward offers its dz GEMMs to `dz_gemms_if_applies`, which runs csrc's
    kernel C where `backward_applies` and the library loads and otherwise declines (the Triton kernels run;
    validation and the bias sums stay Triton's): CPU tensors and fp32 stored logits are declined without
    loading the library; a non-dz backward or the switch off offers nothing."""
    from grpo_kernels.ops.lm_head import triton as triton_impl
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    seen = []
    monkeypatch.setattr(triton_impl, "lm_head_backward", lambda *a, **k: seen.append(k) or "done")
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    y, stats = torch.zeros(8, dtype=torch.long), torch.zeros(8)
    half = HalfLogits.empty(8, 128, "cpu")
    args = (x, w, None, y, 1.0, stats, stats, stats, None)
    hook_args = dict(stored_logits=half, hidden=x, weight=w, grad_weight_acc=None)
    assert not cutlass.backward_applies(x, w, half)  # a CPU tensor
    assert not cutlass.backward_applies(x, w, torch.zeros(8, 128))  # fp32 stored logits
    monkeypatch.setenv(cutlass.ENV_SWITCH, "1")
    cutlass.lm_head_backward(*args, stored_logits=half, dz_in_gemm=True)
    hook = seen[-1]["dz_gemms"]
    assert hook is cutlass.dz_gemms_if_applies
    assert hook(**hook_args) is False and cutlass._state == {}  # declined before looking for the library
    assert hook(**dict(hook_args, stored_logits=torch.zeros(8, 128))) is False and cutlass._state == {}
    if LIB.is_file():  # as on an H100: the hook runs csrc's launcher (the library loads on a CPU machine)
        ran = []
        monkeypatch.setattr(cutlass, "backward_applies", lambda *a, **k: True)
        monkeypatch.setattr(cutlass, "dz_gemms_csrc", lambda lib, **k: ran.append(lib))
        assert hook(**hook_args) is True and ran and ran[0] is not None
    cutlass.lm_head_backward(*args, stored_logits=half)  # the slab path: Triton's dlogits + cuBLAS
    assert "dz_gemms" not in seen[-1]
    cutlass.reset()
    monkeypatch.setenv(cutlass.ENV_SWITCH, "0")
    assert cutlass.lm_head_backward(*args, stored_logits=half, dz_in_gemm=True) == "done"
    assert "dz_gemms" not in seen[-1] and cutlass._state == {}


class _CudaStandIn:
    """What `backward_applies` reads of a CUDA tensor (device, dtype, shape, strides, address, element size),
    for a head too large to allocate here; every field as a contiguous tensor of that shape would have it."""

    def __init__(self, shape, dtype, address=1 << 20):
        self.shape, self.dtype, self._address = tuple(shape), dtype, address
        self.device = torch.device("cuda", 0)
        self._strides = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def data_ptr(self):
        return self._address

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


def test_kernel_c_declines_offsets_past_32_bit_indices(monkeypatch):
    """Kernel C indexes the fp16 store's offsets in 32 bits (token x ld_offset + group; the entry point refuses
    N ld_offset >= 2^31): `backward_applies` declines such a call on an sm_90 device, so the Triton kernels run
    instead of the refusal. On both sides of the limit, with ld_offset = 16 (V <= 1,024): 2^27 - 1 tokens apply,
    2^27 do not; the Qwen vocabulary's offset row (V = 151,936: 2,374 groups) reaches it at 904,585 tokens."""
    from grpo_kernels.ops.lm_head import half_logits_format
    from grpo_kernels.ops.lm_head.triton import HalfLogits

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def applies(n, vocab, groups, hidden=64):
        x = _CudaStandIn((n, hidden), torch.bfloat16)
        w = _CudaStandIn((vocab, hidden), torch.bfloat16)
        difference = _CudaStandIn((n, half_logits_format.row_stride(vocab)), torch.float16)
        store = HalfLogits(difference, _CudaStandIn((n, groups), torch.float32))
        acc = _CudaStandIn((vocab, hidden), torch.float32)
        return cutlass.backward_applies(x, w, store, acc)

    assert applies(2**27 - 1, 1000, 16)
    assert not applies(2**27, 1000, 16)
    groups = half_logits_format.num_groups(151_936)
    limit = -(-(2**31) // groups)  # the first N with N x 2,374 >= 2^31
    assert (groups, limit) == (2374, 904_585)
    assert applies(limit - 1, 151_936, groups)
    assert not applies(limit, 151_936, groups)
    assert not applies(1000, 1000, 16, hidden=60)  # and a TMA rule beside it: H a multiple of 8


_C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
            "float": ctypes.c_float, "void": None}  # fmt: skip


def _c_type(decl: str):
    """The ctypes type of a C parameter or return type as the entry points spell them (`float const* lse`)."""
    decl = " ".join(decl.replace("*", " * ").split())
    if "*" in decl:
        return ctypes.c_char_p if decl.startswith("char const *") and decl.count("*") == 1 else ctypes.c_void_p
    return _C_TYPES[decl.rsplit(" ", 1)[0] if " " in decl else decl]


def _entry_points() -> dict[str, tuple]:
    """Every `GRPO_API` function of csrc/*.cu: name -> (return type, [parameter types]) as ctypes types."""
    found = {}
    for source in sorted(CSRC.glob("*.cu")):
        text = re.sub(r"//[^\n]*", "", source.read_text())
        for ret, name, params in re.findall(r"GRPO_API\s+([\w\s]+?\**)\s*(grpo_csrc_\w+)\s*\(([^)]*)\)", text):
            args = [_c_type(p) for p in params.split(",") if p.strip() not in ("", "void")]
            found[name] = (_c_type(ret), args)
    return found


def test_ctypes_declarations_match_the_c_entry_points():
    """cutlass._declare (and _open's two) against the `GRPO_API` signatures read from csrc/*.cu: the same number of
    parameters, each of the same C type (a float passed where the C side reads a double, or an int where it reads
    int64_t, is garbage on the GPU, not an error here), the same return type; and every entry point Python calls is
    declared (an undeclared one would pass each argument as a C int)."""
    class Library:  # records what _declare sets
        def __init__(self):
            self.functions = {}

        def __getattr__(self, name):
            blank = type("Function", (), {"argtypes": None, "restype": ctypes.c_int})  # ctypes' defaults
            return self.__dict__["functions"].setdefault(name, blank())

    lib = Library()
    cutlass._declare(lib)
    declared = {name: (fn.restype, fn.argtypes) for name, fn in lib.functions.items()}
    declared["grpo_csrc_abi_version"] = (ctypes.c_int, None)  # _open's, before the ABI check
    declared["grpo_csrc_build_stamp"] = (ctypes.c_char_p, None)
    c_side = _entry_points()
    assert len(c_side) >= 12, sorted(c_side)  # the parse found the entry points
    for name, (restype, argtypes) in declared.items():
        assert name in c_side, f"{name} is declared in Python but is no GRPO_API function of csrc/*.cu"
        want_ret, want_args = c_side[name]
        assert restype == want_ret, f"{name}: returns {want_ret}, declared {restype}"
        if argtypes is not None or want_args:
            assert argtypes is not None, f"{name} takes {len(want_args)} parameters and has no argtypes"
            assert len(argtypes) == len(want_args), f"{name}: C {len(want_args)} parameters, {len(argtypes)} declared"
            for i, (got, want) in enumerate(zip(argtypes, want_args)):
                assert got == want, f"{name} parameter {i}: C {want.__name__}, declared {got.__name__}"
    called = set()
    for path in (ROOT / "grpo_kernels" / "ops" / "lm_head" / "cutlass.py", ROOT / "benchmarks" / "gpu" / "csrc_check.py"):
        called |= set(re.findall(r"lib\.(grpo_csrc_\w+)\(", path.read_text()))
        called |= set(re.findall(r'_call\(lib, "(grpo_csrc_\w+)"', path.read_text()))
    assert called and called <= set(declared), sorted(called - set(declared))


def test_kernel_c_abi_validates_before_any_cuda_call(fresh_state):
    """The C ABI as ctypes declares it (argument order and types): kernel C's entry points refuse bad sizes,
    strides and pointers with their message before touching the GPU, so each refusal below shows the argument
    reached its parameter (a shifted argument list would refuse for another reason, or not at all)."""
    if not LIB.is_file():
        pytest.skip("no built library")
    lib = cutlass.load(LIB, CSRC)
    assert lib is not None

    def dz_gemms(n=256, vocab=1000, hidden=64, ld_diff=1000, ld_weight=64, ld_hidden=64, ld_gh=64, ld_gw=64,
                 diff=16, weight=16, x=16, gh=16, gw=16, coef=16, dtype=1, gw_16bit=0, ld_offset=16):  # fmt: skip
        code = lib.grpo_csrc_lm_head_bwd_dz_gemms(dtype, diff, ld_diff, 16, ld_offset, weight, ld_weight, x, ld_hidden, gh,
                                                  ld_gh, 0, gw, ld_gw, gw_16bit, 0, coef, 16, None, n, vocab, hidden,
                                                  0, 1.0, 8, 0)  # fmt: skip
        return code, lib.grpo_csrc_last_error().decode()

    assert dz_gemms(n=0) == (1, "empty problem")
    assert dz_gemms(vocab=0) == (1, "empty problem")
    assert dz_gemms(n=2**31) == (1, "sizes must be below 2^31")
    assert dz_gemms(gh=None, gw=None) == (1, "no output: grad_hidden and grad_weight are null")
    # the per-token offsets are indexed in 32 bits (token x ld_offset + group)
    for bad in ({"n": 2**27, "ld_offset": 16}, {"ld_offset": 0}):
        assert dz_gemms(**bad) == (1, "the offsets [N, ld_offset] must have N ld_offset < 2^31 elements (32-bit "
                                      "indices)"), bad  # fmt: skip
    for bad in ({"hidden": 60}, {"ld_diff": 1001}, {"ld_weight": 68}, {"ld_hidden": 68}, {"ld_gh": 63},
                {"ld_gw": 63}):  # fmt: skip
        code, why = dz_gemms(**bad)
        assert code == 1 and why.startswith("H, ld_diff, ld_weight and ld_hidden must be multiples of 8"), (bad, why)
    for bad in ({"diff": 8}, {"weight": 24}, {"x": 24}, {"gh": 4}, {"gw": 4}, {"coef": 8},
                {"gw_16bit": 1, "gw": 2}):  # fmt: skip
        code, why = dz_gemms(**bad)
        assert code == 1 and why.startswith("misaligned pointer"), (bad, why)
    assert dz_gemms(dtype=3) == (1, "unsupported dtype (1 bf16, 2 fp16)")
    code = lib.grpo_csrc_lm_head_bwd_token_coef(16, 16, None, None, 16, 1.0, None, 0, 16, 16, 0)
    assert code == 1 and lib.grpo_csrc_last_error().decode() == "n_tokens must be in [1, 2^31)"
