"""Ranks never outlive their launcher, and a run whose launcher is gone can be recognised as such.

- The runner (DeepSpeed's `deepspeed` script) gets a parent-death signal: the kernel SIGKILLs it
  the moment `jobspec launch` dies, however it dies (`prctl(PR_SET_PDEATHSIG)`, Linux).
- A parent-death signal reaches only a direct child, and the ranks are the runner's grandchildren
  (runner -> DeepSpeed's launch.py -> ranks), so each rank also watches the launcher itself:
  JOBSPEC_LAUNCHER names it (host, pid, start time); when that process is gone, the rank removes
  the job's /dev/shm buffers and SIGKILLs its process group (runner, launch.py, every rank and
  DataLoader worker of the job), within WATCH_INTERVAL_S.
- The launcher writes the same identity to `run_dir/launcher.json` (jobspec/rundir.py): a later
  `launch`, `sync` or `report` that finds a run still RUNNING whose launcher is gone closes it.

Neutral ground: the launcher and the ranks both use it (the rank side never imports jobspec.launch).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading

import psutil

LAUNCHER_ENV = "JOBSPEC_LAUNCHER"
WATCH_INTERVAL_S = 1.0
PR_SET_PDEATHSIG = 1


def identity() -> dict:
    """This process as a launcher: host, pid and start time (a pid alone may be reused)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time()}


def is_alive(record: dict) -> bool | None:
    """Whether the process `record` names still runs; None when it ran on another host (unknowable
    here)."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(record["pid"]))
        return abs(proc.create_time() - float(record["started"])) < 1.0 \
            and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
    except psutil.Error:  # exists, but not ours to inspect
        return True


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# resolved here, in the parent: a `preexec_fn` runs between fork and exec, where loading a library
# could deadlock on a lock another thread of the parent held at the fork
_PRCTL = _find_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; False
    elsewhere)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent() -> None:
    """`preexec_fn` for the runner: SIGKILL when the launcher dies; if it is already gone, go
    now."""
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died between fork and prctl
        os._exit(1)


def launcher_env(record: dict | None = None) -> dict:
    return {LAUNCHER_ENV: json.dumps(record or identity())}


def watch_launcher(on_gone, environ=os.environ,
                   interval_s: float = WATCH_INTERVAL_S) -> threading.Thread | None:
    """Call `on_gone(record)` from a daemon thread once the launcher in JOBSPEC_LAUNCHER has died.

    Nothing to watch (None) without the variable (ranks started by hand or by tests) or when the
    launcher runs on another host (multi-node: srun tears the remote steps down)."""
    try:
        record = json.loads(environ.get(LAUNCHER_ENV) or "null")
    except ValueError:
        return None
    if not isinstance(record, dict) or is_alive(record) is None:
        return None

    def loop():
        stop = threading.Event()
        while not stop.wait(interval_s):
            if is_alive(record) is False:
                on_gone(record)
                return
    thread = threading.Thread(target=loop, name="jobspec-launcher-watch", daemon=True)
    thread.start()
    return thread


def end_orphaned_job(record: dict, master_port=None) -> None:
    """What a rank does when its launcher is gone: free the job's /dev/shm buffers (nothing else
    will), say why, and SIGKILL the job's process group, this rank included."""
    from jobspec.shm import remove_shared_memory_buffers
    remove_shared_memory_buffers(master_port)
    try:
        os.write(2,
                 (f"jobspec: the launcher (pid {record.get('pid')}) is gone; ending the job's "
                  "processes\n")
                 .encode())
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)
