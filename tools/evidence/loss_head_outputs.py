"""Bit-for-bit evidence for a change of the loss head: loss, every metric, dL/dlogp and dL/dentropy of every
loss-head configuration of the tests (`CONFIGS` of tests/test_loss_head.py in both layouts, and the sampler
cases with NaN log-probs) on both backends (PyTorch; Triton under the interpreter with the interpreter tier's
4-token blocks), saved with torch.save; `compare` checks two such files with torch.equal. Run it from the root
of each tree (the package and tests/ of that tree), then compare:

    TRITON_INTERPRET=1 python tools/evidence/loss_head_outputs.py write OUT.pt
    python tools/evidence/loss_head_outputs.py compare BEFORE.pt AFTER.pt
"""

from __future__ import annotations

import os
import sys


def write(out: str) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (the Triton backend runs under the interpreter on a CPU)")
    import torch

    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    import _loss_head_interpreter_cases as cases  # the interpreter tier's runner (4-token blocks)
    from test_loss_head import CONFIGS, UNSCORED_CASES, batch

    tensors: dict[str, torch.Tensor] = {}

    def record(case: str, backend: str, result) -> None:
        outputs, grads = result
        tensors[f"{case}|{backend}|loss"] = outputs.loss.detach().clone()
        tensors[f"{case}|{backend}|dlogp"] = grads[0].clone()
        tensors[f"{case}|{backend}|dentropy"] = grads[1].clone()
        for name, value in outputs.metrics.items():
            tensors[f"{case}|{backend}|metric:{name}"] = value.detach().clone()

    for name, cfg in sorted(CONFIGS.items()):
        for layout in ("padded", "packed"):
            per_token = layout == "padded" and cfg.loss_type not in ("gmpo", "group_dpo")
            for backend in ("torch", "triton"):
                record(f"{name}-{layout}", backend, cases.run(cfg, batch(per_token_adv=per_token, seed=11), backend, layout))
    for name in UNSCORED_CASES:  # sampler log-probs with unscored (NaN) tokens
        for backend in ("torch", "triton"):
            data = batch(per_token_adv=True, seed=13)
            data["rollout"][0, 2] = float("nan")
            data["rollout"][4, 0] = float("nan")
            record(f"{name}-nan-rollout", backend, cases.run(CONFIGS[name], data, backend, "padded"))
    torch.save(tensors, out)
    print(f"saved {len(tensors)} tensors to {out}")
    return 0


def compare(before: str, after: str) -> int:
    import torch

    a, b = torch.load(before), torch.load(after)
    only = sorted(set(a) ^ set(b))
    differ = [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    cases = len({k.rsplit("|", 1)[0] for k in a})
    print(f"compared {len(set(a) & set(b))} tensors ({cases} case x backend pairs): {len(differ)} differ, "
          f"{len(only)} in one file only")  # fmt: skip
    for k in (differ + only)[:20]:
        print("  ", k)
    return 1 if differ or only else 0


if __name__ == "__main__":
    usage = __doc__.strip().splitlines()[-2:]
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        sys.exit(write(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    raise SystemExit("usage:\n" + "\n".join(usage))
