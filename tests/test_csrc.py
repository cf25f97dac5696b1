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
   store's arithmetic (`tile_half_logits`, ABI 2) reconstructs float64 logits within the HalfLogits bound.
3. The loader: importing grpo_kernels loads nothing; a missing or stale library falls back with one warning.
"""

from __future__ import annotations

import gzip
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


# ---- 2. the committed build ---------------------------------------------------------------------------


def test_committed_library_matches_the_sources():
    assert LIB.is_file(), "csrc/bin/libgrpo_kernels_sm90a.so is missing: run `bash csrc/build.sh` and commit"
    want = cutlass.source_stamp(CSRC)
    assert (BIN / "stamp.txt").read_text().strip() == want, "csrc/bin is stale: rerun `bash csrc/build.sh`"
    assert want.encode() in LIB.read_bytes(), "the library does not embed the sources' stamp"


def test_ptxas_report_no_spills_and_within_sm90_limits():
    report = (BIN / "ptxas.txt").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'\n(.*?)(?=Compiling entry|\Z)", report, re.S)
    assert len(kernels) >= 5, f"expected the 4 GEMM variants and the merge kernel, got {len(kernels)}"
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
    committed = gzip.decompress((BIN / "sass.txt.gz").read_bytes()).decode()
    assert committed.count("HGMMA") == sass.stdout.count("HGMMA"), "csrc/bin/sass.txt.gz is not this library's"


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
