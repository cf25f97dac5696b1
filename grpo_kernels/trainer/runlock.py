"""One process per run folder: `<run folder>/run.lock`, taken before the run writes anything there.

The lock is an advisory `flock` on the file, held while the process lives (the kernel drops it on any exit,
SIGKILL included), and the file's text names the holder: {"pid", "host", "since", "command"}. A clean exit
empties the file (an empty run.lock is a free lock; the file is never removed, so that two processes can
never lock two different files of one name). A lock whose holder died without emptying it (a crash, a kill
-9) is stale: on the same host the pid is gone or is another process (its start time differs), and it is
taken over with a note; a holder on another host cannot be checked from here and is refused, naming it.
"""

from __future__ import annotations

import json
import os
import socket
import time

LOCK_NAME = "run.lock"


class RunFolderInUse(ValueError):
    """Another process holds the run folder's lock (the message names it: pid, host, since when)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None where unknown:
    with the pid, it tells a live holder from a later process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    now = _start_time(pid)
    return start is None or now is None or now == start


def describe_holder(info: dict) -> str:
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    command = f", running: {info['command']}" if info.get("command") else ""
    return f"pid {info.get('pid')} on host {info.get('host')} (since {when}{command})"


class RunLock:
    """The lock of one run folder, held by this process until release() (idempotent)."""

    def __init__(self, run_dir: str, command: str = ""):
        import fcntl

        self.path = os.path.join(run_dir, LOCK_NAME)
        self.note = None  # set when a stale lock was taken over (the caller logs it)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunFolderInUse(self._refusal(run_dir, _read(fd), live=True)) from None
            holder = _read(fd)
            if holder:  # the file names a holder that did not release it: alive elsewhere, or stale
                host = socket.gethostname()
                if holder.get("host") != host:
                    raise RunFolderInUse(self._refusal(run_dir, holder, live=False))
                if isinstance(holder.get("pid"), int) and holder["pid"] != os.getpid() and _alive(
                    holder["pid"], holder.get("start")
                ):
                    raise RunFolderInUse(self._refusal(run_dir, holder, live=True))
                self.note = (f"note: {self.path} named {describe_holder(holder)}, which is no longer running (it "
                             "did not exit cleanly): lock taken over")  # fmt: skip
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                  "start": _start_time(os.getpid()), "command": command}  # fmt: skip
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def _refusal(self, run_dir: str, holder: dict, live: bool) -> str:
        who = describe_holder(holder) if holder else "another process"
        if live:
            return (f"run folder {run_dir!r} is in use by {who}: one process per run folder; wait for it to end "
                    "or stop it (SIGTERM checkpoints and exits), or use another --run-dir")  # fmt: skip
        import shlex

        return (f"run folder {run_dir!r} is locked by {who}, on another host, which cannot be checked from here: "
                f"if that process is gone (its node crashed), free the lock with: rm {shlex.quote(self.path)}")

    def release(self) -> None:
        """Empties the file and drops the lock (the file stays: see the module docstring)."""
        fd, self.fd = getattr(self, "fd", None), None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


def _read(fd: int) -> dict:
    """The holder named in the lock file ({} when empty or unreadable)."""
    try:
        data = os.pread(fd, 65536, 0)
        info = json.loads(data.decode()) if data.strip() else {}
    except (OSError, ValueError):  # a write cut short by a crash: no live holder wrote it
        return {}
    return info if isinstance(info, dict) else {}
