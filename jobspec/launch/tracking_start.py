"""The MLflow run, created while the ranks start instead of before.

Importing mlflow and creating a run (experiment lookup, params, tags, the start artifacts) takes
1.5-3 s of the launcher's time, all of it before the DeepSpeed runner could start; the runner and
the ranks then spend many seconds importing torch and building the model, during which the
launcher waits. So `jobspec launch` does only the quick reachability probe up front (an http(s)
server that cannot be reached fails a `required: true` job at once, before anything starts) and
hands the rest to a thread (`TrackingStart`) that runs next to the runner.

The ranks learn the outcome from `tracking.json` in the run directory (`rundir.write_tracking`),
which the thread always writes: "on" after mlflow_run.json exists, "off" (MLflow disabled, or
unusable and `required: false`), "failed" (unusable and required). With JOBSPEC_TRACKING_PENDING=1
in their environment the ranks wait for it before their first metric (`rundir.wait_for_tracking`);
on "failed" every rank stops with the reason (exit 1) and the launcher reports it.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from jobspec import rundir
from jobspec.errors import RunFailure

log = logging.getLogger("jobspec.launch")

PENDING_ENV = rundir.TRACKING_PENDING_ENV


def unavailable_failure(settings: dict, err) -> RunFailure:
    from jobspec.tracking import telemetry
    uri = telemetry.mask_secrets(settings["tracking_uri"])
    return RunFailure(f"MLflow tracking at {uri} is unavailable: {err}; start the server, fix "
                      "logging.mlflow.tracking_uri, or set logging.mlflow.required: false to run with "
                      "metrics kept in metrics.jsonl")


def probe(spec: dict, run_dir: Path) -> bool:
    """The quick check before the runner starts: False when MLflow is off, or unreachable and optional
    (warned); RunFailure when unreachable and required."""
    from jobspec.tracking import telemetry
    settings = spec["logging"]["mlflow"]
    if not settings["enabled"]:
        return False
    try:
        telemetry.probe(settings["tracking_uri"])
        return True
    except telemetry.TrackingUnavailable as err:
        if settings["required"]:
            raise unavailable_failure(settings, err) from None
        log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s",
                    telemetry.mask_secrets(settings["tracking_uri"]), err, run_dir / rundir.METRICS)
        return False


class TrackingStart:
    """Creates the MLflow run in a thread; `result()` waits for it (the TrackedRun, or None)."""

    def __init__(self, resolved, compiled, run_dir: Path, resume_run_id: str | None, extra_params: dict,
                 on_done=None):
        self.resolved, self.compiled, self.run_dir = resolved, compiled, Path(run_dir)
        self.resume_run_id, self.extra_params, self.on_done = resume_run_id, extra_params, on_done
        self.tracked, self.error = None, None
        self._thread = threading.Thread(target=self._run, name="jobspec-tracking-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from jobspec.memory import at_launch
        from jobspec.tracking import telemetry
        spec = self.resolved.spec
        settings = spec["logging"]["mlflow"]
        status, reason = "off", None
        try:
            self.tracked = telemetry.start_run(spec, self.compiled.launch, self.compiled.derived.as_dict(),
                                               self.resolved.text, self.run_dir, resume_run_id=self.resume_run_id)
            at_launch.log_params(self.tracked, self.extra_params)
            status = "on"
        except telemetry.TrackingUnavailable as err:
            if settings["required"]:
                self.error = unavailable_failure(settings, err)
                status, reason = "failed", self.error.reason
            else:
                log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s",
                            telemetry.mask_secrets(settings["tracking_uri"]), err, self.run_dir / rundir.METRICS)
        except BaseException as err:  # anything else: the ranks must not wait forever
            self.error = RunFailure(f"creating the MLflow run failed: {type(err).__name__}: {err}")
            status, reason = "failed", self.error.reason
        finally:
            rundir.write_tracking(self.run_dir, status, reason)
            if self.on_done is not None:
                self.on_done(self.tracked)

    def result(self):
        """The TrackedRun (None: off); raises the RunFailure of a required run that could not be made."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.tracked
