"""Run by tests/test_fused_triton_interpreter.py in a subprocess with TRITON_INTERPRET=1.

For every configuration of test_loss_head.CONFIGS and both layouts (padded [B, T], packed [N] with
cu_seqlens): fused_linear_grpo_loss(backend="triton") in both schedules (one pass over the
vocabulary per chunk of sequences, and two passes) against backend="torch" (the PyTorch
implementation checked against the references): loss, every metric, and the gradients w.r.t.
hidden, weight and bias. fp32 inputs (the interpreter's bf16 tl.dot is wrong; TRITON_ON_CPU.md).
Prints one JSON line.
"""

import json
import os
import sys

import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused

sys.path.insert(0, os.path.dirname(__file__))
from interpreter_runner import nan_fill_uninitialized, wanted  # noqa: E402
from test_loss_head import CONFIGS  # noqa: E402

# at most 7 valid tokens per chunk: the 5 sequences below (1..7 valid tokens) make 4 chunks
fused.ONE_PASS_CHUNK_TOKENS = 7
nan_fill_uninitialized()  # a schedule that read a grad_weight accumulator before writing it fails every check below


def inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    b, t, h, v = 5, 7, 24, 203
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 3
    bias_ = torch.randn(v, generator=g) * 0.3 if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    targets[~mask] = -100
    with torch.no_grad():
        lp = gk.fused_linear_logprobs(hidden, weight, targets.clamp(min=0), bias_, backend="torch").logprobs
    old = lp + torch.randn(b, t, generator=g) * 0.3
    ref = lp + torch.randn(b, t, generator=g) * 0.2
    rollout = old + torch.randn(b, t, generator=g) * 0.2
    adv = torch.randn(b, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias_, targets=targets, mask=mask, old=old, ref=ref,
                rollout=rollout, adv=adv)  # fmt: skip


def run(cfg, d, backend, schedule, layout):
    hidden, mask, targets = d["hidden"], d["mask"], d["targets"]
    old, ref, rollout = d["old"], d["ref"], d["rollout"]
    extra = {}
    if layout == "packed":  # the valid tokens only, with sequence offsets
        lengths = mask.sum(-1)
        extra["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        hidden, targets, old, ref, rollout = (x[mask] for x in (hidden, targets, old, ref, rollout))
        mask = torch.ones(int(lengths.sum()), dtype=torch.bool)
    leaves = [None if x is None else x.clone().requires_grad_() for x in (hidden, d["weight"], d["bias"])]
    torch.manual_seed(3)  # clip_cov draws a random subset
    out = gk.fused_linear_grpo_loss(
        leaves[0], leaves[1], targets, d["adv"], mask, old, ref if cfg.needs_reference else None,
        rollout if cfg.uses_rollout_logprobs else None,
        bias=leaves[2], config=cfg.replace(temperature=0.8), backend=backend, schedule=schedule, **extra,
    )  # fmt: skip
    out.loss.backward()
    return out, [x.grad for x in leaves]


def worst(a, b):
    diff = (a - b).abs()
    i = int(diff.reshape(-1).argmax())
    return [a.reshape(-1)[i].item(), b.reshape(-1)[i].item(), i, b.abs().max().item()]


def count_stored_backwards():
    """Wrap the Triton LM-head backward to count calls that read the forward's stored logits."""
    import grpo_kernels.ops.lm_head.triton as lm_triton

    original = lm_triton.lm_head_backward
    calls = {"stored": 0, "recomputed": 0, "dz_in_gemm": 0}

    def wrapped(*args, **kwargs):
        calls["stored" if kwargs.get("stored_logits") is not None else "recomputed"] += 1
        calls["dz_in_gemm"] += bool(kwargs.get("dz_in_gemm"))
        return original(*args, **kwargs)

    lm_triton.lm_head_backward = wrapped
    return calls


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    calls = count_stored_backwards()
    report = {}
    d = inputs()

    def compare(case, cfg, layout, schedule, refused_ok=True):
        """Run the Triton backend in `schedule` against the PyTorch backend; one report entry."""
        if not wanted(case):
            return
        ref, g_ref = run(cfg, d, "torch", "two_pass", layout)
        before = dict(calls)
        try:
            out, g = run(cfg, d, "triton", schedule, layout)
        except ValueError as exc:  # one_pass refused (batch-global or not token-local): reported
            report[case] = {"refused" if refused_ok else "error": str(exc)}
            return
        except Exception as exc:
            report[case] = {"error": f"{type(exc).__name__}: {exc}"}
            return
        report[case] = {
            "loss": [out.loss.item(), ref.loss.item()],
            "grads": {k: worst(a, b) for k, a, b in zip(("hidden", "weight", "bias"), g, g_ref)},
            "metrics": {k: [out.metrics[k].item() if k in out.metrics else None, v.item()]
                        for k, v in ref.metrics.items()},  # fmt: skip
            "logprobs": worst(out.logprobs, ref.logprobs),
            "backward_calls": {k: calls[k] - before[k] for k in calls},
        }

    for name, cfg in sorted(CONFIGS.items()):
        for layout in ("padded", "packed"):
            for schedule in ("one_pass", "two_pass"):
                compare(f"{name}-{layout}-{schedule}", cfg, layout, schedule)
    # one pass with dz formed inside the backward GEMMs (opt-in schedule), packed layout, 4 chunks
    for name, cfg in sorted(CONFIGS.items()):
        compare(f"{name}-packed-one_pass_dz", cfg, "packed", "one_pass_dz")
    # the low-memory schedule (vocabulary outside in C): 128-column slabs of V = 203, packed layout
    fused.LOW_MEMORY_SLAB_BYTES = 1
    for name, cfg in sorted(CONFIGS.items()):
        compare(f"{name}-packed-low_memory", cfg, "packed", "low_memory", refused_ok=False)
    # the TMA kernel A (use_forward_kernel("tma")) in both schedules: in one pass the stored logits leave
    # by TMA stores into the padded-row buffer; V = 203 and H = 24 leave ragged tiles on every edge
    import grpo_kernels.ops.lm_head.triton as lm_triton

    launched, launch = [], lm_triton._launch
    lm_triton._launch = lambda kernel, *args: (launched.append(kernel.__name__), launch(kernel, *args))[1]
    with lm_triton.use_forward_kernel("tma"):
        for name in ("grpo", "gspo", "dapo"):
            for schedule in ("one_pass", "two_pass"):
                launched.clear()
                compare(f"{name}-packed-{schedule}-tma", CONFIGS[name], "packed", schedule, refused_ok=False)
                if f"{name}-packed-{schedule}-tma" in report:
                    report[f"{name}-packed-{schedule}-tma"]["forward_kernels"] = sorted(
                    {n for n in launched if n.startswith("lm_head_fwd_kernel_partial")})  # fmt: skip
    lm_triton._launch = launch
    # "auto" where the one- / two-pass schedule's modelled peak exceeds the extra-memory goal (a goal of
    # 0 bytes here; at the Qwen3-8B head the 2.3 GiB fp32 accumulator does it): the low-memory schedule,
    # said in the DEBUG line
    import logging

    import grpo_kernels.ops.fused.memory as memory

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("grpo_kernels").addHandler(handler)
    logging.getLogger("grpo_kernels").setLevel(logging.DEBUG)
    memory.EXTRA_MEMORY_GOAL = 0
    for name in ("grpo", "dr_grpo", "gspo"):
        said.clear()
        compare(f"{name}-packed-auto-over-goal", CONFIGS[name], "packed", "auto", refused_ok=False)
        if f"{name}-packed-auto-over-goal" in report:
            report[f"{name}-packed-auto-over-goal"]["said"] = [m for m in said if "schedule" in m][-1]
    memory.EXTRA_MEMORY_GOAL = 3 * 2**30 // 2
    said.clear()
    compare("grpo-packed-auto-within-goal", CONFIGS["grpo"], "packed", "auto", refused_ok=False)
    if "grpo-packed-auto-within-goal" in report:
        report["grpo-packed-auto-within-goal"]["said"] = [m for m in said if "schedule" in m][-1]
    # long completions: 3 valid tokens per chunk, shorter than 4 of the 5 sequences. Token-local
    # objectives cut sequences across chunks; the others must refuse one_pass (two passes instead).
    fused.ONE_PASS_CHUNK_TOKENS = 3
    for name, cfg in sorted(CONFIGS.items()):
        compare(f"{name}-packed-one_pass-long", cfg, "packed", "one_pass")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
