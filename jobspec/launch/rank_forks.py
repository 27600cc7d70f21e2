"""Ranks forked from DeepSpeed's node launcher, which has already imported what they import.

Every rank of a job imports the same modules before its first step: torch, DeepSpeed, jobspec's
training side, the model's transformers code, MLflow on rank 0. As separate `python -m` processes
each rank pays for them again (4-7 s of CPU each; on a 2-core machine the two ranks' imports and the
node launcher's own `import deepspeed` are most of a small job's start-up). Here the node launcher
(launch/ds_launch.py) imports them once (the rank module's `preload`), and DeepSpeed's
launch.py, run unchanged, starts each rank with `subprocess.Popen`, which `install` replaces for
the rank command (`python -u -m MODULE ARGS`, output inherited) by a fork of this process that runs
MODULE as `__main__` with the environment launch.py gives it. Anything else launch.py starts is a
real `Popen`.

A forked rank is a real child of launch.py: its pid, exit status and signals are as launch.py
expects; it is in the runner's process group, so the launcher's stop signals reach it. Its command
line, as `ps` shows it, is the rank command it runs (setproctitle); its /proc/PID/environ is not its
environment (a fork keeps the block it started with), so the launcher recognises it by its process
name, `FORKED_RANK_NAME`, not by LOCAL_RANK there.

Only for CPU ranks by default (launch/backends.forks_ranks decides): a process that has initialised
CUDA cannot be forked safely, and on a GPU host that is not yet measured after DeepSpeed's import.
JOBSPEC_FORK_RANKS=1 forks GPU ranks too, to measure it (bench/gpu_startup.py): the node launcher
then asks NVML, not the CUDA driver, whether there is a GPU, and a node launcher that has
initialised CUDA all the same starts its ranks as their own processes.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from jobspec.launcher_log import LOG_ONLY
from jobspec.spec.types import JobSpec

FORK_FLAG = "--fork-ranks"          # ds_launch's own option (removed before launch.py parses)
FORKED_RANK_NAME = "jobspec-rank"   # a forked rank's process name (prctl PR_SET_NAME, < 16 bytes)
_PR_SET_NAME = 15
_REAL_POPEN = subprocess.Popen
_REAL_SLEEP = time.sleep            # ds_launch shortens launch.py's sleeps; a rank sleeps as asked


class ForkedRank:
    """The part of `subprocess.Popen` DeepSpeed's launch.py uses (pid, poll, wait, returncode,
    signals), for a rank forked from this process."""

    def __init__(self, cmd: Sequence[str], env: dict, module: str, args: list[str],
                 levels: dict | None = None):
        self.args = list(cmd)
        self.returncode: int | None = None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # what is imported by now stays out of the ranks' garbage collections: a collection would
        # walk (and so copy, page by page) every object the fork shares
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            _run_rank(self.args, module, args, env, levels or {})   # never returns
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:   # reaped elsewhere (psutil.wait_procs): as Popen says
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            _REAL_SLEEP(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def rank_module(cmd: Sequence[str]) -> tuple[str, list[str]] | None:
    """(MODULE, ARGS) of a rank command `python -u -m MODULE ARGS` run by this interpreter; None for
    any other command."""
    cmd = [str(part) for part in cmd]
    if len(cmd) < 4 or cmd[0] != sys.executable or cmd[1:3] != ["-u", "-m"]:
        return None
    return cmd[3], cmd[4:]


def install() -> None:
    """From now on `subprocess.Popen` of a rank command, with its output inherited, forks. The
    log levels of the moment are what each rank starts with (launch.py then sets DeepSpeed's
    logger to its --log_level, which a new process would not have)."""
    levels = _log_levels()

    def popen(cmd, *args, **kwargs):
        ranked = rank_module(cmd) if not args and set(kwargs) <= {"env"} else None
        if ranked is not None and cuda_initialized():
            print(f"{LOG_ONLY}CUDA is initialised in the node launcher: the ranks start as their "
                  "own processes, not forked", file=sys.stderr, flush=True)
            ranked = None
        if ranked is None:
            return _REAL_POPEN(cmd, *args, **kwargs)
        return ForkedRank(cmd, dict(kwargs.get("env") or os.environ), *ranked, levels=levels)
    subprocess.Popen = popen  # type: ignore[misc, assignment]


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (torch's lazy init): a fork of it could not use
    the GPU."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _log_levels() -> dict:
    """Every logger's level and its handlers' levels."""
    loggers = [logging.getLogger(), *(item for item in logging.root.manager.loggerDict.values()
                                      if isinstance(item, logging.Logger))]
    return {logger: (logger.level, [(h, h.level) for h in logger.handlers]) for logger in loggers}


def _restore_log_levels(levels: dict) -> None:
    for logger, (level, handlers) in levels.items():
        logger.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)


def _run_rank(cmd: list[str], module: str, args: list[str], env: dict, levels: dict) -> None:
    """In the forked child: become the rank `python -u -m MODULE ARGS` with `env`, and exit as
    that process would (its exit code; an uncaught exception: the traceback and 1)."""
    code = 1
    try:
        subprocess.Popen = _REAL_POPEN  # type: ignore[misc]
        time.sleep = _REAL_SLEEP
        show_command(cmd, FORKED_RANK_NAME)
        _restore_log_levels(levels)
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):   # as a new process has them
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        if callable(signal.getsignal(signal.SIGINT)):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [module, *args]
        # run as `python -m` runs it: a fresh `__main__`, not the module the preload imported
        # (runpy warns of one found in sys.modules)
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:   # as Python does: killed by the SIGINT it did not handle
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 -- the rank's own failure, printed as Python prints it
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        _flush()
        os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def prepare_titles() -> None:
    """Call before this process changes its environment: setproctitle finds the memory it rewrites
    (the command line's and the environment's, side by side) when first used, and finds none once
    the environment has moved."""
    import setproctitle

    setproctitle.getproctitle()


def show_command(cmd: Sequence[str], name: str = "python") -> None:
    """`cmd` as this process's command line in `ps` and /proc/PID/cmdline (see `prepare_titles`),
    `name` as its process name (setproctitle sets the title's start there)."""
    import setproctitle

    setproctitle.setproctitle(" ".join(str(part) for part in cmd))
    _set_process_name(name)


def _set_process_name(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the launcher finds no rank by name
        pass


def rank_module_name(launch_args: Sequence[str]) -> str | None:
    """The rank module among launch.py's arguments: its first positional one (every option jobspec
    gives launch.py is `--name=value` or a flag, runner.NodeLauncher)."""
    return next((arg for arg in launch_args if not arg.startswith("-")), None)


def preload(module: str | None, spec: JobSpec | None) -> None:
    """Import the rank module and call its `preload(spec)`, if it has one: the node launcher runs
    the ranks' code by the name launch.py runs it by, never by an import of the training side. A
    failure costs only time: each rank imports what it needs itself and reports what fails."""
    if module is None or spec is None:
        return
    try:
        hook = getattr(importlib.import_module(module), "preload", None)
        if hook is not None:
            hook(spec)
    except Exception as err:  # noqa: BLE001 -- see the doc
        print(f"{LOG_ONLY}ranks not preloaded, each imports its own: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)


def spec_of(launch_args: Sequence[str]) -> JobSpec | None:
    """The resolved spec in the run directory among launch.py's arguments (the worker's
    `--run-dir DIR`); None without one."""
    from jobspec import rundir

    run_dir = run_dir_of(launch_args)
    try:
        return rundir.read_resolved(run_dir) if run_dir is not None else None
    except Exception:  # noqa: BLE001 -- the rank reports a bad run directory itself
        return None


def run_dir_of(launch_args: Sequence[str]) -> Path | None:
    """The run directory among launch.py's arguments (the worker's `--run-dir DIR`)."""
    args = list(launch_args)
    for i, arg in enumerate(args[:-1]):
        if arg == "--run-dir":
            return Path(args[i + 1])
    return None
