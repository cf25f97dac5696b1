"""Run by tests/test_loss_head_triton_interpreter.py in a subprocess with TRITON_INTERPRET=1 (the
interpreter must be on before triton is imported). For every configuration of test_loss_head.CONFIGS
and both layouts, grpo_loss(backend="triton") against grpo_loss(backend="torch") (the fp32
reference): loss, every metric, dL/dlogp and dL/dentropy. Prints one JSON line: case -> errors."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import grpo_kernels as gk  # noqa: E402
import grpo_kernels.ops.loss_head.triton as loss_head_triton  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from interpreter_runner import wanted  # noqa: E402
from test_loss_head import CONFIGS, UNSCORED_CASES, batch  # noqa: E402

# 4-token blocks: sequences of 1..9 tokens span 1..3 blocks, so carries across blocks are exercised
loss_head_triton.DEFAULT_BLOCK = 4


def run(cfg, d, backend, layout):
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    kwargs = dict(
        old_logprobs=d["old"],
        ref_logprobs=d["ref"] if cfg.needs_reference else None,
        rollout_logprobs=d["rollout"] if cfg.uses_rollout_logprobs else None,
        entropy=ent,
        config=cfg,
        backend=backend,
    )
    mask = d["mask"]
    if layout == "packed":
        m = mask
        lengths = m.sum(-1)
        kwargs["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        adv = d["adv"] if d["adv"].dim() == 1 else d["adv"][m]
        for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            if kwargs[key] is not None:
                kwargs[key] = kwargs[key][m]
        lp_in, ent_in, mask_in = lp[m], ent[m], torch.ones(int(lengths.sum()), dtype=torch.bool)
        kwargs["entropy"] = ent_in
    else:
        adv, lp_in, mask_in = d["adv"], lp, mask
    torch.manual_seed(5)  # clip_cov draws a random subset
    out = gk.grpo_loss(lp_in, adv, mask_in, **kwargs)
    grads = torch.autograd.grad(out.loss, [lp, ent], allow_unused=True)
    zero = torch.zeros_like(lp)
    return out, [zero if g is None else g for g in grads]


def main():
    report = {}
    for name, cfg in sorted(CONFIGS.items()):
        for layout in ("padded", "packed"):
            per_token = layout == "padded" and cfg.loss_type not in ("gmpo", "group_dpo")
            case = f"{name}-{layout}"
            if not wanted(case):
                continue
            d = batch(per_token_adv=per_token, seed=11)
            try:
                ref, g_ref = run(cfg, d, "torch", layout)
                tri, g_tri = run(cfg, d, "triton", layout)
            except Exception as exc:  # reported, so the test shows which case broke
                report[case] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            errors = {"loss": [tri.loss.item(), ref.loss.item()]}
            for label, a, b in (("dL/dlogp", g_tri[0], g_ref[0]), ("dL/dentropy", g_tri[1], g_ref[1])):
                diff = (a - b).abs()
                i = int(diff.reshape(-1).argmax())
                errors[label] = [a.reshape(-1)[i].item(), b.reshape(-1)[i].item(), i]
            errors["metrics"] = {
                k: [tri.metrics[k].item() if k in tri.metrics else None, v.item()] for k, v in ref.metrics.items()
            }
            errors["extra_metrics"] = sorted(set(tri.metrics) - set(ref.metrics))
            report[case] = errors
    # NaN sampler log-probs: tokens the sampler could not score are neutral (TRL's convention)
    for name in UNSCORED_CASES:
        if not wanted(f"{name}-nan-rollout"):
            continue
        cfg = CONFIGS[name]
        d = batch(per_token_adv=True, seed=13)
        d["rollout"][0, 2] = float("nan")
        d["rollout"][4, 0] = float("nan")
        ref, g_ref = run(cfg, d, "torch", "padded")
        tri, g_tri = run(cfg, d, "triton", "padded")
        report[f"{name}-nan-rollout"] = {
            "loss": [tri.loss.item(), ref.loss.item()],
            "dL/dlogp": [(g_tri[0] - g_ref[0]).abs().max().item(), 0.0, -1],
            "dL/dentropy": [(g_tri[1] - g_ref[1]).abs().max().item(), 0.0, -1],
            "metrics": {k: [tri.metrics[k].item() if k in tri.metrics else None, v.item()] for k, v in ref.metrics.items()},
            "extra_metrics": sorted(set(tri.metrics) - set(ref.metrics)),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
