"""Upload the metrics of a run directory that MLflow does not have yet, into the same MLflow run.

Every metric point a job logs is first appended to RUN_DIR/metrics.jsonl; the MLflow copy can miss
points when the tracking server was down for longer than the job waited for it. `sync` compares
the file with the run's metric history (key, step and timestamp) and sends only what is missing,
so running it twice adds nothing. A run left RUNNING because the server was down when the job
ended is closed with the status of RUN_DIR/summary.json; one whose launcher died without closing it
(SIGKILL, a lost login node) is closed with summary.json's status, else FAILED. When MLflow was unreachable at launch
(`logging.mlflow.required: false`), `sync` creates the run from the run directory first.

Credentials come from the environment (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD),
as for `jobspec launch`. Exit status: 0 when MLflow has every point, 2 when it cannot be reached.

examples:
  jobspec sync runs/xlmr-large/run-20250101-120000-ab12
  jobspec sync RUN_DIR --tracking-uri http://mlflow.internal:5000
"""
from __future__ import annotations

import argparse
from pathlib import Path

from jobspec import rundir
from jobspec.errors import spec_error
from jobspec.launch import orphans
from jobspec.launch import status as run_status
from jobspec.tracking import telemetry

HELP = "Upload metrics.jsonl points that MLflow lacks into the run's MLflow run (idempotent)."

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="run directory written by `jobspec launch`")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="tracking server to use instead of the one recorded in RUN_DIR (e.g. it moved)")


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    metrics_path = run_dir / rundir.METRICS
    if not metrics_path.is_file():
        raise spec_error(f"{metrics_path} not found", file=str(run_dir),
                         hint="pass a run directory of `jobspec launch` whose job logged metrics")
    try:
        orphaned = orphans.close_if_orphaned(run_dir, "sync", args.tracking_uri)
        tracked = open_or_create_run(run_dir, args.tracking_uri)
        sent = telemetry.upload_missing(tracked.client, tracked.run_id, run_dir)
        closed = orphaned.status if orphaned else close_if_ended(tracked, run_dir)
    except telemetry.TrackingUnavailable as err:
        raise spec_error(f"MLflow tracking is unavailable: {err}", file=str(run_dir),
                         hint="start the server (or pass --tracking-uri) and run `jobspec sync` again") from None
    except Exception as err:  # MlflowException, connection errors: the store cannot be used right now
        raise spec_error(f"MLflow tracking is unavailable: {telemetry.mask_secrets(str(err)).splitlines()[0][:300]}",
                         file=str(run_dir), hint="run `jobspec sync` again when the server is back") from None
    total = len(rundir.read_metric_points(run_dir))
    print(f"jobspec: {sent} of {total} metric points uploaded to run {tracked.run_id} "
          f"({total - sent} were already there){'; run closed as ' + closed if closed else ''}")
    return 0


def open_or_create_run(run_dir: Path, tracking_uri: str | None) -> telemetry.TrackedRun:
    """The run named in mlflow_run.json, or a new one made from the run directory's files."""
    info = rundir.read_mlflow_run(run_dir)
    if info is not None:
        uri = tracking_uri or info["tracking_uri"]
        telemetry.probe(uri)
        client = telemetry._client(uri)
        client.get_run(info["run_id"])  # fails clearly if this store does not hold the run
        return telemetry.TrackedRun(uri, info["experiment_id"], info["run_id"], client)
    needed = (rundir.RESOLVED, rundir.LAUNCH, rundir.SPEC)
    missing = [name for name in needed if not (run_dir / name).is_file()]
    if missing:
        raise spec_error(f"{run_dir} has no {rundir.MLFLOW_RUN} and lacks {', '.join(missing)} to create one",
                         file=str(run_dir), hint="pass a run directory written by `jobspec launch`")
    spec = rundir.read_resolved(run_dir)
    launch = rundir.read_launch(run_dir)
    if tracking_uri:
        spec["logging"]["mlflow"]["tracking_uri"] = tracking_uri
    telemetry.probe(spec["logging"]["mlflow"]["tracking_uri"])
    return telemetry.start_run(spec, launch, launch.get("derived", {}), rundir.read_spec_text(run_dir), run_dir)


def close_if_ended(tracked: telemetry.TrackedRun, run_dir: Path) -> str | None:
    """End a RUNNING run whose job has ended (summary.json says how); the status set, or None."""
    end = run_status.from_summary(rundir.read_summary(run_dir))
    if end is None or tracked.client.get_run(tracked.run_id).info.status != "RUNNING":
        return None
    telemetry.end_run(tracked, run_dir, status=end.status, exit_code=end.exit_code, tags=end.tags())
    return end.status
