"""TensorBoard (`logging.tensorboard.enabled`): the run's event files under `<run
dir>/tensorboard/`, for `tensorboard --logdir <output_dir>` (each run directory one TensorBoard
run).

    scalars    every metric row of rank 0's sink (the points of metrics.jsonl), by optimizer step
    text       jobspec/resolved_spec, jobspec/ds_config (the launcher, at start; secrets masked),
               jobspec/params and jobspec/tags (rank 0), eval/generations (one markdown table per
               evaluation with training.eval_generate), jobspec/ending (status, exit code, reason)
    hparams    the HParams tab: the spec's scalar settings, derived.* and the memory plan at start,
               the status at the end

Written with TensorBoard's own event-file writer (no torch, no TensorFlow: ~0.2 s to import, only
where the tracker is enabled), which writes from a thread of its own. The launcher and rank 0 write
separate files into the same directory (`.launcher`, `.rank0` suffixes); TensorBoard reads them as
one run.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from jobspec import rundir
from jobspec.errors import RunFailure, first_line
from jobspec.secrets import mask_secrets
from jobspec.spec.loader import dotted_leaves
from jobspec.spec.types import JobSpec
from jobspec.status import Ending
from jobspec.tracking.base import RunStart

log = logging.getLogger("jobspec.tracking")

LOG_DIR = "tensorboard"
# rank 0's events reach the file at least this often (a live `tensorboard` sees them)
FLUSH_S = 10
# events waiting for the writer's thread before a log call waits (its default, 10, would
QUEUED_EVENTS = 1000
                      # make the training loop wait on a slow disk after 10 logging steps)
TABLE_COLUMNS = ("prompt", "reference", "generation", "exact_match")
TABLE_CELL_CHARS = 500
# KILLED (stopped): STATUS_UNKNOWN
STATUS = {"FINISHED": "STATUS_SUCCESS", "FAILED": "STATUS_FAILURE"}


def log_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOG_DIR


class TensorBoardTracker:
    name = "tensorboard"

    def start(self, run: RunStart) -> Path:
        """The resolved spec and DeepSpeed config as text, and the HParams session's settings."""
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2

        session = plugin_data_pb2.SessionStartInfo(group_name=run.spec["name"],
                                                   start_time_secs=time.time())
        for key, value in hparams({**run.spec, "derived": run.derived, **run.params}).items():
            if isinstance(value, bool):
                session.hparams[key].bool_value = value
            elif isinstance(value, (int, float)):
                session.hparams[key].number_value = value
            else:
                session.hparams[key].string_value = value
        summary = summary_pb2.Summary()
        summary.value.add(tag=metadata.SESSION_START_INFO_TAG, tensor=metadata.NULL_TENSOR,
                          metadata=metadata.create_summary_metadata(
                              plugin_data_pb2.HParamsPluginData(session_start_info=session)))
        texts = {"jobspec/resolved_spec": rundir.RESOLVED, "jobspec/ds_config": rundir.DS_CONFIG}
        try:
            with _Events(run.run_dir, "launcher") as events:
                events.summary(summary, step=0)
                for tag, name in texts.items():
                    path = run.run_dir / name
                    if path.is_file():
                        events.text(tag, _code(mask_secrets(path.read_text(encoding="utf-8"))),
                                    step=0)
        # before any rank trains: a clear refusal, not a run without its events
        except OSError as err:
            raise RunFailure(f"TensorBoard: cannot write event files in {log_dir(run.run_dir)}: "
                             f"{err.strerror or first_line(err)}; free space or fix the "
                             "permissions there, or set logging.tensorboard.enabled: "
                             "false") from None
        return log_dir(run.run_dir)

    def end(self, started: Any, run_dir: Path, ending: Ending) -> None:
        """The HParams session's status, and the ending as text."""
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

        status = api_pb2.Status.Value(STATUS.get(ending.status, "STATUS_UNKNOWN"))
        session = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
        summary = summary_pb2.Summary()
        summary.value.add(tag=metadata.SESSION_END_INFO_TAG, tensor=metadata.NULL_TENSOR,
                          metadata=metadata.create_summary_metadata(
                              plugin_data_pb2.HParamsPluginData(session_end_info=session)))
        step = _last_step(run_dir)
        text = f"**{ending.status}** ({ending.label}), exit code {ending.exit_code}"
        if ending.reason:
            text += "\n\n" + mask_secrets(ending.reason)
        try:
            with _Events(run_dir, "launcher") as events:
                events.summary(summary, step=step)
                events.text("jobspec/ending", text, step=step)
        # the run is over and its files say how: a full disk is not a new failure
        except OSError as err:
            log.warning("TensorBoard: could not write the run's end: %s", err)

    def writer(self, run_dir: Path, spec: JobSpec | None) -> "TensorBoardWriter":
        return TensorBoardWriter(run_dir)


class TensorBoardWriter:
    """Rank 0's event file: scalars by step, the ranks' params, tags and generation tables as text.

    A write that fails (a full disk) is warned about once and ends this writer, never the training:
    metrics.jsonl, written first, still holds every point."""

    def __init__(self, run_dir: Path):
        self._last_step = 0
        self._events: _Events | None = None
        try:
            self._events = _Events(run_dir, "rank0")
        except OSError as err:
            self._give_up(err)

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int) -> None:
        from tensorboard.compat.proto import summary_pb2
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=key, simple_value=value)
                                             for key, value in metrics.items()])
        self._write(lambda events: events.summary(summary, step=step,
                                                  wall_time=timestamp_ms / 1000))
        self._last_step = step

    def log_params(self, params: dict) -> None:
        if params:
            rows = [(key, value if isinstance(value, str) else json.dumps(value))
                    for key, value in dotted_leaves(params, "").items()]
            self._write(lambda events: events.text("jobspec/params",
                                                   _table(("param", "value"), rows),
                                                   step=self._last_step))

    def set_tags(self, tags: dict[str, str]) -> None:
        if tags:
            self._write(lambda events: events.text("jobspec/tags",
                                                   _table(("tag", "value"), list(tags.items())),
                                                   step=self._last_step))

    def log_table(self, step: int, rows: list[dict]) -> None:
        cells = [tuple(row.get(column) for column in TABLE_COLUMNS) for row in rows]
        self._write(lambda events: events.text("eval/generations", _table(TABLE_COLUMNS, cells),
                                               step=step))

    def close(self, timeout: float) -> None:
        self._write(lambda events: events.close())
        self._events = None

    def _write(self, write) -> None:
        """`write(events)`, unless the file never opened, failed before or is closed; a failure ends
        it."""
        if self._events is None:
            return
        try:
            write(self._events)
        # the event writer's thread re-raises its own failure on the next write
        except Exception as err:
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        log.warning("TensorBoard: writing %s failed (%s); the run's metrics from here on are in %s "
                    "only",
                    LOG_DIR, first_line(err), rundir.METRICS)
        self._events = None


class _Events:
    """One event file of the run's TensorBoard directory (TensorBoard's EventFileWriter)."""

    def __init__(self, run_dir: Path, writer: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._file = EventFileWriter(str(log_dir(run_dir)), max_queue_size=QUEUED_EVENTS,
                                     flush_secs=FLUSH_S, filename_suffix=f".{writer}")

    def summary(self, summary, step: int, wall_time: float | None = None) -> None:
        from tensorboard.compat.proto import event_pb2
        self._file.add_event(event_pb2.Event(wall_time=wall_time or time.time(), step=int(step),
                                             summary=summary))

    def text(self, tag: str, markdown: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb
        self.summary(text_pb(tag, markdown), step=step)

    def close(self) -> None:
        self._file.close()   # flushes what is queued

    def __enter__(self) -> "_Events":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hparams(values: dict) -> dict[str, bool | int | float | str]:
    """The settings as HParams: dotted scalar leaves (lists as JSON text, nulls left out), secrets
    masked."""
    found: dict[str, bool | int | float | str] = {}
    for key, value in dotted_leaves(values, "").items():
        if value is None:
            continue
        if isinstance(value, (bool, int, float)):
            found[key] = value
        else:
            found[key] = mask_secrets(value if isinstance(value, str) else json.dumps(value))
    return found


def _code(text: str) -> str:
    """A file's text as a markdown code block (the text plugin renders markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def _table(columns: tuple, rows: list[tuple]) -> str:
    """A markdown table; cells on one line, `|` escaped, long cells cut."""
    def cell(value) -> str:
        text = "" if value is None else str(value)
        text = text.replace("|", "\\|").replace("\r", " ").replace("\n", "<br>")
        return text if len(text) <= TABLE_CELL_CHARS else text[:TABLE_CELL_CHARS] + "…"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _last_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last row, where the ending shows on a step axis (0 without
    rows)."""
    if not (Path(run_dir) / rundir.METRICS).is_file():
        return 0
    points = rundir.read_metric_points(run_dir)
    return points[-1][3] if points else 0


TRACKER = TensorBoardTracker()
