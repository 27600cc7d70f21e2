"""What every tracker of a run does, whatever stores it: the `Tracker` protocol.

A run is tracked in two processes. The launcher starts each enabled tracker before the ranks train
(`start`: the spec, the compiled config, params) and ends it when they are gone (`end`: the final
status); rank 0 feeds it the run's metric rows through the metrics sink (jobspec/tracking/sink.py),
which writes metrics.jsonl first and then hands every row to each tracker's `MetricWriter`. A
tracker is one module of jobspec/tracking/ registered in jobspec/tracking/trackers.py under the name
of its `logging.<name>` section of the schema, whose `enabled` switches it on.

What only one store has stays in its module: MLflow's run names, experiments, resumed and continued
runs, model registry, system metrics, generation tables and `jobspec sync`
(tracking/mlflow_tracker.py and the modules it uses); TensorBoard's event files
(tracking/tensorboard.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from jobspec.spec.types import JobSpec
from jobspec.status import Ending


@dataclass(frozen=True)
class RunStart:
    """What the launcher knows when the run starts: its files are written
    (rundir.write_compiled)."""
    run_dir: Path
    spec: JobSpec              # the resolved spec, defaults filled
    spec_text: str             # the job file as written
    launch: dict               # launch.json
    derived: dict              # spec/derived.DerivedJob.as_dict()
    # more params from the launcher (the memory plan: plan.*, fit.*)
    params: dict = field(default_factory=dict)
    resume_run_id: str | None = None              # the checkpoints' MLflow run (launch/ownership)


@runtime_checkable
class MetricWriter(Protocol):
    """Rank 0's side of a tracker: what the metrics sink hands on after writing metrics.jsonl. It
    must not block the training loop (a slow store is written from a thread of the writer's own)."""

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int) -> None:
        """One metric row: finite floats by name, at an optimizer step."""

    def log_params(self, params: dict) -> None:
        """Params the ranks learn (LoRA's trainable counts, the data cache's statistics); may be
        nested."""

    def set_tags(self, tags: dict[str, str]) -> None:
        """Facts about the run found while it trains (a resume that passed over a checkpoint)."""

    def log_table(self, step: int, rows: list[dict]) -> None:
        """The answers generated at the evaluation of `step` (training.eval_generate)."""

    def close(self, timeout: float) -> None:
        """Write what is pending, waiting at most `timeout` seconds for a remote store."""


@runtime_checkable
class Tracker(Protocol):
    """One way of tracking a run; registered in jobspec/tracking/trackers.TRACKERS as `name`."""
    name: str   # its schema section, `logging.<name>`

    def start(self, run: RunStart) -> Any:
        """On the launcher, before the ranks train: the run with its params, spec and compiled
        config. Returns what `end` needs (None: nothing to end, e.g. an optional server that is
        down); raises jobspec.errors.RunFailure when the job must not run without it."""

    def end(self, started: Any, run_dir: Path, ending: Ending) -> None:
        """On the launcher, after the ranks: the final status (`ending.status`: FINISHED, KILLED or
        FAILED, with its exit code and reason). Never raises: the run's files say how it ended."""

    def writer(self, run_dir: Path, spec: JobSpec | None) -> MetricWriter | None:
        """On rank 0: the writer its metric rows go to (None: this run has none to write to).
        `spec`: the run's resolved spec; None when its directory has no resolved.yaml (then only the
        default tracker is asked)."""
