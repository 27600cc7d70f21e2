"""Run directories, checkpoint ownership, and the supervised `deepspeed` runner process.

Design decisions (why):
- The runner is started with `start_new_session=True` so the whole job (runner, DeepSpeed's per-node
  `launch.py`, ranks, DataLoader workers) is one process group we can signal and, at the end, kill:
  no orphans survive the launcher.
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
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil

from jobspec.errors import spec_error

KILL_GRACE_S = 45.0       # after SIGINT/SIGTERM: DeepSpeed's launch.py waits 30 s for ranks, plus margin
RANK_EXIT_GRACE_S = 20.0  # a rank is gone, others still run, no finished summary: tear down after this
LEFTOVER_GRACE_S = 5.0    # runner exited: group members still alive get this long, then SIGKILL
LOG_FILE = "launcher.log"
TAIL_LINES = 30


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def new_run_dir_path(output_dir: str | Path, now: datetime | None = None) -> Path:
    """`<output_dir>/run-<UTC %Y%m%d-%H%M%S>-<4 hex>` (not created)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return Path(output_dir) / f"run-{stamp}-{secrets.token_hex(2)}"


def create_run_dir(output_dir: str | Path) -> Path:
    """A new, empty run directory; never an existing one (exclusive mkdir, new name on collision)."""
    ensure_writable(output_dir, ("output_dir",))
    for _ in range(100):
        path = new_run_dir_path(output_dir)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise spec_error(f"could not create a new run directory under {output_dir}", path=("output_dir",))


def ensure_writable(directory: str | Path, field: tuple) -> None:
    """Create `directory` if needed and prove we can write there, before anything starts."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".jobspec-write-test-{os.getpid()}"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as err:
        raise spec_error(f"{directory} is not a writable directory ({err.strerror or err})", path=field,
                         hint=f"set {'.'.join(field)} to a directory you can write, or fix its permissions")


def runner_prefix() -> list[str]:
    """How to start DeepSpeed's runner with *this* interpreter.

    The `deepspeed` script next to sys.executable is used when present (it is what a user would type);
    otherwise `python -m deepspeed.launcher.runner`, because a `deepspeed` found elsewhere on PATH
    (another venv, a pyenv shim) may run a different Python than the one jobspec runs in.
    """
    script = shutil.which("deepspeed")
    if script and Path(script).resolve().parent == Path(sys.executable).resolve().parent:
        return [script]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def resolve_runner(argv: list) -> list[str]:
    argv = [str(a) for a in argv]
    return runner_prefix() + argv[1:] if argv and argv[0] == "deepspeed" else argv


def preflight_problems(spec: dict, job) -> list[str]:
    """Host checks that `--ignore-preflight` turns into warnings (they can be wrong, e.g. under Slurm)."""
    problems = []
    res = spec["resources"]
    if res["master_port"] is not None and job.nodes == 1 and port_in_use(res["master_port"]):
        problems.append(f"resources.master_port {res['master_port']} is already in use on this host "
                        "(set it to null to pick a free port)")
    if job.nodes == 1:
        from jobspec.tracking.telemetry import gpu_names
        gpus = [g for g in gpu_names() if g != "cpu"]
        available, kind = (len(gpus), "GPUs") if gpus else (os.cpu_count() or 1, "CPU cores")
        if job.gpus_per_node > available:
            problems.append(f"resources.gpus_per_node is {job.gpus_per_node} but this host has "
                            f"{available} {kind}")
    space_problem = checkpoint_space_problem(spec, job)
    if space_problem:
        problems.append(space_problem)
    return problems


def checkpoint_space_problem(spec: dict, job) -> str | None:
    """Refuse before training when the checkpoint directory's disk cannot hold even one checkpoint."""
    ckpt = spec["checkpoint"]
    if not (ckpt["save_final"] or ckpt["every_n_steps"]):
        return None
    from jobspec.memory.planner import checkpoint_bytes
    needed = checkpoint_bytes(spec, job)
    directory = Path(ckpt["dir"])
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if needed is None or free >= needed:
        return None
    return (f"checkpoint.dir {ckpt['dir']} has {free / 2**30:.1f} GiB free but one checkpoint needs about "
            f"{needed / 2**30:.1f} GiB (parameters x weights + fp32 master + optimizer state); free space "
            "or point checkpoint.dir at a larger disk")


# --- the supervised process -------------------------------------------------------------------

@dataclass
class Outcome:
    exit_code: int                 # what `jobspec launch` returns
    user_signal: int | None        # SIGINT/SIGTERM received from the user, if any
    reason: str | None             # why it failed (None on success)
    log_tail: list[str]


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


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


def _relay(fd: int, log_path: Path, tail: collections.deque, echo) -> None:
    partial = b""
    with open(log_path, "ab") as log_file:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            log_file.write(chunk)
            log_file.flush()
            if echo is not None:
                echo.write(chunk)
                echo.flush()
            lines = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
            partial = lines.pop()
            tail.extend(line.decode("utf-8", "replace") for line in lines if line.strip())
    if partial.strip():
        tail.append(partial.decode("utf-8", "replace"))
    os.close(fd)


def summary_says_done(run_dir: Path) -> bool:
    import json
    try:
        status = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("status")
    except (OSError, ValueError, AttributeError):
        return False
    return status in ("finished", "preempted")


def supervise(argv: list[str], env: dict, run_dir: Path, *, echo=None, kill_grace_s: float = KILL_GRACE_S,
              rank_exit_grace_s: float | None = None, leftover_grace_s: float = LEFTOVER_GRACE_S,
              poll_s: float = 0.2) -> Outcome:
    """Run `argv` in its own process group, relay its output, forward signals; no process outlives it."""
    import subprocess

    rank_exit_grace_s = RANK_EXIT_GRACE_S if rank_exit_grace_s is None else rank_exit_grace_s
    echo = sys.stdout.buffer if echo is None else echo
    read_fd, write_fd = os.pipe()
    previous_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited across exec: see module doc
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
                                start_new_session=True, close_fds=True)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        os.close(write_fd)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    relay = threading.Thread(target=_relay, args=(read_fd, run_dir / LOG_FILE, tail, echo), daemon=True)
    relay.start()

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
                    if now - partial_since >= rank_exit_grace_s and not summary_says_done(run_dir):
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
    exit_code = 128 + user_signal if user_signal else exit_code_of(returncode)
    if user_signal:
        reason = f"stopped by {signal.Signals(user_signal).name} from the user"
    elif exit_code != 0:
        reason = "\n".join([reason or f"runner exited with code {exit_code}", *list(tail)[-15:]])
    return Outcome(exit_code, user_signal, reason, list(tail))


def remove_shared_memory_buffers(master_port: int | None, shm_dir: Path = Path("/dev/shm"),
                                 local_rank: int | None = None) -> int:
    """Delete the CPU accelerator's all-reduce buffers of a finished job; returns how many.

    DeepSpeed's shm communication op leaves a `deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>` file
    of ~66 MB per rank in /dev/shm after every job (it never unlinks them), so a machine that runs
    many jobs fills its RAM-backed /dev/shm until the OOM killer steps in. Once the runner and all
    ranks are gone nothing maps them; the master port names this job's files.
    """
    if not master_port or not shm_dir.is_dir():
        return 0
    removed = 0
    rank = "*" if local_rank is None else int(local_rank)
    for path in shm_dir.glob(f"deepspeed_allreduce_buffer_*_{int(master_port)}_{rank}"):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


# --- checkpoint ownership ---------------------------------------------------------------------

OWNER_FILE = "jobspec_job.json"


def read_owner(ckpt_dir: Path) -> dict | None:
    import json
    try:
        return json.loads((ckpt_dir / OWNER_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise spec_error(f"{ckpt_dir / OWNER_FILE} is unreadable ({err})", path=("checkpoint", "dir"),
                         hint="fix or delete that file, or point checkpoint.dir elsewhere")


def claim_checkpoints(spec: dict) -> str | None:
    """Refuse to touch another job's checkpoints; the MLflow run id to continue when resuming ours.

    Checkpoints exist when the directory has anything besides the ownership file.
    """
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    resume = spec["checkpoint"]["resume"]
    ensure_writable(ckpt_dir, ("checkpoint", "dir"))
    owner = read_owner(ckpt_dir)
    has_checkpoints = any(p.name != OWNER_FILE and not p.name.startswith(".jobspec-write-test")
                          for p in ckpt_dir.iterdir())
    where = ("checkpoint", "dir")
    if owner is not None and owner.get("job") != spec["name"]:
        raise spec_error(f"{ckpt_dir} belongs to job {owner.get('job')!r} (from {owner.get('spec')}), "
                         f"not {spec['name']!r}", path=where,
                         hint="set checkpoint.dir to a directory of this job, or rename the job")
    if has_checkpoints and owner is None:
        raise spec_error(f"{ckpt_dir} already holds files that no jobspec job claims", path=where,
                         hint="point checkpoint.dir at an empty directory, or move those files away")
    if has_checkpoints and resume == "never":
        raise spec_error(f"{ckpt_dir} already holds checkpoints of job {spec['name']!r} and "
                         "checkpoint.resume is 'never'", path=("checkpoint", "resume"),
                         hint="use `--set checkpoint.resume=auto` to continue them, or delete the directory "
                              "/ set checkpoint.dir elsewhere to start over")
    return owner.get("mlflow_run_id") if (owner and has_checkpoints) else None


def write_owner(spec: dict, source: Path, mlflow_run_id: str | None) -> None:
    import json
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    previous = read_owner(ckpt_dir) or {}
    record = {"job": spec["name"], "spec": str(source), "mlflow_run_id": mlflow_run_id,
              "created": previous.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = ckpt_dir / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(ckpt_dir / OWNER_FILE)
