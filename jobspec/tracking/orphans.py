"""Runs left RUNNING by a launcher that is gone (SIGKILL, a lost node, an OOM-killed login shell).

Nothing inside such a run can close it: its ranks end themselves when the launcher dies
(jobspec/lifeline.py), so the MLflow run would stay RUNNING forever. The next `jobspec launch` into
the same output directory, `jobspec sync RUN_DIR` and `jobspec report` check `launcher.json` of the
runs they see: a launcher that ran on this host and no longer exists means the run is over. It is
closed with what summary.json says (rank 0 may have finished it before the launcher died), else
FAILED with the reason, and `launcher.json` records who closed it, so it is never closed twice.
A launcher on another host cannot be checked from here and is left alone.
"""
from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from pathlib import Path

from jobspec import lifeline, rundir
from jobspec import status as run_status
from jobspec.errors import first_line

log = logging.getLogger("jobspec.launch")
RUN_DIR_TAG = "jobspec.run_dir"


def tag_run(tracked, run_dir: Path) -> None:
    """Let `jobspec report` find the run directory of an MLflow run (to check its launcher)."""
    try:
        tracked.client.set_tag(tracked.run_id, RUN_DIR_TAG, str(Path(run_dir).resolve()))
    except Exception as err:  # the tag only helps a later report; never fail a launch on it
        log.warning("could not tag MLflow run %s with its run directory: %s", tracked.run_id,
                    str(err)[:200])


def close_if_orphaned(run_dir: Path, by: str,
                      tracking_uri: str | None = None) -> run_status.Ending | None:
    """Close the run in `run_dir` if its launcher is gone without having closed it; how it was
    closed. `tracking_uri` replaces the one recorded in mlflow_run.json (the server moved)."""
    run_dir = Path(run_dir)
    record = rundir.read_launcher(run_dir)
    if record is None or record.get("ended") or lifeline.is_alive(record) is not False:
        return None
    started = datetime.fromtimestamp(float(record.get("started", 0)),
                                     timezone.utc).isoformat(timespec="seconds")
    end = run_status.from_summary(rundir.read_summary(run_dir)) or run_status.Ending(
        "FAILED", "failed", 1,
        f"the launcher (pid {record.get('pid')} on {record.get('host')}, started "
                                 f"{started}) is gone and the run never ended; found by `jobspec "
                                 f"{by}`")
    rundir.write_fallback_summary(run_dir, end.status, end.exit_code)
    info = rundir.read_mlflow_run(run_dir)
    if info is not None:
        from jobspec.tracking import run as telemetry
        try:
            uri = tracking_uri or info["tracking_uri"]
            client = telemetry.client_for(uri)
            if client.get_run(info["run_id"]).info.status == "RUNNING":
                tracked = telemetry.TrackedRun(uri, info["experiment_id"], info["run_id"], client)
                telemetry.end_run(tracked, run_dir, status=end.status, exit_code=end.exit_code,
                                  failure_reason=end.reason, tags=end.tags())
        # the store is down: leave launcher.json open, a later call retries
        except Exception as err:
            log.warning("run %s: its launcher is gone, but MLflow could not be updated: %s",
                        run_dir, first_line(err, limit=200))
            return None
    rundir.mark_launcher_ended(run_dir, end.status, end.exit_code, by=f"jobspec {by}")
    # stderr: `jobspec report --format csv > runs.csv` keeps its stdout for the table
    print(f"jobspec: closed run {run_dir.name} as {end.status}: its launcher (pid "
          f"{record.get('pid')}) is gone",
          file=sys.stderr, flush=True)
    return end


def close_orphans_under(output_dir: str | Path, by: str = "launch") -> list[Path]:
    """Every run directory of `output_dir` closed by `close_if_orphaned`."""
    return [d for d in rundir.run_dirs(output_dir) if (d / rundir.LAUNCHER).is_file()
            and close_if_orphaned(d, by) is not None]


def close_orphans_of_experiment(client, experiment_id: str) -> list[Path]:
    """RUNNING runs of an MLflow experiment whose run directory (tag) is here and whose launcher is
    gone."""
    closed = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000):
        run_dir = run.data.tags.get(RUN_DIR_TAG)
        if run_dir and Path(run_dir).is_dir() \
                and close_if_orphaned(Path(run_dir), "report") is not None:
            closed.append(Path(run_dir))
    return closed
