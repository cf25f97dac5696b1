"""Run by tests/test_fused_triton_interpreter.py in a subprocess with TRITON_INTERPRET=1.

fused_linear_grpo_loss(backend="triton") in both schedules (one pass per chunk of sequences, and two
passes) against backend="torch": loss, every metric, and the gradients w.r.t. hidden, weight and
bias. fp32 inputs (the interpreter's bf16 tl.dot is wrong; TRITON_ON_CPU.md). Prints one JSON line.
"""

import json
import os
import sys

import torch  # noqa: E402

import grpo_kernels as gk  # noqa: E402
import grpo_kernels.ops.fused.function as fused  # noqa: E402
from grpo_kernels import PolicyLossConfig as C  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

# 6 valid tokens per chunk: the 5 sequences below (1..7 valid tokens) make 4 chunks
fused.ONE_PASS_CHUNK_TOKENS = 7

CONFIGS = {
    "grpo": C.grpo(temperature=0.7),
    "dapo_entropy_bonus": C.dapo(entropy_coef=0.01),
    "gspo": C.gspo(),
    "gmpo": C.gmpo(),
    "cispo_absolute": C.cispo(cispo_form="absolute", cispo_cap=1.3, clip_low=0.2, clip_high=0.2),
    "tis_olmo3": C.olmo3(),
    "dr_grpo": C.dr_grpo(max_completion_length=7),
    "top_entropy": C(top_entropy_quantile=0.5),  # needs the whole batch: two passes only
    "kl_cov": C(loss_type="kl_cov", kl_cov_ratio=0.2),  # likewise
}


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


def run(cfg, d, backend, schedule):
    leaves = [None if x is None else x.clone().requires_grad_() for x in (d["hidden"], d["weight"], d["bias"])]
    torch.manual_seed(3)
    out = gk.fused_linear_grpo_loss(
        leaves[0], leaves[1], d["targets"], d["adv"], d["mask"], d["old"],
        d["ref"] if cfg.needs_reference else None,
        d["rollout"] if (cfg.is_level or cfg.off_policy_mask_threshold is not None) else None,
        bias=leaves[2], config=cfg, backend=backend, schedule=schedule,
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
    calls = {"stored": 0, "recomputed": 0}

    def wrapped(*args, **kwargs):
        calls["stored" if kwargs.get("stored_logits") is not None else "recomputed"] += 1
        return original(*args, **kwargs)

    lm_triton.lm_head_backward = wrapped
    return calls


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    calls = count_stored_backwards()
    report = {}
    for name, cfg in CONFIGS.items():
        d = inputs()
        ref, g_ref = run(cfg, d, "torch", "two_pass")
        for schedule in ("one_pass", "two_pass"):
            case = f"{name}-{schedule}"
            before = dict(calls)
            try:
                out, g = run(cfg, d, "triton", schedule)
            except ValueError as exc:  # one_pass refused for batch-global variants: reported
                report[case] = {"refused": str(exc)}
                continue
            except Exception as exc:
                report[case] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            report[case] = {
                "loss": [out.loss.item(), ref.loss.item()],
                "grads": {k: worst(a, b) for k, a, b in zip(("hidden", "weight", "bias"), g, g_ref)},
                "metrics": {k: [out.metrics[k].item() if k in out.metrics else None, v.item()]
                            for k, v in ref.metrics.items()},  # fmt: skip
                "logprobs": worst(out.logprobs, ref.logprobs),
                "backward_calls": {k: calls[k] - before[k] for k in calls},
            }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
