"""The benchmarked ops, their inputs, and the floor each one is measured against.

Ops (every provider gets the same input tensors):
  logprobs       hidden [N, H], weight [V, H] -> log p(target), entropy [N]; forward only, no grad
  logprobs_grad  the same plus the backward for fixed cotangents on log-probs and entropy
  fused_grpo     hidden states -> GRPO loss (PPO clip 0.2 / 0.28, k3 KL 0.04, token mean), fwd + bwd
  loss_head      the same loss from per-token log-probs [B, T] (no LM head), fwd + bwd

Floors, measured in the same run on the same tensors:
  LM-head ops: the GEMMs the op cannot avoid, with the device BLAS (cuBLAS on GPU): forward
    1 x [N, H] x [H, V]; forward + backward 3 GEMMs (logits, grad_hidden = dZ W,
    grad_weight = dZ^T X), each G = 2 N H V FLOPs. A kernel that recomputes the logits in the
    backward does 4 G and can reach at best 4/3 of this floor.
  loss_head: a device copy of the op's compulsory bytes (COMPULSORY_BYTES_PER_TOKEN below): the
    time to read its inputs and write its gradient once at copy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import PolicyLossConfig
from . import oracle
from .shapes import BenchShape

LM_HEAD_MAX_TOKENS = 65536  # the LM-head ops' token range (the sweep's top); loss_head has none


@dataclass(frozen=True)
class OpSpec:
    name: str
    title: str
    grad: bool  # forward + backward (else forward under no_grad)
    gemm_units: int  # GEMMs of 2 N H V FLOPs the op must do; 0: bandwidth-bound (loss_head)
    compared: tuple[str, ...]  # outputs the parity gate checks, when the provider produces them
    max_tokens: int | None = LM_HEAD_MAX_TOKENS  # larger shapes of a preset are skipped for this op

    @property
    def floor_label(self) -> str:
        if self.gemm_units:
            return f"floor ({self.gemm_units} GEMM{'s' if self.gemm_units > 1 else ''})"
        return "floor (copy)"


_LM_HEAD_OUTPUTS = ("logprobs", "entropy")
_LM_HEAD_GRADS = ("grad_hidden", "grad_weight")
OPS: dict[str, OpSpec] = {
    op.name: op
    for op in (
        OpSpec(
            "logprobs",
            "LM-head log-probs + entropy, forward only (no grad)",
            grad=False,
            gemm_units=1,
            compared=_LM_HEAD_OUTPUTS,
        ),
        OpSpec(
            "logprobs_grad",
            "LM-head log-probs + entropy, forward + backward",
            grad=True,
            gemm_units=3,
            compared=_LM_HEAD_OUTPUTS + _LM_HEAD_GRADS,
        ),
        OpSpec(
            "fused_grpo",
            "hidden states -> GRPO loss, forward + backward",
            grad=True,
            gemm_units=3,
            compared=("loss", *_LM_HEAD_GRADS),
        ),
        OpSpec(
            "loss_head",
            "GRPO loss on per-token log-probs, forward + backward",
            grad=True,
            gemm_units=0,
            compared=("loss", "grad_logprobs"),
            max_tokens=None,
        ),
    )
}

# The loss every loss op computes. Chosen so that every peer's formula gives the same value on the
# benchmark inputs: DAPO clip-higher bounds, TRL's default KL form (unclamped k3), token-mean. verl's
# dual clip (c = 3) and KL clamps and our log-ratio clamp (20) never bind for ratios near 1.
BENCH_LOSS_CONFIG = PolicyLossConfig(
    loss_type="ppo_clip",
    clip_low=0.2,
    clip_high=0.28,
    kl_coef=0.04,
    kl_estimator="k3",
    loss_agg_mode="token-mean",
)
BENCH_LOSS_SUMMARY = "PPO clip 0.2/0.28, k3 KL 0.04, token-mean"

LOGIT_STD = 4.0  # weight ~ N(0, (4 / sqrt(H))^2): logits ~ N(0, 16), max ~ 20 at V = 152k, entropy ~ 4 nats
POLICY_DRIFT = 0.1  # old / ref log-probs = current + N(0, 0.1^2): ratios near 1, a few % clipped

# loss_head compulsory traffic: read logprobs, old, ref (fp32) and the mask (bool), write dL/dlogprobs
# (fp32): 4 + 4 + 4 + 1 + 4 = 17 bytes per token, plus 4 bytes per sequence of advantages.
COMPULSORY_BYTES_PER_TOKEN = 17
COMPULSORY_BYTES_PER_SEQUENCE = 4

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class BenchInputs:
    """Every tensor any provider of one op reads, built once per (op, shape)."""

    op: OpSpec
    shape: BenchShape
    dtype: torch.dtype
    device: torch.device
    config: PolicyLossConfig = BENCH_LOSS_CONFIG
    hidden: torch.Tensor | None = None  # [N, H] dtype (leaf; requires grad for backward ops)
    weight: torch.Tensor | None = None  # [V, H] dtype (leaf; requires grad for backward ops)
    targets: torch.Tensor | None = None  # [N] int64
    cot_logprobs: torch.Tensor | None = None  # [N] fp32, logprobs_grad's cotangent of log-probs
    cot_entropy: torch.Tensor | None = None  # [N] fp32, logprobs_grad's cotangent of entropy
    mask: torch.Tensor | None = None  # [B, T] bool, all valid: every provider does the same GEMM work
    advantages: torch.Tensor | None = None  # [B] fp32
    old_logprobs: torch.Tensor | None = None  # [B, T] fp32
    ref_logprobs: torch.Tensor | None = None  # [B, T] fp32
    logprobs: torch.Tensor | None = None  # [B, T] fp32 leaf (loss_head)
    entropy: torch.Tensor | None = None  # [B, T] fp32, no grad (loss_head: TRL logs its mean)
    flat: dict = field(default_factory=dict)  # flat [N] views for the reference loss head

    @property
    def leaves(self) -> list[torch.Tensor]:
        """Tensors whose .grad the backward fills (reset before every call)."""
        return [t for t in (self.hidden, self.weight, self.logprobs) if t is not None and t.requires_grad]

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def num_valid(self) -> int:
        return int(self.mask.sum()) if self.mask is not None else self.shape.tokens


def _randn(shape, generator, device, std=1.0, dtype=torch.float32):
    return (torch.randn(shape, generator=generator, device=device) * std).to(dtype)


def build_inputs(op: OpSpec, shape: BenchShape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random inputs of one op at one shape. old / ref log-probs of the LM-head loss are drawn around
    the fp32 reference log-probs of these very hidden states (so ratios are near 1, as in training)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n, hid, vocab, b, t = shape.tokens, shape.hidden, shape.vocab, shape.batch, shape.seq_len
    inp = BenchInputs(op=op, shape=shape, dtype=dtype, device=device)
    inp.mask = torch.ones(b, t, dtype=torch.bool, device=device)
    inp.advantages = _randn((b,), g, device)
    if op.name == "loss_head":
        current = -torch.empty(b, t, device=device).exponential_(generator=g) * 2.0  # log-probs, mean -2
        inp.logprobs = current.clone().requires_grad_(True)
        inp.entropy = torch.empty(b, t, device=device).exponential_(generator=g) * 2.0
    else:
        inp.hidden = _randn((n, hid), g, device, dtype=dtype).requires_grad_(op.grad)
        inp.weight = _randn((vocab, hid), g, device, std=LOGIT_STD / hid**0.5, dtype=dtype).requires_grad_(
            op.grad
        )
        inp.targets = torch.randint(0, vocab, (n,), generator=g, device=device)
        if op.name == "logprobs_grad":
            inp.cot_logprobs = _randn((n,), g, device)
            inp.cot_entropy = _randn((n,), g, device)
        current = oracle.fp32_logprobs(inp).view(b, t) if op.name == "fused_grpo" else None
    if current is not None:
        inp.old_logprobs = (current.detach() + _randn((b, t), g, device, std=POLICY_DRIFT)).contiguous()
        inp.ref_logprobs = (current.detach() + _randn((b, t), g, device, std=POLICY_DRIFT)).contiguous()
        inp.flat = dict(
            advantages=inp.advantages.repeat_interleave(t),
            mask=inp.mask.reshape(-1),
            seq_index=torch.arange(b, device=device).repeat_interleave(t),
            old_logprobs=inp.old_logprobs.reshape(-1),
            ref_logprobs=inp.ref_logprobs.reshape(-1),
        )
    return inp


# ------------------------------------------------------------------------------------------------
# Floors
# ------------------------------------------------------------------------------------------------
FLOOR_MAX_ROWS = 16384  # the floor GEMMs run over token chunks of at most this many rows (bounded memory)


def op_flops(op: OpSpec, shape: BenchShape) -> int:
    return op.gemm_units * shape.gemm_flops()


def compulsory_bytes(shape: BenchShape) -> int:
    return COMPULSORY_BYTES_PER_TOKEN * shape.tokens + COMPULSORY_BYTES_PER_SEQUENCE * shape.batch


def make_floor(inp: BenchInputs):
    """A callable doing only the work the op cannot avoid (module docstring), on the op's tensors."""
    if inp.op.gemm_units == 0:
        half = compulsory_bytes(inp.shape) // 2
        src = torch.empty(half, dtype=torch.uint8, device=inp.device).fill_(1)
        dst = torch.empty_like(src)

        def copy():  # reads half, writes half: the compulsory bytes in total
            dst.copy_(src)

        return copy
    x, w = inp.hidden.detach(), inp.weight.detach()
    n, hid = x.shape
    rows = min(n, FLOOR_MAX_ROWS)
    z = torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)  # [rows, V] logits, reused as dZ
    backward = inp.op.gemm_units == 3
    grad_x = torch.empty(rows, hid, dtype=x.dtype, device=x.device) if backward else None
    grad_w = torch.empty_like(w) if backward else None

    def gemms():
        for r0 in range(0, n, rows):
            xc = x[r0 : r0 + rows]
            zc = z[: xc.shape[0]]
            torch.mm(xc, w.t(), out=zc)  # [n, H] x [H, V] -> [n, V]
            if backward:
                torch.mm(zc, w, out=grad_x[: xc.shape[0]])  # [n, V] x [V, H] -> [n, H]
                if r0 == 0:
                    torch.mm(zc.t(), xc, out=grad_w)  # [V, n] x [n, H] -> [V, H]
                else:
                    grad_w.addmm_(zc.t(), xc)

    return gemms
