"""The model directories a job exported (summary.json `exports`), recorded in its MLflow run.

Each one gets the tag `jobspec.export.<name>` with its path; a directory up to
`export.mlflow_max_mb` is also uploaded as the artifacts `model/<name>/...` (then
`jobspec.export.<name>.artifact` names them), a larger one stays where it is: uploading gigabytes of
weights would hold the end of the launch for minutes and duplicate them in the artifact store. The
model card in the directory was written with credentials masked. No torch: the launcher calls this
after the ranks are gone. MLflow itself stays behind jobspec.tracking (the client the run holds,
`tracking.run.log_tags`).
"""
from __future__ import annotations

import logging
from pathlib import Path

from jobspec import rundir
from jobspec.errors import first_line
from jobspec.spec.types import JobSpec
from jobspec.tracking import run as tracking_run

log = logging.getLogger("jobspec.export.artifacts")
ARTIFACT_ROOT = "model"
TAG_PREFIX = "jobspec.export."


def exported_models(run_dir: Path) -> dict:
    summary = rundir.read_summary(Path(run_dir))
    exports = summary.exports if summary is not None else None
    return exports if isinstance(exports, dict) else {}


def log_exported_models(tracked, run_dir: Path, spec: JobSpec) -> dict[str, str]:
    """Upload / tag every exported directory that still exists; returns the tags set. Never raises:
    a tracking problem here must not turn a finished training into a failed launch."""
    limit_bytes = float(spec["export"]["mlflow_max_mb"]) * 1e6
    tags: dict[str, str] = {}
    for name, record in exported_models(run_dir).items():
        path = Path(str(record.get("path", "")))
        if not path.is_dir():
            continue
        tags[f"{TAG_PREFIX}{name}"] = str(path)
        size = int(record.get("bytes")
                   or sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        if 0 < limit_bytes and size <= limit_bytes:  # 0 uploads none (the schema's word)
            try:
                tracked.client.log_artifacts(tracked.run_id, str(path),
                                             artifact_path=f"{ARTIFACT_ROOT}/{name}")
                tags[f"{TAG_PREFIX}{name}.artifact"] = f"{ARTIFACT_ROOT}/{name}"
            except Exception as err:  # noqa: BLE001 -- recorded by path below instead
                reason = first_line(err, limit=300)
                log.warning("could not upload model %s to MLflow (%s); recorded by its path", name,
                            reason)
                tags[f"{TAG_PREFIX}{name}.artifact"] = f"upload failed: {reason}"
        elif limit_bytes <= 0:
            tags[f"{TAG_PREFIX}{name}.artifact"] = "not uploaded: export.mlflow_max_mb is 0"
        else:
            tags[f"{TAG_PREFIX}{name}.artifact"] = (f"not uploaded: {_mb(size)} MB > "
                                                    f"export.mlflow_max_mb {limit_bytes / 1e6:g}")
    if tags:
        try:
            tracking_run.log_tags(tracked, tags)
        except Exception as err:  # noqa: BLE001
            log.warning("could not tag the exported models in MLflow: %s",
                        first_line(err, limit=300))
    return tags


def _mb(size: int) -> str:
    """Megabytes, two significant digits below 10 (a 0.4 MB model is not "0 MB")."""
    mb = size / 1e6
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2g}"
