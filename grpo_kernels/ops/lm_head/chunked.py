"""LM-head statistics and their backward in plain PyTorch, tile by tile (the `backend="torch"` path).

Logits exist one [token_chunk, vocab_chunk] tile at a time and the softmax statistics are folded online in
fp32; the backward recomputes each tile, or reads the forward's fp32 logits when the caller kept them
(`logits_out=` / `stored_logits=`: the fused loss's two-pass schedule when they fit its budget, 3 GEMM
units instead of 4). This is the reference the Triton kernels are checked against at real sizes, and the
backend used on CPU, MPS and any other device without Triton.

Rounding (README.md beside this file, "The PyTorch backend"):
  * every product is exact and every sum is accumulated in fp32. fp32 operands: fp32 GEMMs. bf16 / fp16
    operands: each GEMM gets fp32 copies of one tile of the weight (never the whole weight) and of the
    hidden rows; on a CPU with bf16 arithmetic (AVX512-BF16 / AMX) a bf16 GEMM runs in oneDNN's bf16 math
    mode, whose products of bf16 values are exact in fp32: the fp32 GEMM's result at up to ~3x its speed.
    On CUDA the forward GEMM writes fp32 directly (out_dtype).
  * dz = dL/dlogit is rounded once to bf16 for bf16 operands, as the Triton backend rounds its dz slab (and
    autograd through bf16 logits does); fp16 and fp32 operands keep it in fp32.
  * no fp32 [V, H] buffer for half-precision weights: grad_weight is finished one vocabulary tile at a time
    (its fp32 sum over every token, rounded once), or, with stored logits on a CPU, by one bf16 GEMM over all
    tokens (fp32 accumulation inside oneDNN, one rounding).

Both functions share their signatures with the Triton launchers in triton.py, so the autograd
Function (function.py) and the fused loss (ops/fused) can call either.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .reference import LMHeadStats

# Tile sizes: a [1024, 8192] fp32 tile is 32 MiB, small enough for any CPU or GPU, large enough that
# the per-tile Python overhead is negligible next to the matmul.
DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 8192
# the logit of a forbidden token (a -inf bias): exp of it minus any lse is exactly 0; the Triton kernels' value
# (triton.py: 2^101 below every logit the functional layer lets through, |z| <= 2^100)
NEG_BIG = -(2.0**102)
# Half-precision operands: each GEMM takes a slice of the weight whose fp32 copy (and the fp32 grad_weight
# tile of the backward) is an eighth of the weight's own bytes, within [HALF_SLICE_MIN_BYTES,
# HALF_TILE_BYTES] (Qwen2.5-3B's head: 8192 rows, 64 MiB; H = 1024, V = 32000: 2048 rows, 8 MiB); whole
# 128-row multiples: few GEMM calls at large heads, a copy small next to the weight at small ones.
HALF_TILE_BYTES = 64 * 2**20
HALF_SLICE_MIN_BYTES = 4 * 2**20
# Element-wise work that needs scratch (the softmax fold, dz with an entropy gradient or a soft cap) runs
# over blocks of at most this many elements (16 MiB of fp32 per scratch buffer): few enough torch ops that
# each one's thread fork / join stays small next to its work (on a busy machine a fork waits for the other
# threads' cores), bounded scratch. dz without an entropy gradient or a soft cap is formed in place over
# whole tiles.
ELEMENTWISE_BLOCK = 2**22
# The bf16 backward with stored logits writes dz's first rows through a bf16 buffer of at most this many
# bytes (LogitsStore: rows [r0, 2 r0) are written in place once rows [0, r0) are done).
FIRST_ROWS_BYTES = 4 * 2**20


# ------------------------------------------------------------------------------------------------
# GEMMs with fp32 results
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def bf16_math_available() -> bool:
    """oneDNN's bf16 math mode for fp32 GEMMs exists here (torch.backends.mkldnn.matmul.fp32_precision) and
    the CPU has bf16 arithmetic (without it oneDNN would ignore the mode: plain fp32, still exact)."""
    matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision") or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def exact_bf16_math(enabled: bool = True):
    """fp32 CPU GEMMs in oneDNN's bf16 math mode inside the block: for operands that are upcast bf16 values
    (exactly representable in bf16) the products are exact in fp32 and the sums fp32, i.e. the fp32 GEMM's
    result, at bf16 speed. The mode is a process-wide torch setting: it is restored on exit, and only GEMMs
    of bf16 values run inside (a thread running fp32 GEMMs meanwhile would get them rounded to bf16)."""
    if not (enabled and bf16_math_available()):
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _cuda_mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b of half-precision CUDA operands written in fp32 (out_dtype), or None where torch lacks it."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return None


class _Fp32Rows:
    """fp32 copies of row ranges of a half-precision 2-D tensor, in one buffer of at most `capacity` rows
    (allocated on first use), copied again only when another range is asked for."""

    def __init__(self, source: torch.Tensor, capacity: int):
        self.source, self.capacity = source, capacity
        self.buffer = None
        self.current = None  # (r0, r1) the buffer holds

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """source[r0:r1] in fp32 [r1 - r0, cols] (r1 - r0 <= capacity)."""
        if self.buffer is None:
            self.buffer = torch.empty((self.capacity, self.source.shape[1]), dtype=torch.float32,
                                      device=self.source.device)  # fmt: skip
        out = self.buffer[: r1 - r0]
        if self.current != (r0, r1):
            out.copy_(self.source[r0:r1])
            self.current = (r0, r1)
        return out


class _Operands:
    """fp32 views of the hidden rows and of one weight tile for the GEMMs, from operands of any dtype.

    fp32 operands are used as they are. Half-precision ones are upcast into two reused buffers: the current
    token chunk's hidden rows and one slice of at most HALF_TILE_BYTES of the weight (`tile` rows), each
    copied again only when another chunk / slice is asked for; `math()` turns on the exact bf16 math mode
    for bf16 operands on a CPU that has it."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, token_chunk: int, vocab_chunk: int):
        self.hidden, self.weight = hidden, weight
        self.dtype = hidden.dtype
        self.half = self.dtype != torch.float32
        self.cuda_out = self.half and hidden.is_cuda  # the forward GEMM writes fp32 itself (out_dtype)
        self.bf16_math = self.dtype == torch.bfloat16 and hidden.device.type == "cpu"
        n_tokens, hidden_size = hidden.shape
        self.tile = vocab_chunk  # weight rows per GEMM
        if self.half:  # the fp32 copy of one weight slice: an eighth of the weight, within the bounds
            weight_bytes = weight.numel() * weight.element_size()
            slice_bytes = min(HALF_TILE_BYTES, max(HALF_SLICE_MIN_BYTES, weight_bytes // 8))
            self.tile = max(128, slice_bytes // (4 * hidden_size) // 128 * 128)
        self.token_chunk = token_chunk
        # once per token chunk while the tiles go by (one chunk: once per call); once per weight slice,
        # however many token chunks use it
        self._hidden32 = _Fp32Rows(hidden, min(token_chunk, n_tokens)) if self.half else None
        self._weight32 = _Fp32Rows(weight, min(self.tile, weight.shape[0])) if self.half else None

    def math(self):
        return exact_bf16_math(self.bf16_math)

    def hidden_rows(self, r0: int, r1: int) -> torch.Tensor:
        """hidden[r0:r1] in fp32 [n, H]."""
        return self.hidden[r0:r1] if self._hidden32 is None else self._hidden32.rows(r0, r1)

    def weight_tile(self, c0: int, c1: int) -> torch.Tensor:
        """weight[c0:c1] in fp32 [v, H] (an upcast copy for half-precision weights)."""
        return self.weight[c0:c1] if self._weight32 is None else self._weight32.rows(c0, c1)

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: torch.Tensor) -> None:
        """out [n, c1 - c0] fp32 = hidden[r0:r1] @ weight[c0:c1].T, accumulated in fp32: one GEMM per slice of
        at most `tile` weight rows (one for fp32 operands)."""
        for g0 in range(c0, c1, self.tile):
            g1 = min(g0 + self.tile, c1)
            part = out[:, g0 - c0:g1 - c0]
            if self.cuda_out:
                z = _cuda_mm_fp32(self.hidden[r0:r1], self.weight[g0:g1].T)
                if z is not None:
                    part.copy_(z)
                    continue
            torch.mm(self.hidden_rows(r0, r1), self.weight_tile(g0, g1).T, out=part)


# ------------------------------------------------------------------------------------------------
# Kept logits
# ------------------------------------------------------------------------------------------------
class LogitsStore:
    """The forward's fp32 logits z of every row, kept for the backward (`logits_out=` then
    `stored_logits=`): 4 N V bytes; the backward reads them instead of recomputing them (3 GEMM units
    instead of 4) and consumes them (dz is formed in their place).

    Two row blocks, [ceil(N/2), V] and [floor(N/2), V]. With fp32 operands the backward forms dz in place and
    needs them as one [N, V] matrix: a single block. With bf16 operands it writes dz, rounded to bf16, as an
    [N, V] bf16 matrix into the first block's bytes (row r lands on fp32 rows <= r / 2, already read when the
    rows are taken in order) and releases the second block before its two GEMMs, so that its peak holds 2 N V
    bytes of dz next to the gradients: what autograd through bf16 logits holds."""

    def __init__(self, n_rows: int, vocab: int, dtype: torch.dtype, device):
        self.n_rows, self.vocab = n_rows, vocab
        split = n_rows if dtype == torch.float32 else -(-n_rows // 2)
        self.blocks: list[tuple[int, torch.Tensor]] = [(0, torch.empty((split, vocab), dtype=torch.float32,
                                                                           device=device))]  # fmt: skip
        if split < n_rows:
            self.blocks.append((split, torch.empty((n_rows - split, vocab), dtype=torch.float32, device=device)))

    @staticmethod
    def nbytes(n_rows: int, vocab: int) -> int:
        return 4 * n_rows * vocab

    @classmethod
    def wrap(cls, logits, n_rows: int, vocab: int) -> LogitsStore | None:
        """A LogitsStore, or a store over one fp32 [N, >= V] tensor (unit stride along V), or None."""
        if logits is None or isinstance(logits, cls):
            if logits is not None and (logits.n_rows, logits.vocab) != (n_rows, vocab):
                raise ValueError(f"logits store holds [{logits.n_rows}, {logits.vocab}], the call needs "
                                 f"[{n_rows}, {vocab}]")  # fmt: skip
            return logits
        if not (logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[0] == n_rows
                and logits.shape[1] >= vocab and logits.stride(1) == 1):  # fmt: skip
            raise ValueError(f"stored logits must be fp32 [{n_rows}, >= {vocab}] with unit stride along V, got "
                             f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
        store = cls.__new__(cls)
        store.n_rows, store.vocab = n_rows, vocab
        store.blocks = [(0, logits[:, :vocab])]
        return store

    def row_chunks(self, token_chunk: int):
        """(r0, r1, rows of the block holding them, [r1 - r0, V]): chunks of at most token_chunk rows that
        never straddle two blocks."""
        for start, block in self.blocks:
            for a in range(0, block.shape[0], token_chunk):
                b = min(a + token_chunk, block.shape[0])
                yield start + a, start + b, block[a:b]

    def dz16(self) -> torch.Tensor:
        """[N, V] bf16 over the first block's first 2 N V bytes (the bf16 backward's dz)."""
        first = self.blocks[0][1]
        return first.view(-1).view(torch.bfloat16)[: self.n_rows * self.vocab].view(self.n_rows, self.vocab)

    def release_tail(self) -> None:
        """Drop every block but the first (the bf16 backward, once dz has been written)."""
        del self.blocks[1:]


def _row_chunks(n_tokens: int, token_chunk: int, store: LogitsStore | None):
    """(r0, r1, stored rows [r1 - r0, V] or None)."""
    if store is not None:
        yield from store.row_chunks(token_chunk)
        return
    for r0 in range(0, n_tokens, token_chunk):
        yield r0, min(r0 + token_chunk, n_tokens), None


class _Buffers:
    """Scratch reused by every tile of one call, allocated on first use (a fresh multi-MiB tensor per
    tile would be a fresh mmap and its page faults on a CPU)."""

    def __init__(self, device):
        self.device = device
        self._flat: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
        """A contiguous [rows, cols] view of the named buffer (grown as needed)."""
        n = rows * cols
        buf = self._flat.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(n, dtype=dtype, device=self.device)
            self._flat[name] = buf
        return buf[:n].view(rows, cols)


def _block_rows(cols: int) -> int:
    return max(1, ELEMENTWISE_BLOCK // max(cols, 1))


# ------------------------------------------------------------------------------------------------
# Element-wise work of one tile
# ------------------------------------------------------------------------------------------------
def _transform_(z, bias_cols, inv_temperature, softcap=None):
    # z [n, v] fp32 = hidden @ weight.T, in place: + bias, then / T (or, soft-capped, cap_out tanh(cap_in x))
    if bias_cols is not None:
        z += bias_cols.float()
    if softcap is None:
        if inv_temperature != 1.0:  # (x 1 is exact: skipped)
            z *= inv_temperature
    else:
        cap_in, cap_out = softcap
        torch.tanh(z * cap_in, out=z)
        z *= cap_out
    # a -inf bias forbids its token: NEG_BIG instead keeps p = exp(z - lse) = 0 exactly while p * z and
    # p * (E_p[z] - z) stay 0 (with -inf they would be 0 * inf = NaN). Without a bias every logit is finite
    # (the functional layer bounds |z|): nothing to clamp
    if bias_cols is not None:
        z.clamp_(min=NEG_BIG)


def _fold_(z, m, s, u, bufs: _Buffers):
    """Fold the tile z [n, v] into the rows' running (m, s, u) [n], in place, block by block of rows:

      m' = max(m, max_j z_j),  alpha = e^{m - m'},  s' = alpha s + sum_j e^{z_j - m'},
      u' = alpha (u + (m - m') s) + sum_j e^{z_j - m'} (z_j - m')."""
    rows = _block_rows(z.shape[1])
    for a in range(0, z.shape[0], rows):
        b = min(a + rows, z.shape[0])
        zz, mv, sv, uv = z[a:b], m[a:b], s[a:b], u[a:b]
        m_new = torch.maximum(mv, zz.amax(dim=-1))
        alpha = torch.exp(mv - m_new)  # 0 on the first tile (m = -inf)
        # rescale (s, u) from max m to m_new: (z - m_new) = (z - m) + (m - m_new)
        uv.copy_(alpha * (uv + torch.nan_to_num(mv - m_new, neginf=0.0) * sv))
        sv.mul_(alpha)
        d = torch.sub(zz, m_new[:, None], out=bufs.get("d", b - a, zz.shape[1]))
        e = torch.exp(d, out=bufs.get("e", b - a, zz.shape[1]))
        sv += e.sum(-1)
        uv += e.mul_(d).sum(-1)
        mv.copy_(m_new)


def _dz_(z, dst, c0, rows: dict, inv_t, softcap, bufs: _Buffers, bias_acc=None):
    """dz = dL/dlogit of the tile z [n, v] (fp32, columns c0..), written into dst [n, v] (z itself, or a
    bf16 matrix: rounded once), block by block of rows:

      dz_j = (g_H p_j (E_p[z] - z_j) - g_lp p_j + g_lp 1[j = y]) / T,   p_j = exp(z_j - lse)

    (with a soft cap, times dz/dx = cap_in cap_out (1 - tanh^2) instead of / T). `rows` holds the tile's
    per-row [n] vectors: lse, ez (E_p[z]), g_lp, g_h (or None), y (target ids). bias_acc [v] fp32 gets the
    column sums of the unrounded dz."""
    n, v = z.shape
    lse, ez, g_lp, g_h, y = rows["lse"], rows["ez"], rows["g_lp"], rows["g_h"], rows["y"]
    local = y - c0
    in_tile = (local >= 0) & (local < v) if g_lp is not None else None
    if g_h is None and softcap is None:  # in place over z, the whole tile at once: dz = -g_lp p (+ g_lp at y)
        z.sub_(lse[:, None]).exp_().mul_(-g_lp[:, None])
        hit = in_tile.nonzero().squeeze(-1)
        if hit.numel():
            z[hit, local[hit]] += g_lp[hit]
        if inv_t != 1.0:
            z *= inv_t
        if bias_acc is not None:
            bias_acc += z.sum(0)
        if dst is not z:
            dst.copy_(z)
        return
    bias_from_dst = bias_acc is not None and dst.dtype == torch.float32
    step = _block_rows(v)
    for a in range(0, n, step):
        b = min(a + step, n)
        zz = z[a:b]
        p = torch.sub(zz, lse[a:b, None], out=bufs.get("p", b - a, v)).exp_()
        dz = bufs.get("dz", b - a, v)
        if g_h is not None:
            torch.mul(p, g_h[a:b, None], out=dz)  # g_H p (E_p[z] - z)
            dz.mul_(torch.sub(ez[a:b, None], zz, out=bufs.get("t", b - a, v)))
            if g_lp is not None:
                dz.sub_(torch.mul(p, g_lp[a:b, None], out=bufs.get("t", b - a, v)))
        else:
            torch.mul(p, -g_lp[a:b, None], out=dz)
        if g_lp is not None:
            hit = in_tile[a:b].nonzero().squeeze(-1)
            if hit.numel():
                dz[hit, local[a:b][hit]] += g_lp[a:b][hit]
        if softcap is None:
            if inv_t != 1.0:
                dz *= inv_t  # dL/dlogit
        else:  # dz/dx = cap_in cap_out (1 - tanh^2), tanh = z / cap_out (clamped: NEG_BIG columns have p = 0)
            cap_in, cap_out = softcap
            t = torch.div(zz, cap_out, out=bufs.get("t", b - a, v)).clamp_(-1.0, 1.0)
            t.mul_(t).neg_().add_(1.0).mul_(cap_in * cap_out)
            dz *= t
        if bias_acc is not None and not bias_from_dst:
            bias_acc += dz.sum(0)
        dst[a:b].copy_(dz)  # rounded to bf16 here when dst is bf16
    if bias_from_dst:
        bias_acc += dst.sum(0)


def _round_to_bf16_(x: torch.Tensor, bufs: _Buffers) -> None:
    """x (fp32) rounded to bf16 values in place (the bf16 GEMM operand's rounding, kept in fp32)."""
    step = _block_rows(x.shape[1])
    for a in range(0, x.shape[0], step):
        b = min(a + step, x.shape[0])
        half = bufs.get("round", b - a, x.shape[1], torch.bfloat16)
        half.copy_(x[a:b])
        x[a:b].copy_(half)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
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
    logits_out: LogitsStore | torch.Tensor | None = None,
) -> LMHeadStats:
    """Per-token logprob, entropy, lse and E_p[z] of z = (hidden @ weight.T + bias) / temperature.

    Online fold per row over vocabulary tiles, relative to the running max m:
      s = sum_j exp(z_j - m),  u = sum_j exp(z_j - m) (z_j - m)
    so that lse = m + log s, E_p[z] = m + u / s and H = log s - u / s (no cancellation of large
    numbers: every term is relative to the max); a row's fold is the same in any order the tiles of other
    rows are visited in. With a store the GEMMs run vocabulary-outer (each weight slice read, and in half
    precision upcast, once per call), else token-outer (once per token chunk).
    `logits_out` (a LogitsStore, or an fp32 [N, >= V] tensor with unit stride along V): z is written there
    for a backward that reads it (`stored_logits=`) instead of recomputing it.
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / float(temperature)
    store = LogitsStore.wrap(logits_out, n_tokens, vocab)
    out = torch.empty((4, n_tokens), dtype=torch.float32, device=device)
    logprobs, entropy, lse, expected_logit = out[0], out[1], out[2], out[3]
    if n_tokens == 0:
        return LMHeadStats(logprobs, entropy, lse, expected_logit)
    m = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=device)
    s = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    u = torch.zeros_like(s)
    z_target = torch.zeros_like(s)
    ops = _Operands(hidden, weight, token_chunk, vocab_chunk)
    bufs = _Buffers(device)
    chunks = list(_row_chunks(n_tokens, token_chunk, store))

    def fold(r0, r1, c0, c1, z):  # z [r1 - r0, c1 - c0]: the tile's logits (hidden @ weight.T), in place
        _transform_(z, None if bias is None else bias[c0:c1], inv_t, softcap)
        _fold_(z, m[r0:r1], s[r0:r1], u[r0:r1], bufs)
        y = targets[r0:r1]
        idx = ((y >= c0) & (y < c1)).nonzero().squeeze(-1)
        if idx.numel():
            z_target[r0 + idx] = z[idx, y[idx] - c0]

    # the fold's tiles: vocab_chunk columns (fp32: the arithmetic the results are pinned to); half precision,
    # wide enough that a chunk's tile is ~ELEMENTWISE_BLOCK elements (fewer, larger element-wise ops)
    fold_cols = vocab_chunk
    if ops.half:
        rows = max(r1 - r0 for r0, r1, _ in chunks)
        fold_cols = max(vocab_chunk, ELEMENTWISE_BLOCK // rows // 128 * 128)
    with ops.math():
        if store is not None:  # vocabulary-outer: each weight slice read (half precision: upcast) once
            for c0 in range(0, vocab, fold_cols):
                c1 = min(c0 + fold_cols, vocab)
                for g0 in range(c0, c1, ops.tile):
                    g1 = min(g0 + ops.tile, c1)
                    for r0, r1, stored in chunks:
                        ops.logits(r0, r1, g0, g1, out=stored[:, g0:g1])
                for r0, r1, stored in chunks:
                    fold(r0, r1, c0, c1, stored[:, c0:c1])
        else:  # token-outer: a tile of scratch logits at a time
            for r0, r1, _ in chunks:
                for c0 in range(0, vocab, fold_cols):
                    c1 = min(c0 + fold_cols, vocab)
                    z = bufs.get("z", r1 - r0, c1 - c0)
                    ops.logits(r0, r1, c0, c1, out=z)
                    fold(r0, r1, c0, c1, z)
    log_s = torch.log(s)
    torch.add(m, log_s, out=lse)
    # z_target - lse; a row of forbidden tokens only (every logit at NEG_BIG = -2^102, where m + log_s
    # rounds to m) relative to the max first, which keeps log_s: -log V there, as the Triton kernels give.
    # Every other row keeps z - lse's rounding (the peers' parity tests compare to a few ulp)
    torch.where(m <= NEG_BIG, (z_target - m) - log_s, z_target - lse, out=logprobs)
    u_over_s = u / s
    torch.add(m, u_over_s, out=expected_logit)
    torch.sub(log_s, u_over_s, out=entropy)
    return LMHeadStats(logprobs, entropy, lse, expected_logit)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
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
    stored_logits: LogitsStore | torch.Tensor | None = None,  # the forward's logits_out (consumed)
):
    """Recompute each logits tile (or read it from `stored_logits`) and stream dL/dz through it:

      dz_j = g_lp (1[j=y] - p_j) + g_H p_j (E_p[z] - z_j);   dL/dlogit = dz / T
      grad_hidden = dlogit @ W,  grad_weight += dlogit.T @ hidden,  grad_bias += sum_rows dlogit

    Returns (grad_hidden, grad_weight, grad_bias). grad_hidden is in hidden's dtype, or, with
    `grad_hidden_acc`, the fp32 sum added into it (callers chunking over the vocabulary: the fused low-memory
    schedule). grad_weight is `grad_weight_acc` with this call's fp32 sum added when one is given (callers
    chunking over tokens accumulate in fp32 and cast once), else the gradient itself in the weight's dtype,
    each element summed over every token in fp32 and rounded once. grad_bias is fp32 (`grad_bias_acc` when
    given). With `stored_logits` the stored z is overwritten (dz is formed in its place).
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / float(temperature)
    need_grad_bias = need_grad_bias and bias is not None
    if need_grad_bias and grad_bias_acc is None:
        grad_bias_acc = torch.zeros(vocab, dtype=torch.float32, device=device)
    if grad_logprobs is None and grad_entropy is None:
        grad_hidden = None
        if need_grad_hidden:
            grad_hidden = grad_hidden_acc if grad_hidden_acc is not None else torch.zeros_like(hidden)
        if need_grad_weight and grad_weight_acc is None:
            grad_weight_acc = torch.zeros_like(weight)
        return grad_hidden, grad_weight_acc if need_grad_weight else None, grad_bias_acc
    store = LogitsStore.wrap(stored_logits, n_tokens, vocab)
    per_row = {
        "lse": lse, "ez": expected_logit, "y": targets,
        "g_lp": None if grad_logprobs is None else grad_logprobs.float(),
        "g_h": None if grad_entropy is None else grad_entropy.float(),
    }  # fmt: skip
    args = (hidden, weight, bias, per_row, inv_t, softcap, need_grad_hidden, need_grad_weight, grad_bias_acc)
    # one GEMM per gradient over the kept logits: fp32 (dz in place), or bf16 on a CPU (dz written over the
    # first block, which must then be row-major [rows, V])
    single_gemms = store is not None and grad_weight_acc is None and grad_hidden_acc is None and (
        hidden.dtype == torch.float32 or (hidden.dtype == torch.bfloat16 and device.type == "cpu"
                                          and store.blocks[0][1].is_contiguous()))  # fmt: skip
    if single_gemms and n_tokens > 0:
        return _backward_stored(store, *args, token_chunk, vocab_chunk)
    return _backward_tiles(store, *args, token_chunk, vocab_chunk, grad_weight_acc, grad_hidden_acc)


def _rows_of(per_row: dict, r0: int, r1: int) -> dict:
    return {k: None if x is None else x[r0:r1] for k, x in per_row.items()}


def _backward_stored(store: LogitsStore, hidden, weight, bias, per_row, inv_t, softcap, need_h, need_w, bias_acc,
                     token_chunk, vocab_chunk):  # fmt: skip
    """Stored logits, no accumulators: dz of every row is formed in the operand dtype (fp32 in place; bf16 over
    the store's first block, LogitsStore), then grad_hidden = dz @ W and grad_weight = dz^T @ hidden are one
    GEMM each over the whole vocabulary / every token: fp32 sums, one rounding (a CPU's bf16 GEMM accumulates
    in fp32: oneDNN, or ATen's fp32-accumulating fallback; tests/test_cpu_path.py checks it)."""
    vocab = weight.shape[0]
    bufs = _Buffers(hidden.device)
    tile = min(vocab_chunk, vocab)
    if hidden.dtype == torch.float32:
        for r0, r1, rows in store.row_chunks(token_chunk):
            rv = _rows_of(per_row, r0, r1)
            for c0 in range(0, vocab, tile):
                z = rows[:, c0:c0 + tile]
                _dz_(z, z, c0, rv, inv_t, softcap, bufs, None if bias_acc is None else bias_acc[c0:c0 + tile])
        dz = store.blocks[0][1]
    else:
        dz = store.dz16()
        # rows in order, every column at once; rows [r0, r1) of dz land on the first block's fp32 rows
        # [r0 / 2, r1 / 2): written straight there once r1 <= 2 r0 (those rows are read already), the first
        # rows through a buffer; a group never straddles the two blocks
        n_tokens = store.n_rows
        split = store.blocks[1][0] if len(store.blocks) > 1 else n_tokens
        first = max(1, min(split, FIRST_ROWS_BYTES // (2 * vocab)))  # rows through the buffer
        r0 = 0
        while r0 < n_tokens:
            r1 = min(split if r0 < split else n_tokens, r0 + (first if r0 == 0 else r0))
            dst = bufs.get("first", r1 - r0, vocab, torch.bfloat16) if r0 == 0 else dz[r0:r1]
            _dz_(_stored_rows(store, r0, r1), dst, 0, _rows_of(per_row, r0, r1), inv_t, softcap, bufs, bias_acc)
            if r0 == 0:
                dz[r0:r1].copy_(dst)
            r0 = r1
        store.release_tail()
        del bufs
    grad_hidden = torch.mm(dz, weight) if need_h else None  # [N, V] x [V, H]
    grad_weight = torch.mm(dz.T, hidden) if need_w else None  # [V, N] x [N, H]
    return grad_hidden, grad_weight, bias_acc


def _stored_rows(store: LogitsStore, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the stored logits (within one block)."""
    for start, block in reversed(store.blocks):
        if r0 >= start:
            return block[r0 - start:r1 - start]
    raise AssertionError("unreachable")


def _backward_tiles(store, hidden, weight, bias, per_row, inv_t, softcap, need_h, need_w, bias_acc, token_chunk,
                    vocab_chunk, grad_weight_acc, grad_hidden_acc):  # fmt: skip
    """Vocabulary-outer, token-inner: per tile of the vocabulary, every token chunk's z (recomputed, or
    read from the store), dz in its place, then grad_hidden += dz @ W_tile (fp32 [N, H]) and the tile's
    grad_weight += dz^T @ hidden over every chunk (fp32), written (rounded once) before the next tile."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    ops = _Operands(hidden, weight, token_chunk, vocab_chunk)
    bufs = _Buffers(device)
    bf16_dz = hidden.dtype == torch.bfloat16  # dz rounded to bf16, as every bf16 GEMM operand
    gh_acc = None
    if need_h:
        gh_acc = grad_hidden_acc if grad_hidden_acc is not None else torch.zeros(
            hidden.shape, dtype=torch.float32, device=device)  # fmt: skip
    grad_weight = None
    if need_w:
        if grad_weight_acc is not None:
            grad_weight = grad_weight_acc
        elif weight.dtype == torch.float32:
            grad_weight = torch.zeros_like(weight)  # accumulated in place: the fp32 gradient itself
        else:
            grad_weight = torch.empty_like(weight)  # written one tile at a time, each rounded once
    direct = grad_weight is not None and grad_weight.dtype == torch.float32
    chunks = list(_row_chunks(n_tokens, token_chunk, store))
    with ops.math():
        for c0 in range(0, vocab, ops.tile):
            c1 = min(c0 + ops.tile, vocab)
            w = ops.weight_tile(c0, c1)
            gw = None
            if need_w:
                gw = grad_weight[c0:c1] if direct else bufs.get("gw", c1 - c0, hidden.shape[1]).zero_()
            bias_cols = None if bias is None else bias[c0:c1]
            for r0, r1, stored in chunks:
                if stored is not None:
                    z = stored[:, c0:c1]
                else:
                    z = bufs.get("z", r1 - r0, c1 - c0)
                    ops.logits(r0, r1, c0, c1, out=z)
                    _transform_(z, bias_cols, inv_t, softcap)
                _dz_(z, z, c0, _rows_of(per_row, r0, r1), inv_t, softcap, bufs,
                     None if bias_acc is None else bias_acc[c0:c1])  # fmt: skip
                if bf16_dz:
                    _round_to_bf16_(z, bufs)
                if gh_acc is not None:  # (dz @ W_tile) summed over the tiles in fp32
                    gh_acc[r0:r1] += torch.mm(z, w, out=bufs.get("gh", r1 - r0, hidden.shape[1]))
                if gw is not None:
                    gw += torch.mm(z.T, ops.hidden_rows(r0, r1), out=bufs.get("gw_part", c1 - c0, hidden.shape[1]))
            if gw is not None and not direct:
                grad_weight[c0:c1] = gw
    grad_hidden = None
    if need_h:
        grad_hidden = gh_acc if grad_hidden_acc is not None else gh_acc.to(hidden.dtype)
    return grad_hidden, grad_weight, bias_acc
