"""The launch's MLflow run, created while DeepSpeed's runner starts the ranks.

Importing MLflow and creating the run take 2 s (8 s when a new SQLite store gets its tables), and
the runner, DeepSpeed's launch.py and the ranks take longer than that to start: done one after the
other they add up, done at once they overlap. launch.json says `"mlflow_run": "pending"`, so rank
0 waits (jobspec.rundir.wait_for_tracking) for `mlflow_run.json`, or for `mlflow_off` when the job
runs without a run, before it opens its metric sink, which is after its model and engine exist.
A run that cannot be created with `logging.mlflow.required: true` stops the job (the runner's
process group is killed) and the launch fails as it did before any rank started.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from jobspec import rundir
from jobspec.errors import RunFailure, first_line
from jobspec.launch import ownership
from jobspec.secrets import mask_secrets
from jobspec.tracking import orphans
from jobspec.tracking import run as tracking_run

log = logging.getLogger("jobspec.launch")
PENDING = "pending"   # launch.json `mlflow_run` while the launcher creates the run


def start_tracking(resolved, compiled, run_dir: Path, resume_run_id: str | None):
    """The MLflow run, or None when MLflow is off or (with `required: false`) unreachable."""
    settings = resolved.spec["logging"]["mlflow"]
    if not settings["enabled"]:
        return None
    try:
        tracking_run.probe(settings["tracking_uri"])
        return tracking_run.start_run(resolved.spec, compiled.launch, compiled.derived.as_dict(), resolved.text,
                                      run_dir, resume_run_id=resume_run_id)
    except tracking_run.TrackingUnavailable as err:
        uri = mask_secrets(settings["tracking_uri"])
        if settings["required"]:
            raise RunFailure(f"MLflow tracking at {uri} is unavailable: {err}; start the server, fix "
                             "logging.mlflow.tracking_uri, or set logging.mlflow.required: false to run with "
                             "metrics kept in metrics.jsonl")
        log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s", uri, err,
                    run_dir / rundir.METRICS)
        return None


class BackgroundTracking:
    """Creates the run (plan params, checkpoint owner record) in a thread; `wait` returns it."""

    def __init__(self, resolved, compiled, run_dir: Path, resume_run_id: str | None, plan_params: dict,
                 *, verbose: bool = False, announce=None, done=None, lineage=None, start_step: int = 0):
        self.resolved, self.compiled, self.run_dir = resolved, compiled, Path(run_dir)
        self.resume_run_id, self.plan_params, self.verbose = resume_run_id, plan_params, verbose
        self.lineage, self.start_step = lineage, start_step   # launch/lineage.py: the owner record's history
        self.announce = announce or (lambda info: None)   # called with mlflow_run.json's content
        self.done = done or (lambda: None)                  # called last, whatever happened
        self.tracked = None
        self.failure: BaseException | None = None
        self._runner_pid: int | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="jobspec-tracking", daemon=True)

    def start(self) -> "BackgroundTracking":
        self._thread.start()
        return self

    def runner_started(self, pid: int) -> None:
        with self._lock:
            self._runner_pid = pid
            if self.failure is not None:
                self._stop_runner()

    def wait(self):
        """The TrackedRun (or None); raises what made a required run impossible."""
        self._thread.join()
        if self.failure is not None:
            raise self.failure
        return self.tracked

    def _run(self) -> None:
        spec = self.resolved.spec
        try:
            if spec["logging"]["mlflow"]["enabled"]:
                tracking_run.import_mlflow()   # installs MLflow's log handlers, which route_library_logs re-routes
                from jobspec.launch.quiet import route_library_logs
                route_library_logs(self.run_dir / rundir.LAUNCHER_LOG, self.verbose)
            self.tracked = start_tracking(self.resolved, self.compiled, self.run_dir, self.resume_run_id)
            if self.tracked is not None:  # next to the ranks' measured mem/* series: prediction error per run
                tracking_run.log_params(self.tracked, self.plan_params)
                orphans.tag_run(self.tracked, self.run_dir)   # `report` finds the run dir to check its launcher
            ownership.write_owner(spec, self.resolved.source, self.tracked.run_id if self.tracked else None,
                                  lineage=self.lineage, run_dir=self.run_dir, start_step=self.start_step)
            if self.tracked is not None:
                self.announce(self.tracked.as_json())
        except BaseException as err:  # noqa: BLE001 -- re-raised by wait() in the main thread
            with self._lock:
                self.failure = err
                self._stop_runner()
        finally:
            if self.tracked is None:
                rundir.write_tracking_off(self.run_dir)  # rank 0 stops waiting for mlflow_run.json
            self.done()

    def _stop_runner(self) -> None:
        if self._runner_pid is not None:
            try:
                os.killpg(self._runner_pid, signal.SIGKILL)  # nothing has trained yet: nothing to save
            except (ProcessLookupError, PermissionError):
                pass


def describe_run(tracked, description: str | None, block: str) -> None:
    """The closing summary as the run's description (MLflow shows `mlflow.note.content` as Markdown)."""
    text = (f"{description}\n\n" if description else "") + f"```\n{block}\n```"
    try:
        tracked.client.set_tag(tracked.run_id, "mlflow.note.content",
                               mask_secrets(text)[:tracking_run.MAX_PARAM_VALUE_CHARS])
    except Exception as err:  # noqa: BLE001 -- the run's status and artifacts matter more
        log.warning("could not set the MLflow run's description: %s", first_line(err, limit=300))
