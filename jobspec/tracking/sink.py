"""Rank 0's metrics sink: every metric row is appended to run_dir/metrics.jsonl at once (the run's
own record, what `report` and `jobspec sync` read), then handed to the MetricWriter of each enabled
tracker (tracking/base.py; MLflow's sends from a thread of its own, TensorBoard's writes event
files), so the training loop never waits for a tracker and a tracker that fails loses nothing
metrics.jsonl holds.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from jobspec import rundir
from jobspec.errors import first_line
from jobspec.spec.types import JobSpec
from jobspec.tracking.base import MetricWriter

log = logging.getLogger("jobspec.tracking")


class MetricSink:
    """metrics.jsonl first, then the trackers' writers (`writers`, in order)."""

    def __init__(self, run_dir: Path, writers: list[MetricWriter] | tuple = ()):
        self.run_dir = Path(run_dir)
        self.writers = list(writers)
        self._jsonl = rundir.open_metrics(self.run_dir)

    @classmethod
    def open(cls, run_dir, spec: JobSpec | None = None) -> "MetricSink":
        """The sink of the run in `run_dir`: a writer for each tracker the spec enables that has
        somewhere to write (jobspec/tracking/trackers.py). `spec` defaults to the run's
        resolved.yaml; without one, only the default tracker's (MLflow's, where mlflow_run.json
        names a run)."""
        from jobspec.tracking import trackers
        run_dir = Path(run_dir)
        if spec is None and (run_dir / rundir.RESOLVED).is_file():
            spec = rundir.read_resolved(run_dir)
        chosen = trackers.enabled(spec) if spec is not None \
            else [trackers.TRACKERS[trackers.DEFAULT]]
        writers = [tracker.writer(run_dir, spec) for tracker in chosen]
        return cls(run_dir, [w for w in writers if w is not None])

    def log(self, metrics: dict, step: int) -> None:
        timestamp = int(time.time() * 1000)
        clean = {k: float(v) for k, v in metrics.items() if v is not None
                 and math.isfinite(float(v))}
        self._jsonl.write(rundir.metric_line(clean, step, timestamp))
        self._jsonl.flush()
        for writer in self.writers:
            writer.log_metrics(clean, int(step), timestamp)

    def log_params(self, params: dict) -> None:
        for writer in self.writers:
            writer.log_params(params)

    def log_table(self, step: int, rows: list[dict]) -> None:
        """The answers generated at the evaluation of `step` (generations.jsonl holds them already:
        rank 0 writes it, train/generation.py)."""
        for writer in self.writers:
            writer.log_table(int(step), rows)

    def set_tags(self, tags: dict) -> None:
        for writer in self.writers:
            writer.set_tags(tags)

    def close(self, timeout: float = 30) -> None:
        """Close each writer (a remote one retries for at most `timeout` seconds), then
        metrics.jsonl."""
        for writer in self.writers:
            try:
                writer.close(timeout)
            # one tracker failing to flush must not cost the others theirs
            except Exception as err:
                log.warning("%s: closing failed: %s", type(writer).__name__, first_line(err))
        self._jsonl.close()
