"""The GPU session's headline on CPU: the floor and the providers of a shape timed in turns in one process
(runner.run_interleaved, session_worker's `interleaved` job), and the peers added to the verdict: Liger's
chunked GRPO loss with TF32 allowed and its fastest chunk size, verl's Triton kernel loaded without verl's
package (the GPU machine lacks Ray). The times are the GPU's to give; here: the order of the calls, the
announcements a supervising process reads, the deadline's cut, and that each peer is the peer's own code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_kernels.bench import runner
from grpo_kernels.bench.providers import REGISTRY, RunSettings
from grpo_kernels.bench.session_worker import interleaved_keys, read_rows
from grpo_kernels.bench.shapes import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _settings(iters=4, warmup=1):
    return RunSettings(dtype=torch.float32, device=torch.device("cpu"), warmup=warmup, iters=iters)


def _counted(provider_name, calls):
    """The registry's provider with each call of its op recorded in `calls` (name, round order)."""
    p = REGISTRY.providers[provider_name]
    setups = {}
    for op, setup in p.setups.items():

        def wrapped(inp, s, setup=setup):
            forward = setup(inp, s)
            fn = forward.fn

            def counted():
                calls.append(provider_name)
                return fn()

            forward.fn = counted
            return forward

        setups[op] = wrapped
    return type(p)(**{**p.__dict__, "setups": setups})


def test_the_floor_and_the_providers_take_turns_the_order_rotating():
    calls, seen = [], []
    ctx = runner.prepare_shape("fused_grpo", PRESETS["tiny"][0], _settings())
    providers = [_counted("grpo_kernels", calls), _counted("torch-eager", calls)]
    rows = runner.run_interleaved(providers, ctx, _settings(), floor=True, announce=lambda n, f: seen.append((n, f)))
    assert [r["provider"] for r in rows] == ["floor", "grpo_kernels", "torch-eager"]
    assert all(r["status"] == "ok" and r["time"]["iters"] == 4 and "interleaved" in r["time"]["timer"] for r in rows)
    assert all(r["memory"]["peak_extra_bytes"] > 0 for r in rows[1:]) and rows[0]["memory"] is None
    # gates in order, then 4 rounds of one timed call each, each round starting one participant later
    gates = [n for n, first in seen if first]
    assert gates == ["floor", "grpo_kernels", "torch-eager"]
    timed = [n for n, first in seen if not first][:12]
    assert timed == ["floor", "grpo_kernels", "torch-eager", "grpo_kernels", "torch-eager", "floor",
                     "torch-eager", "floor", "grpo_kernels", "floor", "grpo_kernels", "torch-eager"]  # fmt: skip
    # each provider: the parity gate's call, 1 warm-up, 4 timed, 1 for memory
    assert calls.count("grpo_kernels") == calls.count("torch-eager") == 7


def test_a_deadline_cuts_the_rounds_but_never_below_the_minimum(monkeypatch):
    monkeypatch.setattr(runner, "MIN_GATE_S", 0.1)  # a gate is allowed; then a second is too little for rounds
    monkeypatch.setattr(runner, "ROUNDS_RESERVE_S", 0.1)
    ctx = runner.prepare_shape("logprobs", PRESETS["tiny"][0], _settings())
    rows = runner.run_interleaved([REGISTRY.providers["grpo_kernels"]], ctx, _settings(iters=50), floor=True,
                                  deadline=time.time() + 1.0)  # fmt: skip
    assert [r["time"]["iters"] for r in rows] == [runner.MIN_ROUNDS] * 2
    rows = runner.run_interleaved([REGISTRY.providers["grpo_kernels"]], ctx, _settings(iters=6), floor=True,
                                  deadline=time.time() + 600)  # fmt: skip
    assert [r["time"]["iters"] for r in rows] == [6, 6]  # room enough: every round asked for


def test_with_little_time_left_a_provider_is_not_set_up_and_its_row_says_why():
    """The providers' order is their priority: once what is left of the part would not hold MIN_ROUNDS rounds
    of those already set up plus MIN_GATE_S for the next one, the rest are skipped, named, not started."""
    ctx = runner.prepare_shape("logprobs", PRESETS["tiny"][0], _settings())
    rows = runner.run_interleaved([REGISTRY.providers["grpo_kernels"], REGISTRY.providers["torch-eager"]], ctx,
                                  _settings(), floor=True, deadline=time.time() + runner.MIN_GATE_S)  # fmt: skip
    by = {r["provider"]: r for r in rows}
    assert by["floor"]["status"] == "ok" and by["floor"]["time"]["iters"] == 4  # the floor needs no setup
    for name in ("grpo_kernels", "torch-eager"):
        assert by[name]["status"] == "skipped" and "left of the part" in by[name]["reason"], by[name]


def _planted(op: str, fail_at: int, message: str):
    """torch-eager's provider, renamed "planted", whose `fail_at`-th call of `op` raises RuntimeError(message)
    (the gate's call is the first, each warm-up and timed call the next)."""
    broken = REGISTRY.providers["torch-eager"]

    def setup(inp, s):
        forward = broken.setups[op](inp, s)
        state = {"n": 0}
        fn = forward.fn

        def failing():
            state["n"] += 1
            if state["n"] == fail_at:
                raise RuntimeError(message)
            return fn()

        forward.fn = failing
        return forward

    return type(broken)(**{**broken.__dict__, "name": "planted", "setups": {op: setup}})


def test_a_provider_that_fails_leaves_the_others_timed():
    ctx = runner.prepare_shape("fused_grpo", PRESETS["tiny"][0], _settings())
    planted = _planted("fused_grpo", 4, "a planted failure")  # gate, warm-up, round 1: then a failure
    rows = runner.run_interleaved([planted, REGISTRY.providers["grpo_kernels"]], ctx, _settings(), floor=True)
    by = {r["provider"]: r for r in rows}
    assert by["planted"]["status"] == "error" and "a planted failure" in by["planted"]["reason"]
    assert by["planted"]["time"] is None
    assert by["grpo_kernels"]["time"]["iters"] == 4 and by["floor"]["time"]["iters"] == 4


def test_the_interleaved_job_writes_each_row_under_the_key_its_own_job_would_give(tmp_path):
    """session_worker's `interleaved` job on tiny CPU shapes: rows under the bench keys, with ratios to the floor
    of their own turn; every gate and call announced, every row ended."""
    jsonl = tmp_path / "r.jsonl"
    providers = ("floor", "grpo_kernels", "torch-eager")
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.bench.session_worker", "interleaved", "--jsonl",
                           str(jsonl), "--part", "headline", "--providers", ",".join(providers), "--ops",
                           "logprobs,fused_grpo", "--shapes", "tiny", "--warmup", "1", "--iters", "3", "--rehearsal",
                           "--deadline", str(time.time() + 600)],
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    keys = [k for k, _, _ in interleaved_keys("headline", providers, ("logprobs", "fused_grpo"), "tiny")]
    assert keys[:3] == ["headline|logprobs|floor|64", "headline|logprobs|grpo_kernels|64",
                        "headline|logprobs|torch-eager|64"]  # fmt: skip
    rows = [r for r in read_rows(jsonl) if r["kind"] == "bench"]
    assert [r["key"] for r in rows] == keys
    for r in rows:
        assert r["status"] == "ok" and r["time"]["iters"] == 3, r
        assert r["x_floor"] > 0 and (r["provider"] == "floor") == (r["x_floor"] == 1.0)
    started = [line[8:] for line in proc.stdout.splitlines() if line.startswith("@@start ")]
    ended = [line[6:] for line in proc.stdout.splitlines() if line.startswith("@@end ")]
    assert set(started) == set(keys) and ended == keys
    assert len(started) == 4 * (3 + 3 * 3 + 2)  # 2 ops x 2 shapes, each: 3 gates, 3 rounds of 3 calls, 2 memory calls


def test_liger_tuned_picks_a_chunk_size_and_computes_ligers_loss():
    """Liger's chunked GRPO loss with TF32 allowed (a no-op on CPU) and the fastest of its chunk sizes: the
    same loss as at Liger's defaults; the row names the size chosen and each candidate's time."""
    pytest.importorskip("liger_kernel.chunked_loss")
    ctx = runner.prepare_shape("fused_grpo", PRESETS["tiny"][0], _settings())
    inp = ctx.inputs
    tuned = REGISTRY.providers["liger-chunked-tuned"].setups["fused_grpo"](inp, _settings())
    default = REGISTRY.providers["liger-chunked"].setups["fused_grpo"](inp, _settings())
    assert "chunk_size=" in tuned.impl and "TF32 allowed" in tuned.impl
    tried = tuned.impl.split("one call each: ")[1]
    assert tried.count(" ms") == sum(1 for c in (1, 2, 4, 8) if inp.shape.batch % c == 0), tuned.impl
    before = torch.get_float32_matmul_precision()
    a, b = tuned.fn(), default.fn()
    # a deadline already passed: the first candidate (Liger's default size) only, the others named as not tried
    hurried = REGISTRY.providers["liger-chunked-tuned"].setups["fused_grpo"](
        inp, dataclasses.replace(_settings(), deadline=time.time()))
    assert "chunk_size=1 " in hurried.impl and "not tried (the part's time)" in hurried.impl, hurried.impl
    assert torch.get_float32_matmul_precision() == before  # restored after each call
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)


def test_verls_kernel_loads_without_verls_package():
    """On the GPU machine `import verl` fails (Ray is not there); the kernel's own two files load from verl's
    folder under stand-ins and are verl's code, unchanged. Simulated here by making `ray` unimportable."""
    pytest.importorskip("verl")
    code = ("import sys, json; sys.modules['ray'] = None\n"
            "from grpo_kernels.bench import verl_kernel\n"
            "import verl.utils.kernel.kernels as k\n"
            "m = sys.modules['verl.utils.kernel.linear_cross_entropy']\n"
            "print(json.dumps({'how': verl_kernel.HOW, 'same': verl_kernel.linear_cross_entropy is m.linear_cross_entropy,"
            " 'file': m.__file__, 'kernels': k.__file__,"
            " 'device': type(sys.modules['verl.utils.device'].get_torch_device()).__name__}))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    import importlib.util

    folder = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    assert got["how"].startswith("verl's kernel files from") and "ray" in got["how"].lower(), got
    assert got["same"]  # the function verl's module defines
    assert Path(got["file"]) == folder / "utils" / "kernel" / "linear_cross_entropy.py"
    assert Path(got["kernels"]) == folder / "utils" / "kernel" / "kernels.py"
    assert got["device"] == "module"  # torch.cuda, for the kernel's streams and events


def test_a_fault_that_poisons_the_process_is_raised_not_recorded():
    """A CUDA fault leaves every later call of the process wrong: run_interleaved raises it (the supervising
    session charges it to the call announced last and measures the rest in a fresh process) instead of
    recording an error row and going on with a poisoned context."""
    ctx = runner.prepare_shape("logprobs", PRESETS["tiny"][0], _settings())
    # gate, warm-up, then the first timed call
    planted = _planted("logprobs", 3, "CUDA error: an illegal memory access was encountered")
    seen = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        runner.run_interleaved([REGISTRY.providers["grpo_kernels"], planted], ctx, _settings(), floor=True,
                               announce=lambda n, f: seen.append(n), fatal=lambda text: "illegal memory" in text)  # fmt: skip
    assert seen[-1] == "planted"  # the call the supervisor charges it to
