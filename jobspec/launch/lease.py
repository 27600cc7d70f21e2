"""One live launch per checkpoint directory: an exclusive lease file with a heartbeat.

`<checkpoint.dir>/jobspec_lease.json` names the launch holding the directory (host, pid and its
start time, run directory, MLflow run, a random token) and a heartbeat the holder refreshes every
HEARTBEAT_S. It is created with `link(2)` of a fully written temporary file, which is atomic on
local filesystems and on NFS, where `flock` may do nothing across hosts: of two launches racing for
it, exactly one creates it, and nobody ever reads a half-written lease.

A lease is stale when its holder is known dead: on this host, its process is gone (or is another
process with a reused pid); on another host, its heartbeat is older than STALE_AFTER_S. A stale
lease is taken over, and the launch says whose it was. A live one refuses the launch with exit 2,
naming the holder. A Slurm requeue of the same job waits for its previous incarnation's lease to go
stale instead of refusing: Slurm is ending that incarnation, but its heartbeat cannot prove it yet.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from jobspec import lifeline
from jobspec.errors import spec_error

LEASE_FILE = "jobspec_lease.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0
log = logging.getLogger("jobspec.launch")


def read(ckpt_dir: Path) -> dict | None:
    """The lease record, or None when there is none (or it vanished while being read)."""
    try:
        record = json.loads((Path(ckpt_dir) / LEASE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # written by link of a complete file: unreadable means damaged
        return {"damaged": True}
    return record if isinstance(record, dict) else {"damaged": True}


def holder_state(record: dict, now: float | None = None) -> str:
    """"live", or "dead" (its process is gone), "silent" (no heartbeat for STALE_AFTER_S),
    "damaged"."""
    if record.get("damaged"):
        return "damaged"
    alive = lifeline.is_alive(record)
    if alive is not None:
        return "live" if alive else "dead"
    age = (now or time.time()) - float(record.get("heartbeat") or 0)
    return "live" if age < STALE_AFTER_S else "silent"


def describe(record: dict) -> str:
    """Who holds (or held) a lease, for the user."""
    if record.get("damaged"):
        return "an unreadable lease file"
    started = _utc(record.get("started"))
    parts = [f"host {record.get('host')}", f"pid {record.get('pid')}", f"started {started}"]
    if record.get("mlflow_run_id"):
        parts.append(f"MLflow run {record['mlflow_run_id']}")
    if record.get("run_dir"):
        parts.append(f"run dir {record['run_dir']}")
    return ", ".join(parts)


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint directory's lease, as read now."""

    record: dict
    state: str        # holder_state
    requeued: bool    # an earlier incarnation of this Slurm job: a launch waits for it to lapse

    @property
    def refuses(self) -> bool:
        """Whether a launch is refused: the holder lives and is no requeued incarnation of it."""
        return self.state == "live" and not self.requeued


def holder(ckpt_dir: Path) -> Holder | None:
    """The holder of `ckpt_dir`'s lease, or None when there is no lease."""
    record = read(ckpt_dir)
    return None if record is None else Holder(record, holder_state(record),
                                               _same_slurm_job(record))


def check(ckpt_dir: Path, job: str) -> None:
    """Refuse (exit 2) when a live launch holds `ckpt_dir`; nothing is written. A launch decides
    this with the rest (launch/decision.decide); this reads one directory now."""
    held = holder(ckpt_dir)
    if held is not None and held.refuses:
        raise refusal(ckpt_dir, job, held.record)


class Lease:
    """The lease this launch holds; `release()` (or leaving the `with` block) gives it back."""

    def __init__(self, ckpt_dir: Path, record: dict):
        self.path = Path(ckpt_dir) / LEASE_FILE
        self.record = record
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="jobspec-lease", daemon=True)

    def update(self, **fields) -> None:
        """Add what became known (run dir, MLflow run) to the lease."""
        with self._lock:
            self.record.update({k: (str(v) if isinstance(v, Path) else v)
                                for k, v in fields.items()})
            self._write()

    def release(self) -> None:
        self._stop.set()
        with self._lock:
            if self._still_ours():
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self._stop.is_set():
                    return
                self.record["heartbeat"] = time.time()
                try:
                    self._write()
                # a full or vanished filesystem: the checkpoint save will say more
                except OSError as err:
                    log.warning("could not refresh the lease %s: %s", self.path, err)

    def _still_ours(self) -> bool:
        current = read(self.path.parent)
        return current is not None and current.get("token") == self.record["token"]

    def _write(self) -> None:
        # taken over while this launcher was frozen: never clobber the new holder
        if not self._still_ours():
            self._stop.set()
            return
        tmp = self.path.with_name(f".{LEASE_FILE}.{self.record['token']}.tmp")
        tmp.write_text(json.dumps(self.record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def acquire(ckpt_dir: Path, job: str, *, say=print,
            wait_for_requeue_s: float = STALE_AFTER_S + HEARTBEAT_S, **fields) -> Lease:
    """The lease of `ckpt_dir` (which must exist), taking over a stale one; exit 2 when a live
    launch holds it."""
    ckpt_dir = Path(ckpt_dir)
    record = {**lifeline.identity(), "job": job, "token": secrets.token_hex(8),
              "heartbeat": time.time(),
              "acquired": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT")}
    record.update({k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()})
    deadline = time.monotonic() + wait_for_requeue_s
    announced_wait = False
    for _ in range(1000):
        if _create(ckpt_dir, record):
            lease = Lease(ckpt_dir, record)
            lease._thread.start()
            return lease
        held = read(ckpt_dir)
        if held is None:
            continue   # released (or taken over) between our attempt and the read: try again
        state = holder_state(held)
        if state == "live":
            if _same_slurm_job(held) and time.monotonic() < deadline:
                # Slurm requeued this job: its last incarnation is being ended
                if not announced_wait:
                    say(f"jobspec: waiting for the lease of {ckpt_dir} held by this Slurm job's "
                        f"previous run ({describe(held)}) to lapse")
                    announced_wait = True
                time.sleep(min(HEARTBEAT_S, 2.0))
                continue
            raise refusal(ckpt_dir, job, held)
        if _take_over(ckpt_dir, held):
            why = {"dead": "its process is gone", "damaged": "the file was unreadable",
                   "silent": f"no heartbeat for over {STALE_AFTER_S:.0f} s"}[state]
            say(f"jobspec: took over the lease of {ckpt_dir} left by a launch that is gone "
                f"({describe(held)}; {why})")
    raise spec_error(f"could not acquire the lease of {ckpt_dir}: it keeps changing hands",
                     path=("checkpoint", "dir"),
                     hint="another launch of this job is starting; try again")


def _create(ckpt_dir: Path, record: dict) -> bool:
    tmp = ckpt_dir / f".{LEASE_FILE}.{record['token']}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    try:
        os.link(tmp, ckpt_dir / LEASE_FILE)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(ckpt_dir: Path, stale: dict) -> bool:
    """Move the stale lease aside (rename is atomic: of two takers one gets it) and check that what
    was moved is the lease judged stale, not one a faster taker created meanwhile."""
    aside = ckpt_dir / f".{LEASE_FILE}.stale-{secrets.token_hex(4)}"
    try:
        os.rename(ckpt_dir / LEASE_FILE, aside)
    except FileNotFoundError:
        return False
    moved = read_file(aside)
    if moved is not None and moved.get("token") != stale.get("token") and not stale.get("damaged"):
        try:  # a live lease: put it back (link fails only if yet another launch holds the name now)
            os.link(aside, ckpt_dir / LEASE_FILE)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def read_file(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _same_slurm_job(record: dict) -> bool:
    """The lease is held by an earlier incarnation of this Slurm job (requeued: same id, new restart
    count)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    return bool(job_id) and record.get("slurm_job_id") == job_id and \
        record.get("slurm_restart_count") != os.environ.get("SLURM_RESTART_COUNT")


def refusal(ckpt_dir: Path, job: str, record: dict):
    """A live launch holds `ckpt_dir` (exit 2), naming it."""
    return spec_error(f"job {job!r} is already being launched into {ckpt_dir}: {describe(record)}",
                      path=("checkpoint", "dir"),
                      hint="wait for that launch to end (or stop it); to train a variant at the "
                           "same time, use `--new-run` or another output_dir")


def _utc(stamp) -> str:
    try:
        return datetime.fromtimestamp(float(stamp), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError):
        return "unknown time"
