"""Checkpoint ownership: `checkpoint.dir/jobspec_job.json` names the job (and its MLflow run) whose
checkpoints the directory holds, so a launch never resumes, or overwrites, another job's state.

The record also holds what the checkpoints were trained under: the fingerprint
(launch/fingerprint.py), the flattened resolved spec of the latest launch, and the segments: the
launches that trained into the directory with a changed spec, each with the step it started at, its
run directory and its changes.

Whether a launch may use a directory (another job's, files no job claims, `resume: never` over
checkpoints) is launch/decision.claim's; `claim_checkpoints` applies it to `checkpoint.dir` read
now."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from jobspec import rundir
from jobspec.launch import decision, snapshot
from jobspec.launch.snapshot import OWNER_FILE
from jobspec.spec.types import JobSpec


def read_owner(ckpt_dir: Path) -> dict | None:
    """The owner record of `ckpt_dir`, or None; an unreadable one refuses (exit 2)."""
    owner, unreadable = snapshot.owner_record(Path(ckpt_dir))
    if unreadable is not None:
        raise decision.unreadable_owner(Path(ckpt_dir), unreadable)
    return owner


def claim_checkpoints(spec: JobSpec) -> str | None:
    """Refuse to touch another job's checkpoints; the MLflow run id to continue when resuming ours.
    Makes `checkpoint.dir` (and proves it writable) first."""
    rundir.ensure_writable(Path(spec["checkpoint"]["dir"]), ("checkpoint", "dir"))
    return check_checkpoints(spec)


def check_checkpoints(spec: JobSpec) -> str | None:
    """claim_checkpoints without touching the disk: launch/decision.claim on `checkpoint.dir` read
    now."""
    return decision.claim(snapshot.read_directory(Path(spec["checkpoint"]["dir"])), spec)


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
