"""Where the fused loss's time goes at the target shape, and the cuBLAS logits GEMM of fused_linear_logprobs
against kernel A: one short GPU command (about a minute), run after the first session's verdict.

    python benchmarks/gpu/probe.py --out DIR        # on the GPU machine; DIR/probe.json, a table printed last

Rows (Qwen3-8B head, N = 16384, bf16, the benchmark's inputs and loss, median of --iters after --warmup):
  fused     fused_linear_grpo_loss fwd + bwd, schedule "auto" at the default extra-memory goal and at 3 and
            6 GiB (fewer, larger chunks: how much the per-chunk traffic costs), and the profile of the default
            (torch.profiler: each kernel's device time per call, their sum against the call's wall time)
  logprobs  fused_linear_logprobs without grad, logits GEMM "triton" (kernel A) and "cublas" at three chunk
            budgets (DEFAULT_WORKSPACE_BYTES: 0.5, 1, 2 GiB); its error against fp32 logits of 2048 tokens
  logprobs_grad  the same with the backward for fixed cotangents, "triton" and "cublas"; the gradients'
            relative difference between the two
Nothing here is a test: the numbers go to benchmarks/results/ with the card, versions and git sha.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.bench.environment import git_info  # noqa: E402
from grpo_kernels.bench.ops import OPS, build_inputs, make_floor  # noqa: E402
from grpo_kernels.bench.shapes import PRESETS  # noqa: E402
from grpo_kernels.bench.timing import peak_extra_bytes, time_call  # noqa: E402
from grpo_kernels.ops.lm_head import triton as tri  # noqa: E402

GIB = 2**30


def _fused_call(inp, **kwargs):
    b, t = inp.shape.batch, inp.shape.seq_len

    def call():
        loss = gk.fused_linear_grpo_loss(
            inp.hidden.view(b, t, -1), inp.weight, inp.targets.view(b, t), inp.advantages, inp.mask,
            inp.old_logprobs, inp.ref_logprobs, config=inp.config, **kwargs,
        ).loss  # fmt: skip
        loss.backward()
        return loss

    return call


def _reset(inp):
    def reset():
        for leaf in (inp.hidden, inp.weight):
            leaf.grad = None

    return reset


def _profile(call, reset, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    reset()
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            reset()
            call()
        end.record()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us:
            rows.append({"name": e.key[:160], "calls_per_iter": e.count / iters, "ms_per_iter": us / 1e3 / iters})
    rows.sort(key=lambda r: -r["ms_per_iter"])
    return {"wall_ms_per_iter": start.elapsed_time(end) / iters,
            "kernels_ms_per_iter": sum(r["ms_per_iter"] for r in rows), "kernels": rows[:25]}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rehearsal", action="store_true", help="CPU, tiny shape, no profiles: the flow only")
    parser.add_argument("--only", choices=("fused", "logprobs"), default=None, help="one part only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.rehearsal else "cuda")
    shape = PRESETS["tiny" if args.rehearsal else "qwen3-8b"][-1]
    gpu = not args.rehearsal
    record = {"schema": "grpo_kernels.gpu_probe/1", "gpu": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "git": git_info(), "shape": shape.as_dict(),
              "rows": [], "profiles": {}}  # fmt: skip
    path = out / "probe.json"

    def save():
        path.write_text(json.dumps(record, indent=1) + "\n")

    def row(name, call, reset, **extra):
        t0 = time.time()
        try:
            stats = time_call(call, reset, device, args.warmup, args.iters)
            peak = peak_extra_bytes(call, reset, device)
            r = {"name": name, "median_ms": stats.median_ms, "p20_ms": stats.p20_ms, "p80_ms": stats.p80_ms,
                 "peak_extra_gib": None if peak is None else peak / GIB, **extra}  # fmt: skip
        except Exception as exc:  # one failed row costs one row
            r = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
        r["seconds"] = time.time() - t0
        record["rows"].append(r)
        save()
        print(f"  {name:48s} {r.get('median_ms', float('nan')):9.3f} ms  {r.get('error', '')}", flush=True)
        return r

    if args.only != "logprobs":
        _fused_part(record, row, save, device, shape, gpu)
    if args.only != "fused":
        _logprobs_part(record, row, save, device, shape, gpu)
    _summary(record)
    return 0


def _fused_part(record, row, save, device, shape, gpu):
    """The floor, auto at three memory goals, and the default's profile."""
    inp = build_inputs(OPS["fused_grpo"], shape, torch.bfloat16, device)
    floor = make_floor(inp)
    row("fused floor (3 cuBLAS GEMMs)", floor, lambda: None)
    reset = _reset(inp)
    for goal in (None, 3 * GIB, 6 * GIB):
        label = "default 1.5 GiB" if goal is None else f"{goal / GIB:.0f} GiB"
        row(f"fused auto, max_extra_memory {label}", _fused_call(inp, max_extra_memory=goal), reset)
    if gpu:
        record["profiles"]["fused auto"] = _profile(_fused_call(inp), reset, 2)
        save()
    del inp, floor
    torch.cuda.empty_cache() if gpu else None



def _logprobs_part(record, row, save, device, shape, gpu):
    """logprobs without grad (kernel A against cuBLAS chunks at three budgets), then with grad."""
    inp = build_inputs(OPS["logprobs"], shape, torch.bfloat16, device)
    x, w, y = inp.hidden, inp.weight, inp.targets
    row("logprobs floor (1 cuBLAS GEMM)", make_floor(inp), lambda: None)
    head = slice(0, 2048)  # fp32 truth on a slice of the tokens: [2048, V] fp32 logits
    z = x[head].float() @ w.T.float()
    truth = (z.gather(1, y[head, None]).squeeze(1) - torch.logsumexp(z, dim=1))
    del z
    # the chunk budget (the backward's workspace; the forward's chunk has the same rows, 0.65 of it in logits)
    budgets = {"cublas 0.5 GiB": GIB // 2, "cublas 1 GiB": GIB, "cublas 2 GiB": 2 * GIB}
    for name, budget in [("triton", None), *budgets.items()]:
        gemm = "triton" if budget is None else "cublas"
        if budget is not None:
            tri.DEFAULT_WORKSPACE_BYTES = budget

        def call(gemm=gemm):
            with torch.no_grad(), tri.use_logits_gemm(gemm):
                return gk.fused_linear_logprobs(x, w, y).logprobs

        err = (call()[head] - truth).abs().max().item()
        r = row(f"logprobs {name}", call, lambda: None, max_abs_err_vs_fp32=err)
        if gpu and name in ("triton", "cublas 1 GiB"):
            def prof_call(call=call):
                return call()
            record["profiles"][f"logprobs {name}"] = _profile(prof_call, lambda: None, 3)
            save()
        del r
    tri.DEFAULT_WORKSPACE_BYTES = GIB
    del inp
    torch.cuda.empty_cache() if gpu else None

    # logprobs with grad
    inp = build_inputs(OPS["logprobs_grad"], shape, torch.bfloat16, device)
    reset = _reset(inp)
    grads = {}
    for gemm in ("triton", "cublas"):
        def call(gemm=gemm):
            with tri.use_logits_gemm(gemm):
                out = gk.fused_linear_logprobs(inp.hidden, inp.weight, inp.targets)
                torch.autograd.backward([out.logprobs, out.entropy], [inp.cot_logprobs, inp.cot_entropy])
            return out.logprobs

        reset()
        call()
        grads[gemm] = (inp.hidden.grad.float().clone(), inp.weight.grad.float().clone())
        row(f"logprobs_grad {gemm}", call, reset)
        if gpu and gemm == "cublas":
            record["profiles"]["logprobs_grad cublas"] = _profile(call, reset, 2)
            save()
    rel = {name: ((grads["cublas"][i] - grads["triton"][i]).norm() / grads["triton"][i].norm()).item()
           for i, name in enumerate(("grad_hidden", "grad_weight"))}  # fmt: skip
    record["logprobs_grad_cublas_vs_triton_rel_l2"] = rel
    save()


def _summary(record):
    print("\nprofile of fused auto (ms per call):", flush=True)
    p = record["profiles"].get("fused auto", {"wall_ms_per_iter": 0.0, "kernels_ms_per_iter": 0.0, "kernels": []})
    print(f"  wall {p['wall_ms_per_iter']:.2f}, kernels {p['kernels_ms_per_iter']:.2f}")
    for k in p["kernels"][:12]:
        print(f"  {k['ms_per_iter']:8.3f} ms x{k['calls_per_iter']:5.1f}  {k['name'][:100]}")
    for name in ("logprobs triton", "logprobs cublas 1 GiB", "logprobs_grad cublas"):
        p = record["profiles"].get(name)
        if p:
            print(f"{name}: wall {p['wall_ms_per_iter']:.2f}, kernels {p['kernels_ms_per_iter']:.2f}")
            for k in p["kernels"][:6]:
                print(f"  {k['ms_per_iter']:8.3f} ms x{k['calls_per_iter']:5.1f}  {k['name'][:100]}")
    print(f"\ngrads cublas vs triton (rel L2): {record.get('logprobs_grad_cublas_vs_triton_rel_l2')}")
    print("\nrows:")
    for r in record["rows"]:
        print(f"  {r['name']:48s} {r.get('median_ms', float('nan')):9.3f} ms  peak extra "
              f"{r.get('peak_extra_gib') or 0:6.3f} GiB  {r.get('max_abs_err_vs_fp32', '')} {r.get('error', '')}")


if __name__ == "__main__":
    raise SystemExit(main())
