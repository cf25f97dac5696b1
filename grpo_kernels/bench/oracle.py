"""Ground truth and PyTorch's own same-dtype result for the parity gate, and the eager composition.

truth(inp, outputs)       fp32 reference. LM-head ops: grpo_kernels/ops/lm_head/reference.py (it
                          materialises fp32 [N, V] logits) while N V <= MATERIALISE_LIMIT, above it the
                          chunked fp32 oracle ops/lm_head/chunked.py on fp32 copies of the inputs
                          (tested against reference.py in tests/test_lm_head.py). Loss head:
                          ops/loss_head/reference.py, fp32.
same_dtype(inp, outputs)  what plain PyTorch computes in the benchmark dtype (`eager_lm_head`: the
                          model's lm_head GEMM in the input dtype, log-softmax in fp32, autograd),
                          run over blocks of BASELINE_BLOCK tokens so it fits at every shape. Its error
                          against the truth is the yardstick of the parity gate (parity.py).

`outputs` is the set of per-token outputs a provider returns: ("logprobs", "entropy") or
("logprobs",) (cut-cross-entropy has no entropy); for logprobs_grad the cotangents of the missing
outputs are left out, so gradients are compared like for like.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..ops.lm_head import chunked
from ..ops.lm_head.reference import lm_head_logits_grad_reference, lm_head_stats_reference
from ..ops.loss_head.reference import policy_loss_reference

if TYPE_CHECKING:  # annotations only: ops.py imports this module (inputs are built around the truth)
    from .ops import BenchInputs

MATERIALISE_LIMIT = 1 << 24  # N * V elements: 64 MiB of fp32 logits
BASELINE_BLOCK = 4096  # tokens per block of the same-dtype baseline ([4096, 152k] bf16 logits: 1.2 GiB)
TEMPERATURE = 1.0


@contextlib.contextmanager
def exact_fp32_matmul():
    """fp32 GEMMs in fp32 (no TF32), whatever a peer's import set globally."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


def eager_lm_head(hidden, weight, targets, temperature: float = TEMPERATURE, with_entropy: bool = True):
    """Plain PyTorch with materialised logits, as a training loop without fused kernels does it:
    logits [n, V] in the input dtype (the lm_head GEMM), then log-softmax statistics in fp32."""
    logits = hidden @ weight.t()  # [n, H] x [H, V] -> [n, V], input dtype
    z = logits.float() / temperature  # [n, V] fp32
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logprobs, entropy


def loss_head(logprobs_flat: torch.Tensor, inp: BenchInputs):
    """The benchmark loss on flat [N] log-probs (ops/loss_head/reference.py, fp32)."""
    f = inp.flat
    return policy_loss_reference(
        logprobs_flat, f["advantages"], f["mask"], f["seq_index"], inp.shape.batch, inp.config,
        old_logprobs=f["old_logprobs"], ref_logprobs=f["ref_logprobs"],
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# fp32 truth
# ------------------------------------------------------------------------------------------------
def _materialise(inp: BenchInputs) -> bool:
    return inp.shape.tokens * inp.shape.vocab <= MATERIALISE_LIMIT


def _fp32_copies(inp: BenchInputs):
    return inp.hidden.detach().float(), inp.weight.detach().float(), inp.targets


def _fp32_stats(inp: BenchInputs):
    h32, w32, y = _fp32_copies(inp)
    with exact_fp32_matmul(), torch.no_grad():
        if _materialise(inp):
            return lm_head_stats_reference(h32, w32, y, None, TEMPERATURE)
        return chunked.lm_head_forward(h32, w32, None, y, TEMPERATURE)


def fp32_logprobs(inp: BenchInputs) -> torch.Tensor:
    return _fp32_stats(inp).logprobs


def _fp32_grads(inp: BenchInputs, stats, cot_logprobs, cot_entropy):
    """(grad_hidden, grad_weight) in fp32 for the given per-token cotangents."""
    h32, w32, y = _fp32_copies(inp)
    with exact_fp32_matmul(), torch.no_grad():
        if _materialise(inp):
            dz = lm_head_logits_grad_reference(
                h32, w32, y, cot_logprobs, cot_entropy, None, TEMPERATURE
            )  # [N, V]
            return dz @ w32, dz.t() @ h32
        grad_hidden, grad_weight, _ = chunked.lm_head_backward(
            h32, w32, None, y, TEMPERATURE, stats.lse, stats.expected_logit, cot_logprobs, cot_entropy,
            need_grad_bias=False,
        )  # fmt: skip
        return grad_hidden, grad_weight


def truth(inp: BenchInputs, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    op = inp.op.name
    if op == "loss_head":
        leaf = inp.logprobs.detach().clone().requires_grad_(True)
        out = loss_head(leaf.view(-1), inp)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        return {"loss": out.loss.detach(), "grad_logprobs": grad}
    stats = _fp32_stats(inp)
    result = {"logprobs": stats.logprobs, "entropy": stats.entropy}
    if op == "logprobs_grad":
        cot_entropy = inp.cot_entropy if "entropy" in outputs else None
        result["grad_hidden"], result["grad_weight"] = _fp32_grads(inp, stats, inp.cot_logprobs, cot_entropy)
    elif op == "fused_grpo":
        leaf = stats.logprobs.clone().requires_grad_(True)
        out = loss_head(leaf, inp)
        (grad_logprobs,) = torch.autograd.grad(out.loss, leaf)
        result = {"loss": out.loss.detach()}
        result["grad_hidden"], result["grad_weight"] = _fp32_grads(inp, stats, grad_logprobs, None)
    return result


# ------------------------------------------------------------------------------------------------
# PyTorch in the benchmark dtype, by blocks of tokens
# ------------------------------------------------------------------------------------------------
def _eager_blocks(inp: BenchInputs, cot_logprobs, cot_entropy, with_entropy: bool, need_grads: bool):
    """eager_lm_head over token blocks; with need_grads, autograd per block with the given
    cotangents, grad_weight summed over blocks in fp32 (an unblocked GEMM rounds once)."""
    n = inp.shape.tokens
    logprobs = torch.empty(n, dtype=torch.float32, device=inp.device)
    entropy = torch.empty_like(logprobs) if with_entropy else None
    grad_hidden = torch.empty_like(inp.hidden) if need_grads else None
    grad_weight = (
        torch.zeros(inp.weight.shape, dtype=torch.float32, device=inp.device) if need_grads else None
    )
    for r0 in range(0, n, BASELINE_BLOCK):
        rows = slice(r0, min(r0 + BASELINE_BLOCK, n))
        h = inp.hidden[rows].detach().requires_grad_(need_grads)
        w = inp.weight.detach().requires_grad_(need_grads)
        with torch.set_grad_enabled(need_grads):
            lp, ent = eager_lm_head(h, w, inp.targets[rows], TEMPERATURE, with_entropy)
        logprobs[rows] = lp.detach()
        if with_entropy:
            entropy[rows] = ent.detach()
        if need_grads:
            outs, cots = [lp], [cot_logprobs[rows]]
            if cot_entropy is not None:
                outs.append(ent)
                cots.append(cot_entropy[rows])
            dh, dw = torch.autograd.grad(outs, [h, w], cots)
            grad_hidden[rows] = dh
            grad_weight += dw.float()
    return logprobs, entropy, grad_hidden, grad_weight


def same_dtype(inp: BenchInputs, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    op = inp.op.name
    if op == "loss_head":  # the log-probs are fp32: PyTorch's fp32 computation is the reference itself
        return truth(inp, outputs)
    if op == "logprobs":
        lp, ent, _, _ = _eager_blocks(inp, None, None, True, False)
        return {"logprobs": lp, "entropy": ent}
    if op == "logprobs_grad":
        cot_entropy = inp.cot_entropy if "entropy" in outputs else None
        lp, ent, gh, gw = _eager_blocks(inp, inp.cot_logprobs, cot_entropy, True, True)
        return {"logprobs": lp, "entropy": ent, "grad_hidden": gh, "grad_weight": gw}
    lp, _, _, _ = _eager_blocks(inp, None, None, False, False)
    leaf = lp.requires_grad_(True)
    out = loss_head(leaf, inp)
    (grad_logprobs,) = torch.autograd.grad(out.loss, leaf)
    _, _, gh, gw = _eager_blocks(inp, grad_logprobs, None, False, True)
    return {"loss": out.loss.detach(), "grad_hidden": gh, "grad_weight": gw}
