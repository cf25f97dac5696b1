"""What the ranks' agreement check (grpo_kernels/_agreement.py) costs per call: time and bytes.

    python -m grpo_kernels.bench.agreement [--record docs/records/agreement_cost.json]

1. The fingerprints one rank computes for its row of the first collective, at a realistic shape (a Qwen3-8B
   head, H = 4096, V = 151936 over TP = 8 ranks, 8 x 1024 tokens, bf16 hidden, the per-token inputs of a
   GRPO step with KL), timed with the check on and off (median of repeats, this machine's CPU threads).
2. The bytes the check adds to the call's first all-gather (its row was one int64, the block size).
3. A whole fused_linear_grpo_loss call on a 2-rank gloo group (a small shape that runs in seconds on CPU),
   check on and off, interleaved repeats: the end-to-end difference on this machine.
On a GPU the same comparison is the benchmark's `grpo_kernels-tp` against `grpo_kernels-tp-no-check` under
torchrun. CPU figures only here: no GPU figure is claimed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .. import _agreement

REALISTIC = dict(batch=8, length=1024, hidden=4096, vocab=151936, tp=8, dtype="bfloat16")
END_TO_END = dict(batch=4, length=128, hidden=512, vocab=16384, world=2, repeats=7)


def _switch(on: bool):
    if on:
        os.environ.pop(_agreement.ENV_SWITCH, None)
    else:
        os.environ[_agreement.ENV_SWITCH] = "0"


def fingerprint_cost(repeats: int = 7) -> dict:
    """Seconds one rank spends building its row (check on / off) at the REALISTIC shape, on this CPU."""
    import grpo_kernels as gk

    s = REALISTIC
    g = torch.Generator().manual_seed(0)
    n = s["batch"] * s["length"]
    dtype = getattr(torch, s["dtype"])
    hidden = torch.randn(s["batch"], s["length"], s["hidden"], generator=g).to(dtype)
    block = torch.randn(s["vocab"] // s["tp"], s["hidden"], generator=g).to(dtype)
    targets = torch.randint(0, s["vocab"], (s["batch"], s["length"]), generator=g)
    valid = torch.rand(n, generator=g) < 0.9
    per_token = {name: torch.randn(s["batch"], s["length"], generator=g) for name in ("old_logprobs", "ref_logprobs")}
    advantages = torch.randn(s["batch"], generator=g)
    cfg = gk.PolicyLossConfig.grpo()

    def row(on: bool):
        _switch(on)
        agreement = _agreement.Agreement(None, "tp_group", "fused_linear_grpo_loss")
        agreement.tensors.update(hidden=hidden, targets=targets, mask=valid, advantages=advantages, **per_token)
        agreement.values.update(config=cfg, temperature=cfg.temperature, softcap=None, logit_scale=1.0,
                                check_finite=True, batch_invariant=False, backend="torch", schedule="auto",
                                num_tokens=None, num_sequences=None, dp_size=1, grad_accum_steps=1,
                                bias_present=False)  # fmt: skip
        agreement.block, agreement.targets = block, (targets.reshape(-1), valid)
        start = time.perf_counter()
        agreement._payload(block.shape[0], torch.device("cpu"))
        return time.perf_counter() - start

    row(True)  # the position weights are made once per device
    times = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            times[on].append(row(on))
    _switch(True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {
        "shape": s, "tokens": n, "hashed_elements": hidden.numel() + 5 * n + advantages.numel(),
        "threads": torch.get_num_threads(), "on_ms": round(on * 1e3, 1), "off_ms": round(off * 1e3, 2),
        "added_ms": round((on - off) * 1e3, 1), "repeats": repeats,
    }  # fmt: skip


def payload_bytes() -> dict:
    """Bytes per rank in the call's first all-gather, and what the check adds (every rank receives world x it)."""
    width = _agreement.WIDTH
    return {"row_bytes": width * 8, "row_bytes_before": 8, "added_bytes_per_rank": (width - 1) * 8}


def _end_to_end_worker(rank, world, settings):
    import grpo_kernels as gk

    s = settings
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(s["batch"], s["length"], s["hidden"], generator=g)
    weight = torch.randn(s["vocab"], s["hidden"], generator=g) / s["hidden"] ** 0.5
    targets = torch.randint(0, s["vocab"], (s["batch"], s["length"]), generator=g)
    mask = torch.ones(s["batch"], s["length"], dtype=torch.bool)
    adv = torch.randn(s["batch"], generator=g)
    old = -torch.rand(s["batch"], s["length"], generator=g) * 3
    block = weight.chunk(world)[rank].clone().requires_grad_()
    x = hidden.clone().requires_grad_()

    def call():
        out = gk.fused_linear_grpo_loss(x, block, targets, adv, mask, old, config=gk.PolicyLossConfig.dapo(),
                                        backend="torch", tp_group=torch.distributed.group.WORLD)  # fmt: skip
        out.loss.backward()

    call()  # warm-up
    times = {"on": [], "off": []}
    for _ in range(s["repeats"]):
        for key in ("on", "off"):
            _switch(key == "on")
            torch.distributed.barrier()
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    _switch(True)
    return {key: statistics.median(v) for key, v in times.items()}


def end_to_end_cost() -> dict:
    from ..testing.distributed import run_group

    s = END_TO_END
    results = run_group(_end_to_end_worker, s["world"], s, timeout=900)
    on = max(r["on"] for r in results)  # the call ends when its slowest rank does
    off = max(r["off"] for r in results)
    return {"shape": s, "on_ms": round(on * 1e3, 1), "off_ms": round(off * 1e3, 1),
            "added_percent": round((on - off) / off * 100, 1)}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--skip-end-to-end", action="store_true", help="only the fingerprints and the bytes")
    args = parser.parse_args(argv)
    record = {
        "command": "python -m grpo_kernels.bench.agreement --record docs/records/agreement_cost.json",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), torch {torch.__version__}",
        "device": "cpu",
        "fingerprints": fingerprint_cost(),
        "bytes": payload_bytes(),
    }
    if not args.skip_end_to_end:
        record["end_to_end"] = end_to_end_cost()
    text = json.dumps(record, indent=2)
    print(text)
    if args.record is not None:
        args.record.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
