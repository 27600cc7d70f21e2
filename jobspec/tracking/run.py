"""The MLflow run of a job: created (or reopened on resume) by the launcher with params, tags and
artifacts, and ended by it with the final status; rank 0 only sends metrics into it
(jobspec.tracking.sink). Credentials (`user:pass@` in a URI, tokens) never reach params, tags,
artifacts or logs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jobspec import hardware, rundir
from jobspec.errors import first_line
from jobspec.secrets import mask_secrets, split_credentials
from jobspec.spec.loader import dotted_leaves
from jobspec.spec.types import JobSpec
from jobspec.tracking import naming

log = logging.getLogger("jobspec.tracking")

MAX_PARAMS_PER_BATCH = 100       # MLflow's log_batch limit for params
MAX_PARAM_VALUE_CHARS = 6000     # MLflow's param value limit (6000 since 2.x)
MAX_METRICS_PER_BATCH = 1000     # MLflow's log_batch limit for metrics
FAILURE_REASON_CHARS = 4000
# a continued run's later segments: segments/<k>/resolved.yaml, ...
SEGMENTS_ARTIFACT_DIR = "segments"
SEGMENT_METRIC = "jobspec/segment"    # k at the step segment k started: the boundary on every chart

# The client's defaults (120 s timeout, 7 retries with exponential backoff) block ~4 minutes per
# call against an unreachable server; a training job must notice within seconds instead.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}
VERSIONED_PACKAGES = ("jobspec", "deepspeed", "torch", "transformers", "mlflow")


def apply_http_env(environ: dict | os._Environ = os.environ) -> None:
    """Short MLflow HTTP timeouts/retries, unless the user set their own."""
    for key, value in HTTP_ENV_DEFAULTS.items():
        environ.setdefault(key, value)


# --- params and tags ---------------------------------------------------------------------------

def flatten(value, prefix: str = "") -> dict[str, str]:
    """Dotted keys for nested mappings (`model.config.hidden_size`); lists and scalars as JSON
    text."""
    return {key: mask_secrets(leaf if isinstance(leaf, str)
                              else json.dumps(leaf))[:MAX_PARAM_VALUE_CHARS]
            for key, leaf in dotted_leaves(value, prefix).items()}


def param_batches(params: dict[str, str]) -> list[dict[str, str]]:
    items = sorted(params.items())
    return [dict(items[i:i + MAX_PARAMS_PER_BATCH])
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH)]


def package_versions() -> dict[str, str]:
    """Installed versions without importing the packages (no torch import on the launcher)."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def run_tags(spec: JobSpec, launch: dict, spec_text: str) -> dict[str, str]:
    tags = {f"jobspec.version.{name}": v for name, v in package_versions().items()}
    tags.update({
        "jobspec.job": spec["name"],
        "jobspec.world_size": str(launch.get("world_size", "")),
        "jobspec.nodes": str(launch.get("nodes", "")),
        "jobspec.hosts": socket.gethostname(),
        "jobspec.gpus": ",".join(sorted(set(hardware.gpu_names()))),
        "jobspec.spec_sha256": hashlib.sha256(spec_text.encode("utf-8")).hexdigest(),
    })
    if spec["description"]:
        tags["mlflow.note.content"] = spec["description"]
    for key, value in spec["logging"]["mlflow"]["tags"].items():
        tags[str(key)] = str(value)
    return {k: mask_secrets(v)[:MAX_PARAM_VALUE_CHARS] for k, v in tags.items()}


# --- the launcher's run ------------------------------------------------------------------------

@dataclass
class TrackedRun:
    """An MLflow run the launcher created (or resumed) and will end."""
    tracking_uri: str     # without credentials
    experiment_id: str
    run_id: str
    client: Any           # mlflow.MlflowClient (mlflow is imported lazily)

    def as_json(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id,
                "run_id": self.run_id}


class TrackingUnavailable(RuntimeError):
    """The tracking store could not be reached or used."""


def probe(tracking_uri: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, with a plain reason, when an http(s) tracking server cannot be reached at
    all."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise TrackingUnavailable(f"cannot connect to {parts.hostname}:{port} "
                                  f"({err.strerror or err})") from err


def client_for(tracking_uri: str):
    """An MlflowClient for `tracking_uri` (credentials from the environment), with short HTTP
    timeouts."""
    apply_http_env()
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=tracking_uri)


def start_run(spec: JobSpec, launch: dict, derived: dict, spec_text: str, run_dir: Path,
              resume_run_id: str | None = None) -> TrackedRun:
    """Create (or reopen, for a resumed job) the MLflow run, log params/tags/artifacts, write
    mlflow_run.json.

    Raises TrackingUnavailable with a credential-free message when the store cannot be used.
    """
    settings = spec["logging"]["mlflow"]
    uri, user, password = split_credentials(settings["tracking_uri"])
    if user:  # MLflow reads basic-auth credentials from the environment; the worker inherits it
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    try:
        client = client_for(uri)
        experiment_id = naming.experiment_id_for(client, settings["experiment"])
        run = _reopen(client, resume_run_id)
        # named by what sets it apart: launch.json `overrides`, else the job's last run
        if run is None:
            name = naming.new_run_name(client, experiment_id, spec, launch.get("overrides", ()),
                                       flatten(spec))
            run = client.create_run(experiment_id, run_name=name)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        run_id = run.info.run_id
        tracked = TrackedRun(uri, run.info.experiment_id, run_id, client)
        _log_start(tracked, spec, launch, derived, spec_text, run_dir)
    except TrackingUnavailable:
        raise
    # MlflowException, requests errors, sqlite errors: all "unusable store"
    except Exception as err:
        raise TrackingUnavailable(f"{type(err).__name__}: {first_line(err)}"[:500]) from err
    rundir.write_mlflow_run(run_dir, tracked.as_json())
    return tracked


def _reopen(client, run_id: str | None):
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except Exception:
        log.warning("MLflow run %s of the checkpoints is not in this tracking store; starting a "
                    "new run", run_id)
        return None


def _log_start(tracked: TrackedRun, spec: JobSpec, launch: dict, derived: dict, spec_text: str,
               run_dir: Path) -> None:
    """Params, tags and the start artifacts. A continued run (launch.json `segment`,
    launch/lineage.py) keeps its first segment's params (MLflow params cannot change) and records
    the new segment beside them: tags with each change and the step it took effect, and the
    segment's own files under `segments/<k>/`, so no earlier segment's resolved.yaml is ever
    overwritten."""
    from mlflow.entities import Metric, Param, RunTag
    client, run_id = tracked.client, tracked.run_id
    params = flatten(spec)
    params.update(flatten(derived, "derived"))
    existing = client.get_run(run_id).data
    for batch in param_batches({k: v for k, v in params.items() if k not in existing.params}):
        client.log_batch(run_id, params=[Param(k, v) for k, v in batch.items()], synchronous=True)
    tags = run_tags(spec, launch, spec_text)
    segment = launch.get("segment")
    resumed = bool(existing.params)   # a reopened run: its first launch's files stay where they are
    artifact_path = None
    if segment:
        number, step = int(segment["number"]), int(segment["start_step"])
        artifact_path = f"{SEGMENTS_ARTIFACT_DIR}/{number}"
        tags.update(segment_tags(number, step, segment["changes"], existing.tags))
        client.log_batch(run_id,
                         metrics=[Metric(SEGMENT_METRIC, number, int(time.time() * 1000), step)],
                         synchronous=True)
    client.log_batch(run_id, tags=[RunTag(k, mask_secrets(v)[:MAX_PARAM_VALUE_CHARS])
                                   for k, v in tags.items()],
                     synchronous=True)
    if resumed and not segment:
        return   # the same spec resumed: the run's files already say what runs
    log_artifacts(tracked, run_dir, rundir.START_ARTIFACTS, artifact_path=artifact_path)


def segment_tags(number: int, start_step: int, changes: list[str],
                 existing: dict[str, str]) -> dict[str, str]:
    """The tags recording segment `number` of a run: `jobspec.segments`, the segment's start step
    and changes, and per changed field `jobspec.changed.<field>` (earlier changes of the field
    kept)."""
    tags = {"jobspec.segments": str(number),
            f"jobspec.segment.{number}.start_step": str(start_step),
            f"jobspec.segment.{number}.changes": "; ".join(changes) or "(none)"}
    for change in changes:
        field, _, what = change.partition(": ")
        key = f"jobspec.changed.{field}"
        entry = f"{what} at step {start_step}"
        tags[key] = f"{existing[key]}; {entry}" if key in existing else entry
    return tags


def log_artifacts(tracked: TrackedRun, run_dir: Path, names,
                  artifact_path: str | None = None) -> None:
    """Upload run-dir files, credentials masked (a spec may carry a tracking URI with a
    password)."""
    with tempfile.TemporaryDirectory(prefix="jobspec-artifacts-") as tmp:
        for name in names:
            source = run_dir / name
            if source.is_file():
                masked = Path(tmp) / name
                masked.write_text(mask_secrets(source.read_text(encoding="utf-8",
                                                                errors="replace")),
                                  encoding="utf-8")
                tracked.client.log_artifact(tracked.run_id, str(masked), artifact_path)


def end_run(tracked: TrackedRun, run_dir: Path, *, status: str, exit_code: int,
            failure_reason: str | None = None, tags: tuple[dict, tuple] | None = None) -> None:
    """Upload summary.json (a minimal one when the worker wrote none), set the reason and the final
    status.

    `tags`: (tags to set, tags to delete) from jobspec.status.Ending.tags(), which replace the
    `failure_reason` tag: a resumed run's end supersedes the reason of its earlier end."""
    rundir.write_fallback_summary(run_dir, status, exit_code)
    client, run_id = tracked.client, tracked.run_id
    if tags is None:
        tags = ({"jobspec.failure_reason": failure_reason} if failure_reason else {}, ())
    try:
        log_artifacts(tracked, run_dir, rundir.END_ARTIFACTS)
        client.set_tag(run_id, "jobspec.exit_code", str(exit_code))
        for key, value in tags[0].items():
            client.set_tag(run_id, key, mask_secrets(value)[-FAILURE_REASON_CHARS:])
        stale = [key for key in tags[1] if key in client.get_run(run_id).data.tags] if tags[1] \
            else []
        for key in stale:
            client.delete_tag(run_id, key)
        client.set_terminated(run_id, status=status)
    except Exception as err:
        log.warning("could not finish MLflow run %s: %s", run_id, first_line(err))


def log_params(tracked, params: dict[str, str]) -> None:
    """Add params to the launcher's MLflow run; a resumed run keeps its earlier values
    (immutable)."""
    from mlflow.entities import Param
    try:
        existing = tracked.client.get_run(tracked.run_id).data.params
        for batch in param_batches({k: v for k, v in params.items() if k not in existing}):
            tracked.client.log_batch(tracked.run_id, params=[Param(k, v) for k, v in batch.items()],
                                     synchronous=True)
    except Exception as err:  # the run exists and training can go on: the params are a nicety
        log.warning("could not log plan/fit params to MLflow: %s", first_line(err, limit=300))


def log_tags(tracked, tags: dict[str, str]) -> None:
    """Set tags on the launcher's MLflow run in one synchronous log_batch; raises what MLflow
    raises."""
    from mlflow.entities import RunTag
    tracked.client.log_batch(tracked.run_id, tags=[RunTag(k, v) for k, v in tags.items()],
                             synchronous=True)


def import_mlflow() -> None:
    """Import mlflow now: it installs its log handlers on import, which the launcher's quiet
    terminal (launch/quiet.route_library_logs) then re-routes. Only jobspec.tracking imports
    mlflow."""
    import mlflow  # noqa: F401


def search_active_runs(client, experiment_ids, filter_string: str = "", **kwargs):
    """The experiments' runs that are not deleted: `search_runs` with ViewType.ACTIVE_ONLY."""
    from mlflow.entities import ViewType
    return client.search_runs(experiment_ids, filter_string, run_view_type=ViewType.ACTIVE_ONLY,
                              **kwargs)
