"""The supervised `deepspeed` runner process: output relay, signal forwarding, rank watchdog.

Design decisions (why):
- The runner is started with `start_new_session=True` so the whole job (runner, DeepSpeed's per-node
  `launch.py`, ranks, DataLoader workers) is one process group we can signal and, at the end, kill:
  no orphans survive the launcher. Should the launcher itself be SIGKILLed, the runner gets a
  parent-death signal and the ranks end the group themselves (jobspec/lifeline.py).
- Output always goes through a pipe that we relay byte-chunk by byte-chunk (not line by line) to our
  stdout AND `launcher.log`: the log is needed for the failure reason, and a tqdm bar still renders
  because its `\\r` updates are passed through as they come (COLUMNS is passed so it knows the
  width).
- SIGUSR1 is set to "ignore" across the exec of the runner: DeepSpeed's runner and `launch.py` do
  not handle it and would die of it; the worker installs its own handler (checkpoint and stop), so a
  SIGUSR1 forwarded to the group reaches only the ranks' handlers.
- DeepSpeed's `launch.py` kills sibling ranks when one fails, but a sibling blocked in a gloo
  collective ignores the SIGTERM (the worker turns it into a flag) until `launch.py` SIGKILLs it 30
  s later; the watchdog here tears the group down sooner when a rank is gone and no summary says
  the job finished.
- Every stop is graceful (docs/reliability.md, "Stopping"): the first SIGINT, SIGTERM or SIGHUP
  is forwarded to the group as SIGTERM, whether it reached only this process (a terminal's Ctrl-C:
  the runner has its own session) or every process of the job at once (`scancel`, `kill -- -PGID`);
  the ranks treat every stop signal as a flag (jobspec/train/stopping.py), finish the step and save
  a checkpoint; DeepSpeed's launch.py, which would answer a SIGINT like a SIGTERM anyway, gets the
  signal it handles. Repeats of SIGTERM/SIGHUP keep waiting (`scancel` signals every task, and
  launch.sh passes a TERM on); a second SIGINT is a person pressing Ctrl-C again: the job ends at
  once (SIGKILL), without a checkpoint. SIGHUP means the terminal is gone: what would have been
  written to it goes to launcher.log from then on (a write to a hung-up terminal fails).
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

from jobspec import rundir
from jobspec.launch import rank_forks
from jobspec.launch import standby as standby_launcher

# after SIGINT/SIGTERM: DeepSpeed's launch.py waits 30 s for ranks, plus margin
KILL_GRACE_S = 45.0
# a rank is gone, others still run, no finished summary: tear down after this
RANK_EXIT_GRACE_S = 20.0
LEFTOVER_GRACE_S = 5.0    # runner exited: group members still alive get this long, then SIGKILL
TAIL_LINES = 30


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Outcome:
    exit_code: int                 # what `jobspec launch` returns
    user_signal: int | None        # SIGINT/SIGTERM/SIGHUP received from the user, if any
    reason: str | None             # why it failed (None on success)
    log_tail: list[str]
    # a second Ctrl-C ended the job without waiting for its checkpoint
    at_once: bool = False


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
    """Ranks: the topmost processes with LOCAL_RANK in their environment or a forked rank's name
    (launch/rank_forks.py; children are DataLoader workers)."""
    has_rank = {}
    for proc in members:
        try:
            ranked = proc.name() == rank_forks.FORKED_RANK_NAME or "LOCAL_RANK" in proc.environ()
            has_rank[proc.pid] = (ranked, proc.ppid())
        except psutil.Error:
            continue
    return {pid for pid, (ranked, ppid) in has_rank.items() if ranked
            and not has_rank.get(ppid, (False,))[0]}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _relay(fd: int, run_dir: Path, tail: collections.deque, echo, seen: dict,
           echo_filter=None) -> None:
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
            if echo is not None and shown and not seen.get("hung_up"):
                try:
                    echo.write(shown)
                    echo.flush()
                except OSError:   # the terminal is gone (EIO): keep draining the pipe into the log
                    seen["hung_up"] = True
            lines = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
            partial = lines.pop()
            for line in lines:
                if (found := _RANK_SIGNAL.search(line)) is not None:
                    seen.setdefault("rank_signal", int(found.group(1)))
            tail.extend(line.decode("utf-8", "replace") for line in lines if line.strip())
    if partial.strip():
        tail.append(partial.decode("utf-8", "replace"))
    rest = echo_filter.flush() if echo_filter is not None else b""
    if echo is not None and rest and not seen.get("hung_up"):
        try:
            echo.write(rest)
            echo.flush()
        except OSError:
            seen["hung_up"] = True
    os.close(fd)


def run(argv: list[str], env: dict, run_dir: Path, *, echo=None, kill_grace_s: float = KILL_GRACE_S,
              rank_exit_grace_s: float | None = None, leftover_grace_s: float = LEFTOVER_GRACE_S,
              poll_s: float = 0.2, echo_filter=None, started=None,
              waiting: standby_launcher.Standby | None = None) -> Outcome:
    """Run `argv` in its own process group, relay its output, forward signals; no process outlives
    it.

    `echo_filter` (launch/quiet.TerminalFilter) picks what of the output reaches `echo`
    (launcher.log gets all of it); `started(pid)` is called once the runner runs (the launch tracks
    it meanwhile); `waiting`: a standby node launcher (launch/standby.py) that runs `argv` if it
    takes it."""
    rank_exit_grace_s = RANK_EXIT_GRACE_S if rank_exit_grace_s is None else rank_exit_grace_s
    echo = sys.stdout.buffer if echo is None else echo
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    seen: dict = {}
    proc, relay = _spawn(argv, env, run_dir, echo, echo_filter, tail, seen, waiting)
    if started is not None:
        started(proc.pid)
    stops = _StopForwarder(proc.pid, kill_grace_s, seen, echo, run_dir)
    handled = (*STOP_SIGNALS, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, stops.forward) for sig in handled}
    try:
        reason = _watch(proc, stops, run_dir, rank_exit_grace_s, poll_s)
        returncode = proc.returncode
        # the runner is gone (DeepSpeed's launch.py may exit before its ranks): the ranks still get
        # the stop's grace, which a second Ctrl-C meanwhile cuts short (kill_at is read each time)
        leftover_deadline = time.monotonic() + leftover_grace_s
        while group_members(proc.pid) \
                and time.monotonic() < (stops.kill_at or leftover_deadline):
            stops.tell()
            time.sleep(poll_s)
        _signal_group(proc.pid, signal.SIGKILL)
        stops.tell()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=10)
    if seen.get("hung_up") and not seen.get("detached"):
        detach_from_terminal(run_dir)
    return _outcome(stops, returncode, reason, tail, seen)


def _spawn(argv: list[str], env: dict, run_dir: Path, echo, echo_filter,
           tail: collections.deque, seen: dict, waiting: standby_launcher.Standby | None = None):
    """The runner in a new session (the `waiting` standby node launcher when it takes `argv`), its
    output through a pipe to the relay thread."""
    if waiting is not None and waiting.takes(argv):
        proc, read_fd = waiting.hand_over(argv, env)
    else:
        if waiting is not None:
            waiting.abandon()
        proc, read_fd = standby_launcher.start_runner(argv, env)
    relay = threading.Thread(target=_relay, args=(read_fd, run_dir, tail, echo, seen, echo_filter),
                             daemon=True)
    relay.start()
    return proc, relay


class _StopForwarder:
    """The signal handler of a supervised run: a stop signal goes to the runner's group (SIGTERM,
    then SIGKILL at `kill_at`), a second Ctrl-C kills at once, Slurm's SIGUSR1 passes through.
    The terminal is told in `tell`, from the main loop (a write may be under way in the handler)."""

    def __init__(self, pid: int, kill_grace_s: float, seen: dict, echo, run_dir: Path):
        self.pid, self.kill_grace_s, self.seen = pid, kill_grace_s, seen
        self.echo, self.run_dir = echo, run_dir
        self.user_signal: int | None = None
        self.kill_at: float | None = None
        self.at_once = False
        self.notice: int | None = None

    def forward(self, sig, _frame) -> None:
        # Slurm's warning: the ranks checkpoint and stop; nothing else changes
        if sig == signal.SIGUSR1:
            _signal_group(self.pid, sig)
            return
        if sig == signal.SIGHUP:
            self.seen["hung_up"] = True   # the relay stops writing to the terminal at once
        if self.user_signal is None:
            self.user_signal = sig
            self.kill_at = time.monotonic() + self.kill_grace_s
            self.notice = sig
            _signal_group(self.pid, signal.SIGTERM)
        # Ctrl-C again: do not wait for the checkpoint
        elif sig == signal.SIGINT and not self.at_once:
            self.at_once = True
            self.kill_at = time.monotonic()
            self.notice = sig
            _signal_group(self.pid, signal.SIGKILL)   # now, not at the loop's next tick

    def tell(self) -> None:
        if self.seen.get("hung_up") and not self.seen.get("detached"):
            detach_from_terminal(self.run_dir)
            self.seen["detached"] = True
        if self.notice is not None:
            _notify(self.echo, self.seen, stop_notice(self.notice, self.at_once, self.kill_grace_s))
            self.notice = None


def _watch(proc, stops: _StopForwarder, run_dir: Path, rank_exit_grace_s: float,
           poll_s: float) -> str | None:
    """Until the runner exits: a stop's deadline kept, and a job whose ranks stopped exiting
    together (one gone, the others blocked in a collective) killed; returns why, if it was."""
    reason = None
    seen_ranks: set[int] = set()
    partial_since = None
    next_watch = 0.0
    while proc.poll() is None:
        now = time.monotonic()
        stops.tell()
        if stops.kill_at is not None and now >= stops.kill_at:
            _signal_group(proc.pid, signal.SIGKILL)
        elif now >= next_watch:
            next_watch = now + 0.5
            alive = rank_pids(group_members(proc.pid))
            seen_ranks |= alive
            if alive and len(alive) < len(seen_ranks):
                partial_since = partial_since or now
                if now - partial_since >= rank_exit_grace_s \
                        and not rundir.summary_says_done(run_dir):
                    reason = (f"a rank exited while {len(alive)} other(s) kept running for "
                              f"{rank_exit_grace_s:.0f} s (likely blocked in a collective); "
                              "killed the job")
                    _signal_group(proc.pid, signal.SIGKILL)
        time.sleep(poll_s)
    return reason


def _outcome(stops: _StopForwarder, returncode, reason: str | None,
             tail: collections.deque, seen: dict) -> Outcome:
    """The run's exit code and reason, from how the runner ended and who stopped it."""
    user_signal = stops.user_signal
    if stops.at_once:   # what a shell reports for Ctrl-C: 130, whatever the first signal was
        exit_code = 128 + signal.SIGINT
    else:
        exit_code = 128 + user_signal if user_signal \
            else exit_code_of(returncode, seen.get("rank_signal"))
    if user_signal:
        reason = f"stopped by {signal.Signals(user_signal).name} from the user"
    elif exit_code != 0:
        reason = "\n".join([reason or f"runner exited with code {exit_code}", *list(tail)[-15:]])
    return Outcome(exit_code, user_signal, reason, list(tail), at_once=stops.at_once)


def stop_notice(sig: int, at_once: bool, kill_grace_s: float) -> str:
    """What the terminal is told the moment a stop signal arrives."""
    name = signal.Signals(sig).name
    if at_once:
        return f"jobspec: {name} again: ending the job now, without waiting for the checkpoint"
    return (f"jobspec: {name}: the ranks finish the current step and save a checkpoint "
            f"(at most {kill_grace_s:.0f} s); Ctrl-C again ends the job at once, without one")


def _notify(echo, seen: dict, text: str) -> None:
    if seen.get("hung_up"):
        return
    try:
        echo.write(b"\n" + text.encode() + b"\n")
        echo.flush()
    except OSError:
        seen["hung_up"] = True


def detach_from_terminal(run_dir: Path) -> None:
    """The terminal hung up (SIGHUP: a closed tab, a dropped ssh session): this process's stdout and
    stderr go to launcher.log from now on, so the closing summary is written somewhere and no write
    to the dead terminal fails (EIO) on the way to the checkpoint's exit 75."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    log_fd = os.open(Path(run_dir) / rundir.LAUNCHER_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     0o644)
    try:
        for fd in (1, 2):
            os.dup2(log_fd, fd)
    finally:
        os.close(log_fd)


class HeldStops:
    """The launcher's stop signals around the supervised runner, as a context manager.

    Before `running()`: SIGTERM and SIGHUP interrupt like Ctrl-C (KeyboardInterrupt: the launch
    removes the run directory it was making; nothing is left half-made). While supervise.run runs,
    its own handlers apply. After it: a stop signal is only noted (SIGHUP also detaches from the
    terminal) so that the run's ending is written whole -- MLflow's status, summary.json, the
    closing lines -- instead of leaving a run RUNNING with a traceback."""

    def __init__(self, run_dir: Path | None = None):
        self.run_dir, self._running = run_dir, False
        self._previous: dict = {}

    def __enter__(self) -> "HeldStops":
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def running(self, run_dir: Path) -> None:
        """From now on the ranks run (or ran): signals no longer interrupt the launcher."""
        self.run_dir, self._running = run_dir, True

    def _handle(self, sig, _frame) -> None:
        if not self._running:
            raise KeyboardInterrupt(signal.Signals(sig).name)
        if sig == signal.SIGHUP and self.run_dir is not None:
            detach_from_terminal(self.run_dir)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
