"""Upload the metrics of a run directory that MLflow does not have yet, into the same MLflow run.

Every metric point a job logs is first appended to RUN_DIR/metrics.jsonl; the MLflow copy can miss
points when the tracking server was down for longer than the job waited for it. `sync` compares
the file with the run's metric history (key, step and timestamp) and sends only what is missing,
so running it twice adds nothing. A run left RUNNING because the server was down when the job
ended is closed with the status of RUN_DIR/summary.json; one whose launcher died without closing it
(SIGKILL, a lost login node) is closed with summary.json's status, else FAILED. When MLflow was
unreachable at launch (`logging.mlflow.required: false`), `sync` creates the run from the run
directory first.

Credentials come from the environment (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD),
as for `jobspec launch`. Exit status: 0 when MLflow has every point, 2 when it cannot be reached.

examples:
  jobspec sync runs/xlmr-large/run-20250101-120000-ab12
  jobspec sync RUN_DIR --tracking-uri http://mlflow.internal:5000
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="run directory written by `jobspec launch`")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="tracking server to use instead of the one recorded in RUN_DIR (e.g. "
                             "it moved)")


def run(args: argparse.Namespace) -> int:
    from jobspec.tracking.orphans import close_if_orphaned
    from jobspec.tracking.sync import sync_run

    # its launcher is gone
    orphaned = close_if_orphaned(args.run_dir.resolve(), "sync", args.tracking_uri)
    result = sync_run(args.run_dir, args.tracking_uri)
    closed = orphaned.status if orphaned else result.closed
    print(f"jobspec: {result.sent} of {result.total} metric points uploaded to run {result.run_id} "
          f"({result.total - result.sent} were already "
          f"there){'; run closed as ' + closed if closed else ''}")
    return 0
