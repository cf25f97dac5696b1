"""Spawned CPU process groups (gloo) for the multi-process tests.

`run_group(worker, world_size, *args)` starts `world_size` fresh processes (spawn), initialises a gloo
process group on 127.0.0.1 with a free port, runs `worker(rank, world_size, *args)` in each (a
module-level function: spawn pickles it by name) and returns the list of what each rank returned
(JSON-serialisable values), or raises with the failing rank's traceback. One torch thread per process:
the machines these run on have two cores.

Two time limits, so a hang fails in bounded time instead of waiting: `timeout` (seconds, the harness's
watchdog) kills every rank and raises; `collective_timeout` (seconds, given to `init_process_group`)
makes a gloo collective that a peer never joins raise on the waiting rank instead of blocking for
gloo's default 30 minutes (the default group's and every `new_group`'s).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, env: dict, worker, args,
           collective_timeout: float | None = None) -> None:  # fmt: skip
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        extra = {} if collective_timeout is None else {"timeout": datetime.timedelta(seconds=collective_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
        result = worker(rank, world_size, *args)
        path.write_text(json.dumps({"ok": result}))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(worker, world_size: int, *args, env: dict | None = None, timeout: float = 300,
              collective_timeout: float | None = None) -> list:  # fmt: skip
    """Run `worker(rank, world_size, *args)` on `world_size` spawned gloo ranks; their results in rank order.
    `timeout`: the whole run's limit (every rank killed past it); `collective_timeout`: each collective's."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry, args=(world_size, free_port(), out_dir, dict(env or {}), worker, args, collective_timeout),
            nprocs=world_size,
            join=False, start_method="spawn",
        )  # fmt: skip
        errors = []
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise RuntimeError(f"timed out after {timeout} s")
        except Exception as exc:  # noqa: BLE001 - a rank failed: report every rank's traceback
            errors.append(str(exc))
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.json"
            data = json.loads(path.read_text()) if path.exists() else {"error": "no result (killed?)"}
            if "error" in data:
                errors.append(f"rank {rank}:\n{data['error']}")
            results.append(data.get("ok"))
        if errors:
            raise RuntimeError("multi-process run failed:\n" + "\n".join(errors))
        return results
