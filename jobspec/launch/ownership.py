"""Checkpoint ownership: `checkpoint.dir/jobspec_job.json` names the job (and its MLflow run) whose
checkpoints the directory holds, so a launch never resumes, or overwrites, another job's state."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from jobspec import rundir
from jobspec.errors import spec_error

OWNER_FILE = "jobspec_job.json"


def read_owner(ckpt_dir: Path) -> dict | None:
    try:
        return json.loads((ckpt_dir / OWNER_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise spec_error(f"{ckpt_dir / OWNER_FILE} is unreadable ({err})", path=("checkpoint", "dir"),
                         hint="fix or delete that file, or point checkpoint.dir elsewhere")


def claim_checkpoints(spec: dict) -> str | None:
    """Refuse to touch another job's checkpoints; the MLflow run id to continue when resuming ours.
    Makes `checkpoint.dir` (and proves it writable) first."""
    rundir.ensure_writable(Path(spec["checkpoint"]["dir"]), ("checkpoint", "dir"))
    return check_checkpoints(spec)


def check_checkpoints(spec: dict) -> str | None:
    """claim_checkpoints without touching the disk (`launch --dry-run`): the same refusals, the same
    run id. Checkpoints exist when the directory has anything besides the ownership file."""
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    resume = spec["checkpoint"]["resume"]
    if not ckpt_dir.is_dir():
        return None
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
    ckpt_dir = Path(spec["checkpoint"]["dir"])
    previous = read_owner(ckpt_dir) or {}
    record = {"job": spec["name"], "spec": str(source), "mlflow_run_id": mlflow_run_id,
              "created": previous.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = ckpt_dir / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(ckpt_dir / OWNER_FILE)
