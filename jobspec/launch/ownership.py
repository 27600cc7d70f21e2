"""Checkpoint ownership: `checkpoint.dir/jobspec_job.json` names the job (and its MLflow run) whose
checkpoints the directory holds, so a launch never resumes, or overwrites, another job's state.

The record also holds what the checkpoints were trained under: the fingerprint
(launch/fingerprint.py), the flattened resolved spec of the latest launch, and the segments: the
launches that trained into the directory with a changed spec, each with the step it started at, its
run directory and its changes."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from jobspec import rundir
from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec

OWNER_FILE = "jobspec_job.json"
LEASE_FILE = "jobspec_lease.json"   # launch/lease.py


def is_checkpoint_entry(path: Path) -> bool:
    """Whether a directory entry is (part of) a checkpoint, not jobspec's bookkeeping."""
    name = path.name
    return name not in (OWNER_FILE, LEASE_FILE) and not name.startswith((".jobspec-write-test",
                                                                         f".{LEASE_FILE}",
                                                                          f".{OWNER_FILE}"))


def read_owner(ckpt_dir: Path) -> dict | None:
    try:
        return json.loads((ckpt_dir / OWNER_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise spec_error(f"{ckpt_dir / OWNER_FILE} is unreadable ({err})",
                         path=("checkpoint", "dir"),
                         hint="fix or delete that file, or point checkpoint.dir elsewhere")


def claim_checkpoints(spec: JobSpec) -> str | None:
    """Refuse to touch another job's checkpoints; the MLflow run id to continue when resuming ours.
    Makes `checkpoint.dir` (and proves it writable) first."""
    rundir.ensure_writable(Path(spec["checkpoint"]["dir"]), ("checkpoint", "dir"))
    return check_checkpoints(spec)


def check_checkpoints(spec: JobSpec) -> str | None:
    """claim_checkpoints without touching the disk (`launch --dry-run`): the same refusals, the same
    run id. Checkpoints exist when the directory has anything besides the ownership file."""
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    resume = spec["checkpoint"]["resume"]
    if not ckpt_dir.is_dir():
        return None
    owner = read_owner(ckpt_dir)
    has_checkpoints = any(is_checkpoint_entry(p) for p in ckpt_dir.iterdir())
    where = ("checkpoint", "dir")
    if owner is not None and owner.get("job") != spec["name"]:
        raise spec_error(f"{ckpt_dir} belongs to job {owner.get('job')!r} (from "
                         f"{owner.get('spec')}), not {spec['name']!r}", path=where,
                         hint="set checkpoint.dir to a directory of this job, or rename the job")
    if has_checkpoints and owner is None:
        raise spec_error(f"{ckpt_dir} already holds files that no jobspec job claims", path=where,
                         hint="point checkpoint.dir at an empty directory, or move those files "
                              "away")
    if has_checkpoints and resume == "never":
        raise spec_error(f"{ckpt_dir} already holds checkpoints of job {spec['name']!r} and "
                         "checkpoint.resume is 'never'", path=("checkpoint", "resume"),
                         hint="use `--set checkpoint.resume=auto` to continue them, or delete the "
                              "directory / set checkpoint.dir elsewhere to start over")
    return owner.get("mlflow_run_id") if (owner and has_checkpoints) else None


def write_owner(spec: JobSpec, source: Path, mlflow_run_id: str | None, *, lineage=None,
                run_dir: Path | None = None, start_step: int = 0) -> None:
    """Record (or update) the owner of `checkpoint.dir`: the job, its MLflow run, and, given the
    launch's `lineage` (launch/lineage.py), its fingerprint and a new segment when the spec
    changed."""
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    previous = read_owner(ckpt_dir) or {}
    record = {**previous, "job": spec["name"], "spec": str(source), "mlflow_run_id": mlflow_run_id,
              "created": previous.get("created") or _now()}
    if lineage is not None:
        # fresh: a new history
        segments = list(previous.get("segments") or []) if start_step > 0 else []
        entry = {"segment": len(segments) + 1, "start_step": start_step,
                 "run_dir": str(run_dir) if run_dir else None,
                 "mlflow_run_id": mlflow_run_id, "at": _now(),
                 "changes": [{"field": c.field, "old": c.old, "new": c.new}
                             for c in lineage.recorded]}
        if not segments or lineage.recorded:
            segments.append(entry)
        record.update(fingerprint=lineage.fingerprint, spec_flat=lineage.spec_flat,
                      segments=segments,
                      last_run_dir=str(run_dir) if run_dir else previous.get("last_run_dir"))
    tmp = ckpt_dir / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(ckpt_dir / OWNER_FILE)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
