"""Measure, on CPU, what the Unsloth adapter's kernel changes against Unsloth's own log-prob kernel: the memory each
holds between the forward and the backward, and the error of log-probs, entropy and gradients against float64.

    python tools/records/unsloth_kernel_record.py [--tokens 1024 --hidden 512 --vocab 32000] [--out FILE]

Needs unsloth_zoo (the Unsloth environment: .ci/steps/unsloth.sh). Writes docs/records/unsloth_kernel.json by
default. Both kernels get the same inputs: hidden [tokens, hidden] and an LM head [vocab, hidden] drawn at the
scale of a trained model's logits (standard deviation ~3), targets drawn from the softmax (as sampled
completions are), temperature 1; the loss is sum(logp * g1) + sum(entropy * g2) with random g1, g2 (a GRPO
loss's upstream gradients). Two cases: a trainable head (full fine-tuning) and a frozen head (LoRA, Unsloth's
common case, where its kernel computes the hidden-state gradient in the forward). For each dtype (float32;
bfloat16 as on a GPU, here on CPU where Unsloth's PyTorch path rounds the logits to bf16):

* held_bytes: the bytes autograd saves for the backward (torch.autograd.graph.saved_tensors_hooks), counted
  once per storage, the inputs (hidden, weight) excluded: what the kernel adds to the activation memory.
* max_abs_error of logp, entropy, grad_hidden and grad_weight against float64 on the same (rounded) inputs,
  the gradients as a fraction of their largest element.

Not measured here: speed (CPU timings say nothing about a GPU; Unsloth's GPU path is a Triton kernel) and peak
memory inside the call (CPU tensors have no allocator statistics).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def held_bytes(fn, exclude) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves while `fn` runs, the storages of `exclude` left out."""
    seen, excluded = {}, {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def reference(h, w, t, g1, g2):
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    logp_all = torch.log_softmax(h64 @ w64.T, -1)
    logp = logp_all.gather(-1, t[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * g1).sum() + (ent * g2).sum()).backward()
    return logp.detach(), ent.detach(), h64.grad, w64.grad


def measure(kernel, h, w, t, g1, g2, frozen_head):
    hh = h.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(not frozen_head)

    def forward():
        return kernel(hh, ww, t, return_entropy=True)

    nbytes, (logp, ent) = held_bytes(forward, (hh, ww))
    ((logp * g1).sum() + (ent * g2).sum()).backward()
    return nbytes, logp.detach(), ent.detach(), hh.grad, ww.grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "records" / "unsloth_kernel.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
    # unsloth_zoo writes generated modules into ./unsloth_compiled_cache unless told otherwise: a temporary
    # folder, removed at exit
    if "UNSLOTH_COMPILE_LOCATION" not in os.environ:
        os.environ["UNSLOTH_COMPILE_LOCATION"] = tempfile.mkdtemp(prefix="unsloth_compiled_cache_")
        atexit.register(shutil.rmtree, os.environ["UNSLOTH_COMPILE_LOCATION"], ignore_errors=True)
    import unsloth_zoo.fused_losses.fused_linear as unsloth_kernel
    from grpo_kernels.integrations.unsloth import UnslothLogProbsKernel

    kernels = {"unsloth": unsloth_kernel.fused_linear_logprobs, "grpo_kernels": UnslothLogProbsKernel(backend_options())}
    N, H, V = args.tokens, args.hidden, args.vocab
    g = torch.Generator().manual_seed(0)
    h32 = torch.randn(N, H, generator=g)
    w32 = torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    with torch.no_grad():
        t = torch.multinomial(torch.softmax(h32 @ w32.T, -1), 1, generator=g)[:, 0]
    g1, g2 = torch.randn(N, generator=g), torch.randn(N, generator=g) * 0.1
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        h, w = h32.to(dtype), w32.to(dtype)
        ref_logp, ref_ent, ref_gh, ref_gw = reference(h, w, t, g1.double(), g2.double())
        for frozen_head in (False, True):
            for name, kernel in kernels.items():
                nbytes, logp, ent, gh, gw = measure(kernel, h, w, t, g1.to(torch.float32), g2.to(torch.float32),
                                                    frozen_head)  # fmt: skip
                row = dict(kernel=name, dtype=str(dtype).removeprefix("torch."), head="frozen" if frozen_head else
                           "trainable", held_bytes=nbytes, held_bytes_per_token=nbytes / N,
                           logp_max_abs_error=(logp.double() - ref_logp).abs().max().item(),
                           entropy_max_abs_error=(ent.double() - ref_ent).abs().max().item(),
                           grad_hidden_max_rel_error=((gh.double() - ref_gh).abs().max() / ref_gh.abs().max()).item())  # fmt: skip
                if not frozen_head:
                    row["grad_weight_max_rel_error"] = ((gw.double() - ref_gw).abs().max() / ref_gw.abs().max()).item()
                rows.append(row)
                print(json.dumps(row), flush=True)
    record = dict(
        script="tools/records/unsloth_kernel_record.py", shape=dict(tokens=N, hidden=H, vocab=V),
        logits_fp32_bytes=N * V * 4, device="cpu", machine=platform.machine(), torch=torch.__version__,
        unsloth_zoo=metadata.version("unsloth_zoo"), rows=rows,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {args.out}")
    return 0


def backend_options():
    from grpo_kernels.integrations.unsloth import KernelOptions

    return KernelOptions(backend="torch")


if __name__ == "__main__":
    sys.exit(main())
