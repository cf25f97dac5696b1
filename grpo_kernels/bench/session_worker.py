"""The GPU session's child processes (grpo_kernels/bench/gpu_session.py starts them; not a user command).

  python -m grpo_kernels.bench.session_worker JOB --jsonl FILE [--only KEY,...] [job options]

Jobs: preflight, smoke, micro, bench (one provider), interleaved (the floor and several providers timed in
turns), step, profile, profile-target (the call ncu / nsys wrap).
Every job that measures rows announces each row on stdout before it starts (`@@start KEY`) and appends
it to FILE, flushed and fsync'd, the moment it is measured (`@@end KEY`): the parent knows which row
was in flight when a child crashes, hangs or runs out of time, records that one row as lost, and starts
a fresh child for the rest (`--only`). A child that hits a CUDA error exits with RESTART after writing
the row (its context is poisoned: every later call would fail too).

Test hook (the CPU rehearsal of the isolation, never set on a real run): GRPO_KERNELS_SESSION_FAULT =
"crash:NAME,hang:NAME" makes the first row whose key has the `|`-separated field NAME (a provider, a
case; or a run of fields, "fused_grpo|trl|256") abort its process (SIGABRT, as a fault would) or sleep forever when it starts; the fresh process
that measures the rest passes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

FAULT_ENV = "GRPO_KERNELS_SESSION_FAULT"
RESTART = 10  # exit status: the rows so far are written, start a fresh process for the rest
STOPPED = 11  # exit status: stopped on purpose (the smoke part's first wrong result)
HEADLINE_OPS = ("fused_grpo", "logprobs")
FLOOR = "floor"


def append(path: str | Path, record: dict) -> None:
    """One JSON line, on disk before this returns (a kill right after loses nothing)."""
    from .report import _json_safe

    with open(path, "a") as f:
        f.write(json.dumps(_json_safe(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: str | Path) -> list[dict]:
    """Every complete line of a results file (a line cut by a kill is skipped)."""
    rows = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _hits(name: str, key: str) -> bool:
    """A fault's target: a field of the key (a provider, a case), or a run of fields ("fused_grpo|trl|256")."""
    return name in key if "|" in name else name in key.split("|")


def _fault(key: str, first: bool) -> None:
    """The test hook: acts on the first row (of the job's full list) whose key has the field NAME, so the
    fresh process that measures the rest after it passes."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or not first:
        return
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, name = item.partition(":")
        if _hits(name, key):
            print(f"test hook {FAULT_ENV}: {action} in row {key}", flush=True)
            if action == "crash":
                os.abort()
            if action == "hang":
                while True:
                    time.sleep(3600)


def _start(key: str, keys: list[str]) -> None:
    """Announce a row; `keys`: the job's full list of rows (the test hook acts on the first of a name)."""
    print(f"@@start {key}", flush=True)
    spec = os.environ.get(FAULT_ENV, "")
    names = {item.partition(":")[2] for item in spec.split(",") if item.strip()}
    first = any(_hits(name, key) and key == next(k for k in keys if _hits(name, k)) for name in names)
    _fault(key, first)


def _end(key: str) -> None:
    print(f"@@end {key}", flush=True)


def _poisoned(text: str) -> bool:
    text = text.lower()
    return any(s in text for s in ("cuda error", "illegal memory access", "device-side assert", "cublas_status",
                                   "unspecified launch failure", "misaligned address"))  # fmt: skip


def _settings(args, provider: str | None = None):
    import torch

    from .ops import DTYPES
    from .providers import RunSettings

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    return RunSettings(dtype=DTYPES["bf16"], device=device, warmup=args.warmup, iters=args.iters,
                       explicit=frozenset({provider}) if provider else frozenset())  # fmt: skip


# ------------------------------------------------------------------------------------------------
# keys: what each job measures, computed the same way by the parent (to know what is left)
# ------------------------------------------------------------------------------------------------
def smoke_shapes(rehearsal: bool):
    from .shapes import PRESETS, BenchShape

    if rehearsal:
        return [("small", PRESETS["tiny"][0]), ("target", PRESETS["tiny"][1])]
    # small: odd vocabulary and a token count no tile divides (the masked edges); target: the §7 head
    return [("small", BenchShape("smoke", 512, 4099, 1000, 250)), ("target", PRESETS["qwen3-8b"][0])]


def smoke_checks(schedules: tuple[str, ...], opt_in: bool, rehearsal: bool = False) -> list[tuple[str, str, dict]]:
    """(name, op, what the candidate is) per check. Core: kernel A, the backward, the loss head, then
    the fused loss in each schedule; opt-in: the TMA kernel A (its one-pass check on a GPU only: the
    rehearsal's PyTorch backend has no one-pass schedule), and the schedules given."""
    if opt_in:
        checks = [("tma kernel A", "logprobs", {"forward_kernel": "tma"})]
        if not rehearsal:
            checks.append(("tma kernel A one_pass", "fused_grpo", {"forward_kernel": "tma", "schedule": "one_pass"}))
    else:
        checks = [("kernel A", "logprobs", {}), ("lm-head backward", "logprobs_grad", {}),
                  ("loss head", "loss_head", {})]  # fmt: skip
    return checks + [(f"schedule={s}", "fused_grpo", {"schedule": s}) for s in schedules]


def smoke_keys(part: str, schedules: tuple[str, ...], opt_in: bool, rehearsal: bool) -> list[str]:
    """Check by check, each on the small shape then the target: a schedule added at the end of SCHEDULES
    (never run before) is checked after every core kernel, at both shapes."""
    return [f"{part}|{label}|{name}" for name, _, _ in smoke_checks(schedules, opt_in, rehearsal)
            for label, _ in smoke_shapes(rehearsal)]  # fmt: skip


def micro_keys(part: str, opt_in: bool) -> list[str]:
    from .microbench import cases

    return [f"{part}|{c.name}" for c in cases(opt_in)]


def bench_keys(part: str, provider: str, ops: tuple[str, ...], preset: str) -> list[tuple[str, str, object]]:
    """(key, op, shape) for one provider: the ops it implements, the shapes in each op's range."""
    from .ops import OPS
    from .providers import REGISTRY
    from .shapes import PRESETS

    keys = []
    for op in ops:
        if provider != FLOOR and op not in REGISTRY.providers[provider].setups:
            continue
        for shape in PRESETS[preset]:
            limit = OPS[op].max_tokens
            if limit is None or shape.tokens <= limit:
                keys.append((f"{part}|{op}|{provider}|{shape.tokens}", op, shape))
    return keys


def interleaved_keys(part: str, providers: tuple[str, ...], ops: tuple[str, ...],
                     preset: str) -> list[tuple[str, str, object]]:  # fmt: skip
    """(key, op, shape) of an interleaved job: per op and shape, every provider's row (the keys bench_keys
    gives each provider alone, so a row is the same row whichever way it was measured)."""
    from .shapes import PRESETS

    each = {p: {(op, shape.tokens): key for key, op, shape in bench_keys(part, p, ops, preset)} for p in providers}
    keys = []
    for op in ops:
        for shape in PRESETS[preset]:
            keys += [(each[p][(op, shape.tokens)], op, shape) for p in providers if (op, shape.tokens) in each[p]]
    return keys


def profile_keys(part: str) -> list[str]:
    return [f"{part}|torch.profiler", f"{part}|ncu", f"{part}|nsys"]


# ------------------------------------------------------------------------------------------------
# jobs
# ------------------------------------------------------------------------------------------------
def job_preflight(args) -> int:
    """Versions, the GPU, whether each peer imports, which profilers exist: one record."""
    import platform

    record: dict = {
        "kind": "preflight",
        "key": f"{args.part}|{args.call_key}",
        "status": "ok",
        "python": platform.python_version(),
    }
    try:
        import torch

        record["torch"] = torch.__version__
        record["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            from .microbench import device_peaks

            props = torch.cuda.get_device_properties(0)
            record.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                          multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                          cuda_runtime=torch.version.cuda, peaks=device_peaks(props.name))  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        record["torch"] = f"not importable: {type(exc).__name__}: {exc}"
    for module in ("triton", "grpo_kernels", "matplotlib"):
        try:
            mod = __import__(module)
            record.setdefault("imports", {})[module] = getattr(mod, "__version__", "imported")
        except Exception as exc:  # noqa: BLE001
            record.setdefault("imports", {})[module] = f"not importable: {type(exc).__name__}: {str(exc)[:160]}"
    # each provider of the plan: the modules its setups import (a lazy top-level package is not enough:
    # a missing dependency of trl.trainer.grpo_trainer shows only there), one process per provider, all
    # at once (the imports are seconds each; the GPU machine has cores to spare); the session skips a
    # provider whose import fails, with this reason, before attempting its rows
    from .providers import REGISTRY

    record["providers"], record["import_seconds"] = {}, {}
    checks = {}
    for name in [p for p in args.providers.split(",") if p]:
        provider = REGISTRY.providers.get(name)
        if provider is None:
            record["providers"][name] = "not in the registry"
        elif not provider.imports:
            record["providers"][name] = "ok"
        else:
            code = ("import importlib, sys, time; t = time.perf_counter()\n"
                    "for m in sys.argv[1:]:\n"
                    "    try:\n        importlib.import_module(m)\n"
                    "    except Exception as exc:\n"
                    "        print(f'not importable: {m}: {type(exc).__name__}: {str(exc)[:200]}'); sys.exit(3)\n"
                    "print(f'ok {time.perf_counter() - t:.1f}')")  # fmt: skip
            checks[name] = (time.perf_counter(), subprocess.Popen([sys.executable, "-c", code, *provider.imports],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))  # fmt: skip
    for name, (started, proc) in checks.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.import_timeout - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            record["providers"][name] = f"not importable: the import did not finish within {args.import_timeout:.0f} s"
            continue
        line = (out or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if proc.returncode == 0 and line[0].startswith("ok "):
            record["providers"][name] = "ok"
            record["import_seconds"][name] = float(line[0][3:])  # the import's own time, in its process
        else:
            record["providers"][name] = line[0]
    for name in record["providers"]:
        dist = REGISTRY.providers[name].dist if name in REGISTRY.providers else None
        if dist and dist not in record["imports"]:
            try:
                from importlib.metadata import version

                record["imports"][dist] = version(dist)
            except Exception:  # noqa: BLE001
                record["imports"][dist] = "not installed"
    record["profilers"] = {"torch.profiler": True, "ncu": shutil.which("ncu"), "nsys": shutil.which("nsys")}
    append(args.jsonl, record)
    print(json.dumps(record, indent=1))
    return 0


def _candidate_setup(op: str, spec: dict, rehearsal: bool):
    from .providers import _ours

    backend = "auto" if rehearsal else "triton"  # the rehearsal: the PyTorch backend stands in
    return _ours(
        backend, spec.get("schedule", "auto"), forward_kernel=spec.get("forward_kernel", "cp.async")
    )[op]


def job_smoke(args) -> int:
    """Each kernel and schedule against the PyTorch backend on the same bf16 inputs, small shape then the
    target; the first wrong result stops the job (STOPPED) with its worst elements printed."""
    import torch

    from . import oracle
    from .ops import OPS, build_inputs
    from .parity import check_outputs
    from .providers import _ours
    from .runner import make_call, reset_grads

    settings = _settings(args)
    only = set(args.only.split(",")) if args.only else None
    schedules = tuple(s for s in args.schedules.split(",") if s)
    cache: dict = {}
    keys = smoke_keys(args.part, schedules, args.opt_in, args.rehearsal)
    for name, op, spec in smoke_checks(schedules, args.opt_in, args.rehearsal):
        for label, shape in smoke_shapes(args.rehearsal):
            key = f"{args.part}|{label}|{name}"
            if only is not None and key not in only:
                continue
            _start(key, keys)
            t0 = time.perf_counter()
            row = {
                "kind": "smoke",
                "part": args.part,
                "key": key,
                "check": name,
                "op": op,
                "shape": shape.as_dict(),
            }
            try:
                if (op, label) not in cache:  # inputs, the PyTorch backend's result, plain bf16 PyTorch's
                    if len(cache) >= 2:  # the small and the target shape of one op at most
                        cache.clear()
                    inp = build_inputs(OPS[op], shape, settings.dtype, settings.device, seed=1)
                    reference = make_call(inp, _ours("torch")[op](inp, settings).fn, ("logprobs", "entropy"))
                    reset_grads(inp)
                    truth = reference()
                    reset_grads(inp)
                    cache[(op, label)] = (inp, truth, oracle.same_dtype(inp, ("logprobs", "entropy")))
                inp, truth, yardstick = cache[(op, label)]
                call = make_call(
                    inp, _candidate_setup(op, spec, args.rehearsal)(inp, settings).fn, ("logprobs", "entropy")
                )
                reset_grads(inp)
                result = call()
                dtype = torch.float32 if op == "loss_head" else settings.dtype
                parity = check_outputs(result, truth, yardstick, OPS[op].compared, dtype)
                reset_grads(inp)
                row.update(status="ok" if parity.passed else "wrong", summary=parity.summary(),
                           parity=parity.as_dict(), seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
                if not parity.passed:
                    row["report"] = parity.failure_message()
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                           traceback="".join(traceback.format_exception(exc)[-4:])[-2000:])  # fmt: skip
            append(args.jsonl, row)
            _end(key)
            print(f"  {key}: {row['status']} {row.get('summary', row.get('reason', ''))}", flush=True)
            if row["status"] != "ok":
                print(f"SMOKE STOPPED at {key} ({shape.label}): {row['status']}\n"
                      + row.get("report", row.get("reason", "")), flush=True)  # fmt: skip
                return STOPPED
    return 0


def _ceilings(jsonl: str) -> dict:
    found = {}
    for r in read_rows(jsonl):
        if r.get("kind") == "micro" and r.get("status") == "ok":
            if r["case"] == "ceiling-gemm":
                found["tflops"] = r["tflops"]
            elif r["case"] == "ceiling-copy":
                found["gbps"] = r["gbps"]
    return found


def job_micro(args) -> int:
    import torch

    from .microbench import TARGET, TINY, Tensors, cases, device_peaks, kernel_split, rates
    from .timing import free_memory, time_call

    settings = _settings(args)
    device = settings.device
    only = set(args.only.split(",")) if args.only else None
    peaks = device_peaks(torch.cuda.get_device_name(0)) if device.type == "cuda" else None
    tensors = None
    keys = micro_keys(args.part, args.opt_in)
    for case in cases(args.opt_in):
        key = f"{args.part}|{case.name}"
        if only is not None and key not in only:
            continue
        _start(key, keys)
        row = {"kind": "micro", "part": args.part, "key": key, "case": case.name, "what": case.what}
        try:
            if case.needs_cuda and device.type != "cuda":
                row.update(status="skipped", reason=f"needs CUDA: {case.needs_cuda}")
            else:
                if tensors is None:
                    tensors = Tensors(TINY if args.rehearsal else TARGET, device, settings.dtype)
                call, flops, moved, kernels = case.setup(tensors)
                stats = time_call(call, lambda: None, device, settings.warmup, settings.iters)
                ceilings = _ceilings(args.jsonl)
                row.update(status="ok", time=stats.as_dict(), median_ms=stats.median_ms, flops=flops, bytes=moved,
                           **rates(stats.median_ms / 1e3, flops, moved, peaks, ceilings),
                           kernels=kernel_split(call, kernels, device, peaks, ceilings), peaks=peaks)  # fmt: skip
                del call
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        free_memory(device)
        append(args.jsonl, row)
        _end(key)
        shown = f"{row['median_ms']:.3f} ms" if row.get("median_ms") is not None else row.get("reason", "")
        print(f"  {case.name:<26} {row['status']} {shown}", flush=True)
        if _poisoned(row.get("reason", "")):
            return RESTART
    return 0


def job_bench(args) -> int:
    """One provider's rows (or the floor's): the benchmark runner's gate, timing and memory per row."""
    from .._backend import BackendFallbackWarning
    from . import environment
    from .providers import REGISTRY
    from .runner import _row, measure_floor, prepare_shape, run_provider

    provider = args.provider
    settings = _settings(args, provider)
    only = set(args.only.split(",")) if args.only else None
    ops = tuple(args.ops.split(","))
    meta = environment.describe(settings, list(ops), [provider], [args.shapes])
    append(
        args.jsonl, {"kind": "meta", "part": args.part, "key": f"{args.part}|meta|{provider}", "report": meta}
    )
    warnings.simplefilter("ignore", BackendFallbackWarning)
    keys = [k for k, _, _ in bench_keys(args.part, provider, ops, args.shapes)]
    for key, op, shape in bench_keys(args.part, provider, ops, args.shapes):
        if only is not None and key not in only:
            continue
        _start(key, keys)
        if provider == FLOOR:
            row = measure_floor(prepare_shape(op, shape, settings), settings)
        else:
            p = REGISTRY.providers[provider]
            reason = p.unavailable(settings, op)
            if reason:
                row = _row(op, shape, provider, status="skipped", reason=reason)
            else:
                try:
                    row = run_provider(p, prepare_shape(op, shape, settings), settings)
                except Exception as exc:  # noqa: BLE001 - e.g. building the inputs ran out of memory
                    row = _row(
                        op, shape, provider, status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}"
                    )
        append(args.jsonl, {"kind": "bench", "part": args.part, "key": key, **row})
        _end(key)
        shown = (
            f"{row['time']['median_ms']:.3f} ms" if row.get("time") else f"{row['status']} {row['reason']}"
        )
        print(f"  {op:<10} {shape.tokens:>6} {provider:<28} {shown}", flush=True)
        if _poisoned(row.get("reason", "")):
            return RESTART
    return 0


def job_interleaved(args) -> int:
    """The floor and the providers of each (op, shape) in this one process, timed in rotating turns
    (runner.run_interleaved): the headline's rows, each provider beside the floor it is divided by.
    Every gate and every timed call is announced (`@@start KEY`), so a crash or a hang costs the row of the
    provider whose call it was; a fresh process measures the rest of that shape without it (`--only`)."""
    from .._backend import BackendFallbackWarning
    from . import environment
    from .providers import REGISTRY
    from .runner import _row, add_ratios, prepare_shape, run_interleaved

    names = tuple(args.providers.split(","))
    settings = _settings(args)
    only = set(args.only.split(",")) if args.only else None
    ops = tuple(args.ops.split(","))
    meta = environment.describe(settings, list(ops), [n for n in names if n != FLOOR], [args.shapes])
    append(args.jsonl, {"kind": "meta", "part": args.part, "key": f"{args.part}|meta|interleaved", "report": meta})
    warnings.simplefilter("ignore", BackendFallbackWarning)
    every = interleaved_keys(args.part, names, ops, args.shapes)
    all_keys = [k for k, _, _ in every]
    groups: dict = {}
    for key, op, shape in every:
        if only is None or key in only:
            groups.setdefault((op, shape.tokens), (op, shape, []))[2].append(key)
    for op, shape, keys in groups.values():
        key_of = {key.split("|")[2]: key for key in keys}
        done: list[dict] = []
        providers = []
        for name in key_of:
            if name == FLOOR:
                continue
            p = REGISTRY.providers[name]
            reason = p.unavailable(settings, op)
            if reason:
                done.append(_row(op, shape, name, status="skipped", reason=reason))
            else:
                providers.append(p)

        def announce(name, first, key_of=key_of):
            if first:
                _start(key_of[name], all_keys)  # the test hook acts here, on a gate
            else:
                print(f"@@start {key_of[name]}", flush=True)

        try:
            ctx = prepare_shape(op, shape, settings)
            rows = run_interleaved(providers, ctx, settings, floor=FLOOR in key_of, announce=announce,
                                   deadline=args.deadline, fatal=_poisoned)  # fmt: skip
            add_ratios(rows, ctx.inputs)
            del ctx
        except Exception as exc:  # noqa: BLE001 - e.g. building the inputs ran out of memory
            if _poisoned(str(exc)):
                raise  # the process is done: the call announced last is lost, a fresh process measures the rest
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows = [_row(op, shape, p.name, status="error", reason=reason) for p in providers]
            if FLOOR in key_of:
                rows.insert(0, _row(op, shape, FLOOR, status="error", reason=reason))
        for row in done + rows:
            key = key_of[row["provider"]]
            append(args.jsonl, {"kind": "bench", "part": args.part, "key": key, **row})
            _end(key)
            shown = f"{row['time']['median_ms']:.3f} ms" if row.get("time") else f"{row['status']} {row['reason']}"
            print(f"  {op:<10} {shape.tokens:>6} {row['provider']:<28} {shown}", flush=True)
    return 0


def _profiled_call(args):
    """The fused loss in `auto` at the target shape (tiny in a rehearsal), ready to call."""
    from .providers import REGISTRY
    from .runner import make_call, prepare_shape, reset_grads
    from .shapes import PRESETS

    settings = _settings(args)
    shape = PRESETS["tiny" if args.rehearsal else "qwen3-8b"][-1]
    inp = prepare_shape("fused_grpo", shape, settings).inputs
    call = make_call(
        inp, REGISTRY.providers["grpo_kernels"].setups["fused_grpo"](inp, settings).fn, ("logprobs",)
    )

    def run():
        reset_grads(inp)
        call()

    return run, settings.device


def job_profile_target(args) -> int:
    """What ncu / nsys wrap: warm-up calls, then the profiled ones."""
    run, device = _profiled_call(args)
    for _ in range(args.warmup + args.iters):
        run()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return 0


def job_profile(args) -> int:
    """torch.profiler over the fused loss (auto) at the target shape: the kernels by device time; then,
    where they exist, ncu (SpeedOfLight of the three hottest kernels, clocks left alone) and nsys."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    only = set(args.only.split(",")) if args.only else None
    key = f"{args.part}|torch.profiler"
    hottest: list[str] = []
    if only is None or key in only:
        _start(key, profile_keys(args.part))
        run, device = _profiled_call(args)
        for _ in range(2):
            run()
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(args.iters):
                run()
            if cuda:
                torch.cuda.synchronize()
        table = []
        for e in prof.key_averages():
            us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if cuda \
                else e.self_cpu_time_total  # fmt: skip
            if us:
                table.append({"name": e.key[:200], "calls": e.count, "ms_per_call": us / 1e3 / args.iters})
        table.sort(key=lambda r: -r["ms_per_call"])
        total = sum(r["ms_per_call"] for r in table)
        for r in table:
            r["share"] = r["ms_per_call"] / total if total else None
        hottest = [r["name"] for r in table[:3]]
        append(args.jsonl, {"kind": "profile", "part": args.part, "key": key, "status": "ok",
                            "timer": "device" if cuda else "cpu (rehearsal)", "top": table[:15]})  # fmt: skip
        _end(key)
        print("\n".join(f"  {r['ms_per_call']:9.3f} ms  {r['name'][:90]}" for r in table[:10]), flush=True)
    else:
        for r in read_rows(args.jsonl):
            if r.get("key") == key and r.get("top"):
                hottest = [t["name"] for t in r["top"][:3]]
    target = [sys.executable, "-m", "grpo_kernels.bench.session_worker", "profile-target", "--jsonl", os.devnull,
              "--warmup", "1", "--iters", "1", *(["--rehearsal"] if args.rehearsal else [])]  # fmt: skip
    for tool in ("ncu", "nsys"):
        key = f"{args.part}|{tool}"
        if only is not None and key not in only:
            continue
        _start(key, profile_keys(args.part))
        exe = shutil.which(tool)
        row: dict = {"kind": "profile", "part": args.part, "key": key, "tool": tool}
        if exe is None:
            row.update(status="skipped", reason=f"{tool} is not on the PATH")
        elif tool == "ncu":  # one run over the three hottest kernels' first launches, clocks left alone
            names = [n.split("(")[0].split("<")[0].strip().split(" ")[-1][:60] for n in hottest if n.strip()]
            command = [exe, "--clock-control", "none", "--section", "SpeedOfLight", "--csv", "-k",
                       "regex:" + "|".join(names), "--launch-count", "6", *target]  # fmt: skip
            row.update(
                status="ok",
                kernels=names,
                **_tool_output(command, "the three hottest kernels", args.tool_timeout),
            )
        else:
            command = [exe, "profile", "--stats=true", "--force-overwrite=true", "-o", "/tmp/grpo_kernels_nsys",
                       *target]  # fmt: skip
            row.update(status="ok", **_tool_output(command, "whole call", args.tool_timeout))
        append(args.jsonl, row)
        _end(key)
        print(f"  {tool}: {row['status']} {row.get('reason', '')}", flush=True)
    return 0


def step_keys(rehearsal: bool) -> list[str]:
    from .step import session_rows

    return list(session_rows(rehearsal))


def job_step(args) -> int:
    """The training-step rows (grpo_kernels/bench/step.py): each family's parity check and timed steps, then
    the memory walls (each try a process of its own). A rehearsal plants a memory limit for the walls."""
    from . import step

    if args.rehearsal:
        os.environ[step.PLANTED_ENV] = str(step.REHEARSAL_PLANTED_BYTES)
        import torch

        torch.set_num_threads(1)  # tiny models on a shared CPU: thread start-up would dominate every op
    specs = step.session_rows(args.rehearsal)
    keys = list(specs)
    only = set(args.only.split(",")) if args.only else None
    for key in keys:
        if only is not None and key not in only:
            continue
        _start(key, keys)
        spec = specs[key]
        try:
            row = step.run_session_row(spec, [r for r in read_rows(args.jsonl) if r.get("kind") == "step"])
            status = "ok"
            if row["kind"] == "step" and any(s.get("status") != "ok" for s in row["sides"]):
                status = "ok-with-errors"
        except Exception as exc:  # noqa: BLE001 - the row says why; the next rows go on
            row = {"kind": spec["kind"], "model": spec["model"], "reason": f"{type(exc).__name__}: {str(exc)[:400]}",
                   "traceback": traceback.format_exc()[-1500:]}  # fmt: skip
            status = "oom" if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() else "error"
        append(args.jsonl, {**row, "kind": row["kind"], "part": args.part, "key": key, "status": status})
        _end(key)
        if row["kind"] == "step":
            for s in row.get("sides", []):
                if s.get("status") == "ok":
                    peak = s.get("peak_memory_bytes")
                    shown = (f"{s['median_s']['step'] * 1e3:.1f} ms/step, {s['tokens_per_s']:.0f} tok/s, peak "
                             + ("n/a (CPU)" if peak is None else f"{peak / 2**30:.1f} GiB"))  # fmt: skip
                else:
                    shown = f"{s.get('status')}: {s.get('reason', '')[:200]}"
                print(f"  {key} {s['side']:<20} {shown}", flush=True)
        else:
            print(f"  {key}: {status}, fits {row.get('largest_ok')}, OOM at {row.get('smallest_oom')}", flush=True)
        if _poisoned(row.get("reason", "")):
            return RESTART
    return 0


def _tool_output(command: list[str], what: str, timeout: float) -> dict:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return {"what": what, "command": " ".join(command), "returncode": out.returncode,
                "output": (out.stdout + out.stderr)[-6000:]}  # fmt: skip
    except subprocess.TimeoutExpired:
        return {
            "what": what,
            "command": " ".join(command),
            "returncode": None,
            "output": f"timed out after {timeout} s",
        }


JOBS = {"step": job_step, "preflight": job_preflight, "smoke": job_smoke, "micro": job_micro, "bench": job_bench,
        "interleaved": job_interleaved, "profile": job_profile, "profile-target": job_profile_target}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_kernels.bench.session_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("job", choices=list(JOBS))
    parser.add_argument("--jsonl", required=True, help="the results file rows are appended to")
    parser.add_argument("--part", default="part")
    parser.add_argument("--only", default="", help="comma-separated keys: run only these rows")
    parser.add_argument(
        "--rehearsal", action="store_true", help="tiny shapes (CPU): the flow, not the numbers"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--provider", default=FLOOR, help="bench: the provider, or 'floor'")
    parser.add_argument("--ops", default=",".join(HEADLINE_OPS), help="bench: comma-separated ops")
    parser.add_argument("--shapes", default="qwen3-8b", help="bench: a shape preset")
    parser.add_argument("--schedules", default="", help="smoke: comma-separated schedules of the fused loss")
    parser.add_argument("--providers", default="",
                        help="preflight: the providers whose imports to check; interleaved: the floor and the "
                             "providers timed in turns")  # fmt: skip
    parser.add_argument("--call-key", default="call1", help="preflight: the row's key suffix (one per call)")
    parser.add_argument("--import-timeout", type=float, default=50.0,
                        help="preflight: seconds the providers' imports may take (in parallel)")  # fmt: skip
    parser.add_argument("--opt-in", action="store_true", help="smoke / micro: the opt-in kernels")
    parser.add_argument("--deadline", type=float, default=None,
                        help="interleaved: the epoch second by which the job must be done (fewer rounds then)")  # fmt: skip
    parser.add_argument(
        "--tool-timeout", type=float, default=90.0, help="profile: seconds per ncu / nsys run"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from .._backend import BackendFallbackWarning

    # "auto" on a CPU rehearsal says once that it runs the PyTorch backend; the rows name the path taken
    warnings.filterwarnings("ignore", category=BackendFallbackWarning)
    return JOBS[args.job](args)


if __name__ == "__main__":
    sys.exit(main())
