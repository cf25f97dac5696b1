"""AOT-compile matrix of the loss-head Triton kernel (tier 3) and its register / spill / smem report.

The kernel has one compiled variant per code path (loss type, ratio level, KL estimator,
aggregation modes, which inputs exist); CASES below covers every value of every constexpr at least
once. Launches are recorded from the real host launcher (`loss_head_triton`) running on small CPU
tensors (its host-side selections need values; the kernel launch itself is recorded, not run), then
compiled for each architecture of aot.ARCHS (sm_90, sm_80, sm_100a, sm_120; one this Triton cannot
target is a row with its skip reason) with the whole Triton toolchain, and cuobjdump reports registers
and spills. The kernel has no tl.dot: no MMA is expected on any architecture. Nothing here needs a GPU.

    python -m grpo_kernels.testing.loss_head_compile --out benchmarks/results   # writes the report
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import platform
from pathlib import Path

import torch

from ..config import PolicyLossConfig as C
from ..ops.loss_head.variants import VARIANTS
from . import aot

ARCHS = aot.ARCHS

# name -> (config, which optional inputs are present)
ALL = ("old", "ref", "rollout", "entropy")
CASES = {
    "grpo": (C.grpo(), ALL),
    "dapo": (C.dapo(), ("old", "entropy")),
    "dapo_on_policy_no_entropy": (C.dapo(), ()),
    "dr_grpo": (C.dr_grpo(max_completion_length=512), ("old",)),
    "gspo": (C.gspo(), ("old",)),
    "gspo_token": (C.gspo(ratio_level="sequence_token"), ("old",)),
    "tic_grpo": (C.tic_grpo(), ("old",)),
    "prefix_trace": (C(ratio_level="prefix"), ("old",)),
    "kl_k1_ratio_corrected": (C(kl_coef=0.1, kl_estimator="k1", kl_ratio_correction=True), ("old", "ref")),
    "kl_k2_own_agg": (C(kl_coef=0.1, kl_estimator="k2", kl_agg_mode="seq-mean-token-mean"), ("old", "ref")),
    "kl_low_var_st": (C(kl_coef=0.1, kl_estimator="low_var_kl", kl_straight_through=True), ("old", "ref")),
    "kl_abs": (C(kl_coef=0.1, kl_estimator="abs"), ("old", "ref")),
    "entropy_bonus_local": (C(entropy_coef=0.01, entropy_agg_mode="token-mean-local"), ("old", "entropy")),
    "top_entropy": (C(top_entropy_quantile=0.2), ("old", "entropy")),
    "mis_sequence": (C(is_level="sequence", is_mode="mask", is_min=0.5), ("old", "rollout")),
    "olmo3_tis": (C.olmo3(), ("old", "rollout")),
    "lopti_high_token_weights": (C(old_prob_threshold=0.5, old_prob_side="high", loss_agg_mode="length-pow"),
                                 ("old", "token_weights")),
    "seq_mean_token_sum": (C(loss_agg_mode="seq-mean-token-sum"), ("old",)),
    "lopti_low": (C(old_prob_threshold=0.5), ("old",)),
    # the rollout anchor, the squared log-ratio penalty, geometric IS and the sampler gates
    "is_sequence_geometric": (C(is_level="sequence_geometric", is_mode="mask", is_min=0.5), ("old", "rollout")),
    "seq_mask_tis": (C(is_level="token", is_max=None, is_gate="ratio", is_gate_level="sequence", is_gate_min=0.99,
                       is_gate_max=1.01), ("old", "rollout")),
    "gate_binary_kl_token": (C(is_gate="binary_kl", is_gate_max=0.01), ("old", "rollout")),
    "gate_tv_sequence_weights": (C(is_level="token", is_gate="tv", is_gate_level="sequence", is_gate_max=0.05),
                                 ("old", "rollout", "token_weights")),
    # pieces of longer sequences (the one-pass schedule cuts them for token-local objectives)
    "grpo_cut_sequences": (C.grpo(entropy_coef=0.01), ALL + ("seq_lengths",)),
}


def _variant_case(keywords: dict) -> C:
    keywords = dict(keywords)
    preset = keywords.pop("preset", None)
    return C(**keywords) if preset is None else C.from_preset(preset, **keywords)


# each loss variant's own code paths (grpo_kernels/ops/loss_head/variants/<loss_type>.py COMPILE_CASES)
for _variant in VARIANTS.values():
    for _name, (_keywords, _present) in _variant.compile_cases.items():
        assert _name not in CASES, f"compile case {_name!r} defined twice"
        CASES[_name] = (_variant_case(_keywords), _present)


def record_case(name: str, need_grad: bool = True):
    """Run the host launcher on a small batch and return its recorded kernel launch."""
    from ..ops.loss_head import triton as loss_head
    from .aot import record_launches

    cfg, present = CASES[name]
    g = torch.Generator().manual_seed(0)
    batch, length = 4, 16
    n = batch * length
    lp = -torch.rand(n, generator=g)
    tensors = dict(
        old=lp + 0.1 * torch.randn(n, generator=g), ref=lp + 0.1 * torch.randn(n, generator=g),
        rollout=lp + 0.1 * torch.randn(n, generator=g), entropy=torch.rand(n, generator=g),
        is_weights=torch.rand(n, generator=g) + 0.5, token_weights=torch.rand(n, generator=g),
    )  # fmt: skip
    valid = torch.ones(n, dtype=torch.bool)
    seq_index = torch.arange(batch).repeat_interleave(length)
    cu = torch.arange(batch + 1, dtype=torch.int64) * length
    with record_launches(loss_head) as launches:
        loss_head.loss_head_triton(
            lp, torch.randn(n, generator=g), valid, cu, seq_index, batch, cfg,
            old_logprobs=tensors["old"] if "old" in present else None,
            ref_logprobs=tensors["ref"] if "ref" in present else None,
            rollout_logprobs=tensors["rollout"] if "rollout" in present else None,
            is_weights=tensors["is_weights"] if "is_weights" in present else None,
            entropy=tensors["entropy"] if "entropy" in present else None,
            token_weights=tensors["token_weights"] if "token_weights" in present else None,
            need_grad_logprobs=need_grad, need_grad_entropy=need_grad and cfg.entropy_coef != 0,
            seq_lengths=torch.full((batch,), 3.0 * length) if "seq_lengths" in present else None,
        )  # fmt: skip
    (launch,) = launches
    return launch


def compile_case(name: str) -> list[dict]:
    """Record one case's launch and compile it for every architecture: its report rows ("error" instead of
    resources where the compiler raises, "skipped" with the reason where this Triton cannot target it)."""
    from .aot import compile_launch, target_blocker

    launch = record_case(name)
    rows = []
    for arch in ARCHS:
        row = dict(id=f"{name}-sm{arch}", case=name, arch=arch)
        blocker = target_blocker(arch)
        if blocker is not None:
            row["skipped"] = blocker
            rows.append(row)
            continue
        try:
            result = compile_launch(launch, arch)
            row.update(result.as_dict())
        except Exception as exc:  # reported per row; the test fails on it
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def run_matrix(names=None, workers: int | None = None) -> list[dict]:
    """Every case x architecture, cases spread over `workers` processes (default: one per CPU)."""
    todo = list(names or CASES)
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        return [row for name in todo for row in compile_case(name)]
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch / triton state
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return [row for rows in pool.map(compile_case, todo) for row in rows]


def write_report(rows: list[dict], out_dir, name: str = "compile_report_loss_head"):
    import triton

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    versions = dict(triton=triton.__version__, torch=torch.__version__, python=platform.python_version())
    (out_dir / f"{name}.json").write_text(json.dumps(dict(versions=versions, rows=rows), indent=1, default=str))
    lines = [
        "# Loss-head Triton kernel: AOT compile report",
        "",
        f"Generated by `python -m grpo_kernels.testing.loss_head_compile` (triton {versions['triton']}, "
        f"torch {versions['torch']}); one row per code path and architecture, the kernel's only "
        "configuration (BLOCK = 256 tokens, 4 warps). REG = registers per thread, STACK / LOCAL = spill "
        "bytes per thread (0 = no spills); st.global = global store instructions in the PTX (0 would mean a "
        "kernel that writes nothing); mma = tensor-core instructions (none: the kernel has no matrix "
        "product). From cuobjdump on the cubin; no GPU was used. " + aot.targets_sentence(),
        "",
        "| case | arch | REG | STACK | LOCAL | smem B | st.global | mma | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['case']} | sm_{r['arch']} | {aot.skip_or_error_cells(r)} | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | sm_{r['arch']} | {r['registers']} | {r['stack']} | {r['local']} | "
            f"{r['shared']} | {r['global_stores']} | {aot.mma_cell(r)} | {r['seconds']:.1f} |"
        )
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="compile_report_loss_head", help="report file name, without suffix")
    args = parser.parse_args(argv)
    from .aot import own_triton_cache

    with own_triton_cache():  # this source's compiles, not another copy's cached ones (aot.py's docstring)
        rows = run_matrix()
    write_report(rows, args.out, args.name)
    bad = [r["id"] for r in rows if "error" in r or r.get("spills") or r.get("shared_fits") is False]
    skipped = sorted({f"sm_{r['arch']}: {r['skipped']}" for r in rows if "skipped" in r})
    print(f"{sum('skipped' not in r for r in rows)} compiles, {len(bad)} with errors, spills or too much shared "
          f"memory: {bad}; skipped: {skipped}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
