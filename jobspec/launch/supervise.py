"""The supervised `deepspeed` runner process: output relay, signal forwarding, rank watchdog.

Design decisions (why):
- The runner is started with `start_new_session=True` so the whole job (runner, DeepSpeed's per-node
  `launch.py`, ranks, DataLoader workers) is one process group we can signal and, at the end, kill:
  no orphans survive the launcher. Should the launcher itself be SIGKILLed, the runner gets a
  parent-death signal and the ranks end the group themselves (jobspec/lifeline.py).
- Output always goes through a pipe that we relay byte-chunk by byte-chunk (not line by line) to our
  stdout AND `launcher.log`: the log is needed for the failure reason, and a tqdm bar still renders
  because its `\\r` updates are passed through as they come (COLUMNS is passed so it knows the width).
- SIGUSR1 is set to "ignore" across the exec of the runner: DeepSpeed's runner and `launch.py` do not
  handle it and would die of it; the worker installs its own handler (checkpoint and stop), so a
  SIGUSR1 forwarded to the group reaches only the ranks' handlers.
- DeepSpeed's `launch.py` kills sibling ranks when one fails, but a sibling blocked in a gloo
  collective ignores the SIGTERM (the worker turns it into a flag) until `launch.py` SIGKILLs it 30 s
  later; the watchdog here tears the group down sooner when a rank is gone and no summary says
  the job finished.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from jobspec import lifeline, rundir

KILL_GRACE_S = 45.0       # after SIGINT/SIGTERM: DeepSpeed's launch.py waits 30 s for ranks, plus margin
RANK_EXIT_GRACE_S = 20.0  # a rank is gone, others still run, no finished summary: tear down after this
LEFTOVER_GRACE_S = 5.0    # runner exited: group members still alive get this long, then SIGKILL
TAIL_LINES = 30


@dataclass
class Outcome:
    exit_code: int                 # what `jobspec launch` returns
    user_signal: int | None        # SIGINT/SIGTERM received from the user, if any
    reason: str | None             # why it failed (None on success)
    log_tail: list[str]


def exit_code_of(returncode: int, rank_signal: int | None = None) -> int:
    """Shell convention: a child killed by signal N exits 128+N. DeepSpeed's launch.py ends with
    `sys.exit(rank.returncode)`, -N for a rank killed by signal N, which the OS turns into 256-N
    (247 for SIGKILL): with the signal seen in its log line, that is 128+N too."""
    if returncode < 0:
        return 128 - returncode
    if rank_signal and returncode == 256 - rank_signal:
        return 128 + rank_signal
    return returncode


# DeepSpeed's launch.py, when a rank ends badly: "[...] exits with return code = -9"
_RANK_SIGNAL = re.compile(rb"exits with return code = -(\d+)")


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of the process group."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def rank_pids(members: list[psutil.Process]) -> set[int]:
    """Ranks: the topmost processes with LOCAL_RANK in their environment (children are DataLoader workers)."""
    has_rank = {}
    for proc in members:
        try:
            has_rank[proc.pid] = ("LOCAL_RANK" in proc.environ(), proc.ppid())
        except psutil.Error:
            continue
    return {pid for pid, (ranked, ppid) in has_rank.items() if ranked and not has_rank.get(ppid, (False,))[0]}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _relay(fd: int, run_dir: Path, tail: collections.deque, echo, seen: dict, echo_filter=None) -> None:
    partial = b""
    with rundir.open_launcher_log(run_dir) as log_file:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            log_file.write(chunk)
            log_file.flush()
            shown = echo_filter.feed(chunk) if echo_filter is not None else chunk
            if echo is not None and shown:
                echo.write(shown)
                echo.flush()
            lines = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
            partial = lines.pop()
            for line in lines:
                if (found := _RANK_SIGNAL.search(line)) is not None:
                    seen.setdefault("rank_signal", int(found.group(1)))
            tail.extend(line.decode("utf-8", "replace") for line in lines if line.strip())
    if partial.strip():
        tail.append(partial.decode("utf-8", "replace"))
    rest = echo_filter.flush() if echo_filter is not None else b""
    if echo is not None and rest:
        echo.write(rest)
        echo.flush()
    os.close(fd)


def run(argv: list[str], env: dict, run_dir: Path, *, echo=None, kill_grace_s: float = KILL_GRACE_S,
              rank_exit_grace_s: float | None = None, leftover_grace_s: float = LEFTOVER_GRACE_S,
              poll_s: float = 0.2, echo_filter=None, started=None) -> Outcome:
    """Run `argv` in its own process group, relay its output, forward signals; no process outlives it.

    `echo_filter` (launch/quiet.TerminalFilter) picks what of the output reaches `echo` (launcher.log
    gets all of it); `started(pid)` is called once the runner runs (the launch tracks it meanwhile)."""
    import subprocess

    rank_exit_grace_s = RANK_EXIT_GRACE_S if rank_exit_grace_s is None else rank_exit_grace_s
    echo = sys.stdout.buffer if echo is None else echo
    read_fd, write_fd = os.pipe()
    previous_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited across exec: see module doc
    try:
        # the runner dies with us, even of SIGKILL; the ranks watch us themselves (jobspec/lifeline.py)
        proc = subprocess.Popen(argv, env={**env, **lifeline.launcher_env()}, stdin=subprocess.DEVNULL,
                                stdout=write_fd, stderr=write_fd, start_new_session=True, close_fds=True,
                                preexec_fn=lifeline.die_with_parent)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        os.close(write_fd)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    seen: dict = {}
    relay = threading.Thread(target=_relay, args=(read_fd, run_dir, tail, echo, seen, echo_filter), daemon=True)
    relay.start()
    if started is not None:
        started(proc.pid)

    state = {"user_signal": None, "kill_at": None}

    def forward(sig, _frame):
        _signal_group(proc.pid, sig)
        if sig in (signal.SIGINT, signal.SIGTERM):
            if state["user_signal"] is not None:  # a second Ctrl-C: stop waiting
                state["kill_at"] = time.monotonic()
            else:
                state["user_signal"] = sig
                state["kill_at"] = time.monotonic() + kill_grace_s

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    reason = None
    try:
        seen_ranks: set[int] = set()
        partial_since = None
        next_watch = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            if state["kill_at"] is not None and now >= state["kill_at"]:
                _signal_group(proc.pid, signal.SIGKILL)
            elif now >= next_watch:
                next_watch = now + 0.5
                alive = rank_pids(group_members(proc.pid))
                seen_ranks |= alive
                if alive and len(alive) < len(seen_ranks):
                    partial_since = partial_since or now
                    if now - partial_since >= rank_exit_grace_s and not rundir.summary_says_done(run_dir):
                        reason = (f"a rank exited while {len(alive)} other(s) kept running for "
                                  f"{rank_exit_grace_s:.0f} s (likely blocked in a collective); killed the job")
                        _signal_group(proc.pid, signal.SIGKILL)
            time.sleep(poll_s)
        returncode = proc.returncode
        deadline = state["kill_at"] or (time.monotonic() + leftover_grace_s)
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(poll_s)
        _signal_group(proc.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=10)

    user_signal = state["user_signal"]
    exit_code = 128 + user_signal if user_signal else exit_code_of(returncode, seen.get("rank_signal"))
    if user_signal:
        reason = f"stopped by {signal.Signals(user_signal).name} from the user"
    elif exit_code != 0:
        reason = "\n".join([reason or f"runner exited with code {exit_code}", *list(tail)[-15:]])
    return Outcome(exit_code, user_signal, reason, list(tail))
