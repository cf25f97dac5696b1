"""Kernel A from csrc/ (CUTLASS 3.x, sm_90a): log-probs without grad below one cuBLAS GEMM's cost, opt-in.

`csrc/lm_head_fwd_sm90.cu` is the logits GEMM (TMA + WGMMA, warp-specialized persistent schedule) whose
epilogue writes, per row and per vocabulary tile of `block_n` columns, the tile's max m_t, sum exp(z - m_t),
sum exp(z - m_t)(z - m_t) and the target logit: the Triton partials' format with one "split" per tile, folded
by the same merge (README.md beside this file, §1). It is built without a GPU by `csrc/build.sh` into
`csrc/bin/libgrpo_kernels_sm90a.so`, a plain C ABI loaded here with ctypes (no torch extension, no ABI
coupling to the GPU machine's torch).

This module is an `impl` for LMHeadFunction (the interface of triton.py): `lm_head_forward` runs the csrc kernel
where it applies (switch on, CUDA device of capability 9.0, bf16 / fp16, 16-byte aligned rows, `logits_out`
None or a HalfLogits: the fused one-pass schedules' training forward) and triton.py's otherwise;
`lm_head_backward` is triton.py's. Nothing happens at import: the
library is looked for and loaded on the first call with the switch on, and a missing, stale (its stamp differs
from csrc/'s sources) or unloadable library gives exactly one warning and the Triton path from then on.

Switch: GRPO_KERNELS_CSRC=1 (read per call; `get_impl("triton")` returns this module then). Not taken by
backend="auto" on its own: csrc/README.md.

It also holds the float64 / fp32 model of the epilogue's arithmetic (`tile_partials`, `merge_partials`), the
spec that tests/test_csrc.py pins against the full-row float64 softmax and that the GPU check compares to.
"""

from __future__ import annotations

import ctypes
import heapq
import importlib.util
import math
import os
import warnings
from pathlib import Path

import torch

from . import half_logits_format
from .reference import LMHeadStats
from .transform import gradient_factor

ENV_SWITCH = "GRPO_KERNELS_CSRC"
ENV_LIBRARY = "GRPO_KERNELS_CSRC_LIB"  # another library file (e.g. a build carried elsewhere)
ABI_VERSION = 7  # 2: the partials call takes the HalfLogits store; 3: the backward's dz GEMMs (kernel C); 4: their
# grad_weight summed in place into a 16-bit gradient buffer (out_16bit); 5: grad_weight overwritten where accumulate
# is 0 (a 4 library would add into the caller's uninitialised buffer: refused); 6: both dz GEMMs in one launch
# (grpo_csrc_lm_head_bwd_dz_gemms, in place of one grpo_csrc_lm_head_bwd_dz_gemm call per GEMM); 7: a soft cap's
# constant cap_in cap_out in the token coefficients (token_coef's coef_factor), dz_gemms taking cap_out alone
LOG2E = 1.4426950408889634
RUN_MAX_INIT = -(2.0**105)
PAD_LOGIT = -(2.0**104)
VARIANTS = {"cooperative": 0, "pingpong": 1}  # 128x256x64 two consumer warpgroups / 64x256x64 ping-pong
DTYPES = {torch.bfloat16: 1, torch.float16: 2}
BIAS_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_SRC_DIR = Path(__file__).resolve().parents[3] / "csrc"
_state: dict = {}  # "lib": the loaded library or None; "why": the reason it is None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "0") not in ("", "0", "false", "False")


def library_path() -> Path:
    return Path(os.environ.get(ENV_LIBRARY) or _SRC_DIR / "bin" / "libgrpo_kernels_sm90a.so")


def source_stamp(src_dir: Path = _SRC_DIR) -> str | None:
    """csrc/stamp.py's stamp of the sources, or None where the sources are not shipped (a wheel install)."""
    stamp_py = Path(src_dir) / "stamp.py"
    if not stamp_py.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_grpo_csrc_stamp", stamp_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_stamp(Path(src_dir))


def _open(path: Path, src_dir: Path):
    """(library, None) or (None, reason). Loading runs no CUDA call: the stamp is a host string."""
    if not path.is_file():
        return None, f"{path} is missing (build it with `bash csrc/build.sh`)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path} does not load: {exc}"
    try:
        lib.grpo_csrc_abi_version.restype = ctypes.c_int
        if lib.grpo_csrc_abi_version() != ABI_VERSION:
            return None, f"{path} has ABI version {lib.grpo_csrc_abi_version()}, this module wants {ABI_VERSION}"
        lib.grpo_csrc_build_stamp.restype = ctypes.c_char_p
        built = lib.grpo_csrc_build_stamp().decode()
        want = source_stamp(src_dir)
        if want is not None and built != want:
            return None, f"{path} is stale (built from sources {built}, csrc/ is now {want}): rerun `bash csrc/build.sh`"
        _declare(lib)
    except AttributeError as exc:  # a symbol missing: not this library, or a build without the exports
        return None, f"{path} lacks an entry point: {exc}"
    return lib, None


def _declare(lib) -> None:
    c_int, c_i64, c_f, c_p, c_sz, c_u64 = (ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_uint64)  # fmt: skip
    lib.grpo_csrc_last_error.restype = ctypes.c_char_p
    lib.grpo_csrc_lm_head_fwd_block_n.argtypes = [c_int]
    lib.grpo_csrc_lm_head_fwd_block_n.restype = c_int
    lib.grpo_csrc_lm_head_fwd_smem_bytes.argtypes = [c_int, c_int]
    lib.grpo_csrc_lm_head_fwd_smem_bytes.restype = c_int
    lib.grpo_csrc_lm_head_fwd_workspace_bytes.argtypes = [c_int, c_int, c_i64, c_i64, c_i64]
    lib.grpo_csrc_lm_head_fwd_workspace_bytes.restype = c_sz
    lib.grpo_csrc_lm_head_fwd_partials.argtypes = [
        c_int, c_int, c_p, c_p, c_i64, c_i64, c_i64, c_i64, c_i64,  # variant dtype hidden weight N H V ldh ldw
        c_p, c_int, c_p, c_f, c_int, c_f, c_f,  # bias bias_dtype targets inv_T has_softcap cap_in cap_out
        c_p, c_p, c_p, c_p,  # part_max part_sum part_dev target_logit
        c_p, c_i64, c_p, c_i64,  # the HalfLogits store: diff ld_diff offset ld_offset (null: statistics only)
        c_int, c_int, c_p, c_sz, c_u64,  # raster swizzle workspace workspace_bytes stream
    ]
    lib.grpo_csrc_lm_head_fwd_partials.restype = c_int
    lib.grpo_csrc_lm_head_fwd_merge.argtypes = [c_p] * 8 + [c_i64, c_i64, c_u64]
    lib.grpo_csrc_lm_head_fwd_merge.restype = c_int
    # kernel C (csrc/lm_head_bwd_sm90.cu)
    lib.grpo_csrc_lm_head_bwd_smem_bytes.argtypes = [c_int, c_int]
    lib.grpo_csrc_lm_head_bwd_smem_bytes.restype = c_int
    lib.grpo_csrc_lm_head_bwd_tile.argtypes = [c_p]
    lib.grpo_csrc_lm_head_bwd_tile.restype = None
    lib.grpo_csrc_lm_head_bwd_token_coef.argtypes = [
        c_p, c_p, c_p, c_p, c_p, c_f, c_p,  # lse expected_logit grad_logprobs grad_entropy targets coef_factor dz_scale
        c_i64, c_p, c_p, c_u64,  # N coef target stream
    ]
    lib.grpo_csrc_lm_head_bwd_token_coef.restype = c_int
    lib.grpo_csrc_lm_head_bwd_dz_gemms.argtypes = [
        c_int, c_p, c_i64, c_p, c_i64,  # dtype diff ld_diff offset ld_offset
        c_p, c_i64, c_p, c_i64,  # weight ld_weight hidden ld_hidden
        c_p, c_i64, c_int,  # grad_hidden ld_grad_hidden accumulate_hidden
        c_p, c_i64, c_int, c_int,  # grad_weight ld_grad_weight grad_weight_16bit accumulate_weight
        c_p, c_p, c_p,  # coef target inv_scale
        c_i64, c_i64, c_i64, c_int, c_f, c_int, c_u64,  # N V H has_softcap cap_out group_m stream
    ]
    lib.grpo_csrc_lm_head_bwd_dz_gemms.restype = c_int


def load(path: Path | None = None, src_dir: Path = _SRC_DIR):
    """The library, or None after exactly one warning per process (the reason is kept in `why_not()`)."""
    if "lib" not in _state:
        lib, why = _open(library_path() if path is None else Path(path), Path(src_dir))
        _state.update(lib=lib, why=why)
        if lib is None:
            warnings.warn(f"grpo_kernels csrc kernels unavailable, using the Triton path: {why}", stacklevel=2)
    return _state["lib"]


def why_not() -> str | None:
    return _state.get("why")


def reset() -> None:
    """Forget the loaded library (tests; a rebuilt library is looked for again)."""
    _state.clear()


def applies(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logits_out=None) -> bool:
    """Whether the csrc kernel can run this call (otherwise the Triton path does, silently: a shape question).
    `logits_out`: None (statistics only) or a HalfLogits with 16-byte aligned fp16 rows (the training forward
    of the fused one-pass schedules); fp32 logits are Triton's or cuBLAS's."""
    from .triton import HalfLogits

    if logits_out is not None:
        if not isinstance(logits_out, HalfLogits):
            return False
        d = logits_out.difference
        if d.data_ptr() % 16 or (d.stride(0) * 2) % 16 or logits_out.offset.stride(1) != 1:
            return False
    if hidden.device.type != "cuda" or hidden.dtype not in DTYPES:
        return False
    if weight.dtype != hidden.dtype or torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return False
    if bias is not None and bias.dtype not in BIAS_DTYPES:
        return False
    elt = hidden.element_size()
    # TMA: unit stride along H, 16-byte aligned base and row strides
    return all(
        t.stride(-1) == 1 and (t.stride(0) * elt) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (hidden, weight)
    ) and (hidden.shape[1] * elt) % 16 == 0


def _call(lib, fn: str, *args) -> None:
    if getattr(lib, fn)(*args) != 0:
        raise RuntimeError(f"csrc {fn}: {lib.grpo_csrc_last_error().decode()}")


def forward_partials(lib, hidden, weight, bias, targets, temperature: float, softcap=None, *,
                     variant: str = "cooperative", raster: int = 0, swizzle: int = 1, logits_out=None):  # fmt: skip
    """The csrc GEMM's partials: (part_max, part_sum, part_dev [num_tiles, N], target_logit [N]), fp32; with
    `logits_out` (a HalfLogits) the epilogue also stores the logits there as fp16 z - m_t, m_t per 64 columns."""
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    v = VARIANTS[variant]
    block_n = lib.grpo_csrc_lm_head_fwd_block_n(v)
    num_tiles = -(-vocab // block_n)
    parts = torch.empty((3, num_tiles, n_tokens), dtype=torch.float32, device=hidden.device)
    target_logit = torch.full((n_tokens,), float("nan"), dtype=torch.float32, device=hidden.device)
    targets = targets.to(torch.int64).contiguous()
    ws_bytes = lib.grpo_csrc_lm_head_fwd_workspace_bytes(v, DTYPES[hidden.dtype], n_tokens, hidden_size, vocab)
    ws = torch.empty((max(ws_bytes, 1),), dtype=torch.uint8, device=hidden.device)
    if softcap is None:
        has_softcap, cap_in, cap_out = 0, 0.0, 0.0
    else:
        has_softcap, (cap_in, cap_out) = 1, softcap
    bias_c = bias.contiguous() if bias is not None else None
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    _call(lib, "grpo_csrc_lm_head_fwd_partials", v, DTYPES[hidden.dtype], hidden.data_ptr(), weight.data_ptr(),
          n_tokens, hidden_size, vocab, hidden.stride(0), weight.stride(0),
          bias_c.data_ptr() if bias_c is not None else None, BIAS_DTYPES[bias_c.dtype] if bias_c is not None else 0,
          targets.data_ptr(), 1.0 / temperature, has_softcap, cap_in, cap_out,
          parts[0].data_ptr(), parts[1].data_ptr(), parts[2].data_ptr(), target_logit.data_ptr(),
          *((logits_out.difference.data_ptr(), logits_out.difference.stride(0), logits_out.offset.data_ptr(),
             logits_out.offset.stride(0)) if logits_out is not None else (None, 0, None, 0)),
          raster, swizzle, ws.data_ptr(), ws_bytes, stream)  # fmt: skip
    return parts[0], parts[1], parts[2], target_logit


def forward_stats(lib, hidden, weight, bias, targets, temperature: float, softcap=None, **kwargs) -> LMHeadStats:
    """Partials then the CUDA merge: LMHeadStats (fp32 [N]) as triton.lm_head_forward returns them."""
    n_tokens = hidden.shape[0]
    out = torch.empty((4, n_tokens), dtype=torch.float32, device=hidden.device)
    stats = LMHeadStats(out[0], out[1], out[2], out[3])
    if n_tokens == 0:
        return stats
    with torch.cuda.device(hidden.device):  # the library launches on the current device, as torch's stream
        m, s, d, t = forward_partials(lib, hidden, weight, bias, targets, temperature, softcap, **kwargs)
        stream = torch.cuda.current_stream(hidden.device).cuda_stream
        _call(lib, "grpo_csrc_lm_head_fwd_merge", m.data_ptr(), s.data_ptr(), d.data_ptr(), t.data_ptr(),
              *(x.data_ptr() for x in stats), n_tokens, m.shape[0], stream)  # fmt: skip
    return stats


def lm_head_forward(hidden, weight, bias, targets, temperature, **kwargs) -> LMHeadStats:
    """triton.lm_head_forward's signature; the csrc kernel where it applies and the switch is on."""
    from . import triton as triton_impl

    softcap, logits_out = kwargs.get("softcap"), kwargs.get("logits_out")
    plain = set(kwargs) <= {"softcap", "logits_out"}  # config / tiles_per_split / forward_gemm: Triton requests
    if enabled() and plain and hidden.shape[0] > 0 and applies(hidden, weight, bias, logits_out):
        lib = load()
        if lib is not None:
            triton_impl._check_common(hidden, weight, bias, targets, temperature)
            if logits_out is not None:
                triton_impl._check_half_logits(logits_out, hidden.shape[0], weight.shape[0], hidden.device,
                                               "logits_out")  # fmt: skip
            return forward_stats(lib, hidden, weight, bias, targets, temperature, softcap, logits_out=logits_out)
    return triton_impl.lm_head_forward(hidden, weight, bias, targets, temperature, **kwargs)


def backward_applies(hidden, weight, stored_logits, grad_weight_acc=None) -> bool:
    """Whether csrc's dz GEMMs (kernel C) can run a `dz_in_gemm` backward: an sm_90 device, bf16 / fp16 operands,
    the fp16 store (HalfLogits; fp32 stored logits are Triton's), TMA's alignment (unit stride along H,
    16-byte aligned bases and rows, H a multiple of 8), offsets the kernel indexes in 32 bits (N ld_offset < 2^31)
    and a grad_weight accumulator with even rows, fp32 or the gradient buffer itself in the operands' dtype (in
    place)."""
    from .triton import HalfLogits

    if not isinstance(stored_logits, HalfLogits):
        return False
    if hidden.device.type != "cuda" or hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        return False
    if torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return False
    d, off = stored_logits.difference, stored_logits.offset
    if d.stride(1) != 1 or d.data_ptr() % 16 or (d.stride(0) * 2) % 16 or off.stride(1) != 1:
        return False
    if off.shape[0] * off.stride(0) >= 2**31:
        return False
    if grad_weight_acc is not None and (grad_weight_acc.dtype not in (torch.float32, hidden.dtype)
                                        or grad_weight_acc.stride(1) != 1 or grad_weight_acc.stride(0) % 2
                                        or grad_weight_acc.data_ptr() % (2 * grad_weight_acc.element_size())):  # fmt: skip
        return False
    elt = hidden.element_size()
    return hidden.shape[1] % 8 == 0 and all(
        t.stride(-1) == 1 and (t.stride(0) * elt) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (hidden, weight)
    )


def lm_head_backward(*args, **kwargs):
    """triton.lm_head_backward's signature and checks; with the switch on, a `dz_in_gemm` call offers its two dz
    GEMMs to `dz_gemms_if_applies` (csrc's kernel C where it applies, else the Triton ones; the bias sums stay
    Triton's)."""
    from . import triton as triton_impl

    if enabled() and kwargs.get("dz_in_gemm"):
        kwargs["dz_gemms"] = dz_gemms_if_applies
    return triton_impl.lm_head_backward(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Kernel C: the dz GEMMs. `dz_gemms_csrc` launches csrc's kernels, `dz_gemms_reference` is their arithmetic in
# torch (the spec: the tests run it on the CPU against float64, the GPU check against the device). Both take
# triton.lm_head_backward's prepared operands (DZ_GEMMS_ARGS) and write the same outputs:
#   grad_hidden_out [N, H] fp32 = (grad_hidden_out if accumulate_hidden else 0) + dz W / S
#   grad_weight_acc [V, H] = (grad_weight_acc if accumulate_weight else 0) + dz^T X / S   (fp32, or in the
#                            operands' dtype: the fp32 sum rounded into it once; not read where not accumulated)
# dz from the stored fp16 logits and the per-token coefficients (csrc/lm_head_bwd_sm90.cu's header), rounded to
# the operands' dtype; S the fp16 dz scale (dz_scale[0]; 1 without).

DZ_GEMMS_ARGS = ("stored_logits", "hidden", "weight", "targets", "lse", "expected_logit", "grad_logprobs",
                 "grad_entropy", "inv_temperature", "softcap", "dz_scale", "grad_hidden_out", "accumulate_hidden",
                 "grad_weight_acc", "accumulate_weight")  # fmt: skip
DEAD_LSE = 2.0**105  # triton_common.py DEAD_LSE


def token_coefficients(lse, expected_logit, grad_logprobs, grad_entropy, targets, inv_temperature: float,
                       dz_scale=None, softcap=None):  # fmt: skip
    """token_coef_kernel's packing, in lse's dtype: (coef [N, 4], target [N] int64, -1 where there is no target
    term). With F = gradient_factor(inv_temperature, softcap) (token_coef_kernel's coef_factor, ABI 7: 1 / T, or
    a soft cap's cap_in cap_out, left out of the dz GEMMs' per-logit factor), c_lp = F S g_lp and c_H = F S g_H,
    coef = (lse log2 e, c_lp, -c_H, c_H E_p[z] - c_lp), so that dz = (2^(z log2 e - coef[0]) (coef[2] z + coef[3]) + c_lp 1[v = y])
    (times 1 - t^2 with a soft cap: `dz_from_stored`) (csrc/lm_head_bwd_sm90.cu, TokenCoef); a token without
    upstream gradient gets (DEAD_LSE log2 e, 0, 0, 0): its dz is exactly 0."""
    zeros = torch.zeros_like(lse)
    s = dz_scale[0].to(lse.dtype) if dz_scale is not None else 1.0
    factor = gradient_factor(inv_temperature, softcap)  # rounded to lse's dtype by the product, as the ABI's float
    c_lp = grad_logprobs.to(lse.dtype) * factor if grad_logprobs is not None else zeros
    c_h = grad_entropy.to(lse.dtype) * factor if grad_entropy is not None else zeros
    live = (c_lp != 0) | (c_h != 0)
    c_lp_s, c_h_s = c_lp * s, c_h * s
    # c_H E_p[z] - c_lp, E_p[z] read only where the token has an entropy gradient (as the kernel's fmaf)
    k = torch.where(c_h != 0, c_h_s * expected_logit.to(lse.dtype), zeros) - c_lp_s
    coef = torch.stack([torch.where(live, lse * LOG2E, torch.full_like(lse, DEAD_LSE * LOG2E)),
                        torch.where(live, c_lp_s, zeros), torch.where(live, -c_h_s, zeros),
                        torch.where(live, k, zeros)], 1)  # fmt: skip
    target = targets.long() if grad_logprobs is not None else torch.full_like(targets.long(), -1)
    target = torch.where((target >= 0) & (target < 2**31), target, torch.full_like(target, -1))
    return coef, target


def dz_from_stored(difference, offset, coef, target, softcap=None) -> torch.Tensor:
    """dz_chunk's arithmetic, in difference's dtype, on logits z = offset + difference given apart (each [N, V]: the
    fp16 store's differences widened and its offsets expanded over their 64 columns; any split of z works, e.g.
    offset 0): the offset folded into two per-row shifts, then per element
        p = 2^(d log2 e + exp_shift),  exp_shift = m log2 e - lse log2 e
        dz = p (-c_H d + coef_shift) + c_lp 1[v = y],  coef_shift = -c_H m + c_H E_p[z] - c_lp
    (= p (c_H (E_p[z] - z) - c_lp) + c_lp 1[v = y]), with a soft cap times 1 - t^2 clamped to [0, 1], t = d / cap_out
    + m / cap_out (= 1 - clamp(z / cap_out, -1, 1)^2), the target term included: its constant cap_in cap_out is in coef
    (`token_coefficients(..., softcap=)`). The kernel fuses the products into FMAs; torch rounds each."""
    lse_log2, c_lp, neg_c_h, k = (coef[:, i : i + 1] for i in range(4))
    exp_shift = offset * LOG2E - lse_log2
    coef_shift = neg_c_h * offset + k
    dz = torch.exp2(difference * LOG2E + exp_shift) * (neg_c_h * difference + coef_shift)
    cols = torch.arange(difference.shape[1], device=difference.device)
    dz = dz + torch.where(cols[None, :] == target[:, None], c_lp, torch.zeros_like(c_lp))
    if softcap is not None:
        inv_cap_out = 1.0 / float(softcap[1])
        t = difference * inv_cap_out + offset * inv_cap_out
        dz = dz * (1.0 - t * t).clamp(0.0, 1.0)  # the kernel's fma.rn.sat
    return dz


def dz_magnitude(z, coef, target) -> torch.Tensor:
    """An upper bound of |dz| per element (with a soft cap: before its factor 1 - t^2 in [0, 1], the constant
    cap_in cap_out being in coef), in z's dtype (float64 for the bounds): p (|c_H| |E_p[z] - z| + |c_lp|) + |c_lp|
    1[v = y], for `token_coefficients`' coef / target (no target term where target is -1)."""
    lse_log2, c_lp, neg_c_h, k = (coef[:, i : i + 1] for i in range(4))
    p = torch.exp2(z * LOG2E - lse_log2)
    mag = p * ((neg_c_h * z + k + c_lp).abs() + c_lp.abs())  # |c_H (E_p[z] - z)| + |c_lp|
    rows = torch.arange(z.shape[0], device=z.device)
    mag[rows, target.clamp(min=0)] += coef[:, 1].abs() * (target >= 0)
    return mag


def dz_gemms_reference(*, stored_logits, hidden, weight, targets, lse, expected_logit, grad_logprobs, grad_entropy,
                       inv_temperature, softcap, dz_scale, grad_hidden_out, accumulate_hidden, grad_weight_acc,
                       accumulate_weight=True) -> bool:  # fmt: skip
    """Kernel C's arithmetic in torch on any device: fp32 dz from the stored fp16 logits, rounded to the
    operands' dtype, products summed in fp32 (the WGMMA's accumulate), the sums divided by S."""
    coef, target = token_coefficients(lse, expected_logit, grad_logprobs, grad_entropy, targets, inv_temperature,
                                      dz_scale, softcap)  # fmt: skip
    difference = stored_logits.difference.float()  # [N, V]
    group = half_logits_format.STORED_GROUP
    offset = stored_logits.offset.float().repeat_interleave(group, dim=1)[:, : difference.shape[1]]  # [N, V]
    dz = dz_from_stored(difference, offset, coef, target, softcap).to(hidden.dtype).float()
    inv_s = dz_scale[1] if dz_scale is not None else 1.0
    if grad_hidden_out is not None:
        part = (dz @ weight.float()) * inv_s
        grad_hidden_out.copy_(grad_hidden_out + part if accumulate_hidden else part)
    if grad_weight_acc is not None:  # in place (16-bit): old + part summed in fp32, rounded once
        part = (dz.t() @ hidden.float()) * inv_s
        grad_weight_acc.copy_((grad_weight_acc.float() + part if accumulate_weight else part).to(grad_weight_acc.dtype))
    return True  # the hook's answer: it ran them


def dz_gemms_if_applies(**args) -> bool:
    """triton.lm_head_backward's `dz_gemms` hook: csrc's kernel C on the prepared operands where
    `backward_applies` and the library loads (True), else nothing (False: the Triton kernels run)."""
    acc = args["grad_weight_acc"]
    if not backward_applies(args["hidden"], args["weight"], args["stored_logits"], acc):
        return False
    lib = load()
    if lib is None:
        return False
    dz_gemms_csrc(lib, **args)
    return True


def dz_gemms_csrc(lib, *, stored_logits, hidden, weight, targets, lse, expected_logit, grad_logprobs, grad_entropy,
                  inv_temperature, softcap, dz_scale, grad_hidden_out, accumulate_hidden, grad_weight_acc,
                  accumulate_weight=True, group_m: int = 8):  # fmt: skip
    """csrc's kernel C: token_coef_kernel, then the wanted dz GEMMs in one launch (grad_hidden's tiles first, so
    grad_weight's short tiles fill the SMs its last wave leaves: `dz_gemms_makespan`), on torch's current stream."""
    if grad_hidden_out is None and grad_weight_acc is None:
        return
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    coef = torch.empty((n_tokens, 4), dtype=torch.float32, device=device)
    target = torch.empty((n_tokens,), dtype=torch.int32, device=device)
    targets = targets.to(torch.int64).contiguous()

    def ptr(t):
        return None if t is None else t.data_ptr()

    has_softcap, cap_out = (0, 1.0) if softcap is None else (1, float(softcap[1]))
    diff, offset = stored_logits.difference, stored_logits.offset
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        _call(lib, "grpo_csrc_lm_head_bwd_token_coef", lse.data_ptr(), expected_logit.data_ptr(), ptr(grad_logprobs),
              ptr(grad_entropy), targets.data_ptr(), gradient_factor(inv_temperature, softcap), ptr(dz_scale),
              n_tokens, coef.data_ptr(), target.data_ptr(), stream)  # fmt: skip
        inv_scale = None if dz_scale is None else dz_scale[1:].data_ptr()
        gh, gw = grad_hidden_out, grad_weight_acc
        _call(lib, "grpo_csrc_lm_head_bwd_dz_gemms", DTYPES[hidden.dtype], diff.data_ptr(), diff.stride(0),
              offset.data_ptr(), offset.stride(0), weight.data_ptr(), weight.stride(0), hidden.data_ptr(),
              hidden.stride(0), ptr(gh), 0 if gh is None else gh.stride(0), int(accumulate_hidden), ptr(gw),
              0 if gw is None else gw.stride(0), int(gw is not None and gw.dtype != torch.float32),
              int(accumulate_weight), coef.data_ptr(), target.data_ptr(), inv_scale, n_tokens, vocab, hidden_size,
              has_softcap, cap_out, group_m, stream)  # fmt: skip


def dz_gemms_makespan(n_tokens: int, vocab: int, hidden_size: int, sms: int = 132, *, one_launch: bool = True,
                      tile: tuple[int, int, int] = (128, 256, 64)) -> int:
    """Kernel C's time in K-tile steps of one CTA (one 128 x 256 x 64 WGMMA tile: ~1,024 tensor-core cycles),
    counted, not measured: each CTA holds one SM (230 KB of shared memory) for as many steps as its GEMM's K has
    tiles; CTAs start in index order on the first free SM (a greedy list schedule). grad_hidden's tiles (ceil(N / BM)
    x ceil(H / BN), each over K = V) come first, grad_weight's (ceil(V / BM) x ceil(H / BN), K = N) after them: in
    one launch (`one_launch`, what csrc does since ABI 6) grad_weight's tiles start on the SMs grad_hidden's last
    wave leaves free; as two launches on one stream the second starts when the first has ended. Prologue and
    epilogue time are not counted (the same CTAs either way)."""
    bm, bn, bk = tile
    tiles_n = -(-hidden_size // bn)
    gemms = [(-(-n_tokens // bm) * tiles_n, -(-vocab // bk)), (-(-vocab // bm) * tiles_n, -(-n_tokens // bk))]
    end = 0
    free = [0] * sms  # when each SM is next free, a min-heap
    for count, steps in gemms:
        if not one_launch:
            free = [end] * sms  # stream order: the launch waits for the previous one to end
        for _ in range(count):
            start = heapq.heappop(free)
            heapq.heappush(free, start + steps)
            end = max(end, start + steps)
    return end


# ---------------------------------------------------------------------------------------------------------
# The epilogue's arithmetic on the host: the spec of the partials and their merge.


def tile_half_logits(z: torch.Tensor, block_n: int, group: int = half_logits_format.STORED_GROUP):
    """The epilogue's fp16 store of logits z [N, V] (fp32), tiles of block_n columns: (difference fp16 [N, V] =
    max(z - m_t, -65504), offset fp32 [N, ceil(V / group)] = m_t of the group's tile), m_t the row's max over
    its tile, as csrc's StatsEpilogue writes them (the HalfLogits format)."""
    n, vocab = z.shape
    num_tiles = -(-vocab // block_n)
    padded = torch.full((n, num_tiles * block_n), PAD_LOGIT, dtype=z.dtype)
    padded[:, :vocab] = z
    m = padded.view(n, num_tiles, block_n).amax(-1)  # [N, T]
    m_col = m.repeat_interleave(block_n, dim=1)[:, :vocab]
    difference = (z - m_col).clamp(min=half_logits_format.HALF_DIFF_MIN).to(torch.float16)
    offset = m.repeat_interleave(block_n // group, dim=1)[:, : -(-vocab // group)].contiguous()
    return difference, offset


def tile_partials(z: torch.Tensor, targets: torch.Tensor, block_n: int):
    """Per-tile statistics of logits z [N, V] (any float dtype; the arithmetic runs in z's dtype), tiles of
    block_n columns, padding past V at PAD_LOGIT as the kernel's: (part_max, part_sum, part_dev [T, N],
    target_logit [N], NaN where the target is outside [0, V)). exp(x) = exp2(x log2 e) as the kernel's."""
    n, vocab = z.shape
    num_tiles = -(-vocab // block_n)
    padded = torch.full((n, num_tiles * block_n), PAD_LOGIT, dtype=z.dtype)
    padded[:, :vocab] = z
    tiles = padded.view(n, num_tiles, block_n).transpose(0, 1)  # [T, N, BN]
    m = tiles.amax(-1)
    d = tiles - m[..., None]
    e = torch.exp2(d * LOG2E)
    target_logit = torch.full((n,), float("nan"), dtype=z.dtype)
    ok = (targets >= 0) & (targets < vocab)
    target_logit[ok] = z[ok].gather(1, targets[ok].long()[:, None]).squeeze(1)
    return m, e.sum(-1), (e * d).sum(-1), target_logit


def merge_partials(part_max, part_sum, part_dev, target_logit) -> LMHeadStats:
    """The merge kernel's fold over tiles, in the partials' dtype (lm_head_fwd_kernel_merge's order)."""
    run_max = torch.full_like(part_max[0], RUN_MAX_INIT)
    run_sum = torch.zeros_like(part_sum[0])
    run_dev = torch.zeros_like(part_dev[0])
    for m_k, s_k, d_k in zip(part_max, part_sum, part_dev):
        new_max = torch.maximum(run_max, m_k)
        a = torch.exp2((run_max - new_max) * LOG2E)
        b = torch.exp2((m_k - new_max) * LOG2E)
        run_dev = a * (run_dev + (run_max - new_max) * run_sum) + b * (d_k + (m_k - new_max) * s_k)
        run_sum = a * run_sum + b * s_k
        run_max = new_max
    log_sum = torch.log(run_sum)
    mean_dev = run_dev / run_sum
    return LMHeadStats((target_logit - run_max) - log_sum, log_sum - mean_dev, run_max + log_sum, run_max + mean_dev)


def stats_error_bound(z64: torch.Tensor, block_n: int, eps: float = 2.0**-24) -> torch.Tensor:
    """Per-row bound on |fp32 statistic - float64 statistic| for the tile partials + merge computed in fp32
    from fp32-rounded z (derivation in tests/test_csrc.py): eps (2 max|z| + 4 (L + 8) (1 + spread)),
    L = block_n + num_tiles terms on the longest summation path, spread = max z - min z over the row."""
    num_tiles = math.ceil(z64.shape[1] / block_n)
    spread = (z64.amax(1) - z64.amin(1)).clamp(max=200.0)  # exp underflows past ~104: those terms are 0
    return eps * (2 * z64.abs().amax(1) + 4 * (block_n + num_tiles + 8) * (1 + spread))
