"""The model directories a job exported (summary.json `exports`), recorded in its MLflow run.

Each one gets the tag `jobspec.export.<name>` with its path; a directory up to `export.mlflow_max_mb`
is also uploaded as the artifacts `model/<name>/...` (then `jobspec.export.<name>.artifact` names
them), a larger one stays where it is: uploading gigabytes of weights would hold the end of the
launch for minutes and duplicate them in the artifact store. The model card in the directory was
written with credentials masked. No torch: the launcher calls this after the ranks are gone.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from jobspec import rundir
from jobspec.secrets import mask_secrets

log = logging.getLogger("jobspec.tracking.model_artifacts")
ARTIFACT_ROOT = "model"
TAG_PREFIX = "jobspec.export."


def exported_models(run_dir: Path) -> dict:
    summary = rundir.read_summary(Path(run_dir))
    exports = summary.get("exports") if isinstance(summary, dict) else None
    return exports if isinstance(exports, dict) else {}


def log_exported_models(tracked, run_dir: Path, spec: dict) -> dict[str, str]:
    """Upload / tag every exported directory that still exists; returns the tags set. Never raises:
    a tracking problem here must not turn a finished training into a failed launch."""
    limit_bytes = float((spec.get("export") or {}).get("mlflow_max_mb", 0)) * 1e6
    tags: dict[str, str] = {}
    for name, record in exported_models(run_dir).items():
        path = Path(str(record.get("path", "")))
        if not path.is_dir():
            continue
        tags[f"{TAG_PREFIX}{name}"] = str(path)
        size = int(record.get("bytes") or sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        if size <= limit_bytes:
            try:
                tracked.client.log_artifacts(tracked.run_id, str(path), artifact_path=f"{ARTIFACT_ROOT}/{name}")
                tags[f"{TAG_PREFIX}{name}.artifact"] = f"{ARTIFACT_ROOT}/{name}"
            except Exception as err:  # noqa: BLE001 -- recorded by path below instead
                log.warning("could not upload model %s to MLflow (%s); recorded by its path",
                            name, mask_secrets(str(err)).splitlines()[0][:300])
                tags[f"{TAG_PREFIX}{name}.artifact"] = "upload failed: see launcher.log"
        else:
            tags[f"{TAG_PREFIX}{name}.artifact"] = (f"not uploaded: {size / 1e6:.0f} MB > export.mlflow_max_mb "
                                                    f"{limit_bytes / 1e6:g}")
    if tags:
        try:
            from mlflow.entities import RunTag
            tracked.client.log_batch(tracked.run_id, tags=[RunTag(k, v) for k, v in tags.items()],
                                     synchronous=True)
        except Exception as err:  # noqa: BLE001
            log.warning("could not tag the exported models in MLflow: %s",
                        mask_secrets(str(err)).splitlines()[0][:300])
    return tags
