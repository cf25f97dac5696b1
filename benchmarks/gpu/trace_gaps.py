"""Where the GPU waits during one fused_linear_grpo_loss call at the target shape: the idle gaps between its
kernels and what the host was doing meanwhile (one short GPU command, ~30 s).

    python benchmarks/gpu/trace_gaps.py --out DIR     # DIR/gaps.json, DIR/trace.json.gz; a table printed last
    python benchmarks/gpu/trace_gaps.py --out F.json  # the record in F.json, the trace in a temporary folder
                                                      # (the GPU session's "trace" part: session.json "trace")

The first probe (benchmarks/results/gpu-2026-11-26-h100/probe.json) found the call's wall time 9.4 ms above
the sum of its kernels' device times (110.9 against 101.5 ms). This records one call under torch.profiler
(CPU + CUDA, Python stacks), then lists every gap of more than --min-gap-us between consecutive kernels with
the innermost host operation and the Python frames running at the gap's start, and the host's time from the
call's start to its first kernel.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.bench.ops import OPS, build_inputs  # noqa: E402
from grpo_kernels.bench.shapes import PRESETS  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gaps"))
    parser.add_argument("--min-gap-us", type=float, default=30.0)
    parser.add_argument("--max-extra-gib", type=float, default=None, help="max_extra_memory of the call")
    args = parser.parse_args(argv)
    if args.out.endswith(".json"):  # one file: the record; the Chrome trace beside it in a temporary folder
        record_path = Path(args.out)
        out = Path(tempfile.mkdtemp(prefix="grpo_kernels_trace_"))
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record_path = out / "gaps.json"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = PRESETS["qwen3-8b" if cuda else "tiny"][-1]
    inp = build_inputs(OPS["fused_grpo"], shape, torch.bfloat16 if cuda else torch.float32, device)
    b, t = shape.batch, shape.seq_len
    extra = None if args.max_extra_gib is None else int(args.max_extra_gib * 2**30)

    def call():
        inp.hidden.grad = inp.weight.grad = None
        loss = gk.fused_linear_grpo_loss(
            inp.hidden.view(b, t, -1), inp.weight, inp.targets.view(b, t), inp.advantages, inp.mask,
            inp.old_logprobs, inp.ref_logprobs, config=inp.config, max_extra_memory=extra,
        ).loss  # fmt: skip
        loss.backward()

    for _ in range(2):
        call()
    if cuda:
        torch.cuda.synchronize()
    # host time alone: how long the host takes to issue one call (it waits on the device at each host read)
    t0 = time.perf_counter()
    call()
    host_ms = (time.perf_counter() - t0) * 1e3
    if cuda:
        torch.cuda.synchronize()
    total_ms = (time.perf_counter() - t0) * 1e3

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()

    events = list(prof.events())
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    host_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    record = {"schema": "grpo_kernels.gpu_gaps/1", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "host_issue_ms": host_ms, "call_ms": total_ms, "kernels": len(kernels), "gaps": []}  # fmt: skip
    if kernels:
        first_host = min(e.time_range.start for e in host_ops) if host_ops else kernels[0].time_range.start
        record["host_start_to_first_kernel_us"] = kernels[0].time_range.start - first_host
        record["kernels_us"] = sum(k.time_range.end - k.time_range.start for k in kernels)
        record["span_us"] = kernels[-1].time_range.end - kernels[0].time_range.start
        for prev, nxt in zip(kernels, kernels[1:]):
            gap = nxt.time_range.start - prev.time_range.end
            if gap < args.min_gap_us:
                continue
            at = prev.time_range.end
            covering = [e for e in host_ops if e.time_range.start <= at <= e.time_range.end]
            inner = min(covering, key=lambda e: e.time_range.end - e.time_range.start) if covering else None
            frames = [f for f in (inner.stack if inner is not None and inner.stack else [])
                      if "grpo_kernels" in f or "functional" in f][:6]  # fmt: skip
            record["gaps"].append({
                "us": gap, "at_us": at - kernels[0].time_range.start, "after": prev.name[:80], "before": nxt.name[:80],
                "host_op": None if inner is None else inner.name[:80], "frames": frames,
            })  # fmt: skip
        record["gaps_total_us"] = sum(g["us"] for g in record["gaps"])
    record["chrome_trace"] = str(out / "trace.json.gz")
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"host issue {host_ms:.2f} ms, call {total_ms:.2f} ms, kernels {record.get('kernels_us', 0) / 1e3:.2f} ms "
          f"over a span of {record.get('span_us', 0) / 1e3:.2f} ms; host start to first kernel "
          f"{record.get('host_start_to_first_kernel_us', 0) / 1e3:.2f} ms; gaps >= {args.min_gap_us} us: "
          f"{len(record['gaps'])}, {record.get('gaps_total_us', 0) / 1e3:.2f} ms")  # fmt: skip
    for g in sorted(record["gaps"], key=lambda g: -g["us"])[:15]:
        print(f"  {g['us']:8.0f} us at {g['at_us'] / 1e3:7.2f} ms  host {g['host_op']}  | {' <- '.join(g['frames'][:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
