"""The launch's trackers (jobspec/tracking/trackers.py), started while DeepSpeed's runner starts the
ranks and ended after them; MLflow's run is the one the launcher waits on.

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
from typing import Any

from jobspec import rundir
from jobspec.errors import first_line
from jobspec.launch import ownership
from jobspec.secrets import mask_secrets
from jobspec.status import Ending
from jobspec.tracking import generations, trackers
from jobspec.tracking import run as tracking_run
from jobspec.tracking.base import RunStart
from jobspec.tracking.run import TrackedRun

log = logging.getLogger("jobspec.launch")
PENDING = "pending"   # launch.json `mlflow_run` while the launcher creates the run


class BackgroundTracking:
    """Starts the enabled trackers (MLflow's run with the plan params) and writes the checkpoint
    owner record, in a thread; `wait` returns the MLflow run, `end` ends every tracker that
    started."""

    def __init__(self, resolved, compiled, run_dir: Path, resume_run_id: str | None,
                 plan_params: dict,
                 *, launch: dict, verbose: bool = False, announce=None, done=None, lineage=None,
                 start_step: int = 0):
        self.resolved, self.compiled, self.run_dir = resolved, compiled, Path(run_dir)
        # launch.json's launch fields: the argv that runs, counts, overrides, segment
        self.launch = launch
        self.resume_run_id, self.plan_params, self.verbose = resume_run_id, plan_params, verbose
        # launch/lineage.py: the owner record's history
        self.lineage, self.start_step = lineage, start_step
        self.announce = announce or (lambda info: None)   # called with mlflow_run.json's content
        self.done = done or (lambda: None)                  # called last, whatever happened
        # MLflow's run, for the launcher's MLflow-only steps
        self.tracked: TrackedRun | None = None
        self.started: dict[str, Any] = {}   # tracker name -> what its `start` returned
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
                # installs MLflow's log handlers, which route_library_logs re-routes
                tracking_run.import_mlflow()
                from jobspec.launch.quiet import route_library_logs
                route_library_logs(self.run_dir / rundir.LAUNCHER_LOG, self.verbose)
            run = RunStart(self.run_dir, spec, self.resolved.text, self.launch,
                           self.compiled.derived.as_dict(), self.plan_params, self.resume_run_id)
            # the default (MLflow) last: rank 0 opens its sink once mlflow_run.json exists, and by
            # then every other tracker has started (TensorBoard's start file is then the directory's
            # first)
            for tracker in sorted(trackers.enabled(spec), key=lambda t: t.name == trackers.DEFAULT):
                started = tracker.start(run)
                if started is not None:
                    self.started[tracker.name] = started
            self.tracked = self.started.get("mlflow")
            ownership.write_owner(spec, self.resolved.source,
                                  self.tracked.run_id if self.tracked else None,
                                  lineage=self.lineage, run_dir=self.run_dir,
                                  start_step=self.start_step)
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

    def end(self, ending: Ending) -> None:
        """End every tracker that started, with the run's final status (after `wait`)."""
        for name, started in self.started.items():
            trackers.TRACKERS[name].end(started, self.run_dir, ending)

    def _stop_runner(self) -> None:
        if self._runner_pid is not None:
            try:
                # nothing has trained yet: nothing to save
                os.killpg(self._runner_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def describe_run(tracked, description: str | None, block: str, generated: bool = False) -> None:
    """The closing summary as the run's description (MLflow shows `mlflow.note.content` as
    Markdown); `generated`: the run holds evaluation generations, and the description links to their
    table."""
    parts = [description] if description else []
    if generated:
        parts.append(generations.description_line(tracked.experiment_id, tracked.run_id))
    text = "".join(f"{part}\n\n" for part in parts) + f"```\n{block}\n```"
    try:
        tracked.client.set_tag(tracked.run_id, "mlflow.note.content",
                               mask_secrets(text)[:tracking_run.MAX_PARAM_VALUE_CHARS])
    except Exception as err:  # noqa: BLE001 -- the run's status and artifacts matter more
        log.warning("could not set the MLflow run's description: %s", first_line(err, limit=300))
