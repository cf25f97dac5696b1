"""Run by tests/test_host_reads.py in a subprocess with TRITON_INTERPRET=1: counts the host reads (every
operation that waits for the device on CUDA) of fused_linear_grpo_loss and fused_linear_logprobs on the
Triton backend, forward and backward, per schedule and layout. Prints one JSON line:
{case: [[site "path:line", what], ...]} with the reads made in grpo_kernels/, in call order.

How a read is seen: the torch functions and Tensor methods that can wait are patched with counting wrappers
while a call runs (also its autograd backward, which runs on this thread for CPU tensors; a TorchFunctionMode
would not see it: torch turns the modes off there). A call counts when it waits for the device
on CUDA: a value read on the host (.item(), .tolist(), bool() / int() / float() / index of a tensor, .cpu(),
.numpy(), formatting), a result whose size depends on the values (nonzero, masked_select, unique, boolean
indexing, repeat_interleave of a tensor without output_size, bincount without minlength), or a value
compared on the host (torch.equal, allclose). Its site is the innermost frame outside torch: a site in
grpo_kernels/ is counted; one in triton/ (the interpreter copies kernel arguments to the host and back,
which a GPU launch does not) or in this script is not.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback

import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused

sys.path.insert(0, os.path.dirname(__file__))
from interpreter_runner import wanted  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(gk.__file__)) + os.sep
TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
ROOT = os.path.dirname(PACKAGE.rstrip(os.sep)) + os.sep

T = torch.Tensor
# (owner, attribute, what): always a read on CUDA
READS = [
    (T, "item", "item"), (T, "tolist", "tolist"), (T, "__bool__", "bool"), (T, "__int__", "int"),
    (T, "__float__", "float"), (T, "__index__", "index"), (T, "__complex__", "complex"), (T, "cpu", "cpu"),
    (T, "numpy", "numpy"), (T, "__format__", "format"), (T, "__repr__", "repr"), (T, "__array__", "array"),
    (T, "__contains__", "contains"), (torch, "nonzero", "nonzero"), (T, "nonzero", "nonzero"),
    (torch, "masked_select", "masked_select"), (T, "masked_select", "masked_select"), (torch, "unique", "unique"),
    (T, "unique", "unique"), (torch, "unique_consecutive", "unique_consecutive"), (torch, "equal", "equal"),
    (T, "equal", "equal"), (torch, "allclose", "allclose"), (T, "allclose", "allclose"),
    (torch, "argwhere", "argwhere"), (torch, "where", None), (torch, "repeat_interleave", None),
    (T, "repeat_interleave", None), (torch, "bincount", None), (T, "bincount", None), (T, "__getitem__", None),
    (T, "__setitem__", None), (T, "index_put", None), (T, "index_put_", None), (torch, "index_put", None),
]  # fmt: skip


def _conditional(name, args, kwargs) -> str | None:
    """The reads that depend on the arguments (None where the call does not wait)."""
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(condition)"  # the nonzero form
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
        if isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
    if name == "bincount" and not kwargs.get("minlength") and len(args) < 3:
        return "bincount without minlength"
    if name in ("__getitem__", "__setitem__", "index_put", "index_put_"):
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        parts = index if isinstance(index, (tuple, list)) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            return "boolean indexing"
    return None


class CountReads:
    """Patches the reading attributes of torch and torch.Tensor while active (a TorchFunctionMode would not
    see the autograd backward: torch disables the modes there)."""

    def __init__(self):
        self.reads: list[tuple[str, str]] = []
        self._depth = 0

    def __enter__(self):
        self._saved = []
        for owner, name, what in READS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, name, what))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _wrap(self, original, name, what):
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                found = what or _conditional(name, args, kwargs)
                if found is not None:
                    self._record(found)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    def _record(self, what: str) -> None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = os.path.abspath(frame.filename)
            if path.startswith(TORCH):
                continue
            if path.startswith(PACKAGE):  # grpo_kernels' own read
                self.reads.append((f"{os.path.relpath(path, ROOT)}:{frame.lineno} ({frame.name})", what))
            return  # the innermost frame outside torch decides (triton's interpreter, this script: not counted)


# ---- the inputs ---------------------------------------------------------------------------------------

B, L, H, V = 3, 5, 16, 67  # 15 tokens


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g) * 0.1
    targets = torch.randint(0, V, (B, L), generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor([5, 2, 4])[:, None]
    old = torch.randn(B, L, generator=g) * 0.1 - 4.0
    adv = torch.randn(B, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, old=old, adv=adv)


def inputs_valid(x):
    """A [B, L] per-token tensor of inputs() at the valid tokens only, [N]."""
    return x[inputs()["mask"]]


def packed(d):
    """The valid tokens only, [N] with cu_seqlens."""
    mask = d["mask"]
    lengths = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    out = {k: d[k][mask] for k in ("hidden", "targets", "old")}
    n = int(lengths.sum())
    return dict(d, **out, mask=torch.ones(n, dtype=torch.bool), cu_seqlens=cu)


def leaves(d, bias=True):
    return [d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_(),
            d["bias"].clone().requires_grad_() if bias else None]  # fmt: skip


class _Schedules(logging.Handler):
    """The schedule each fused call ran (its DEBUG line on the "grpo_kernels" logger)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.chosen: list[str] = []

    def emit(self, record):
        if record.getMessage().startswith("fused_linear_grpo_loss: "):
            self.chosen.append(record.args[0])


def count(fn) -> dict:
    """{"forward": [...], "backward": [...], "schedule": ...} reads of fn, which returns (loss, backward thunk)."""
    mode = CountReads()
    logger, handler = logging.getLogger("grpo_kernels"), _Schedules()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with mode:
            out, backward = fn()
    finally:
        logger.removeHandler(handler)
    forward_reads = list(mode.reads)
    mode.reads.clear()
    if backward is not None:
        with mode:
            backward(out)
    return {"forward": forward_reads, "backward": list(mode.reads), "schedule": handler.chosen[:1] or None}


def loss_case(schedule, layout, *, config=None, scale=1.0, max_extra_memory=None, grad=True, bias=True,
              normalizers=None, samplers=False, **options):
    d = inputs()
    if samplers:  # the reference's and the sampler's log-probs; NaN: a token the sampler did not score
        g = torch.Generator().manual_seed(5)
        d["ref"] = d["old"] + torch.randn(d["old"].shape, generator=g) * 0.1
        d["rollout"] = d["old"] + torch.randn(d["old"].shape, generator=g) * 0.1
        d["rollout"][0, 1] = float("nan")
    if layout == "packed":
        d = packed(d)
        if samplers:
            d["ref"], d["rollout"] = inputs_valid(d["ref"]), inputs_valid(d["rollout"])
    cfg = config or gk.PolicyLossConfig(temperature=0.9)
    h, w, b = leaves(d, bias)

    def call():
        extra = {} if max_extra_memory is None else {"max_extra_memory": max_extra_memory}
        extra.update(normalizers or {}, **options)
        if samplers:
            extra.update(ref_logprobs=d["ref"], rollout_logprobs=d["rollout"])
        with torch.set_grad_enabled(grad):
            out = gk.fused_linear_grpo_loss(h, w, d["targets"], d["adv"], d["mask"], d["old"], bias=b, config=cfg,
                                            cu_seqlens=d.get("cu_seqlens"), backend="triton", schedule=schedule,
                                            **extra)  # fmt: skip
        return out.loss, (lambda loss: (loss * scale).backward()) if grad else None

    return count(call)


def logprobs_case(layout, *, grad=True, entropy=True):
    d = inputs()
    if layout == "packed":
        d = packed(d)
    h, w, b = leaves(d)
    targets = d["targets"].clone()
    if layout == "padded":
        targets[~d["mask"]] = -100  # ignore_index

    def call():
        with torch.set_grad_enabled(grad):
            out = gk.fused_linear_logprobs(h, w, targets, b, 0.8, mask=d["mask"] if layout == "padded" else None,
                                           compute_entropy=entropy, backend="triton")  # fmt: skip
        total = out.logprobs.sum() + (out.entropy.sum() * 0.5 if entropy else 0)
        return total, (lambda t: t.backward()) if grad else None

    return count(call)


def cases():
    fused.ONE_PASS_CHUNK_TOKENS = 4  # several chunks at 11 valid tokens
    token_local = gk.PolicyLossConfig(temperature=0.9)
    sequence_level = gk.PolicyLossConfig(ratio_level="sequence", temperature=0.9)  # whole sequences per chunk
    global_stats = gk.PolicyLossConfig(top_entropy_quantile=0.5, temperature=0.9)  # two passes
    schedules = ("one_pass", "one_pass_inplace", "one_pass_cublas", "one_pass_cublas_inplace", "two_pass",
                 "low_memory", "one_pass_dz", "one_pass_dz_inplace")  # fmt: skip
    for layout in ("padded", "packed"):
        for schedule in schedules:
            yield f"loss-{schedule}-{layout}", lambda s=schedule, lay=layout: loss_case(s, lay)
        # what auto picks: a one-pass variant (token-local), one_pass over whole sequences, two_pass (batch
        # statistics), low_memory (a goal nothing else fits), one_pass without a weight gradient
        yield f"loss-auto-{layout}", lambda lay=layout: loss_case("auto", lay, config=token_local)
        yield f"loss-auto_sequence-{layout}", lambda lay=layout: loss_case("auto", lay, config=sequence_level)
        yield f"loss-auto_global-{layout}", lambda lay=layout: loss_case("auto", lay, config=global_stats)
        yield f"loss-auto_lowmem-{layout}", lambda lay=layout: loss_case("auto", lay, max_extra_memory=0)
        yield f"loss-auto_nograd-{layout}", lambda lay=layout: loss_case("auto", lay, grad=False)
        yield f"loss-scaled-{layout}", lambda lay=layout: loss_case("auto", lay, scale=0.5)
        # TRL passes num_items_in_batch as a tensor: its value joins the call's one read
        tensors = {"num_tokens": torch.tensor(20.0), "num_sequences": torch.tensor(4)}
        yield f"loss-normalizers-{layout}", lambda lay=layout: loss_case("auto", lay, normalizers=tensors)
        # the options together: KL, token IS over NaN sampler log-probs, an entropy bonus, a soft cap and a logit
        # scale, the step's normalizers; and the batch-invariant head
        options = gk.PolicyLossConfig(kl_coef=0.1, is_level="token", entropy_coef=0.01, temperature=0.9)
        yield f"loss-options-{layout}", lambda lay=layout: loss_case(
            "one_pass_cublas_inplace", lay, config=options, samplers=True, softcap=5.0, logit_scale=0.8, dp_size=2,
            grad_accum_steps=2)  # fmt: skip
        yield f"loss-batch_invariant-{layout}", lambda lay=layout: loss_case("one_pass_inplace", lay,
                                                                             batch_invariant=True)  # fmt: skip
        yield f"logprobs-{layout}", lambda lay=layout: logprobs_case(lay)
        yield f"logprobs_nograd-{layout}", lambda lay=layout: logprobs_case(lay, grad=False, entropy=False)


def scale_exact() -> dict:
    """ops/fused/scale.py's in-place kernel against PyTorch's (x.float() * s.float()).to(x.dtype):
    {"dtype x scale": [elements whose bits differ (NaN equals NaN), the largest difference in ulps]}."""
    from grpo_kernels.ops.fused.scale import scale_

    g = torch.Generator().manual_seed(1)
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(5000, generator=g) * 3).to(dtype)
        x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(dtype)
        for s in (1.0, 0.3, -2.5, 1e-30, float("nan")):
            scale = torch.tensor(s)
            expected = (x.float() * scale.float()).to(dtype)
            got = scale_(x.clone(), scale)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            differ = (got.view(bits) != expected.view(bits)) & ~(got.isnan() & expected.isnan())  # NaN is NaN
            # distance in units in the last place (same-sign values: their bit patterns' difference)
            ulps = (got.view(bits).int() - expected.view(bits).int()).abs().masked_fill(~differ, 0)
            out[f"{str(dtype).replace('torch.', '')} x {s}"] = [int(differ.sum()), int(ulps.max())]
    return out


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    report = {}
    if wanted("scale_exact"):
        report["scale_exact"] = scale_exact()
    for key, run in cases():
        if wanted(key):
            try:
                report[key] = run()
            except Exception as exc:  # reported, the test names it
                report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report))
