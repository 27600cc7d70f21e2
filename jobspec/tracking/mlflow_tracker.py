"""MLflow, the default tracker (`logging.mlflow`): the Tracker of tracking/base.py over the modules
that hold what only MLflow has: the run created or reopened with its name, experiment, params, tags
and artifacts (tracking/run.py), rank 0's background sender (tracking/mlflow_sender.py), generation
tables, system metrics, orphaned runs and `jobspec sync`. The launcher's own MLflow steps (the
rendezvous in mlflow_run.json, the header's links, the model registry, the run's description) use
the TrackedRun that `start` returns (launch/tracking.py, launch/pipeline.py, export/artifacts.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

from jobspec import rundir
from jobspec.errors import RunFailure
from jobspec.secrets import mask_secrets
from jobspec.spec.types import JobSpec
from jobspec.status import Ending
from jobspec.tracking import orphans
from jobspec.tracking import run as tracking_run
from jobspec.tracking.base import RunStart
from jobspec.tracking.mlflow_sender import MlflowSender

log = logging.getLogger("jobspec.launch")


class MlflowTracker:
    name = "mlflow"

    def start(self, run: RunStart) -> tracking_run.TrackedRun | None:
        """The MLflow run (plan params, the run-directory tag), or None when the server is
        unreachable and `required: false`; RunFailure when it is required."""
        settings = run.spec["logging"]["mlflow"]
        try:
            tracking_run.probe(settings["tracking_uri"])
            tracked = tracking_run.start_run(run.spec, run.launch, run.derived, run.spec_text,
                                             run.run_dir, resume_run_id=run.resume_run_id)
        except tracking_run.TrackingUnavailable as err:
            uri = mask_secrets(settings["tracking_uri"])
            if settings["required"]:
                raise RunFailure(f"MLflow tracking at {uri} is unavailable: {err}; start the "
                                 "server, fix logging.mlflow.tracking_uri, or set "
                                 "logging.mlflow.required: false to run with metrics kept in "
                                 "metrics.jsonl") from None
            log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s",
                        uri, err, run.run_dir / rundir.METRICS)
            return None
        if run.params:   # next to the ranks' measured mem/* series: prediction error per run
            tracking_run.log_params(tracked, run.params)
        orphans.tag_run(tracked, run.run_dir)   # `report` finds the run dir to check its launcher
        return tracked

    def end(self, started: tracking_run.TrackedRun, run_dir: Path, ending: Ending) -> None:
        tracking_run.end_run(started, run_dir, status=ending.status, exit_code=ending.exit_code,
                             tags=ending.tags())

    def writer(self, run_dir: Path, spec: JobSpec | None) -> MlflowSender | None:
        """The sender into the run of mlflow_run.json (rank 0 has waited for the launcher to write
        it, or `mlflow_off`); None without a run."""
        return MlflowSender.for_run_dir(run_dir)


TRACKER = MlflowTracker()
