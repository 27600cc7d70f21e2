"""DeepSpeed's node launcher started while `jobspec launch` still plans, so that what the ranks
import is imported beside the plan instead of after it.

A launch whose ranks will be forked (one node, CPU ranks: launch/rank_forks.py) starts
`python -u -m jobspec.launch.ds_launch --standby` as soon as its spec validates, the way
launch/supervise starts the runner (its own session, dies with the launcher, output into a pipe),
with a pipe for stdin. Two lines of JSON reach it there:

    {"module": ..., "spec": ...}   at once: it imports DeepSpeed and what the ranks import
                                   (the rank module's `preload`) while the launcher plans,
                                   decides, compiles and checks
    {"args": [...], "env": {...}}  once the run directory is written: launch.py's arguments and
                                   the ranks' environment; from then on it is ds_launch as always

A launch that does not get that far (a refusal, a finished job, a stop, an error) `abandon`s it: the
standby's process group is killed; it wrote nothing. The time a launch saves is the overlap, on two
cores the plan's imports beside the node launcher's (docs/benchmarks.md).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from jobspec import hardware, lifeline
from jobspec.compile.launch_plan import RANK_ENVIRONMENT, WORKER_MODULE
from jobspec.launch import rank_forks, runner
from jobspec.launch.backends import forks_ranks
from jobspec.spec.types import JobSpec

STANDBY_FLAG = "--standby"


def wanted(spec: JobSpec, environ=os.environ) -> bool:
    """Whether a launch of `spec` on this host forks its ranks from a node launcher started now:
    one node whose ranks are forked (launch/backends.forks_ranks, which backend_for asks of the
    plan)."""
    return (spec["resources"]["nodes"] == 1 and environ.get("JOBSPEC_DEEPSPEED_RUNNER") != "1"
            and forks_ranks(environ, hardware.ranks_on_cpus()))


def start_runner(argv: list[str], env: dict, stdin=subprocess.DEVNULL):
    """`argv` in a new session that dies with this process, its output into a pipe: (the process,
    the pipe's read end)."""
    read_fd, write_fd = os.pipe()
    # Slurm's early SIGUSR1 is ignored until the ranks handle it (launch/supervise.py's doc)
    previous_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        # the runner dies with us, even of SIGKILL; the ranks watch us themselves
        # (jobspec/lifeline.py)
        proc = subprocess.Popen(argv, env={**env, **lifeline.launcher_env()}, stdin=stdin,
                                stdout=write_fd, stderr=write_fd, start_new_session=True,
                                close_fds=True, preexec_fn=lifeline.die_with_parent)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        os.close(write_fd)
    return proc, read_fd


class Standby:
    """A node launcher importing what the ranks import, waiting for its arguments."""

    def __init__(self, proc: subprocess.Popen, read_fd: int):
        self.proc, self.read_fd = proc, read_fd
        self.handed_over = False

    @classmethod
    def start(cls, spec: JobSpec) -> Standby:
        argv = [sys.executable, "-u", "-m", runner.NODE_LAUNCHER, STANDBY_FLAG]
        proc, read_fd = start_runner(argv, {**os.environ, **RANK_ENVIRONMENT},
                                     stdin=subprocess.PIPE)
        standby = cls(proc, read_fd)
        standby._send({"module": WORKER_MODULE, "spec": dict(spec)})
        return standby

    def takes(self, argv: list[str]) -> bool:
        """Whether `argv` is a command this standby runs: ds_launch forking its ranks."""
        return (not self.handed_over and self.proc.poll() is None
                and argv[:4] == [sys.executable, "-u", "-m", runner.NODE_LAUNCHER]
                and rank_forks.FORK_FLAG in argv)

    def hand_over(self, argv: list[str], env: dict) -> tuple[subprocess.Popen, int]:
        """The node launcher runs `argv` (see `takes`) with `env` from now on: (the process, its
        output's read end), as `start_runner` gives them."""
        self._send({"args": argv[4:], "env": {**env, **lifeline.launcher_env()}})
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.handed_over = True
        return self.proc, self.read_fd

    def abandon(self) -> None:
        """Unless handed over: the standby and anything it started, gone; its pipe closed."""
        if self.handed_over:
            return
        self.handed_over = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:   # a line it never read: nothing to flush it to
            pass
        os.close(self.read_fd)

    def _send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message, default=str).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:   # it died: `takes` then says no, and the runner starts anew
            pass


def read_message(stream=None) -> dict | None:
    """In the standby: the next line of JSON on stdin; None at its end (the launch abandoned it)."""
    line = (stream or sys.stdin.buffer).readline()
    return json.loads(line) if line.strip() else None
