"""The GPU session: the verdict from one command on a GPU machine, the rest from a second that resumes it.
Built so that a lent GPU's 15 minutes cannot be wasted.

The lease (the device notes): 15 minutes of device time per session, each machine start (1-2 minutes) and
every idle wait counted, one command at most 10 minutes, no machine started with under 4 minutes left, 8
result files kept per command. So one call is one command of at most CALL_LIMIT_S = 340 s (the session
stops starting parts after CALL_BUDGET_S = 320 s), and `--dry-run` fails unless one machine start plus two
such calls fit the lease (120 + 2 x (340 + 30) = 860 <= 900 s; the second call follows the first at once,
on the machine still warm).

Order (priority: what the verdict needs first, then what the next change is chosen from):
  wheels          install the carried peer wheels (.whl/, from `run.sh make-wheels`) one by one: a wheel that
                  fails costs its providers only (session.json `wheels`, `skipped_providers`)
  preflight       versions, the GPU and its peaks, every provider's modules imported (not just the lazy
                  package: trl.trainer.grpo_trainer, Liger's chunked loss, ...), profilers; a provider whose
                  import fails is skipped with the reason
  gpu-tests       the GPU test tier, first: tests/test_gpu_tier.py (every loss-head configuration, schedule,
                  input dtype and layout against the fp32 reference) and tests/test_gpu.py; a failure is named
                  (session.json: the part's `tests`) and stops nothing. Beside it, the csrc gate
                  (csrc_check.py --gate, its own process, killed at CSRC_GATE_LIMIT_S): csrc's kernels on
                  small heads and one wide head; anything but "ok" (wrong, hung, crashed) skips the csrc
                  providers for the session, with the reason (session.json `csrc_gate`)
  headline        logprobs + fused_grpo at the target shape: the GEMM floor, grpo_kernels (auto), TRL, Liger
                  (defaults, and TF32 with its best chunk size), liger-flsce, cut-cross-entropy, verl's kernel,
                  all in one process, each checked against the fp32 reference, then timed in turns (20 rounds,
                  fitted to the part's time left); verdict.json (median, p20, p80, ratios to the floor and to
                  each peer, extra memory, met / missed) rewritten after each shape
  sweep-trl       fused_grpo over 4k-32k tokens: the floor, grpo_kernels, TRL in turns per size
  trace           the idle gaps in one call of the fused loss (benchmarks/gpu/trace_gaps.py; session.json "trace")
  csrc            csrc/'s CUTLASS sm_90a kernel A (the library travels built): every check against the fp32
                  reference, then timed against one cuBLAS GEMM, interleaved (benchmarks/gpu/csrc_check.py;
                  session.json's "csrc"); wrong or slower, the default stays
  step            a GRPO training step, stock against grpo_kernels (grpo_kernels/bench/step.py): TRL 1.16's
                  GRPOTrainer stock and with the adapter in both modes, the reference trainer's update with
                  the fused loss and with a plain PyTorch head; Qwen3-1.7B full fine-tuning and Qwen3-8B with
                  LoRA, built in code; losses checked equal per pair before timing; time split, peak memory,
                  tokens/s; then the memory walls (longest completion, most sequences; each try a process)
  smoke           each kernel and fused-loss schedule against the PyTorch backend on the same bf16 inputs,
                  a small shape then the target; stops with a report at the first wrong one
  micro           per-kernel microbenchmarks at the target head (microbench.py): TF/s and GB/s against the
                  device's peaks and the ceilings measured in the same run
  schedules       the other schedules and plain PyTorch at the target shape (SCHEDULE_PROVIDERS)
  sweep           fused_grpo over 4k-64k tokens: the floor and SWEEP_PROVIDERS
  opt-in-kernels  microbenchmarks of the opt-in kernels (TMA kernel A, one_pass_dz's dz kernels)
  smoke-opt-in    the TMA kernel A and OPT_IN_SCHEDULES against the PyTorch backend
  opt-in          every other provider of the registry (opt-in variants, the other peers; torch-compile last)
  profile         torch.profiler's kernel table of the fused loss; ncu on its three hottest kernels, nsys
A call runs the parts in this order while its budget lasts. `--resume DIR` (DIR: an earlier call's folder,
copied back into the tree) keeps every row measured there, skips it, and goes on with the rest, on a fresh
machine too (wheels and preflight run again).

Isolation: every measurement runs in a child process (grpo_kernels/bench/session_worker.py), one per
provider (in the interleaved parts, one for the floor and the providers, each gate and timed call announced),
each row announced before it starts and appended to results.jsonl (flushed, fsync'd) the moment
it is measured. A row that crashes its process (a CUDA fault), hangs past its row limit or is cut by its
part's limit is recorded as lost (status "crashed" / "timeout", named in session.json's `lost_rows`) and a
fresh process measures the rest: one fault costs one row; a kill of the whole call keeps every row written
and the verdict of the headline rows measured before it.

Files (8): session.json (every call's parts, lost rows, wheels, skipped providers, verdict), log.txt,
results.jsonl, verdict.json, headline.json (the benchmark report of every target-shape and sweep row),
headline.png (the sweep's panels below the headline's), kernels.png, step.png (the step report itself is
session.json's "step"). The last lines printed: the verdict table, the three kernels furthest
from their measured ceilings, what was lost or not reached and how to resume.

  python -m grpo_kernels.bench.gpu_session run [--out DIR] [--resume DIR] [--budget S] [--parts a,b]
                                               [--dry-run] [--rehearsal] [--row-limit S]
  python -m grpo_kernels.bench.gpu_session make-wheels [--dest .whl] [--dry-run]
  python -m grpo_kernels.bench.gpu_session stamp        # .whl/SOURCE.json: the commit of the tree, before a call

--rehearsal runs the same flow on tiny CPU shapes with fewer providers (what CI does: the flow, the
isolation, the resume and the files, not the numbers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .plots import empty_panel, line_style, offset, save_figure, sha_label
from .session_worker import (
    FLOOR,
    HEADLINE_OPS,
    RESTART,
    STOPPED,
    _poisoned,
    append,
    bench_keys,
    interleaved_keys,
    micro_keys,
    profile_keys,
    read_rows,
    smoke_keys,
    step_keys,
)

SCHEMA = "grpo_kernels.gpu_session/3"
ROOT = Path(__file__).resolve().parents[2]  # the repository (a copy of it on the GPU machine)
# The lease (the device notes): 15 minutes of device time per session, each machine start (1-2 minutes) and
# every idle wait counted, one command at most 10 minutes, no machine started with under 4 minutes left.
# A call is one command of at most CALL_LIMIT_S (the `timeout_s` to ask for); the session's own clock stops
# starting parts CALL_BUDGET_S into it, so the files are written well inside the command's limit.
LEASE_S = 15 * 60
MACHINE_START_S = 120  # one machine start, at most (seen: 30 s to 2 minutes)
TRANSFER_S = 30  # the tree out and the files back, per call
CALL_LIMIT_S = 340
CALL_BUDGET_S = 320
CALLS = 2  # the plan must fit this many calls (the second resumes the first): start + CALLS x (limit + transfer)
RESERVE_S = 15  # kept back for writing session.json and the plots
MIN_PART_S = 20  # a part with less time than this left is skipped, not started
MAX_FILES = 8
WHEEL_LIMIT_BYTES = 48 * 2**20  # the tree travels too, under 64 MiB in all
ROW_LIMIT_S = (
    60  # one row (gate + timing + memory) at the target shape; the first compile of a kernel included
)
ROW_LIMITS = {"liger-chunked": 120, "liger-chunked-tuned": 150, "torch-compile": 150}  # torch.compile inside the row
SMOKE_ROW_LIMIT_S = 90  # a smoke row compiles the kernels it runs first
STARTUP_LIMIT_S = 90  # a child that starts no row within this is stuck (imports, CUDA context)
# The GPU test tier (tests/test_gpu_tier.py is every kernel path against the fp32 reference, sized to run in
# under 60 s on an H200; its part's budget lets the verdict's headline still fit the first call)
GPU_TEST_FILES = ("test_gpu_tier.py", "test_gpu.py")
GPU_TESTS_BUDGET_S = 75
# The training step (grpo_kernels/bench/step.py): at most ~3 minutes in a call; rows not reached are resumed
STEP_BUDGET_S = 135  # the second call: wheels 20 + preflight 40 + sweep 40 + trace 20 + csrc 50 + step 135 + 15 = 320
# csrc/'s CUTLASS kernels (benchmarks/gpu/csrc_check.py): kernel A checked against the fp32 reference, then timed
# against one cuBLAS GEMM; kernel C checked against its spec, then timed against the two cuBLAS backward GEMMs (no
# compile of its own: the library travels built; Triton compiles its comparison kernels)
CSRC_BUDGET_S = 50
# The csrc gate (benchmarks/gpu/csrc_check.py --gate: every kernel entry point the headline calls, small heads and one
# wide head, no Triton to compile): run beside the GPU test tier, so it costs the call nothing while it works
# (seconds); killed at its limit. The csrc code has never run on a GPU: a kernel that hangs would otherwise hang
# in the headline's process (a row's limit, 60 s, then every provider of that shape gated again in a fresh
# process, and the same for each other csrc provider) and in the tier's csrc tests. Anything but "ok" skips the csrc providers for the whole session (every
# call), the tier's csrc tests (they wait for the verdict) and, for a hang or a crash, the csrc part.
CSRC_GATE_LIMIT_S = 40
CSRC_GATE_SKIPS = ("wrong", "hung", "crashed", "not loaded")  # the verdicts that skip the csrc providers
CSRC_GATE_STOPS = ("hung", "crashed")  # and those after which nothing else calls the library (it would again)
CSRC_GATE_ENV = "GRPO_KERNELS_CSRC_GATE"  # the gate's JSON, where the tier's csrc tests read its verdict
HEADLINE_BUDGET_S = 170  # the first call: wheels 20 + preflight 40 + gpu-tests 75 + headline 170 + reserve 15 = 320
SWEEP_TRL_BUDGET_S = 40
TRACE_BUDGET_S = 20
# The headline's timing: every provider beside the floor in one process, >= 20 timed calls each (p20 / p80 hold)
HEADLINE_TIMING = ["--warmup", "2", "--iters", "20"]
SWEEP_TRL_TIMING = ["--warmup", "1", "--iters", "10"]
STEP_ROW_LIMIT_S = 130  # one family (every side built twice: parity, then timing) or one memory wall

# Peers the GPU image lacks, as cp312 wheels, with their own dependencies the image lacks too
# (the image has transformers, accelerate, pandas, pyarrow, xxhash, huggingface-hub, fsspec, ...).
PEER_WHEELS = (
    "trl==1.16.0",
    "liger-kernel==0.8.5",
    "cut-cross-entropy==25.1.1",
    "verl==0.9.1",  # its Triton kernel only (bench/verl_kernel.py): verl's package needs Ray, not carried
    "datasets==5.2.0",  # trl's import needs it
    "dill==0.4.1",  # datasets'
    "multiprocess==0.70.19",  # datasets'
)
# A carried dependency's providers are those of the peer that needs it (a wheel that fails costs them only)
WHEEL_NEEDED_BY = {"datasets": "trl", "dill": "trl", "multiprocess": "trl"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")

# Performance targets (docs/design.md §7, checked on the headline shape; "faster_than": the least speedup of
# ours over each peer, 1.0 = faster than it), and on every token count of the sweep against TRL
TARGETS = {
    "fused_grpo": {"x_floor": 1.10, "extra_gib": 1.5,
                   "faster_than": {"trl": 1.35, "liger-chunked": 1.0, "liger-chunked-tuned": 1.0}},
    "logprobs": {"x_floor": 1.05, "faster_than": {"trl": 1.0, "liger-flsce": 1.0, "cce": 1.0, "verl-kernel": 1.0}},
}
SWEEP_TARGET = ("trl", 1.0)  # ours faster than this peer at every token count of the sweep

# What runs, in this order. Providers are names of grpo_kernels/bench/providers.py's REGISTRY; a provider the
# registry gains is measured in the "opt-in" part (after every core row) until its name is added to one of
# the lists below (one line), and a schedule fused/function.py's SCHEDULES gains is smoke-tested with the
# core schedules unless it is in OPT_IN_SCHEDULES.
HEADLINE_PROVIDERS = (  # the verdict's rows, beside the floor in one process: ours, then every peer it is judged against
    "grpo_kernels",  # schedule="auto"
    "trl",
    "liger-chunked",  # at Liger's defaults; compiles its loss inside the row
    "liger-chunked-tuned",  # TF32 allowed, its fastest chunk_size (one compile per candidate)
    "liger-flsce",  # log-probs: Liger's Hopper fused linear CE
    "cce",  # log-probs
    "verl-kernel",  # log-probs: verl's Triton kernel
    "grpo_kernels-csrc",  # csrc/'s CUTLASS kernel A: log-probs, and the fused loss with its fp16 logits store (opt-in;
    # last: its gate checks it first)
    "grpo_kernels-csrc-one-pass-dz-inplace",  # the fused loss with csrc's kernels A and C, grad_weight in place (within
    # the memory goal: the candidate for auto)
    "grpo_kernels-csrc-one-pass-dz",  # the same with an fp32 grad_weight accumulator (kernel C's fp32 epilogue)
)
CSRC_PROVIDERS = tuple(p for p in HEADLINE_PROVIDERS if p.startswith("grpo_kernels-csrc"))  # one library: one gate
HEADLINE_ORDER = ("logprobs", "fused_grpo")  # the quick op first: a part cut short keeps it
SWEEP_TRL_PROVIDERS = ("grpo_kernels", "trl")
SCHEDULE_PROVIDERS = (  # the other schedules and plain PyTorch, at the same shape, after smoke and micro
    "torch-eager",
    "grpo_kernels-one-pass",
    "grpo_kernels-two-pass",
    "grpo_kernels-low-memory",
    # kernel A against the cuBLAS forward with grad_weight summed in place: "auto" runs the cuBLAS one at
    # the target head by its time model; these two rows are what that choice is checked by
    "grpo_kernels-one-pass-inplace",
    "grpo_kernels-one-pass-cublas",
)
SWEEP_PROVIDERS = ("grpo_kernels", "grpo_kernels-one-pass")  # auto (in place in bf16) against fp32 accumulation
OPT_IN_SCHEDULES = ("one_pass_dz", "one_pass_dz_inplace")  # after the core rows (Triton's dz GEMMs: ~2x slower)
# Not in any part: verl's loss (core_algos) needs verl's package, whose imports (Ray, tensordict, omegaconf) are
# not on the GPU machine and too large to carry (its kernel alone runs: verl-kernel); grpo_kernels-torch is the
# CPU backend.
EXCLUDED_PROVIDERS = ("verl", "verl-torch", "grpo_kernels-torch")
LAST_PROVIDERS = ("torch-compile",)  # the opt-in part's end: inductor compiles inside the row
# The rehearsal (CPU, tiny shapes): the providers and schedules that run on the PyTorch backend; TRL's path
# runs on CPU, so the verdict's peer rows are rehearsed too (skipped with the reason where TRL is absent).
REHEARSAL_HEADLINE = ("grpo_kernels", "trl", "torch-eager")
REHEARSAL_SCHEDULES_PROVIDERS = ("grpo_kernels-low-memory",)
REHEARSAL_SWEEP = ("grpo_kernels",)
REHEARSAL_OPT_IN = ("grpo_kernels-batch-invariant", "grpo_kernels-tp")
REHEARSAL_SCHEDULES = ("auto", "low_memory")
# The parts whose rows feed the verdict: it is rewritten after each of their rows
VERDICT_PARTS = ("headline",)


def core_schedules() -> tuple[str, ...]:
    from ..ops.fused.function import SCHEDULES

    return tuple(s for s in SCHEDULES if s not in OPT_IN_SCHEDULES)


def opt_in_providers() -> tuple[str, ...]:
    """Every provider of the registry not in an earlier part (the opt-in variants, the other peers), with
    the ones that compile inside their row last."""
    from .providers import REGISTRY

    earlier = set(HEADLINE_PROVIDERS) | set(SCHEDULE_PROVIDERS) | set(EXCLUDED_PROVIDERS) | set(LAST_PROVIDERS)
    rest = [p for p in REGISTRY.providers if p not in earlier]
    return tuple(rest) + tuple(p for p in LAST_PROVIDERS if p in REGISTRY.providers)


@dataclass
class Job:
    """One child process (restarted for the rows left after a crash or a time-out)."""

    label: str
    argv: list[str]  # the worker's arguments, the job's name first
    keys: list[str]  # the rows it measures, in order
    row_limit_s: float
    lost_fields: dict = field(default_factory=dict)  # key -> the fields a lost row of it carries
    key_limits: dict = field(default_factory=dict)  # key -> its own limit where it differs (an interleaved job's)
    provider: str | None = None  # a bench job's provider (skipped when its imports failed in preflight)


@dataclass
class Part:
    name: str
    what: str
    budget_s: int  # the most this part may take (less when less is left)
    kind: str = "rows"  # "rows" (jobs), "wheels", "tests", "script" (a command writing one JSON file)
    jobs: list[Job] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # "tests" / "script": the command
    beside: list[str] = field(default_factory=list)  # "tests": the csrc gate, run at the same time (`--out` added)


def _python() -> str:
    return sys.executable or "python3"


def _bench_job(part: str, provider: str, ops: tuple[str, ...], preset: str, common: list[str],
               row_limit: float | None) -> Job:  # fmt: skip
    keys = bench_keys(part, provider, ops, preset)
    lost = {k: {"op": op, "provider": provider, "shape": shape.as_dict(), "shape_label": shape.label,
                "impl": "", "parity": None, "time": None, "memory": None} for k, op, shape in keys}  # fmt: skip
    argv = ["bench", "--provider", provider, "--ops", ",".join(ops), "--shapes", preset, *common]
    return Job(provider, argv, [k for k, _, _ in keys], row_limit or ROW_LIMITS.get(provider, ROW_LIMIT_S), lost,
               provider=None if provider == FLOOR else provider)  # fmt: skip


def _interleaved_job(part: str, providers: tuple[str, ...], ops: tuple[str, ...], preset: str, common: list[str],
                     row_limit: float | None) -> Job:  # fmt: skip
    """One process timing the floor and `providers` in turns per op and shape (session_worker.job_interleaved);
    its rows have the keys each provider's own job would give them. A row's limit applies to each gate and
    each timed call of its provider (they are announced by key): each provider's own (ROW_LIMITS), so that a
    provider that hangs costs its limit, not the slowest compiler's (liger-chunked-tuned: 150 s); `row_limit`
    (--row-limit) sets them all."""
    keys = interleaved_keys(part, providers, ops, preset)
    lost = {k: {"op": op, "provider": k.split("|")[2], "shape": shape.as_dict(), "shape_label": shape.label,
                "impl": "", "parity": None, "time": None, "memory": None} for k, op, shape in keys}  # fmt: skip
    argv = ["interleaved", "--providers", ",".join(providers), "--ops", ",".join(ops), "--shapes", preset, *common]
    limit = row_limit or max(ROW_LIMITS.get(p, ROW_LIMIT_S) for p in providers)
    key_limits = {} if row_limit else {k: ROW_LIMITS.get(k.split("|")[2], ROW_LIMIT_S) for k, _, _ in keys}
    return Job("interleaved: " + ", ".join(providers), argv, [k for k, _, _ in keys], limit, lost,
               key_limits=key_limits)  # fmt: skip


def plan(rehearsal: bool, row_limit: float | None = None, call: int = 1) -> list[Part]:
    """Every part of the session, in priority order, with its budget. One call runs them in order while
    its budget lasts; a later call (--resume) skips every row already measured and goes on. The rows of
    the "schedules" and "opt-in" parts belong to the headline (same shape, same floor, one report)."""
    timing = ["--warmup", "1", "--iters", "2"] if rehearsal else ["--warmup", "2", "--iters", "5"]
    headline_timing = ["--warmup", "1", "--iters", "3"] if rehearsal else HEADLINE_TIMING
    sweep_trl_timing = ["--warmup", "1", "--iters", "2"] if rehearsal else SWEEP_TRL_TIMING
    sweep_timing = ["--warmup", "1", "--iters", "2"] if rehearsal else ["--warmup", "1", "--iters", "3"]
    flag = ["--rehearsal"] if rehearsal else []
    head, sweep, trl_sweep = ("tiny", "tiny", "tiny") if rehearsal else ("qwen3-8b", "session-sweep", "trl-sweep")
    headline = REHEARSAL_HEADLINE if rehearsal else HEADLINE_PROVIDERS
    others = REHEARSAL_SCHEDULES_PROVIDERS if rehearsal else SCHEDULE_PROVIDERS
    opt_in = REHEARSAL_OPT_IN if rehearsal else opt_in_providers()
    schedules = REHEARSAL_SCHEDULES if rehearsal else core_schedules()
    sweepers = REHEARSAL_SWEEP if rehearsal else SWEEP_PROVIDERS
    opt_in_schedules = () if rehearsal else OPT_IN_SCHEDULES

    def common(part: str, t=timing) -> list[str]:
        return ["--part", part, *t, *flag]

    def rows(name, what, budget, jobs):
        return Part(name, what, budget, "rows", jobs)

    def bench(part_of_rows: str, providers, ops=HEADLINE_OPS, preset=head, t=timing):
        return [_bench_job(part_of_rows, p, ops, preset, common(part_of_rows, t), row_limit) for p in providers]

    every = (*headline, *others, *opt_in)
    return [
        Part("wheels", "install the carried peer wheels (.whl/) one by one into a private folder", 20, "wheels"),
        # importing every provider's modules takes ~10-20 s on a GPU machine, longer on a loaded CPU
        rows("preflight", "versions, GPU and peaks, each provider's imports, profilers", 90 if rehearsal else 40,
             [Job("preflight", ["preflight", "--providers", ",".join(every), "--call-key", f"call{call}",
                               "--import-timeout", "80" if rehearsal else "30", *common("preflight")],
                  [f"preflight|call{call}"], 90 if rehearsal else 60)]),
        # (a rehearsal's headline imports TRL in each of its processes and may restart after a planted fault)
        # every kernel path against the fp32 reference, first: a failure is named there and stops nothing
        Part("gpu-tests", f"GPU test tier: {', '.join(GPU_TEST_FILES)} (each config named; stops nothing)",
             GPU_TESTS_BUDGET_S, "tests",
             command=[_python(), "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *_test_workers(rehearsal),
                      *[str(ROOT / "tests" / f) for f in GPU_TEST_FILES]],
             beside=[] if rehearsal else [_python(), str(ROOT / "benchmarks" / "gpu" / "csrc_check.py"), "--gate"]),
        rows("headline", f"{' + '.join(HEADLINE_ORDER)} at {head}: the floor and {', '.join(headline)} in one "
             f"process, timed in turns ({headline_timing[-1]} calls each; the verdict, rewritten after each shape)",
             240 if rehearsal else HEADLINE_BUDGET_S,
             [_interleaved_job("headline", (FLOOR, *headline), HEADLINE_ORDER, head,
                               common("headline", headline_timing), row_limit)]),
        # ours against TRL over 4k-32k tokens, in turns with the floor (rows of the sweep's report)
        rows("sweep-trl", f"fused_grpo over {trl_sweep}: the floor, {', '.join(SWEEP_TRL_PROVIDERS)} in turns",
             120 if rehearsal else SWEEP_TRL_BUDGET_S,
             [_interleaved_job("sweep", (FLOOR, *SWEEP_TRL_PROVIDERS), ("fused_grpo",), trl_sweep,
                               common("sweep", sweep_trl_timing), row_limit)]),
        # where the GPU waits in one call of ours at the target: session.json's "trace"
        Part("trace", "the idle gaps between the kernels of one fused_linear_grpo_loss call at the target and "
             "what the host did meanwhile (benchmarks/gpu/trace_gaps.py)", TRACE_BUDGET_S, "script",
             command=[_python(), str(ROOT / "benchmarks" / "gpu" / "trace_gaps.py")]),
        # csrc/'s kernel A: its checks, then its timing (one JSON, session.json's "csrc"); on a CPU rehearsal skipped
        Part("csrc", "csrc/ CUTLASS sm_90a kernels: A checked against the fp32 reference (small head, target head), "
             "then timed against one cuBLAS GEMM; C (the backward's dz GEMMs) checked against its spec, then timed "
             "against the two cuBLAS GEMMs, interleaved (benchmarks/gpu/csrc_check.py)", CSRC_BUDGET_S,
             "script",
             command=[_python(), str(ROOT / "benchmarks" / "gpu" / "csrc_check.py")]),
        rows("step", "a GRPO training step, stock against grpo_kernels (TRL 1.16 and the reference trainer; "
             f"{'tiny Qwen3, 2 steps, planted memory limit' if rehearsal else 'Qwen3-1.7B full, Qwen3-8B LoRA'}): "
             "time split, peak memory, tokens/s, then the memory walls", STEP_BUDGET_S,
             [Job("step", ["step", *common("step")], step_keys(rehearsal), row_limit or STEP_ROW_LIMIT_S)]),
        rows("smoke", f"kernel A, backward, loss head, schedules {', '.join(schedules)} vs the PyTorch "
             "backend (bf16), small then target shape; stops at the first wrong", 45,
             [Job("smoke", ["smoke", "--schedules", ",".join(schedules), *common("smoke")],
                  smoke_keys("smoke", schedules, False, rehearsal), row_limit or SMOKE_ROW_LIMIT_S)]),
        rows("micro", "per-kernel microbenchmarks (core kernels, cuBLAS at the same shapes, ceilings)", 30,
             [Job("micro", ["micro", *common("micro")], micro_keys("micro", False), row_limit or ROW_LIMIT_S)]),
        rows("schedules", f"the other schedules and PyTorch at {head}: {', '.join(others)}", 70,
             bench("headline", others)),
        rows("sweep", f"fused_grpo over {sweep}: floor, {', '.join(sweepers)}", 70,
             bench("sweep", (FLOOR, *sweepers), ("fused_grpo",), sweep, sweep_timing)),
        rows("opt-in-kernels", "microbenchmarks of the opt-in kernels (TMA kernel A, dz-in-GEMM)", 30,
             [Job("micro-opt-in", ["micro", "--opt-in", *common("opt-in-kernels")],
                  micro_keys("opt-in-kernels", True), row_limit or ROW_LIMIT_S)]),
        rows("smoke-opt-in", f"TMA kernel A{''.join(', schedule=' + s for s in opt_in_schedules)} vs the "
             "PyTorch backend (bf16); stops at the first wrong", 40,
             [Job("smoke-opt-in", ["smoke", "--opt-in", "--schedules", ",".join(opt_in_schedules),
                                   *common("smoke-opt-in")],
                  smoke_keys("smoke-opt-in", opt_in_schedules, True, rehearsal), row_limit or SMOKE_ROW_LIMIT_S)]),
        rows("opt-in", f"the opt-in paths and the other peers at {head}: {', '.join(opt_in)}", 120,
             bench("headline", opt_in)),
        rows("profile", "torch.profiler of the fused loss (auto) at the target; ncu on its 3 hottest kernels, nsys", 60,
             [Job("profile", ["profile", *common("profile")], profile_keys("profile"), row_limit or 150)]),
    ]  # fmt: skip


def _test_workers(rehearsal: bool) -> list[str]:
    """pytest-xdist's workers for the GPU tier where it is installed (the GPU image has it): the kernels'
    specialisations compile in parallel, one process each (each its own CUDA context). `-v`: every test's
    outcome is a line of log.txt as it ends, so a tier cut at its limit still names what passed and failed."""
    import importlib.util

    return [] if rehearsal or importlib.util.find_spec("xdist") is None else ["-n", "8"]


def file_list() -> list[str]:
    # the sweep's plot is drawn below the headline's in headline.png; the step report is session.json's "step"
    files = ["session.json", "log.txt", "results.jsonl", "verdict.json", "headline.json", "headline.png",
             "kernels.png", "step.png"]  # fmt: skip
    assert len(files) <= MAX_FILES, files
    return files


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------


class _Gate:
    """The csrc gate: a command (its JSON at `--out`, rewritten after each phase) run in its own process group
    beside the test tier, killed at `limit` seconds by a thread of its own, which then writes the verdict into the
    JSON (`"verdict"`: what the tier's csrc tests wait for) and keeps it for `verdict()`."""

    def __init__(self, command: list[str], out: Path, limit: float, env: dict):
        self.out, self.limit = out, limit
        out.unlink(missing_ok=True)
        self.log = out.with_suffix(".log")
        self.start = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command + ["--out", str(out)], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self._verdict: dict | None = None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            code, killed = self.proc.wait(timeout=self.limit), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            code, killed = self.proc.wait(), True
        try:
            data = json.loads(self.out.read_text())
        except (OSError, ValueError):
            data = {}
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log.exists() else []
        verdict = gate_verdict(data, code, killed, self.limit, tail)
        verdict["seconds"] = round(time.monotonic() - self.start, 1)
        _write_json(self.out, {**data, "verdict": verdict})
        self._verdict = {**verdict, "checks": data.get("gate")}  # each case's worst element, into session.json

    def verdict(self) -> dict:
        self.thread.join()
        assert self._verdict is not None
        return self._verdict


def gate_verdict(data: dict, code: int | None, killed: bool, limit: float, tail: list[str]) -> dict:
    """The csrc gate's outcome from its JSON and its end: ok, wrong (the failing cases named), not loaded (the
    loader's reason), crashed (a CUDA fault, a signal, or an error the library returned: its last lines), hung
    (killed at its limit, in the phase after the last one it saved), or inconclusive (the gate's own Python
    failed: nothing learnt of the kernels, so nothing is skipped)."""
    phase = data.get("phase", "starting")
    if killed:
        return {"status": "hung", "reason": f"not done within {limit:.0f} s (the last phase it finished: {phase})"}
    if code != 0 or "loaded" not in data:
        said = f"{_exit_text(code)} after phase {phase}: {' | '.join(tail)[-300:]}"
        text = " ".join(tail)
        kernel = code is None or code < 0 or _poisoned(text) or "RuntimeError: csrc " in text
        return {"status": "crashed" if kernel else "inconclusive", "reason": said}
    if not data["loaded"]:
        return {"status": "not loaded", "reason": str(data.get("why_not"))}
    if data.get("gate_ok"):
        return {"status": "ok", "reason": f"{len(data.get('gate', []))} checks"}
    wrong = [r.get("case", "?") for r in data.get("gate", []) if not r.get("ok")]
    checks = len(data.get("gate", []))
    return {"status": "wrong", "reason": f"{len(wrong)} of {checks} checks: {', '.join(wrong)[:300]}"}


class Session:
    """One call of the session: the parts in order while the budget lasts, every row on disk as it is
    measured, the verdict rewritten after each headline row. With `resume` (the results folder of an
    earlier call, copied back into the tree), every row measured there is kept and skipped."""

    def __init__(self, out: Path, budget_s: float, rehearsal: bool, row_limit: float | None = None,
                 parts: list[Part] | None = None, resume: Path | None = None):  # fmt: skip
        self.out = out
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.rehearsal = rehearsal
        self.results = out / "results.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        earlier = _earlier_session(resume) if resume is not None else None
        self.call = 1 + len(earlier["calls"]) if earlier else 1
        if resume is not None and resume.resolve() != out.resolve():
            for name in ("results.jsonl", "log.txt"):  # the whole session in one folder
                if (resume / name).exists():
                    shutil.copyfile(resume / name, out / name)
        self.parts = parts if parts is not None else plan(rehearsal, row_limit, self.call)
        self.site = Path(tempfile.gettempdir()) / "grpo_kernels_session_site"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(self.site), *([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])]
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.source = _source_info()
        if self.source.get("sha"):
            self.env["GRPO_KERNELS_GIT_SHA"] = self.source["sha"]
            if self.source.get("dirty") is not None:
                self.env["GRPO_KERNELS_GIT_DIRTY"] = "1" if self.source["dirty"] else "0"
        self.this_call = {
            "call": self.call,
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "source": self.source,
            "environment": _environment(),
            "parts": [],
        }
        self.record = {
            "schema": SCHEMA,
            "rehearsal": rehearsal,
            "plan": [_planned(p) for p in self.parts],
            "files": file_list(),
            "calls": [*(earlier["calls"] if earlier else []), self.this_call],
            "lost_rows": list(earlier.get("lost_rows", [])) if earlier else [],
            "wheels": {},
            "skipped_providers": {},
            "verdict": earlier.get("verdict") if earlier else None,
            "step": earlier.get("step") if earlier else None,  # the step report (step.py), kept across calls
            "csrc": earlier.get("csrc") if earlier else None,  # csrc_check.py's JSON, kept across calls
            "csrc_gate": earlier.get("csrc_gate") if earlier else None,  # the gate's verdict, kept across calls
        }
        self._apply_csrc_gate()
        self.log = open(out / "log.txt", "a", buffering=1)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        _write_json(self.out / "session.json", self.record)

    def run(self) -> int:
        resumed = f", resuming {len(self.done_keys())} row(s) measured before" if self.call > 1 else ""
        self.say(f"grpo_kernels GPU session, call {self.call}: budget {self.budget_s:.0f} s, results in "
                 f"{self.out}{resumed}")  # fmt: skip
        self.save()
        stop_reason = None
        for part in self.parts:
            limit = min(part.budget_s, self.left() - RESERVE_S)
            entry: dict = {"name": part.name, "status": "skipped", "seconds": 0.0}
            self.this_call["parts"].append(entry)
            if part.kind != "wheels" and self._measured(part):
                entry.update(status="done", reason="every row measured already (an earlier call, or an earlier part)")
                self.say(f"[{part.name}] done earlier")
                continue
            if stop_reason or limit < MIN_PART_S:
                entry["reason"] = stop_reason or f"out of time ({self.left():.0f} s left of the budget)"
                self.say(f"[{part.name}] skipped: {entry['reason']}")
                self.save()
                continue
            self.say(f"[{part.name}] {part.what} (limit {limit:.0f} s)")
            entry.update(status="running", limit_s=round(limit))  # what a killed session.json shows
            self.save()
            t0 = time.monotonic()
            {"wheels": self._wheels, "tests": self._tests, "rows": self._rows, "script": self._script}[part.kind](
                part, entry, limit)
            entry["seconds"] = round(time.monotonic() - t0, 1)
            self._outputs(part, entry)
            self.say(f"[{part.name}] {entry['status']} in {entry['seconds']:.0f} s")
            self.save()
            if part.name == "preflight":
                self._read_preflight()
                if not self.rehearsal and not self._on_gpu():
                    stop_reason = "no CUDA device (see the preflight row): nothing else can run"
        self._write_verdict()
        self.this_call["seconds"] = round(time.monotonic() - self.start, 1)
        self.save()
        self.say(closing_summary(self.record, read_rows(self.results), self.out))
        self.log.close()
        failed = [p["name"] for p in self.this_call["parts"] if p["status"] not in ("ok", "skipped", "done")]
        return 1 if failed else 0

    def _measured(self, part: Part) -> bool:
        """Every row of the part is in the results (measured, lost or skipped by an earlier call)."""
        done = self.done_keys()
        if part.kind in ("tests", "script"):
            return f"{part.name}|{part.kind}" in done
        keys = [k for j in part.jobs for k in j.keys]
        return bool(keys) and all(k in done for k in keys)

    def _on_gpu(self) -> bool:
        """False only when this call's preflight saw no CUDA device (a lost preflight row stops nothing)."""
        row = self._preflight_row()
        return row is None or bool(row.get("cuda_available"))

    def _preflight_row(self) -> dict | None:
        rows = [r for r in read_rows(self.results)
                if r.get("kind") == "preflight" and r.get("key") == f"preflight|call{self.call}"]  # fmt: skip
        return rows[-1] if rows and rows[-1].get("status") == "ok" else None

    def _read_preflight(self) -> None:
        """Providers whose modules did not import here are skipped, each with its reason."""
        row = self._preflight_row()
        for provider, status in ((row or {}).get("providers") or {}).items():
            if status != "ok":
                self.record["skipped_providers"][provider] = status
        for wheel, status in self.record["wheels"].items():
            if status != "ok":
                for provider in _wheel_providers(wheel):
                    self.record["skipped_providers"].setdefault(provider, f"its wheel {wheel} did not install: {status}")

    # -- child processes --------------------------------------------------------------------------

    def watch(self, command: list[str], row_limit: float, deadline: float, rows: bool = True, on_row=None,
              env: dict | None = None, key_limits: dict | None = None):  # fmt: skip
        """Run a command, echoing its output; kill its process group at the deadline and, for a worker
        (`rows`), when a row outlasts its limit (`key_limits`' entry for its key, else row_limit) or no row
        starts for STARTUP_LIMIT_S. `on_row` runs (in this thread) after each row the worker finishes. Returns
        (exit code or None if killed, the key in flight, why it was killed, its last lines)."""
        key_limits = key_limits or {}
        proc = subprocess.Popen(command, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        state = {"key": None, "since": time.monotonic(), "tail": collections.deque(maxlen=15), "ended": 0}

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("@@start "):
                    state["key"], state["since"] = line[8:], time.monotonic()
                elif line.startswith("@@end "):
                    state["key"], state["since"] = None, time.monotonic()
                    state["ended"] += 1
                else:
                    state["tail"].append(line)
                    self.say("  " + line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        why, seen = None, 0
        while proc.poll() is None:
            now = time.monotonic()
            if on_row is not None and state["ended"] != seen:
                seen = state["ended"]
                on_row()
            limit = key_limits.get(state["key"], row_limit)
            if state["key"] is not None and now - state["since"] > limit:
                why = f"timeout: the row ran past its limit of {limit:.0f} s"
            elif rows and state["key"] is None and now - state["since"] > STARTUP_LIMIT_S:
                why = f"timeout: no row started within {STARTUP_LIMIT_S} s"
            elif now > deadline:
                why = "timeout: the part's time limit"
            if why:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the worker's own children too
                break
            time.sleep(0.1)
        code = proc.wait()
        reader.join(timeout=10)
        if on_row is not None and state["ended"] != seen:
            on_row()
        return (None if why else code), state["key"], why, list(state["tail"])

    def done_keys(self) -> set[str]:
        return {r["key"] for r in read_rows(self.results) if r.get("key") and r.get("kind") != "meta"}

    def lose(self, part: Part, job: Job, key: str, status: str, reason: str) -> None:
        kind = _row_kind(job)
        row = {"kind": kind, "part": _row_part(job), "key": key, **job.lost_fields.get(key, {}), "status": status,
               "reason": reason}  # fmt: skip
        append(self.results, row)
        lost = {"call": self.call, "part": part.name, "job": job.label, "key": key, "status": status, "reason": reason}
        self.record["lost_rows"].append(lost)
        self.say(f"  LOST {key}: {status}: {reason}")
        provider = job.lost_fields.get(key, {}).get("provider", job.provider)
        its_own = status == "crashed" or reason.startswith("timeout: the row ran past")  # not the part's clock
        if provider in CSRC_PROVIDERS and its_own:  # one library: the other csrc providers would fail the same way
            said = "hung" if status == "timeout" else "crashed"
            self.record["csrc_gate"] = {"status": said, "reason": f"{key}: {reason}"[:400], "where": "a row"}
            self._apply_csrc_gate()

    def skip_job(self, job: Job, keys: list[str], reason: str) -> None:
        """The rows of a provider that cannot run here, recorded as skipped with the reason (the verdict and
        the report name it) instead of being attempted."""
        for key in keys:
            append(self.results, {"kind": _row_kind(job), "part": _row_part(job), "key": key,
                                  **job.lost_fields.get(key, {}), "status": "skipped", "reason": reason})  # fmt: skip
        self.say(f"  {job.label}: skipped ({reason})")

    def run_job(self, part: Part, job: Job, entry: dict, deadline: float) -> None:
        on_row = self._write_verdict if part.kind == "rows" and _row_part(job) in VERDICT_PARTS else None
        while True:
            done = self.done_keys()
            remaining = [k for k in job.keys if k not in done]
            if not remaining:
                return
            if job.provider in self.record["skipped_providers"]:
                self.skip_job(job, remaining, f"skipped here: {self.record['skipped_providers'][job.provider]}")
                if on_row:
                    on_row()
                return
            if job.argv[0] == "interleaved":  # the rows of a provider that cannot run here: skipped, the rest go on
                skipped = self.record["skipped_providers"]
                for name in dict.fromkeys(k.split("|")[2] for k in remaining if k.split("|")[2] in skipped):
                    self.skip_job(job, [k for k in remaining if k.split("|")[2] == name],
                                  f"{name} skipped here: {skipped[name]}")  # fmt: skip
                remaining = [k for k in remaining if k.split("|")[2] not in skipped]
                if not remaining:
                    return
            if deadline - time.monotonic() < 3:
                entry.setdefault("not_run", []).extend(remaining)
                return
            command = [_python(), "-m", "grpo_kernels.bench.session_worker", *job.argv, "--jsonl", str(self.results),
                       "--only", ",".join(remaining)]  # fmt: skip
            if job.argv[0] == "interleaved":  # it fits its timed rounds into what is left of the part
                command += ["--deadline", f"{time.time() + deadline - time.monotonic():.1f}"]
            code, key, why, tail = self.watch(command, job.row_limit_s, deadline, on_row=on_row,
                                              key_limits=job.key_limits)  # fmt: skip
            if code == STOPPED:
                entry["stopped"] = job.label
                entry.setdefault("not_run", []).extend(k for k in job.keys if k not in self.done_keys())
                return
            if key is None and why is None and code in (0, RESTART):
                left = [k for k in remaining if k not in self.done_keys()]
                if left and len(left) == len(remaining):  # a process that measured nothing: not again
                    entry.setdefault("not_run", []).extend(left)
                    return
                continue  # done, or a fresh process for the rest (RESTART: its CUDA context was poisoned)
            # killed or crashed: the row in flight is lost (the first one left when none had started)
            status = "timeout" if why else "crashed"
            detail = why or f"the process died ({_exit_text(code)})"
            if tail:
                detail += "; last output: " + " | ".join(tail[-3:])[-500:]
            left = [k for k in remaining if k not in self.done_keys()]
            if key is None and not left:  # killed after its last row (on its way out): nothing lost
                return
            self.lose(part, job, key or left[0], status, detail)
            if on_row:
                on_row()
            if why == "timeout: the part's time limit":
                entry.setdefault("not_run", []).extend(k for k in job.keys if k not in self.done_keys())
                return

    # -- parts ------------------------------------------------------------------------------------

    def _rows(self, part: Part, entry: dict, limit: float) -> None:
        deadline = time.monotonic() + limit
        for job in part.jobs:
            self.run_job(part, job, entry, deadline)
        keys = {k for j in part.jobs for k in j.keys}
        rows = [r for r in read_rows(self.results) if r.get("key") in keys and r.get("kind") != "meta"]
        counts = collections.Counter(r.get("status", "?") for r in rows)
        entry["rows"] = dict(counts)
        entry["lost"] = [r["key"] for r in self.record["lost_rows"]
                         if r["part"] == part.name and r.get("call") == self.call]  # fmt: skip
        if entry.get("stopped"):
            first = next((r for r in rows if r.get("status") not in ("ok", "skipped")), None)
            entry.update(status="stopped", reason=f"first wrong: {first['key']}" if first else "stopped")
            if first:
                entry["report"] = first.get("report") or first.get("reason")
        elif entry["lost"] or entry.get("not_run"):
            entry["status"] = "partial"
        elif any(s in counts for s in ("error", "wrong", "parity-failed", "oom")):
            entry["status"] = "ok-with-errors"  # measured; the rows say which provider failed and why
        else:
            entry["status"] = "ok"
        if part.name in ("headline", "sweep-trl", "schedules", "sweep", "opt-in"):
            entry["summary"] = summarize({"results": [r for r in rows if r.get("kind") == "bench"]})

    def _wheels(self, part: Part, entry: dict, limit: float) -> None:
        """Each carried wheel on its own: one that does not install costs its providers only."""
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if self.rehearsal:  # cp312 wheels for the GPU image; the rehearsal runs on this environment's packages
            entry.update(status="skipped", reason="rehearsal: this environment's own packages")
            return
        if not wheels:
            entry.update(status="skipped", reason="no .whl/ folder carried: peers absent here are skipped")
            return
        deadline = time.monotonic() + limit
        for wheel in wheels:
            command = [_python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--no-cache-dir", "--upgrade", "--target", str(self.site), str(wheel)]  # fmt: skip
            left = deadline - time.monotonic()
            if left < 1:
                self.record["wheels"][wheel.name] = "not installed: the part's time limit"
                continue
            code, _, why, tail = self.watch(command, left, deadline, rows=False)
            self.record["wheels"][wheel.name] = "ok" if code == 0 else (
                why or f"pip exit status {code}: {' | '.join(tail[-2:])[-300:]}")  # fmt: skip
        failed = [w for w, s in self.record["wheels"].items() if s != "ok"]
        entry.update(wheels=dict(self.record["wheels"]), status="partial" if failed else "ok")

    def _tests(self, part: Part, entry: dict, limit: float) -> None:
        junit = Path(tempfile.gettempdir()) / f"grpo_kernels_gpu_tests_{os.getpid()}.xml"
        junit.unlink(missing_ok=True)
        self.log.flush()
        start = (self.out / "log.txt").stat().st_size
        env, gate = self.env, None
        if part.beside and not (self.record.get("csrc_gate") or {}).get("status"):  # not judged in an earlier call
            gate = _Gate(part.beside, Path(tempfile.gettempdir()) / f"grpo_kernels_csrc_gate_{os.getpid()}.json",
                         min(CSRC_GATE_LIMIT_S, limit), self.env)  # fmt: skip
            env = {**self.env, CSRC_GATE_ENV: str(gate.out)}
            self.say(f"  the csrc gate, beside the tier (limit {gate.limit:.0f} s): {' '.join(part.beside[1:])}")
        code, _, why, _ = self.watch(
            part.command + [f"--junitxml={junit}"], limit, time.monotonic() + limit, rows=False, env=env
        )
        if gate is not None:
            verdict = self.record["csrc_gate"] = entry["csrc_gate"] = gate.verdict()
            self.say(f"  the csrc gate: {verdict['status']}: {verdict['reason']}")
            self._apply_csrc_gate()
        entry["tests"] = _junit_summary(junit)
        if entry["tests"]["counts"] is None:  # cut at its limit (no junit): the outcomes its -v lines gave
            self.log.flush()
            with open(self.out / "log.txt", "rb") as f:
                f.seek(start)
                entry["tests"] = _verbose_summary(f.read().decode(errors="replace"))
        if why:
            entry["status"] = "timeout"
        elif code == 0:
            entry["status"] = "ok"
        else:
            entry.update(status="failed", reason=f"pytest exit code {code}")
        if not why:  # the tier ran to its end: a resumed call does not run it again
            append(self.results, {"kind": "tests", "part": part.name, "key": f"{part.name}|tests",
                                  "status": entry["status"], "tests": entry["tests"]})  # fmt: skip

    def _apply_csrc_gate(self) -> None:
        """A csrc gate that did not pass (this call's or an earlier one's) skips every csrc provider, with why."""
        gate = self.record.get("csrc_gate") or {}
        if gate.get("status") in CSRC_GATE_SKIPS:
            for name in CSRC_PROVIDERS:
                self.record["skipped_providers"][name] = f"the csrc gate: {gate['status']}: {gate['reason']}"

    def _script(self, part: Part, entry: dict, limit: float) -> None:
        """A command that writes one JSON file (`--out`), rewritten as it goes: its content lands in
        session.json under the part's name, whatever the command's end (a cut keeps what it measured)."""
        if self.rehearsal:  # csrc_check needs a Hopper GPU, the trace a CUDA one: the rehearsal checks the flow
            entry.update(status="skipped", reason="rehearsal: needs a GPU")
            return
        gate = self.record.get("csrc_gate") or {}
        if part.name == "csrc" and gate.get("status") in CSRC_GATE_STOPS:  # its time goes to the next part
            entry.update(status="skipped", reason=f"the csrc gate {gate['status']}: {gate['reason']}")
            append(self.results, {"kind": part.kind, "part": part.name, "key": f"{part.name}|{part.kind}",
                                  "status": "skipped", "reason": entry["reason"]})  # fmt: skip
            return
        result = Path(tempfile.gettempdir()) / f"grpo_kernels_{part.name}_{os.getpid()}.json"
        result.unlink(missing_ok=True)
        code, _, why, tail = self.watch(part.command + ["--out", str(result)], limit, time.monotonic() + limit,
                                        rows=False)  # fmt: skip
        try:
            self.record[part.name] = json.loads(result.read_text())
        except (OSError, ValueError) as e:
            self.record[part.name] = {"error": f"no readable result: {e}"}
        if why:
            entry.update(status="timeout", reason=why)
        elif code == 0:
            entry["status"] = "ok"
        else:
            entry.update(status="failed", reason=f"exit code {code}: {' | '.join(tail[-2:])[-300:]}")
        if not why:  # ran to its end: a resumed call does not run it again
            append(self.results, {"kind": part.kind, "part": part.name, "key": f"{part.name}|{part.kind}",
                                  "status": entry["status"]})  # fmt: skip

    # -- result files -----------------------------------------------------------------------------

    def _write_verdict(self) -> None:
        """verdict.json and headline.json from every row on disk now (after each headline row, so that a
        later fault or kill keeps the verdict of the rows measured before it)."""
        rows = read_rows(self.results)
        report = assemble(rows, ("headline", "sweep"), self.record["calls"])
        if report is not None:
            _write_json(self.out / "headline.json", report)
        self.record["verdict"] = verdict_of(report, self.record.get("skipped_providers", {}))
        _write_json(self.out / "verdict.json", self.record["verdict"])
        self.save()

    def _outputs(self, part: Part, entry: dict) -> None:
        """Rewrite the benchmark report and redraw the plots the part feeds (a failed plot never loses
        the JSON)."""
        rows = read_rows(self.results)
        try:
            if part.name == "step":  # the step report in session.json (8 files at most), its plot in step.png
                from .step import plot as step_plot
                from .step import report as step_report

                self.record["step"] = step_report([r for r in rows if r.get("key", "").startswith(("step|", "wall|"))],
                                                  self.this_call["environment"], self.source)  # fmt: skip
                step_plot(self.record["step"], self.out / "step.png")
                entry["files"] = ["session.json", "step.png"]
                return
            if part.name in ("micro", "opt-in-kernels"):  # one plot of every micro row so far
                if kernels_plot(rows, self.out / "kernels.png", self.this_call["environment"], self.source):
                    entry["files"] = ["kernels.png"]
                return
            if part.name not in ("headline", "sweep-trl", "schedules", "sweep", "opt-in"):
                return
            self._write_verdict()
            report = assemble(rows, ("headline", "sweep"), self.record["calls"])
            if report is None:
                return
            entry["files"] = ["verdict.json", "headline.json"]
            # one figure: the headline's panels, the sweep's below them once it has rows (8 files at most)
            headline_plot(report, self.out / "headline.png", "headline")
            if any(r.get("part") == "sweep" for r in report["results"]):
                sweep = self.out / "sweep.tmp.png"
                sweep_plot(report, sweep)
                _stack_pngs([self.out / "headline.png", sweep], self.out / "headline.png")
                sweep.unlink()
            entry["files"].append("headline.png")
        except Exception as exc:  # noqa: BLE001 - a plot must not stop the session
            entry["plot_error"] = f"{type(exc).__name__}: {exc}"


def _stack_pngs(paths: list[Path], out: Path) -> None:
    """The images one above the other (left-aligned, white behind the narrower) into `out`."""
    from PIL import Image

    images = [Image.open(p).convert("RGB") for p in paths]
    canvas = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for image in images:
        canvas.paste(image, (0, y))
        y += image.height
    canvas.save(out)


def _row_kind(job: Job) -> str:
    """The kind of a job's rows (an interleaved job's are bench rows, as each provider's own job would write)."""
    return "bench" if job.argv[0] == "interleaved" else job.argv[0]


def _row_part(job: Job) -> str:
    """The part a job's rows belong to (its worker's --part)."""
    return job.argv[job.argv.index("--part") + 1] if "--part" in job.argv else job.label


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _earlier_session(folder: Path) -> dict:
    """The session.json of an earlier call's results folder (its calls, lost rows and verdict)."""
    path = folder / "session.json"
    if not (folder / "results.jsonl").exists():
        raise SystemExit(f"--resume {folder}: no results.jsonl there (the folder of an earlier call's files)")
    if not path.exists():
        return {"calls": [{"call": 1, "note": "session.json missing: results.jsonl only"}]}
    data = json.loads(path.read_text())
    if "calls" not in data:  # a call of the two-call plan (schema 2): one call
        data = {"calls": [{k: data.get(k) for k in ("call", "started", "budget_s", "source", "environment", "parts")}],
                "lost_rows": data.get("lost_rows", []), "verdict": data.get("verdict")}  # fmt: skip
    return data


def _wheel_providers(wheel: str) -> list[str]:
    """The providers a carried wheel serves (by its distribution; a dependency by the peer that needs it)."""
    from .providers import REGISTRY

    dist = wheel.split("-")[0].lower().replace("_", "-")
    dist = WHEEL_NEEDED_BY.get(dist.replace("-", "_"), WHEEL_NEEDED_BY.get(dist, dist))
    return [name for name, p in REGISTRY.providers.items() if (p.dist or "").lower() == dist]


def _planned(part: Part) -> dict:
    jobs = [{"label": j.label, "rows": len(j.keys), "row_limit_s": j.row_limit_s} for j in part.jobs]
    return {"name": part.name, "what": part.what, "budget_s": part.budget_s, "jobs": jobs}


def _exit_text(code: int | None) -> str:
    if code is None:
        return "killed"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def assemble(rows: list[dict], parts: tuple[str, ...], calls: list[dict] | None = None) -> dict | None:
    """The benchmark report (the schema of `python -m benchmarks`' JSON) of the bench rows of `parts`,
    with the ratios to the floor and to grpo_kernels per (part, op, shape). `calls` (session.json's): the
    report's git is the source the last call verified (the rows' own may be a GPU machine's older git),
    every call's listed in `sources`."""
    from .ops import OPS, compulsory_bytes, op_flops
    from .shapes import BenchShape

    bench = [r for r in rows if r.get("kind") == "bench" and r.get("part") in parts]
    metas = [r["report"] for r in rows if r.get("kind") == "meta" and r.get("part") in parts]
    if not bench or not metas:
        return None
    report = {**metas[0], "settings": {**metas[0]["settings"]}}
    report["settings"]["providers"] = list(dict.fromkeys(r["provider"] for r in bench))
    report["settings"]["ops"] = list(dict.fromkeys(r["op"] for r in bench))
    report["settings"]["presets"] = list(dict.fromkeys(p for m in metas for p in m["settings"]["presets"]))
    results = [{k: v for k, v in r.items() if k not in ("kind", "key")} for r in bench]
    groups = collections.defaultdict(list)
    for r in results:
        groups[(r["part"], r["op"], r["shape"]["tokens"])].append(r)
    for (_, op, _), group in groups.items():
        timed = {r["provider"]: r for r in group if r.get("time")}
        floor, ours = timed.get(FLOOR), timed.get("grpo_kernels")
        for r in group:
            if not r.get("time"):
                continue
            shape = BenchShape(**{k: v for k, v in r["shape"].items() if k != "batch"})
            seconds = r["time"]["median_ms"] * 1e-3
            r["x_floor"] = r["time"]["median_ms"] / floor["time"]["median_ms"] if floor else None
            r["ours_speedup"] = (
                r["time"]["median_ms"] / ours["time"]["median_ms"] if ours and r is not floor else None
            )
            if OPS[op].gemm_units:
                r["tflops"] = op_flops(OPS[op], shape) / seconds / 1e12
            else:
                r["gbps"] = compulsory_bytes(shape) / seconds / 1e9
    report["results"] = results
    report["skipped"] = [{"op": r["op"], "provider": r["provider"], "reason": r["reason"]}
                         for r in results if r["status"] == "skipped"]  # fmt: skip
    report["date"] = max(m["date"] for m in metas)
    sources = [c.get("source") for c in calls or [] if c.get("source") and c["source"].get("sha")]
    if sources:
        report["git"] = {"sha": sources[-1]["sha"], "dirty": sources[-1].get("dirty")}
        report["sources"] = [{"call": c.get("call"), **c["source"]} for c in calls if c.get("source")]
    return report


def _junit_summary(path: Path) -> dict:
    if not path.exists():
        return {"counts": None, "cases": []}
    root = ET.parse(path).getroot()
    cases, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                detail = (node.get("message") or "")[:300]
                break
        counts[outcome] += 1
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})  # fmt: skip
    return {"counts": counts, "cases": cases}


def _verbose_summary(text: str) -> dict:
    """pytest -v's outcome lines (plain or pytest-xdist's `[gw0] [ 5%] PASSED path::test`) as counts and
    the failed tests' names: what a tier cut at its limit leaves."""
    import re

    counts, failed = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}, []
    pattern = re.compile(r"(?:(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED))|(?:(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+))")
    for line in text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        test, outcome = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}[outcome]
        counts[key] += 1
        if key in ("failed", "error"):
            failed.append({"test": test, "outcome": key})
    return {"counts": counts, "cases": failed, "from": "log lines (the tier was cut at its limit: no junit)"}


def summarize(report: dict) -> list[dict]:
    """One line per result row: what the verdict and a reader need."""
    rows = []
    for r in report["results"]:
        memory = r.get("memory") or {}
        rows.append({
            "op": r["op"], "tokens": r["shape"]["tokens"], "provider": r["provider"], "status": r["status"],
            "reason": r.get("reason", "")[:200],
            "median_ms": r["time"]["median_ms"] if r.get("time") else None,
            "x_floor": r.get("x_floor"), "ours_speedup": r.get("ours_speedup"),
            "extra_gib": None if not memory else memory["beyond_grads_bytes"] / 2**30,
            "paths": r.get("paths"),
        })  # fmt: skip
    return rows


def verdict_of(report: dict | None, skipped_providers: dict | None = None) -> dict:
    """The headline rows against the targets: met, missed, or not measured (never guessed). Computed from
    whatever rows exist, so a call cut short still gives the verdict of what it measured."""
    written = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if report is None:
        return {"measured": False, "why": "no headline results yet (see the parts' status)", "written": written}
    on_gpu = report["device"]["type"] == "cuda"
    result: dict = {"measured": on_gpu, "device": report["device"]["name"], "git": report.get("git"),
                    "written": written, "checks": [], "rows": []}  # fmt: skip
    if not on_gpu:  # a rehearsal: the values show the flow works; no target is judged off a GPU
        result["why"] = "not a GPU run: the targets are judged on H100 / H200 only, every 'met' is null"
    judged = {FLOOR, "grpo_kernels", *(p for g in TARGETS.values() for p in g.get("faster_than", {}))}
    for op, goals in TARGETS.items():
        # one row per provider: the largest shape measured (the target on a GPU; a rehearsal has two)
        rows = {r["provider"]: r for r in sorted(report["results"], key=lambda r: r["shape"]["tokens"])
                if r["op"] == op and r.get("part", "headline") == "headline"}  # fmt: skip
        for name in sorted(judged & set(rows), key=lambda n: (n != FLOOR, n != "grpo_kernels", n)):
            r, mem, timed = rows[name], rows[name].get("memory") or {}, rows[name].get("time") or {}
            result["rows"].append({
                "op": op, "provider": name, "status": r["status"], "reason": (r.get("reason") or "")[:200],
                **{k: timed.get(k) for k in ("median_ms", "p20_ms", "p80_ms", "iters", "timer")},
                "x_floor": r.get("x_floor"), "ours_speedup": r.get("ours_speedup"),
                "extra_gib": mem["beyond_grads_bytes"] / 2**30 if mem.get("beyond_grads_bytes") is not None else None,
                "impl": r.get("impl") or None,
            })  # fmt: skip
        ours = rows.get("grpo_kernels")
        if ours is None or not ours.get("time"):
            result["checks"].append({"op": op, "check": "grpo_kernels ran", "met": False,
                                     "value": None if ours is None else ours["status"]})  # fmt: skip
            continue
        x = ours.get("x_floor")
        result["checks"].append({"op": op, "check": f"time <= {goals['x_floor']}x the GEMM floor", "value": x,
                                 "met": None if x is None or not on_gpu else x <= goals["x_floor"],
                                 **({} if x is not None else {"why": "no floor row"})})  # fmt: skip
        if "extra_gib" in goals:
            mem = ours.get("memory")
            gib = None if not mem else mem["beyond_grads_bytes"] / 2**30
            result["checks"].append({"op": op, "check": f"extra memory <= {goals['extra_gib']} GiB", "value": gib,
                                     "met": None if gib is None or not on_gpu else gib <= goals["extra_gib"]})  # fmt: skip
        for peer, factor in goals.get("faster_than", {}).items():
            row = rows.get(peer)
            speed = row.get("ours_speedup") if row and row.get("time") else None
            why = {}
            if speed is None:
                why = {"why": row["status"] + ": " + (row.get("reason") or "")[:160] if row else
                       (f"skipped: {skipped_providers[peer]}" if peer in (skipped_providers or {}) else "not run yet")}
            what = f">= {factor}x faster than {peer}" if factor != 1.0 else f"faster than {peer}"
            result["checks"].append({"op": op, "check": what, "value": speed,
                                     "met": None if speed is None or not on_gpu else speed >= factor, **why})  # fmt: skip
    peer, factor = SWEEP_TARGET  # ours against the peer at every token count of the sweep (its own floor beside)
    sweep = {(r["shape"]["tokens"], r["provider"]): r for r in report["results"]
             if r.get("part") == "sweep" and r["op"] == "fused_grpo" and r.get("time")}  # fmt: skip
    for tokens in sorted({n for n, p in sweep if p == peer}):
        speed = sweep[(tokens, peer)].get("ours_speedup")
        result["checks"].append({"op": "fused_grpo", "check": f"faster than {peer} at {tokens} tokens (sweep)",
                                 "value": speed, "met": None if speed is None or not on_gpu else speed >= factor,
                                 **({} if speed is not None else {"why": "no grpo_kernels row at this size"})})  # fmt: skip
    return result


def slowest_kernels(rows: list[dict], count: int = 3) -> list[dict]:
    """The microbenchmark cases furthest from their ceiling measured in the same run (share of it), the
    ceiling rows themselves left out: where the next change should go."""
    cases = []
    for r in rows:
        if r.get("kind") != "micro" or r.get("status") != "ok" or r.get("case", "").startswith("ceiling"):
            continue
        tf = r.get("tflops") is not None
        share = r.get("pct_measured_tflops" if tf else "pct_measured_gbps")
        if share is None:
            continue
        cases.append({"case": r["case"], "median_ms": r.get("median_ms"), "pct_of_ceiling": share,
                      "rate": f"{r['tflops']:.0f} TF/s" if tf else f"{r.get('gbps', 0):.0f} GB/s"})  # fmt: skip
    return sorted(cases, key=lambda c: c["pct_of_ceiling"])[:count]


def closing_summary(record: dict, rows: list[dict], out: Path) -> str:
    """What the call printed last (only the end of the output comes back from the machine): the verdict
    table, the three kernels furthest from their ceilings, what was lost or not reached, how to resume."""
    lines = ["", "=" * 100, f"verdict ({(record.get('verdict') or {}).get('device', 'no device')})"]
    v = record.get("verdict") or {}
    if v.get("why"):
        lines.append(f"  {v['why']}")
    for r in v.get("rows", []):
        ms = (f"{r['median_ms']:9.2f} ms ({r['p20_ms']:.2f}-{r['p80_ms']:.2f}, {r['iters']} calls)"
              if r.get("median_ms") is not None else f"{r['status']:>12}")
        extra = f" x{r['x_floor']:.2f} floor" if r.get("x_floor") else ""
        extra += f", ours {r['ours_speedup']:.2f}x faster" if r.get("ours_speedup") and r["provider"] != "grpo_kernels" else ""
        extra += f", {r['extra_gib']:.2f} GiB extra" if r.get("extra_gib") is not None else ""
        lines.append(f"  {r['op']:<10} {r['provider']:<19} {ms}{extra}")
    for c in v.get("checks", []):
        met = {True: "MET", False: "MISSED", None: "n/a"}[c.get("met")]
        value = c.get("value")
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"  [{met:>6}] {c['op']}: {c['check']}: {shown}{'  (' + c['why'] + ')' if c.get('why') else ''}")
    tier = next((p for c in reversed(record["calls"]) for p in c["parts"] if p["name"] == "gpu-tests"
                 and p.get("tests")), None)  # fmt: skip
    if tier and tier["tests"].get("counts"):
        bad = [c["test"] for c in tier["tests"]["cases"] if c["outcome"] in ("failed", "error")]
        lines.append(f"GPU test tier ({tier['status']}): {tier['tests']['counts']}"
                     + (f"; failed: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}" if bad else ""))  # fmt: skip
    if (record.get("step") or {}).get("pairs") or (record.get("step") or {}).get("walls"):
        lines.append("training step, stock -> grpo_kernels (session.json \"step\", step.png):")
    for p in (record.get("step") or {}).get("pairs", []):  # the training step: stock -> ours, per pair
        speed = f"{p['step_speedup']:.2f}x the step speed" if p.get("step_speedup") else p["status"]
        saved = f", {p['peak_memory_saved_gib']:.1f} GiB less peak" if p.get("peak_memory_saved_gib") is not None else ""
        lines.append(f"  step {p['model']}: {p['stock']} -> {p['ours']}: {speed}{saved}")
    for w in (record.get("step") or {}).get("walls", []):
        lines.append(f"  wall {w['model']} {w['axis']} {w['side']}: fits {w.get('largest_ok')}, OOM at {w.get('smallest_oom')}")
    gate = record.get("csrc_gate")
    if gate:  # beside the test tier (or a csrc row lost in a part): whether the csrc providers ran at all
        lines.append(f"csrc gate (session.json \"csrc_gate\"): {gate['status']}: {gate['reason']}"
                     + ("; the csrc providers were skipped" if gate["status"] in CSRC_GATE_SKIPS else ""))
    csrc = record.get("csrc")
    if csrc:  # csrc/'s kernel A (csrc_check.py): its checks, then its time against one cuBLAS GEMM
        timing = (csrc.get("timing") or {}).get("summary")
        checks = csrc.get("checks") or []
        wrong = [c["case"] for c in checks if not c.get("ok")]
        said = (f"{len(checks) - len(wrong)}/{len(checks)} checks ok" + (f" (wrong: {', '.join(wrong)})" if wrong else "")
                if checks else f"not checked ({csrc.get('why_not') or csrc.get('error') or 'cut before its checks'})")
        if timing:
            said += (f"; best {timing['best_csrc']} at {timing['best_csrc_to_cublas']:.3f}x one cuBLAS GEMM "
                     f"(Triton kernel A {timing['triton_to_cublas']:.3f}x)")
        lines.append(f"csrc kernel A (session.json \"csrc\"): {said}")
        back = csrc.get("backward_checks") or []
        if back or csrc.get("backward_timing"):  # kernel C: its checks against the spec, its time against cuBLAS
            wrong = [c["case"] for c in back if not c.get("ok")]
            said = f"{len(back) - len(wrong)}/{len(back)} checks ok" + (f" (wrong: {', '.join(wrong)})" if wrong else "")
            timing = (csrc.get("backward_timing") or {}).get("summary")
            if timing:
                said += f"; both dz GEMMs {timing['csrc_dz_to_cublas_pair']:.3f}x the two cuBLAS GEMMs of the same shapes"
            lines.append(f"csrc kernel C (session.json \"csrc\"): {said}")
    slow = slowest_kernels(rows)
    lines.append("kernels furthest from their measured ceilings:" if slow else
                 "kernels: no microbenchmark rows yet (the micro part has not run)")  # fmt: skip
    for c in slow:
        lines.append(f"  {c['case']:<28} {c['median_ms']:9.3f} ms  {c['rate']:>12}  {c['pct_of_ceiling']:5.1f} % of the ceiling")
    lost = [r for r in record.get("lost_rows", [])]
    if lost:
        lines.append("lost rows: " + ", ".join(f"{r['key']} ({r['status']})" for r in lost))
    this = record["calls"][-1]
    waiting = [p["name"] for p in this["parts"] if p["status"] in ("skipped",) and "out of time" in p.get("reason", "")]
    if waiting:
        lines.append(f"not reached in this call: {', '.join(waiting)}: copy {out} into the tree and run "
                     f"`bash benchmarks/gpu/run.sh --resume <that folder>` (it measures only what is missing)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------
def caption_lines(report: dict) -> str:
    """Two short lines (a one-line caption of every field is cut at both ends of the figure)."""
    v, git = report["versions"], report["git"]
    sha = sha_label(git)
    device = report["device"]
    driver = f", driver {device['driver']}" if device.get("driver") else ""
    cpu = "" if device.get("type") == "cuda" else " | CPU: the flow, not the product's numbers"
    return (f"{device['name']}{driver} | {report['settings']['dtype']} | {report['date'][:16]}{cpu}\n"
            f"torch {v['torch']}, triton {v['triton']} | grpo_kernels {sha}")  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def headline_plot(report: dict, path: Path, part: str = "headline") -> Path:
    """Per op: median time per provider as bars with p20-p80 whiskers (lost / failed rows named in place of a
    bar), the GEMM floor and the target as lines."""
    plt = _pyplot()
    results = [r for r in report["results"] if r.get("part", part) == part]
    ops = [op for op in report["settings"]["ops"] if any(r["op"] == op for r in results)]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(7 * max(1, len(ops)), 5.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in results if r["op"] == op]
        largest = max(r["shape"]["tokens"] for r in rows)  # one shape per panel (the target shape on a GPU)
        rows = [r for r in rows if r["shape"]["tokens"] == largest]
        floor = next((r for r in rows if r["provider"] == FLOOR and r.get("time")), None)
        bars = [r for r in rows if r["provider"] != FLOOR]
        times = [r["time"]["median_ms"] if r.get("time") else 0.0 for r in bars]
        colors = ["tab:red" if r["provider"] == "grpo_kernels" else "tab:blue" for r in bars]
        # whiskers: the 20th and 80th percentiles of the timed calls (the verdict gives them beside each median)
        spread = [[t - r["time"]["p20_ms"] if r.get("time") else 0.0 for t, r in zip(times, bars)],
                  [r["time"]["p80_ms"] - t if r.get("time") else 0.0 for t, r in zip(times, bars)]]  # fmt: skip
        ax.bar(range(len(bars)), times, color=colors, yerr=spread, capsize=4, ecolor="black")
        top = max([t + e for t, e in zip(times, spread[1])] + [floor["time"]["median_ms"] if floor else 0.0]) or 1.0
        for i, r in enumerate(bars):
            label = f"{r['x_floor']:.2f}x" if r.get("x_floor") else r["status"]
            ax.text(i, times[i] + spread[1][i] + 0.01 * top, label, ha="center", va="bottom", fontsize=8,
                    rotation=0 if r.get("x_floor") else 90)  # fmt: skip
        if floor:
            f_ms = floor["time"]["median_ms"]
            ax.axhline(f_ms, color="black", linestyle="--", label=f"GEMM floor {f_ms:.3g} ms")
            goal = TARGETS.get(op, {}).get("x_floor")
            if goal:
                ax.axhline(goal * f_ms, color="green", linestyle=":", label=f"target {goal}x floor")
            ax.legend(fontsize=8, loc="upper left")
        ax.set_xticks(range(len(bars)), [r["provider"] for r in bars], rotation=30, ha="right", fontsize=8)
        shape = rows[0]["shape"] if rows else {}
        ax.set_title(f"{op} ({part}): N={shape.get('tokens')} H={shape.get('hidden')} V={shape.get('vocab')}",
                     fontsize=10)  # fmt: skip
        ax.set_ylabel("median ms (bar label: x GEMM floor)")
        positive = [t for t in times if t > 0]
        if positive and top / min(positive) > 8:  # one slow provider would flatten every other bar
            ax.set_yscale("log")
            ax.set_ylim(min(positive) * 0.5, top * 2.0)
            ax.set_ylabel("median ms, log scale (bar label: x GEMM floor)")
        else:
            ax.set_ylim(0, top * 1.25)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(caption_lines(report), fontsize=9)
    return save_figure(fig, path)


def sweep_plot(report: dict, path: Path) -> Path:
    """Time and extra memory against tokens, one line per provider (floor dashed black)."""
    plt = _pyplot()
    results = [r for r in report["results"] if r.get("part", "sweep") == "sweep"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5))
    providers = list(dict.fromkeys(r["provider"] for r in results))
    for i, provider in enumerate(providers):
        pts = sorted(
            (r["shape"]["tokens"], r) for r in results if r["provider"] == provider and r.get("time")
        )
        if not pts:
            continue
        style = {"color": "black", "linestyle": "--", "marker": "x"} if provider == FLOOR else line_style(i)
        shift = 1.0 if provider == FLOOR else offset(i, len(providers))  # coinciding lines both show
        ax_t.plot(
            [n * shift for n, _ in pts], [r["time"]["median_ms"] for _, r in pts], label=provider, **style
        )
        mem = [(n, r["memory"]["beyond_grads_bytes"] / 2**30) for n, r in pts if r.get("memory")]
        if mem and provider != FLOOR:
            ax_m.plot([n * shift for n, _ in mem], [g for _, g in mem], label=provider, **style)
    ax_t.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median ms", title="fused_grpo: time")
    ax_m.set(
        xscale="log",
        xlabel="tokens N",
        ylabel="GiB beyond inputs and gradients",
        title="fused_grpo: extra memory",
    )
    if ax_m.lines:
        ax_m.axhline(TARGETS["fused_grpo"]["extra_gib"], color="green", linestyle=":", label="target")
    else:
        empty_panel(ax_m, "no memory figures: peak memory is measured on CUDA only" if report["device"].get("type")
                    != "cuda" else "no memory figures (every row failed or was lost: see session.json)")  # fmt: skip
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(caption_lines(report), fontsize=9)
    return save_figure(fig, path)


def kernels_plot(rows: list[dict], path: Path, environment: dict, source: dict | None = None) -> Path | None:
    """The microbenchmarks: each case's achieved share of the measured ceiling (TF/s, or GB/s for
    bandwidth cases), and of the datasheet peak where the device is known."""
    micro = [r for r in rows if r.get("kind") == "micro"]
    if not micro:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(micro) + 1.8))
    labels, measured, sheet, notes = [], [], [], []
    for r in micro:
        tf = r.get("tflops") is not None
        labels.append(r["case"] + (" (TF/s)" if tf else " (GB/s)" if r.get("gbps") else ""))
        measured.append(r.get("pct_measured_tflops" if tf else "pct_measured_gbps") or 0.0)
        sheet.append(r.get("pct_datasheet_tflops" if tf else "pct_datasheet_gbps") or 0.0)
        if r.get("status") != "ok":
            notes.append(r.get("status", "?"))
        elif r.get("median_ms") is not None:
            rate = f"{r['tflops']:.3g} TF/s" if tf else f"{r['gbps']:.3g} GB/s" if r.get("gbps") else ""
            notes.append(f"{r['median_ms']:.3g} ms {rate}")
        else:
            notes.append("")
    y = list(range(len(micro)))
    ax.barh([i - 0.2 for i in y], measured, height=0.4, label="% of the ceiling measured in this run")
    ax.barh([i + 0.2 for i in y], sheet, height=0.4, label="% of the datasheet peak", alpha=0.6)
    for i, text in enumerate(notes):  # beside the longer bar (bars past 100 % are cut at 110)
        ax.text(min(100.0, max(measured[i], sheet[i])) + 1, i, text, va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 135)
    ax.set_xlabel("% of peak")
    ax.legend(fontsize=8, loc="lower right")
    if not any(measured) and not any(sheet):
        ax.text(55, len(micro) / 2, "no rates: not a GPU run (a rehearsal times the flow only)", ha="center",
                fontsize=10, color="gray")  # fmt: skip
    gpu = environment.get("gpu") or "no GPU"
    sha = sha_label(source)
    driver = f", driver {environment['driver']}" if environment.get("driver") else ""
    ax.set_title(f"per-kernel microbenchmarks | {gpu}{driver}\n"
                 f"torch {environment.get('torch')}, triton {environment.get('triton')} | grpo_kernels {sha}",
                 fontsize=9)  # fmt: skip
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------------------
# environment, source, wheels
# ------------------------------------------------------------------------------------------------


def _environment() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                        memory_gib=round(props.total_memory / 2**30, 1), cuda_runtime=torch.version.cuda)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        info["torch"] = f"not importable: {exc}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"not importable: {exc}"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)  # fmt: skip
        info["driver"] = driver.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _files_digest(paths: list[str]) -> str | None:
    """sha256 over the paths and contents of `paths` (relative to the repository), in order; None if one is
    missing. Pure Python: the GPU machine needs no git history (its own git, if any, is older)."""
    import hashlib

    digest = hashlib.sha256()
    for rel in paths:
        path = ROOT / rel
        if not path.is_file():
            return None
        digest.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def stamp_source(dest: Path) -> dict:
    """.whl/SOURCE.json: the commit, whether the tree differs from it, the files that travel and their
    digest. The GPU machine gets the tree without this checkout's history (its git, if any, is older), so
    the session trusts the stamp exactly when the digest of those files there equals the stamp's."""
    sha = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if sha else None
    wheels = sorted(p.name for p in dest.glob("*.whl")) if dest.exists() else []
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard")  # what travels: tracked + not ignored
    files = sorted(f for f in (listed or "").splitlines() if (ROOT / f).is_file())
    data = {"sha": sha, "dirty": dirty, "digest": _files_digest(files) if files else None, "files": files,
            "wheels": wheels, "written": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "SOURCE.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def _source_info(stamp_path: Path | None = None) -> dict:
    """The commit the tree came from. .whl/SOURCE.json (stamp_source) when the files here are the stamped
    ones (same digest): the GPU machine's own git, if any, knows only an older commit. Else git here (a
    checkout: its HEAD and whether the tree differs), else the stamp marked unverified, else unknown."""
    recorded = stamp_path or ROOT / ".whl" / "SOURCE.json"
    stamp = json.loads(recorded.read_text()) if recorded.exists() else None
    sha = _git("rev-parse", "HEAD")
    same = bool(stamp and stamp.get("sha") and stamp.get("digest")
                and _files_digest(stamp.get("files", [])) == stamp["digest"])  # fmt: skip
    if same:
        return {"sha": stamp["sha"], "dirty": stamp.get("dirty"), "from": ".whl/SOURCE.json (files digest equal)",
                "git_head_here": sha}  # fmt: skip
    if sha:
        info = {"sha": sha, "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "from": "git"}
        if stamp and stamp.get("sha") and stamp["sha"] != sha:
            info["stamp_ignored"] = f"{stamp['sha'][:10]}: the files here differ from the stamped tree"
        return info
    if stamp and stamp.get("sha"):
        return {"sha": stamp["sha"], "dirty": stamp.get("dirty"), "from": ".whl/SOURCE.json (no git here to verify)"}
    return {"sha": None, "dirty": None, "from": "unknown (no .git, no .whl/SOURCE.json)"}


def make_wheels(dest: Path, dry_run: bool) -> int:
    command = [_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
               *PEER_WHEELS]  # fmt: skip
    print("make-wheels: the peers' cp312 wheels for a GPU machine without network")
    print("  " + " ".join(command))
    print(
        f"  then: SOURCE.json (git sha) into {dest}/, total checked against {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB"
    )
    if dry_run:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    code = subprocess.run(command).returncode
    if code != 0:
        return code
    stamp_source(dest)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    total = sum(p.stat().st_size for p in dest.glob("*"))
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}")
    if total > WHEEL_LIMIT_BYTES:
        print(
            f"too large to carry: {total / 2**20:.1f} MiB > {WHEEL_LIMIT_BYTES / 2**20:.0f} MiB",
            file=sys.stderr,
        )
        return 1
    return 0


def lease_plan(rehearsal: bool = False, row_limit: float | None = None) -> dict:
    """The plan against the lease: which parts the first call's budget reaches (by their budgets) and
    which a second call would, the device time of both calls, and whether it fits."""
    parts = plan(rehearsal, row_limit)
    calls, call, used = [[]], 0, 0.0
    for p in parts:
        if used + p.budget_s + RESERVE_S > CALL_BUDGET_S and calls[call]:
            calls.append([])
            call, used = call + 1, 0.0
            # a resumed call installs the wheels and checks the machine again
            used += sum(q.budget_s for q in parts if q.name in ("wheels", "preflight"))
            calls[call] += [q.name for q in parts if q.name in ("wheels", "preflight")]
        calls[call].append(p.name)
        used += p.budget_s
    device = MACHINE_START_S + CALLS * (CALL_LIMIT_S + TRANSFER_S)
    return {"parts": parts, "calls": calls, "device_s": device, "fits": device <= LEASE_S}


def print_plan(out: Path, rehearsal: bool, row_limit: float | None = None) -> int:
    kind = "rehearsal, tiny CPU shapes" if rehearsal else "GPU"
    lease = lease_plan(rehearsal, row_limit)
    print(f"grpo_kernels GPU session plan ({kind}); output in {out} (or $OUT)")
    print(f"each call: one command, timeout_s={CALL_LIMIT_S}; the session stops starting parts after "
          f"{CALL_BUDGET_S} s and writes {len(file_list())} files: {', '.join(file_list())}")  # fmt: skip
    print("which call reaches which part, by the parts' budgets (upper bounds: a call goes on to the next part "
          "while its budget lasts, so it usually reaches further)")
    for i, names in enumerate(lease["calls"], start=1):
        how = "bash benchmarks/gpu/run.sh" if i == 1 else "bash benchmarks/gpu/run.sh --resume <the last call's folder>"
        later = "" if i <= CALLS else " (beyond this lease's two calls: a later lease)"
        print(f"\ncall {i}{later}: {how}")
        for p in lease["parts"]:
            if p.name not in names:
                continue
            print(f"  [{p.name}] up to {p.budget_s} s: {p.what}")
            if p.command:
                print("      " + " ".join(p.command))
            if p.beside:
                print(f"      beside it, up to {CSRC_GATE_LIMIT_S} s: " + " ".join(p.beside))
            for j in p.jobs:
                low = min(j.key_limits.values(), default=j.row_limit_s)
                each = f"{j.row_limit_s:.0f} s" if low == j.row_limit_s else (
                    f"{low:.0f}-{j.row_limit_s:.0f} s by provider")  # fmt: skip
                print(f"      process {j.label}: {len(j.keys)} row(s), each up to {each}")
    verdict = "fits" if lease["fits"] else "DOES NOT FIT"
    print(f"\ndevice time: {MACHINE_START_S} s machine start + {CALLS} x ({CALL_LIMIT_S} s command + {TRANSFER_S} s "
          f"transfers) = {lease['device_s']} s <= {LEASE_S} s ({LEASE_S // 60}-minute lease): {verdict}; "
          f"{LEASE_S - lease['device_s']} s left for the second call's machine start")  # fmt: skip
    return 0 if lease["fits"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/run.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the session (default)")
    run.add_argument("--out", default=None,
                     help="output folder (default: $OUT if set, else benchmarks/results/gpu_session)")  # fmt: skip
    run.add_argument("--resume", default=None,
                     help="an earlier call's results folder: its rows are kept and skipped, the rest measured")  # fmt: skip
    run.add_argument("--budget", type=float, default=None,
                     help=f"seconds this call may start parts in (default {CALL_BUDGET_S})")  # fmt: skip
    run.add_argument("--row-limit", type=float, default=None, help="seconds one row may take (default: per part)")
    run.add_argument("--parts", default=None, help="comma-separated: run only these parts (default: all)")
    run.add_argument("--dry-run", action="store_true",
                     help="print the plan against the lease and the files; run nothing (exit 1 if it does not fit)")  # fmt: skip
    run.add_argument("--rehearsal", action="store_true", help="tiny CPU shapes: the flow, not the numbers")
    wheels = sub.add_parser("make-wheels", help="download the peers' cp312 wheels to carry (and stamp the tree)")
    wheels.add_argument("--dest", default=str(ROOT / ".whl"))
    wheels.add_argument("--dry-run", action="store_true")
    stamp = sub.add_parser("stamp", help="record the tree's commit in .whl/SOURCE.json (just before a call)")
    stamp.add_argument("--dest", default=str(ROOT / ".whl"))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    if args.command == "make-wheels":
        return make_wheels(Path(args.dest), args.dry_run)
    if args.command == "stamp":
        print(json.dumps(stamp_source(Path(args.dest)), indent=1))
        return 0
    out = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu_session")
    budget = args.budget if args.budget is not None else CALL_BUDGET_S
    if budget < 60:
        parser.error(f"--budget must be at least 60 s, got {budget}")
    if args.dry_run:
        return print_plan(out, args.rehearsal, args.row_limit)
    resume = Path(args.resume) if args.resume else None
    if resume is not None and not (resume / "results.jsonl").exists():
        parser.error(f"--resume {resume}: no results.jsonl there (give the folder an earlier call wrote)")
    call = 1 + len(_earlier_session(resume)["calls"]) if resume is not None else 1
    parts = plan(args.rehearsal, args.row_limit, call)
    if args.parts:
        names = [n.strip() for n in args.parts.split(",") if n.strip()]
        unknown = sorted(set(names) - {p.name for p in parts})
        if unknown:
            parser.error(f"--parts: no part {', '.join(unknown)} ({', '.join(p.name for p in parts)})")
        parts = [p for p in parts if p.name in names]
    return Session(out, budget, args.rehearsal, args.row_limit, parts, resume=resume).run()


if __name__ == "__main__":
    sys.exit(main())
