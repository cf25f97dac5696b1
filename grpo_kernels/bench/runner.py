"""One benchmark run: for every op and shape, the floor, then every provider: parity gate, time, memory.

Order per (op, shape): build the inputs; compute the fp32 truth and PyTorch's same-dtype result
(oracle.py); time the floor (ops.make_floor); then per provider: set up, one call checked against
the truth (a provider that fails is reported, never timed), `warmup` + `iters` timed calls, one call
for peak memory. Ratios to the floor and to grpo_kernels are filled in at the end of each shape.
Interleaved (`--interleave`, the GPU session's headline): the floor and every provider of a shape in one
process, gated and warmed up, then timed in rotating turns (run_interleaved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from .._backend import BackendFallbackWarning, SlowPathWarning
from . import environment, oracle
from .ops import OPS, BenchInputs, build_inputs, compulsory_bytes, make_floor, op_flops
from .parity import check_outputs
from .providers import REGISTRY, Provider, ProviderSkip, RunSettings
from .shapes import BenchShape
from .timing import free_memory, peak_extra_bytes, stats_of, synchronize, time_call

OURS = "grpo_kernels"
FLOOR = "floor"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class ShapeContext:
    """The inputs of one (op, shape) and their reference results, shared by every provider."""

    inputs: BenchInputs
    _truth: dict = field(default_factory=dict)
    _yardstick: dict = field(default_factory=dict)

    def truth(self, outputs: tuple[str, ...]) -> dict:
        if outputs not in self._truth:
            self._truth[outputs] = oracle.truth(self.inputs, outputs)
        return self._truth[outputs]

    def yardstick(self, outputs: tuple[str, ...]) -> dict:
        if outputs not in self._yardstick:
            self._yardstick[outputs] = oracle.same_dtype(self.inputs, outputs)
        return self._yardstick[outputs]


def prepare_shape(op: str, shape: BenchShape, settings: RunSettings) -> ShapeContext:
    return ShapeContext(build_inputs(OPS[op], shape, settings.dtype, settings.device, settings.seed))


def reset_grads(inp: BenchInputs) -> None:
    for leaf in inp.leaves:
        leaf.grad = None


def make_call(inp: BenchInputs, fn, outputs: tuple[str, ...]):
    """The provider's forward plus the op's backward; returns the outputs the parity gate reads."""
    op = inp.op.name
    if op == "logprobs":

        def call():
            with torch.no_grad():
                logprobs, entropy = fn()
            return {"logprobs": logprobs, "entropy": entropy}

    elif op == "logprobs_grad":

        def call():
            logprobs, entropy = fn()
            tensors, cotangents = [logprobs], [inp.cot_logprobs.view_as(logprobs).to(logprobs.dtype)]
            if "entropy" in outputs and entropy is not None:
                tensors.append(entropy)
                cotangents.append(inp.cot_entropy.view_as(entropy).to(entropy.dtype))
            torch.autograd.backward(tensors, cotangents)
            return {
                "logprobs": logprobs.detach(),
                "entropy": None if entropy is None else entropy.detach(),
                "grad_hidden": inp.hidden.grad,
                "grad_weight": inp.weight.grad,
            }

    else:

        def call():
            loss = fn()
            loss.backward()
            grads = {"grad_logprobs": inp.logprobs.grad} if op == "loss_head" else {
                "grad_hidden": inp.hidden.grad, "grad_weight": inp.weight.grad}  # fmt: skip
            return {"loss": loss.detach(), **grads}

    return call


def compared_outputs(op: str, provider: Provider) -> tuple[str, ...]:
    per_token = ("logprobs", "entropy")
    return tuple(n for n in OPS[op].compared if n not in per_token or n in provider.outputs)


def _row(op: str, shape: BenchShape, provider: str, **fields) -> dict:
    row = {
        "op": op,
        "shape": shape.as_dict(),
        "shape_label": shape.label,
        "provider": provider,
        "status": "ok",
    }
    return {**row, "reason": "", "impl": "", "parity": None, "time": None, "memory": None, **fields}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def measure_floor(ctx: ShapeContext, settings: RunSettings) -> dict:
    inp = ctx.inputs
    row = _row(inp.op.name, inp.shape, FLOOR, impl=inp.op.floor_label)
    try:
        floor = make_floor(inp)
        row["time"] = time_call(
            floor, lambda: None, settings.device, settings.warmup, settings.iters
        ).as_dict()
    except Exception as exc:  # noqa: BLE001 - reported in the results, the run goes on
        row.update(status="oom" if _is_oom(exc) else "error", reason=_error_text(exc))
    free_memory(settings.device)
    return row


class _PathRecorder(logging.Handler):
    """Collects what grpo_kernels says at DEBUG about the path it took (the fused loss's schedule) and
    any SlowPathWarning, during one provider's gated call."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "schedule" in message and message not in self.messages:
            self.messages.append(message)


@contextlib.contextmanager
def record_paths(row: dict):
    """Fill row["paths"]: the schedule(s) grpo_kernels chose, its backward GEMM path on CUDA, and any
    slower fallback it warned about (those warnings are recorded here, not printed)."""
    logger = logging.getLogger("grpo_kernels")
    recorder = _PathRecorder()
    old_level, old_propagate = logger.level, logger.propagate
    # DEBUG records reach the root logger's handlers only if the user asked for them (`--verbose`, or
    # their own logging set to DEBUG): a peer's import may have configured the root logger
    asked = logger.getEffectiveLevel() <= logging.DEBUG
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    logger.propagate = old_propagate and asked
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SlowPathWarning)
            yield
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
    paths = {"schedule": recorder.messages}
    slow = [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]
    if slow:
        paths["slow_path_warnings"] = slow
    lm_triton = sys.modules.get("grpo_kernels.ops.lm_head.triton")  # imported only if the Triton path ran
    if lm_triton is not None:
        paths["backward_gemms"] = lm_triton.gemm_path("cuda")
    row["paths"] = paths


def gate(provider: Provider, ctx: ShapeContext, settings: RunSettings):
    """Set the provider up and check one call against the truth. Returns (call, forward, parity);
    raises ProviderSkip, or whatever the provider raises."""
    inp = ctx.inputs
    op = inp.op.name
    forward = provider.setups[op](inp, settings)
    call = make_call(inp, forward.fn, provider.outputs)
    reset_grads(inp)
    result = call()
    dtype = torch.float32 if op == "loss_head" else settings.dtype
    truth, yardstick = ctx.truth(provider.outputs), ctx.yardstick(provider.outputs)
    parity = check_outputs(result, truth, yardstick, compared_outputs(op, provider), dtype)
    del result
    reset_grads(inp)
    return call, forward, parity


def _gated(provider: Provider, ctx: ShapeContext, settings: RunSettings):
    """(row, call): the provider set up and checked against the truth; call is None when it is not to be timed
    (skipped, failed, or its parity gate failed: the row says why)."""
    inp = ctx.inputs
    row = _row(inp.op.name, inp.shape, provider.name)
    try:
        with record_paths(row):
            call, forward, parity = gate(provider, ctx, settings)
    except ProviderSkip as exc:
        row.update(status="skipped", reason=str(exc))
        return row, None
    except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
        row.update(status="oom" if _is_oom(exc) else "error", reason=_error_text(exc))
        _log(
            f"    {provider.name}: {row['reason']}\n" + "".join(traceback.format_exception(exc)[-3:]).rstrip()
        )
        reset_grads(inp)
        free_memory(settings.device)
        return row, None
    row.update(impl=forward.impl, parity=parity.as_dict(), parity_summary=parity.summary())
    if not parity.passed and provider.timed_despite_parity:
        row["parity_note"] = (f"parity gate failed ({parity.summary()}); timed anyway: "
                              f"{provider.timed_despite_parity}")
        _log(f"    {provider.name}: parity gate failed, timed anyway (a baseline)\n{parity.failure_message()}")
    elif not parity.passed:
        row.update(status="parity-failed", reason=parity.summary())
        _log(f"    {provider.name}: parity FAILED, not timed\n{parity.failure_message()}")
        free_memory(settings.device)
        return row, None
    return row, call


def _measure_memory(row: dict, call, ctx: ShapeContext, settings: RunSettings) -> None:
    inp = ctx.inputs
    extra = peak_extra_bytes(call, functools.partial(reset_grads, inp), settings.device)
    if extra is not None:
        grads = inp.grad_bytes()
        row["memory"] = {
            "peak_extra_bytes": extra,
            "grad_bytes": grads,
            "beyond_grads_bytes": extra - grads,
        }


def run_provider(provider: Provider, ctx: ShapeContext, settings: RunSettings) -> dict:
    inp = ctx.inputs
    row, call = _gated(provider, ctx, settings)
    if call is None:
        return row
    reset = functools.partial(reset_grads, inp)
    try:
        row["time"] = time_call(call, reset, settings.device, settings.warmup, settings.iters).as_dict()
        _measure_memory(row, call, ctx, settings)
    except Exception as exc:  # noqa: BLE001
        row.update(status="oom" if _is_oom(exc) else "error", reason=_error_text(exc), time=None)
    reset_grads(inp)
    free_memory(settings.device)
    return row


@dataclass
class _Turn:
    """One participant of an interleaved run: its row, the call timed, the reset before each call."""

    name: str
    row: dict
    call: object
    reset: object
    samples: list = field(default_factory=list)
    warm_s: float = 0.0  # the last warm-up call's wall time (rounds are fitted to a deadline by it)


def _timed_ms(call, reset, device: torch.device) -> float:
    """One call's time (ms): CUDA events on the current stream bracketing it (the device time, host syncs
    inside the call included), then a synchronize, so that a fault surfaces in this call and not the next
    participant's; perf_counter elsewhere."""
    reset()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


MIN_ROUNDS = 5  # a deadline cuts the rounds to what fits, never below this
MIN_GATE_S = 15.0  # with a deadline: a provider is not set up with less time than this left for it
ROUNDS_RESERVE_S = 10.0  # with a deadline: kept beyond MIN_ROUNDS rounds of the providers set up before


def run_interleaved(providers: list[Provider], ctx: ShapeContext, settings: RunSettings, *, floor: bool = False,
                    announce=None, deadline: float | None = None, fatal=None) -> list[dict]:  # fmt: skip
    """The floor (with `floor`) and every provider in one process, timed in turns: each gated first and
    warmed up (`warmup` calls), then `iters` rounds of one call each, the order rotated by one every round
    (no participant always follows the same one), then each one's memory. On a machine whose clocks or
    load drift, every participant sees the same drift, and the floor is measured beside them, not before.

    `announce(name, first)`: called before a participant's gate (`first`) and before each of its timed calls,
    so that a supervising process knows whose call a crash or a hang belongs to (session_worker.py).
    `deadline` (time.time() seconds): a provider is set up only if, after MIN_ROUNDS rounds of those set up
    before it, MIN_GATE_S are left (else its row is skipped and says so), and its setup gets that time as
    `settings.deadline`; the rounds are cut to what fits by the warm-up calls' times, keeping time for the
    memory calls (at least MIN_ROUNDS; each row's time says how many calls it has). The order of `providers`
    is thus their priority. `fatal(text)`: whether an error's text says no later call in this process can be
    trusted (a CUDA fault poisons the context): such an error is raised, not recorded, so the supervisor
    charges it to the gate or call announced last and measures the rest in a fresh process.
    Returns the rows in the order given (the floor's first), each with its time, or its status and reason."""
    inp = ctx.inputs
    announce = announce or (lambda name, first: None)
    device = settings.device
    turns: list[_Turn] = []
    rows: list[dict] = []

    def failed(turn: _Turn, exc: BaseException) -> None:
        if fatal is not None and fatal(str(exc)):
            raise exc
        turn.row.update(status="oom" if _is_oom(exc) else "error", reason=_error_text(exc), time=None)
        turns.remove(turn)
        reset_grads(inp)
        free_memory(device)

    entrants: list = ([FLOOR] if floor else []) + list(providers)
    for entrant in entrants:
        name = FLOOR if entrant == FLOOR else entrant.name
        announce(name, True)
        if entrant == FLOOR:
            row = _row(inp.op.name, inp.shape, FLOOR, impl=inp.op.floor_label)
            try:
                call = make_floor(inp)
            except Exception as exc:  # noqa: BLE001 - reported in the results, the run goes on
                row.update(status="oom" if _is_oom(exc) else "error", reason=_error_text(exc))
                call = None
            turn = _Turn(name, row, call, lambda: None)
        else:
            gate_settings = settings
            if deadline is not None:
                reserve = MIN_ROUNDS * sum(t.warm_s for t in turns) + ROUNDS_RESERVE_S
                left = deadline - time.time() - reserve
                if left < MIN_GATE_S:
                    rows.append(_row(inp.op.name, inp.shape, name, status="skipped",
                                     reason=f"not set up: {deadline - time.time():.0f} s left of the part, kept for "
                                            f"the rounds of the providers before it"))  # fmt: skip
                    continue
                gate_settings = dataclasses.replace(settings, deadline=time.time() + left)
            row, call = _gated(entrant, ctx, gate_settings)
            if fatal is not None and row["status"] == "error" and fatal(row["reason"]):
                raise RuntimeError(f"{name}'s gate: {row['reason']}")
            turn = _Turn(name, row, call, functools.partial(reset_grads, inp))
        rows.append(row)
        if turn.call is None:
            continue
        turns.append(turn)
        try:
            for _ in range(settings.warmup):
                t0 = time.perf_counter()
                turn.reset()
                turn.call()
                synchronize(device)
                turn.warm_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            failed(turn, exc)
    rounds = settings.iters
    if deadline is not None and turns:
        per_round = sum(t.warm_s for t in turns)
        fits = int((deadline - time.time() - 2 * per_round - 5.0) / max(per_round, 1e-6))
        rounds = max(min(rounds, fits), min(rounds, MIN_ROUNDS))
        if rounds < settings.iters:
            _log(f"    {rounds} rounds of {settings.iters}: the deadline ({per_round:.2f} s per round)")
    for round_ in range(rounds):
        order = turns[round_ % len(turns):] + turns[: round_ % len(turns)] if turns else []
        for turn in order:
            announce(turn.name, False)
            try:
                turn.samples.append(_timed_ms(turn.call, turn.reset, device))
            except Exception as exc:  # noqa: BLE001
                failed(turn, exc)
    timer = "cuda-events (interleaved)" if device.type == "cuda" else "perf_counter (interleaved)"
    for turn in list(turns):  # a copy: a failure removes its turn
        turn.row["time"] = stats_of(turn.samples, settings.warmup, timer).as_dict()
        if turn.name == FLOOR:
            continue
        announce(turn.name, False)
        try:
            _measure_memory(turn.row, turn.call, ctx, settings)
        except Exception as exc:  # noqa: BLE001
            failed(turn, exc)
        turn.reset()
    free_memory(device)
    for r in rows:
        shown = f"{r['time']['median_ms']:.3f} ms" if r["time"] else f"{r['status']} {r['reason']}"
        _log(f"    {r['provider']:<28} {shown}")
    return rows


def add_ratios(rows: list[dict], inp: BenchInputs) -> None:
    """x_floor = time / floor time; ours_speedup = time / grpo_kernels' time (> 1: ours is faster);
    throughput at the op's minimal work (GEMM FLOPs, or compulsory bytes for the loss head)."""
    by_name = {r["provider"]: r for r in rows if r["time"]}
    floor = by_name.get(FLOOR)
    ours = by_name.get(OURS)
    for r in rows:
        if not r["time"]:
            continue
        seconds = r["time"]["median_ms"] * 1e-3
        r["x_floor"] = r["time"]["median_ms"] / floor["time"]["median_ms"] if floor else None
        r["ours_speedup"] = (
            r["time"]["median_ms"] / ours["time"]["median_ms"] if ours and r is not floor else None
        )
        if inp.op.gemm_units:
            r["tflops"] = op_flops(inp.op, inp.shape) / seconds / 1e12
        else:
            r["gbps"] = compulsory_bytes(inp.shape) / seconds / 1e9


def run_suite(ops: list[str], shapes: list[BenchShape], provider_names: list[str], settings: RunSettings,
              presets: list[str]) -> dict:  # fmt: skip
    report = environment.describe(settings, ops, provider_names, presets)
    with warnings.catch_warnings():
        # the implementations legend of each table already says which backend "auto" resolved to
        warnings.simplefilter("ignore", BackendFallbackWarning)
        _run_ops(report, ops, shapes, provider_names, settings)
    return report


def _run_ops(report: dict, ops: list[str], shapes: list[BenchShape], provider_names: list[str],
             settings: RunSettings) -> None:  # fmt: skip
    for op in ops:
        providers = []
        for p in REGISTRY.for_op(op):
            if p.name not in provider_names:
                continue
            reason = p.unavailable(settings, op)
            if reason:
                report["skipped"].append({"op": op, "provider": p.name, "reason": reason})
            else:
                providers.append(p)
                note = p.version_note()
                if note and note not in report["notes"]:
                    report["notes"].append(note)
        limit = OPS[op].max_tokens
        for shape in shapes:
            if limit is not None and shape.tokens > limit:
                _log(f"[{op}] {shape.label}: beyond this op's token range ({limit}), not run")
                continue
            _log(f"[{op}] {shape.label}")
            ctx = prepare_shape(op, shape, settings)
            if settings.interleave:
                rows = run_interleaved(providers, ctx, settings, floor=True)
            else:
                rows = [measure_floor(ctx, settings)]
                for provider in providers:
                    rows.append(run_provider(provider, ctx, settings))
                    r = rows[-1]
                    shown = f"{r['time']['median_ms']:.3f} ms" if r["time"] else f"{r['status']} {r['reason']}"
                    _log(f"    {provider.name:<28} {shown}")
            add_ratios(rows, ctx.inputs)
            report["results"] += rows
            del ctx
            free_memory(settings.device)
