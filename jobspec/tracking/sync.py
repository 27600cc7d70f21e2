"""metrics.jsonl -> MLflow: the points a run's MLflow copy lacks, uploaded into the same run (or a
run created from the run directory when MLflow was unreachable at launch); a run left RUNNING
because the server was down when the job ended is closed with the status of summary.json.
Idempotent.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jobspec import rundir
from jobspec import status as run_status
from jobspec.errors import first_line, spec_error
from jobspec.tracking import generations
from jobspec.tracking import run as tracking
from jobspec.tracking.run import MAX_METRICS_PER_BATCH


@dataclass
class SyncResult:
    run_id: str
    sent: int            # points uploaded now
    total: int           # points in metrics.jsonl
    closed: str | None   # the status the run was closed with, if it was still RUNNING


def sync_run(run_dir: Path, tracking_uri: str | None = None) -> SyncResult:
    """Upload what MLflow lacks of `run_dir`'s metrics; SpecError (exit 2) when MLflow cannot be
    used."""
    run_dir = Path(run_dir).resolve()
    metrics_path = run_dir / rundir.METRICS
    if not metrics_path.is_file():
        raise spec_error(f"{metrics_path} not found", file=str(run_dir),
                         hint="pass a run directory of `jobspec launch` whose job logged metrics")
    try:
        tracked = open_or_create_run(run_dir, tracking_uri)
        sent = upload_missing(tracked.client, tracked.run_id, run_dir)
        # training.eval_generate's tables
        generations.upload_missing(tracked.client, tracked.run_id, run_dir)
        closed = close_if_ended(tracked, run_dir)
    except tracking.TrackingUnavailable as err:
        raise spec_error(f"MLflow tracking is unavailable: {err}", file=str(run_dir),
                         hint="start the server (or pass --tracking-uri) and run `jobspec sync` "
                              "again") from None
    # MlflowException, connection errors: the store cannot be used right now
    except Exception as err:
        raise spec_error(f"MLflow tracking is unavailable: {first_line(err, limit=300)}",
                         file=str(run_dir),
                         hint="run `jobspec sync` again when the server is back") from None
    return SyncResult(tracked.run_id, sent, len(rundir.read_metric_points(run_dir)), closed)


def open_or_create_run(run_dir: Path, tracking_uri: str | None) -> tracking.TrackedRun:
    """The run named in mlflow_run.json, or a new one made from the run directory's files."""
    info = rundir.read_mlflow_run(run_dir)
    if info is not None:
        uri = tracking_uri or info["tracking_uri"]
        tracking.probe(uri)
        client = tracking.client_for(uri)
        client.get_run(info["run_id"])  # fails clearly if this store does not hold the run
        return tracking.TrackedRun(uri, info["experiment_id"], info["run_id"], client)
    needed = (rundir.RESOLVED, rundir.LAUNCH, rundir.SPEC)
    missing = [name for name in needed if not (run_dir / name).is_file()]
    if missing:
        raise spec_error(f"{run_dir} has no {rundir.MLFLOW_RUN} and lacks {', '.join(missing)} to "
                         "create one",
                         file=str(run_dir), hint="pass a run directory written by `jobspec launch`")
    spec = rundir.read_resolved(run_dir)
    launch = rundir.read_launch(run_dir)
    if tracking_uri:
        spec["logging"]["mlflow"]["tracking_uri"] = tracking_uri
    tracking.probe(spec["logging"]["mlflow"]["tracking_uri"])
    return tracking.start_run(spec, launch, launch.get("derived", {}),
                              rundir.read_spec_text(run_dir), run_dir)


def close_if_ended(tracked: tracking.TrackedRun, run_dir: Path) -> str | None:
    """End a RUNNING run whose job has ended (summary.json says how); the status set, or None."""
    end = run_status.from_summary(rundir.read_summary(run_dir))
    if end is None or tracked.client.get_run(tracked.run_id).info.status != "RUNNING":
        return None
    tracking.end_run(tracked, run_dir, status=end.status, exit_code=end.exit_code, tags=end.tags())
    return end.status


def upload_missing(client, run_id: str, run_dir: Path) -> int:
    """Send the points of metrics.jsonl that the run lacks (same key, step and timestamp); returns
    how many.

    Idempotent: a second call finds nothing missing.
    """
    from mlflow.entities import Metric
    points = rundir.read_metric_points(run_dir)
    known = {}
    for key in sorted({p[0] for p in points}):
        known[key] = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, key)}
    missing = [Metric(k, v, ts, step) for k, v, ts, step in points if (step, ts) not in known[k]]
    for i in range(0, len(missing), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[i:i + MAX_METRICS_PER_BATCH], synchronous=True)
    return len(missing)
