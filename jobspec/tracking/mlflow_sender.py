"""Rank 0's metrics to the job's MLflow run: the MLflow tracker's MetricWriter (tracking/base.py).
The metrics sink (tracking/sink.py) has written each row to metrics.jsonl already; a background
thread sends the rows here, so the training loop never waits for the tracking server and nothing is
lost while it is down (`jobspec sync` uploads what the thread could not).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from jobspec import rundir
from jobspec.errors import first_line
from jobspec.secrets import mask_secrets
from jobspec.tracking import generations, sync
from jobspec.tracking.run import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE_CHARS,
    client_for,
    flatten,
    param_batches,
)

log = logging.getLogger("jobspec.tracking")

RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # backoff between attempts of a batch (no attempt limit)
MAX_PENDING_POINTS = 200_000     # queued in memory while MLflow is down; beyond, metrics.jsonl only
# at most one metrics log_batch per 5 s (points coalesced; close flushes)
SEND_INTERVAL_S = 5.0


class MlflowSender:
    """Non-blocking MLflow writer for rank 0: `log_metrics` queues the points of a row for MLflow.

    A background thread sends them, retrying each batch with backoff for as long as the job runs
    (a tracking server restarted mid-run gets every point). Memory stays bounded: past
    MAX_PENDING_POINTS queued points, new ones are only in metrics.jsonl and `close` uploads them
    from there when the server is back (`jobspec sync RUN_DIR` does it later if it never is).
    """

    def __init__(self, run_dir: Path, client=None, run_id: str | None = None,
                 tracking_uri: str | None = None):
        """`client`, or `tracking_uri` for one the sender thread makes itself: importing mlflow
        takes 1-2 s of CPU, which then overlaps the first training steps instead of delaying
        them."""
        if client is None and tracking_uri is None:
            raise ValueError("MlflowSender: a client or a tracking URI")
        self.run_dir = Path(run_dir)
        self.client, self.run_id, self._uri = client, run_id, tracking_uri
        self.sent = 0      # points MLflow acknowledged
        self.spilled = 0   # points kept only in metrics.jsonl (queue full)
        self.dropped = 0   # points still unsent when `close` gave up (all in metrics.jsonl)
        self._pending = 0
        self._queue: queue.Queue = queue.Queue()
        self._give_up_at: float | None = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="jobspec-metric-sink",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> "MlflowSender | None":
        """A sender into the run of `run_dir/mlflow_run.json`; None without that file (MLflow off,
        or an optional server that was down at launch: metrics.jsonl then holds everything for
        `sync`)."""
        info = rundir.read_mlflow_run(run_dir)
        if info is None:
            return None
        return cls(run_dir, run_id=info["run_id"], tracking_uri=info["tracking_uri"])

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int) -> None:
        if self._pending + len(metrics) > MAX_PENDING_POINTS:
            self.spilled += len(metrics)
            return
        self._pending += len(metrics)
        self._queue.put(("metrics", metrics, int(step), timestamp_ms))

    def log_params(self, params: dict) -> None:
        # nothing to log is nothing sent: flatten({}) is {"": "{}"}, a key MLflow rejects, and the
        # sender would retry it until close() gives up (30 s at the end of every run, past the
        # SIGKILL Slurm sends KillWait seconds after a scancel's SIGTERM)
        if params:
            self._queue.put(("params", flatten(params), None, None))

    def log_table(self, step: int, rows: list[dict]) -> None:
        """The answers generated at the evaluation of `step` as the run's MLflow table
        (tracking/generations.py; generations.jsonl holds them already: rank 0 writes it)."""
        self._queue.put(("table", [dict(row) for row in rows], int(step), None))

    def set_tags(self, tags: dict) -> None:
        self._queue.put(("tags",
                         {k: mask_secrets(str(v))[:MAX_PARAM_VALUE_CHARS] for k, v in tags.items()},
                         None, None))

    def close(self, timeout: float = 30) -> None:
        """Flush what is queued (retrying for at most `timeout` seconds), then stop the sender."""
        self._give_up_at = time.monotonic() + timeout
        self._queue.put(None)
        self._wake.set()  # cut a long backoff short: try now, then until the deadline
        self._thread.join(timeout + 15)  # + one HTTP request's timeout and retries
        if self.spilled and not self.dropped and self.run_id is not None \
                and time.monotonic() < self._give_up_at:
            try:   # metrics.jsonl has them: the sink wrote every row there before handing it on
                self.spilled -= sync.upload_missing(self.client, self.run_id, self.run_dir)
            except Exception as err:
                log.warning("MLflow sink: could not upload spilled points: %s", first_line(err))
        unsent = self.dropped + max(0, self.spilled)
        if unsent:
            log.warning("MLflow sink: %d metric points are only in %s; upload them with "
                        "`jobspec sync %s`", unsent, self.run_dir / rundir.METRICS, self.run_dir)

    def _send_loop(self) -> None:
        if self.client is None:
            if self._uri is None:
                # __init__ checks
                raise RuntimeError("MlflowSender: neither a client nor a tracking URI")
            self.client = client_for(self._uri)
        from mlflow.entities import Metric, Param, RunTag
        last_sent = -SEND_INTERVAL_S
        while True:
            items = [self._queue.get()]
            # Coalesce: what arrives until SEND_INTERVAL_S after the previous send goes out in one
            # log_batch. A call costs ~8 ms of CPU on a sqlite store before its first point; a job
            # logging every step would pay it every step. The wait is on `_wake` (set by `close`),
            # not on the queue, so the points logged meanwhile do not wake this thread one by one.
            wait = last_sent + SEND_INTERVAL_S - time.monotonic()
            if items[0] is not None and wait > 0:
                self._wake.wait(wait)
            while items[-1] is not None:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            metrics: list = []
            for item in items:
                if item is None or item[0] != "metrics":
                    # in order: points queued before params/tags go first
                    self._send_metrics(metrics)
                    metrics = []
                if item is None:
                    return
                kind, payload, step, timestamp = item
                if kind == "params":
                    for batch in param_batches(payload):
                        self._send(params=[Param(k, v) for k, v in batch.items()])
                elif kind == "tags":
                    self._send(tags=[RunTag(k, v) for k, v in payload.items()])
                elif kind == "table":
                    self._retry(lambda rows=payload,
                                at=step: generations.log_table(self.client, str(self.run_id),
                                                                                      at, rows))
                else:
                    metrics += [Metric(k, v, timestamp, step) for k, v in payload.items()]
            self._send_metrics(metrics)
            last_sent = time.monotonic()

    def _send_metrics(self, metrics: list) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            chunk = metrics[i:i + MAX_METRICS_PER_BATCH]
            if self._send(metrics=chunk):
                self.sent += len(chunk)
            else:
                self.dropped += len(chunk)
            self._pending -= len(chunk)

    def _send(self, **batch) -> bool:
        """Retry one batch with backoff until it is sent (True) or `close`'s deadline passes
        (False)."""
        return self._retry(lambda: self.client.log_batch(self.run_id, synchronous=True, **batch))

    def _retry(self, call) -> bool:
        """Retry `call` with backoff until it succeeds (True) or `close`'s deadline passes
        (False)."""
        delay, attempts = RETRY_FIRST_S, 0
        while True:
            try:
                call()
                if attempts:
                    log.warning("MLflow sink: tracking server reachable again after %d failed "
                                "attempts", attempts)
                return True
            except Exception as err:
                attempts += 1
                if attempts == 1 or attempts % 20 == 0:
                    log.warning("MLflow sink: sending failed (attempt %d, retrying; metrics.jsonl "
                                "has every point): %s", attempts, first_line(err))
            if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                return False
            if self._wake.wait(delay):
                self._wake.clear()
                delay = RETRY_FIRST_S
            else:
                delay = min(delay * 2, RETRY_MAX_S)
            if self._give_up_at is not None:
                delay = min(delay, max(0.05, self._give_up_at - time.monotonic()))


