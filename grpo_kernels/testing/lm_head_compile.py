"""AOT-compile matrix of the LM-head Triton kernels (tier 3) and its register / spill / smem report.

Every kernel of grpo_kernels/ops/lm_head/triton_*.py (re-exported by triton.py) is compiled for each
architecture of aot.ARCHS (sm_90, sm_80, sm_100a, sm_120). The configurations the dispatcher picks for an architecture
(triton.arch_class: "sm90", "sm80", "sm100", "sm120", and "unaligned" everywhere) are compiled there in every
code path (dtype and fp32 dot precision, bias, ragged H, which upstream / input gradients); on sm_90 and
sm_80 the other one's configurations are compiled too, in their default path, for the report (not on the
Blackwell targets: the picked ones are what a B200 / RTX 50xx user launches, others would add CI minutes). Launches are recorded from the real host launchers running on `meta` tensors at a
Qwen2.5-7B shape, so the signatures and specialisations are exactly those of a real call.

A case added to cases() inside its architecture loop is compiled for every architecture; one a Triton
version cannot target (aot.target_blocker) is kept in the matrix with its skip reason.

    python -m grpo_kernels.testing.lm_head_compile --out benchmarks/results   # writes the report
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import re
import sys
from pathlib import Path

from ..ops.lm_head import triton as tri
from . import aot

# Qwen2.5-7B LM head. RAGGED_H exercises the EVEN_K=False path of the aligned configurations (a multiple of
# 16, not of 64); UNALIGNED_H (8 mod 16) is what sends the dispatcher to the "unaligned" configurations.
SHAPE = dict(N=16384, H=3584, V=152064)
RAGGED_H = 3600
UNALIGNED_H = 3592
ARCHS = aot.ARCHS
# the configuration class the dispatcher picks on each architecture (triton.arch_class of its capability)
ARCH_CLASS = {arch: tri.arch_class(divmod(arch, 10)) for arch in ARCHS}
CONFIG_ARCHS = ("sm90", "sm80", "sm100", "sm120", "unaligned")
# configurations the dispatcher does not pick there, compiled in their default path for the report: Hopper's
# on sm_80 and Ampere's on sm_90 (what the other's tiles cost); none on the Blackwell targets (CI time)
REPORT_OTHER_CONFIGS = {90: ("sm80",), 80: ("sm90",)}
KERNEL_NAMES = dict(
    fwd="lm_head_fwd_kernel_partial", merge="lm_head_fwd_kernel_merge", bwd="lm_head_bwd_kernel_dlogits",
    # schedule="one_pass_dz": dz formed inside the backward GEMMs (always from stored logits)
    gh_dz="lm_head_bwd_kernel_grad_hidden_dz", gw_dz="lm_head_bwd_kernel_grad_weight_dz",
    # kernel A with TMA operands (use_forward_kernel("tma")); "_ws" with WARP_SPECIALIZE=True, the probe of
    # whether Triton honours warp_specialize on this kernel (same PTX digest: it does not)
    fwd_tma="lm_head_fwd_kernel_partial_tma", fwd_tma_ws="lm_head_fwd_kernel_partial_tma",
    # schedule="one_pass_cublas*": the statistics streamed over the logits cuBLAS wrote (no GEMM, no MMA)
    fwd_stream="lm_head_fwd_kernel_stats_from_logits",
)
DZ_KERNELS = ("gh_dz", "gw_dz")
TMA_KERNELS = ("fwd_tma", "fwd_tma_ws")
STREAM_KERNELS = ("fwd_stream",)
# where the WARP_SPECIALIZE=True probe is compiled: sm_90 only. No launch sets it (the host passes False);
# on sm_100a triton 3.6 fails to compile it (NVWSInsertAref) and triton 3.9 does specialise the loop, then
# spills hundreds of local-memory accesses at 128 registers: a row that could not pass is left out
WARP_SPECIALIZE_PROBE_ARCHS = (90,)


def _picked(arch: int, config_arch: str) -> bool:
    return config_arch in (ARCH_CLASS[arch], "unaligned")


def _case(arch, config_arch, kernel, dtype, precision, *, bias=False, grads="both", needs="hwb", h=None,
          stored=False, softcap=False, in_place=False):  # fmt: skip
    operand = "fp32" if dtype == "float32" else "16bit"
    default_h = UNALIGNED_H if config_arch == "unaligned" else SHAPE["H"]
    return dict(
        arch=arch,
        config=(config_arch, operand),
        kernel=kernel,
        dtype=dtype,
        precision=precision,
        bias=bias,
        grads=grads,
        needs=needs,
        H=h or default_h,
        picked=_picked(arch, config_arch),
        stored=stored,
        softcap=softcap,
        in_place=in_place,
    )


def _add_case(out: list, arch: int, config_arch: str, *args, **kwargs) -> None:
    out.append(_case(arch, config_arch, *args, **kwargs))


def cases() -> list[dict]:
    """The compile matrix (~50 compiles per architecture). On each architecture, the configurations its
    dispatcher picks in bf16 and fp32 (tf32x3) with and without bias, with a ragged last K slice, each
    upstream-gradient combination and the bias-only backward; fp16 and fp32 (tf32) in the default path
    (same code as bf16 / tf32x3 up to the operand type); the "unaligned" configurations with bias; on sm_90
    and sm_80, the other architecture's configurations in the default bf16 path, for the report."""
    out = []
    for arch in ARCHS:
        for config_arch in CONFIG_ARCHS:
            add = functools.partial(_add_case, out, arch, config_arch)
            if not _picked(arch, config_arch):
                if config_arch not in REPORT_OTHER_CONFIGS.get(arch, ()):
                    continue
                add("fwd", "bfloat16", None)
                add("bwd", "bfloat16", None)
                continue
            if config_arch == "unaligned":
                for dtype, precision in (("bfloat16", None), ("float32", "tf32x3")):
                    add("fwd", dtype, precision, bias=True)
                    add("bwd", dtype, precision, bias=True)
                continue
            for dtype, precision in (("bfloat16", None), ("float32", "tf32x3")):
                for bias in (False, True):
                    add("fwd", dtype, precision, bias=bias)
                    add("bwd", dtype, precision, bias=bias)
                add("fwd", dtype, precision, h=RAGGED_H)
                add("bwd", dtype, precision, h=RAGGED_H)
            for grads in ("logprobs", "entropy"):
                add("bwd", "bfloat16", None, grads=grads)
            add("bwd", "bfloat16", None, bias=True, needs="b")
            # the fused one-pass schedule: the forward keeps the logits (fp32, or for 16-bit inputs fp16
            # differences from the running row max + fp32 offsets: stored="half"), the backward reads them
            for stored in (True, "half"):
                for bias in (False, True):
                    add("fwd", "bfloat16", None, bias=bias, stored=stored)
                    add("bwd", "bfloat16", None, bias=bias, stored=stored)
            add("fwd", "float16", None, stored="half")
            # logit soft-capping (Gemma 2 / 3): tanh in the forward epilogue, its derivative in dz
            for stored in (False, True, "half"):
                add("fwd", "bfloat16", None, bias=True, stored=stored, softcap=True)
                add("bwd", "bfloat16", None, bias=True, stored=stored, softcap=True)
            for dtype, precision in (("float16", None), ("float32", "tf32")):
                add("fwd", dtype, precision)
                add("bwd", dtype, precision)
            add("merge", "float32", None)
            # dz inside the backward GEMMs (opt-in): each upstream-gradient combination, the soft-cap, fp32
            for kernel in DZ_KERNELS:  # the fused schedule's store for 16-bit inputs: half; fp32 keeps fp32
                for grads in ("both", "logprobs", "entropy"):
                    add(kernel, "bfloat16", None, grads=grads, stored="half")
                add(kernel, "bfloat16", None, bias=True, stored="half", softcap=True)
                add(kernel, "bfloat16", None, stored=True)
                add(kernel, "float32", "tf32x3", stored=True)
            # schedule="one_pass_dz_inplace": grad_weight summed into the bf16 gradient buffer (load, fp32 add, store)
            add("gw_dz", "bfloat16", None, stored="half", in_place=True)
            # the cuBLAS-forward schedules' streaming statistics kernel: each of its code paths (bias added
            # and z written back, soft-cap), bf16 and fp32 buffers are the same (it reads fp32 logits)
            for bias, softcap in ((False, False), (True, False), (True, True)):
                add("fwd_stream", "bfloat16", None, bias=bias, stored=True, softcap=softcap)
            add("fwd_stream", "float32", "tf32x3", stored=True)
            # the TMA kernel A, where the picked configuration has TMA tiles (sm_90 and sm_100; on sm_120
            # and sm_80 there are none, so use_forward_kernel("tma") runs the cp.async kernel there):
            # each path of the cp.async one that it replaces
            if tri.CONFIGS[(config_arch, "16bit")].forward_tma is not None:
                for bias in (False, True):
                    for stored in (False, True, "half"):
                        add("fwd_tma", "bfloat16", None, bias=bias, stored=stored)
                add("fwd_tma", "bfloat16", None, h=RAGGED_H)
                for stored in (False, True):
                    add("fwd_tma", "bfloat16", None, bias=True, stored=stored, softcap=True)
                    if arch in WARP_SPECIALIZE_PROBE_ARCHS:
                        add("fwd_tma_ws", "bfloat16", None, stored=stored)
                add("fwd_tma", "float16", None)
    return out


def case_id(c: dict) -> str:
    parts = [f"sm{c['arch']}", f"{c['config'][0]}-{c['config'][1]}", c["kernel"], c["dtype"]]
    if c["precision"]:
        parts.append(c["precision"])
    if c["kernel"] != "merge":
        parts.append("bias" if c["bias"] else "nobias")
        parts.append(f"H{c['H']}")
    if c["kernel"] in ("bwd", *DZ_KERNELS):
        parts.append(f"grads-{c['grads']}")
        if c["needs"] != "hwb":
            parts.append(f"needs-{c['needs']}")
    if c.get("stored"):
        parts.append("stored-half-logits" if c["stored"] == "half" else "stored-logits")
    if c.get("softcap"):
        parts.append("softcap")
    if c.get("in_place"):
        parts.append("grad-weight-in-place")
    return "/".join(parts)


@contextlib.contextmanager
def _allow_tf32(value: bool):
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = value
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def record_lm_head_launches(
    n, h, v, dtype, config, *, bias=False, grads="both", needs="hwb", precision=None, workspace_bytes=None,
    stored=False, softcap=False, dz_in_gemm=False, forward_kernel="cp.async", forward_gemm="kernel_a",
    in_place=False,
):  # fmt: skip
    """Run lm_head_forward and lm_head_backward on meta tensors; return their recorded launches. in_place:
    grad_weight accumulated in the weight's dtype (the in-place schedules' gradient buffer), else fp32."""
    import torch

    from ..ops.lm_head import triton as tri
    from .aot import record_launches

    dt = getattr(torch, dtype)
    meta = lambda *shape, dtype=dt: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    x, w, y = meta(n, h), meta(v, h), meta(n, dtype=torch.int64)
    b = meta(v) if bias else None
    f32 = lambda: meta(n, dtype=torch.float32)  # noqa: E731
    extra = {} if workspace_bytes is None else dict(workspace_bytes=workspace_bytes)
    # stored: True for fp32 logits, "half" for kernel A's fp16 differences and offsets (tri.HalfLogits)
    logits = tri.HalfLogits.empty(n, v, "meta") if stored == "half" else meta(n, v, dtype=torch.float32) if stored \
        else None  # fmt: skip
    if stored:
        extra["stored_logits"] = logits
    cap = (1.0 / 30.0, 30.0 / 0.7) if softcap else None  # Gemma 2's cap, temperature 0.7
    extra["softcap"] = cap
    if dz_in_gemm:
        extra["dz_in_gemm"] = True
    if in_place:
        extra["grad_weight_acc"] = meta(v, h)
    with _allow_tf32(precision == "tf32"), tri.use_forward_kernel(forward_kernel), record_launches(tri) as launches:
        if forward_gemm == "cublas":  # no tile configuration: the streaming kernel has its own tiles
            stats = tri.lm_head_forward(x, w, b, y, 0.7, logits_out=logits, softcap=cap, forward_gemm="cublas")
        else:
            stats = tri.lm_head_forward(x, w, b, y, 0.7, config=config, logits_out=logits, softcap=cap)
        tri.lm_head_backward(
            x,
            w,
            b,
            y,
            0.7,
            stats.lse,
            stats.expected_logit,
            f32() if grads in ("both", "logprobs") else None,
            f32() if grads in ("both", "entropy") else None,
            need_grad_hidden="h" in needs,
            need_grad_weight="w" in needs,
            need_grad_bias="b" in needs,
            config=config,
            **extra,
        )
    return launches


def compile_case(c: dict) -> dict:
    """Compile one case; returns the report row (with "error" instead of resources when it fails, "skipped"
    with the reason when this Triton cannot target the case's architecture)."""
    from .aot import compile_launch, target_blocker

    row = dict(id=case_id(c), **{k: v for k, v in c.items() if k != "config"})
    row["config"] = tri.CONFIGS[tuple(c["config"])].name
    blocker = target_blocker(c["arch"])
    if blocker is not None:
        row["skipped"] = blocker
        return row
    try:
        config = tri.CONFIGS[tuple(c["config"])]
        launches = record_lm_head_launches(
            SHAPE["N"],
            c["H"],
            SHAPE["V"],
            c["dtype"],
            config,
            bias=c["bias"],
            grads=c["grads"],
            needs=c["needs"],
            precision=c["precision"],
            stored=c.get("stored", False),
            softcap=c.get("softcap", False),
            dz_in_gemm=c["kernel"] in DZ_KERNELS,
            forward_kernel="tma" if c["kernel"] in TMA_KERNELS else "cp.async",
            forward_gemm="cublas" if c["kernel"] in STREAM_KERNELS else "kernel_a",
            in_place=c.get("in_place", False),
        )
        launch = next(la for la in launches if la.name == KERNEL_NAMES[c["kernel"]])
        if c["kernel"] == "fwd_tma_ws":
            launch.args["WARP_SPECIALIZE"] = True
        result = compile_launch(launch, c["arch"])
        row.update(result.as_dict())
        row["tile"] = {k: launch.args[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in launch.args}
    except Exception as exc:  # reported per case
        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return row


def run_matrix(workers: int | None = None, selected: list[dict] | None = None) -> list[dict]:
    todo = selected if selected is not None else cases()
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        return [compile_case(c) for c in todo]
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch / triton state
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(compile_case, todo, chunksize=4))


def _versions() -> dict:
    import torch
    import triton

    return dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__)


def write_report(
    rows: list[dict], out_dir: str | Path, name: str = "compile_report_lm_head"
) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    versions = _versions()
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(dict(versions=versions, shape=SHAPE, rows=rows), indent=1, default=str))
    lines = [
        "# LM-head Triton kernels: AOT compile report",
        "",
        f"Generated by `python -m grpo_kernels.testing.lm_head_compile` (triton {versions['triton']}, "
        f"torch {versions['torch']}), launches recorded at N={SHAPE['N']}, H={SHAPE['H']} "
        f"(ragged K: {RAGGED_H}; unaligned configs: {UNALIGNED_H}), V={SHAPE['V']}. "
        "REG = registers per thread, STACK / LOCAL = bytes per thread of spill stack / local memory "
        "(0 = no spills), smem = shared memory per block, "
        "picked = the dispatcher's choice on that architecture (on sm_100 and sm_120 only the picked ones "
        "are compiled), CTAs/SM = blocks one SM holds by registers, shared memory and tensor memory, TMEM = "
        "tcgen05 tensor-memory columns allocated. Resource numbers are from cuobjdump on the cubin; no GPU "
        "was used. " + aot.targets_sentence(),
        "",
        "| arch | config | kernel | dtype | precision | flags | tile (BMxBNxBK) | warps | stages | REG | "
        "STACK | LOCAL | smem KiB | CTAs/SM | mma | TMEM | TMA | picked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flags = []
        if r["kernel"] != "merge":
            flags.append("bias" if r["bias"] else "no bias")
            flags.append(f"H={r['H']}")
        if r["kernel"] in ("bwd", *DZ_KERNELS):
            flags.append(f"grads={r['grads']}")
            if r["needs"] != "hwb":
                flags.append(f"needs={r['needs']}")
        if r.get("stored"):
            flags.append("stored fp16 logits" if r["stored"] == "half" else "stored logits")
        if r.get("softcap"):
            flags.append("softcap")
        if r["kernel"] == "fwd_tma_ws":
            flags.append("WARP_SPECIALIZE")
        if "error" in r or "skipped" in r:
            lines.append(
                f"| sm_{r['arch']} | {r['config']} | {KERNEL_NAMES[r['kernel']]} | {r['dtype']} | "
                f"{r['precision'] or ''} | {' '.join(flags)} | | | | {aot.skip_or_error_cells(r)} "
                f"| | | | | | | | {'yes' if r['picked'] else ''} |"
            )
            continue
        tile = r.get("tile") or {}
        # the streaming statistics kernel has no K loop: its tile is BLOCK_M x BLOCK_N
        tile_s = "x".join(str(tile[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in tile) if tile else "-"
        lines.append(
            f"| sm_{r['arch']} | {r['config']} | {r['kernel_name']} | {r['dtype']} | "
            f"{r['precision'] or ''} | "
            f"{' '.join(flags)} | {tile_s} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
            f"{r['stack']} | {r['local']} | {r['shared'] / 1024:.0f} | {r['ctas_per_sm']} | {aot.mma_cell(r)} | "
            f"{r.get('tensor_memory_columns') or ''} | {_tma_cell(r)} | {'yes' if r['picked'] else ''} |"
        )
    md_path = out_dir / f"{name}.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


def _tma_cell(r: dict) -> str:
    if not r.get("tma"):
        return ""
    return "loads + store" if r.get("tma_store") else "loads"


_ADDPTR_TENSOR = re.compile(r"(%[\w.]+) = tt\.addptr (%[\w.]+), (%[\w.]+) : [^,]+, tensor<[\dx]+x(i\d+)>")
_ADDPTR_SCALAR = re.compile(r"(%[\w.]+) = tt\.addptr %(\w+), (%[\w.]+) : !tt\.ptr<\w+>, (i\d+)")
_SPLAT_ARG = re.compile(r"(%[\w.]+) = tt\.splat %(\w+) : !tt\.ptr")


def first_offset_widths(ttir: str) -> dict[str, set[str]]:
    """For each pointer argument of a kernel, the integer widths of the offsets first added to it, as a
    tensor (splat of the argument + offsets) or as a scalar (argument + offset)."""
    splat_of = {m.group(1): m.group(2) for m in _SPLAT_ARG.finditer(ttir)}
    widths: dict[str, set[str]] = {}
    for m in _ADDPTR_TENSOR.finditer(ttir):
        base = splat_of.get(m.group(2))
        if base is not None:
            widths.setdefault(base, set()).add(m.group(4))
    for m in _ADDPTR_SCALAR.finditer(ttir):
        widths.setdefault(m.group(2), set()).add(m.group(4))
    return widths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="report folder")
    parser.add_argument("--name", default="compile_report_lm_head", help="report file name, without suffix")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    from .aot import own_triton_cache

    with own_triton_cache():  # this source's compiles, not another copy's cached ones (aot.py's docstring)
        rows = run_matrix(args.workers)
    md, js = write_report(rows, args.out, args.name)
    bad = [r["id"] for r in rows if "error" in r]
    compiled = [r for r in rows if "error" not in r and "skipped" not in r]
    spills = [r["id"] for r in compiled if r["picked"] and (r["spills"] or not r["shared_fits"])]
    bad += [r["id"] for r in compiled if r["global_stores"] == 0]  # compiled to an empty body
    skipped = sorted({f"sm_{r['arch']}: {r['skipped']}" for r in rows if "skipped" in r})
    print(f"{len(compiled)} compiles, {len(bad)} errors, {len(spills)} picked configs with spills or over the "
          f"shared-memory limit -> {md}, {js}")  # fmt: skip
    for i in bad + spills:
        print("  ", i)
    for reason in skipped:
        print("   skipped", reason)
    return 1 if bad or spills else 0


if __name__ == "__main__":
    sys.exit(main())
