"""MLflow telemetry: the launcher's run (params, tags, artifacts, final status) and the worker's MetricSink.

The launcher owns the run's lifecycle; rank 0 of the worker only sends metrics through `MetricSink`,
which never blocks the training loop (a queue drained by a background thread) and always keeps a
local copy in `run_dir/metrics.jsonl`, so nothing is lost when the tracking server is down.
Credentials (`user:pass@` in a URI, tokens) never reach params, tags, artifacts or logs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from jobspec import hardware, rundir
from jobspec.secrets import mask_secrets, split_credentials

log = logging.getLogger("jobspec.tracking.telemetry")

MAX_PARAMS_PER_BATCH = 100       # MLflow's log_batch limit for params
MAX_PARAM_VALUE_CHARS = 6000     # MLflow's param value limit (6000 since 2.x)
MAX_METRICS_PER_BATCH = 1000     # MLflow's log_batch limit for metrics
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # MetricSink: backoff between attempts of a batch (no attempt limit)
MAX_PENDING_POINTS = 200_000     # MetricSink: queued in memory while MLflow is down; beyond, metrics.jsonl only
SEND_INTERVAL_S = 5.0            # MetricSink: at most one metrics log_batch per 5 s (points coalesced; close flushes)
FAILURE_REASON_CHARS = 4000

# The client's defaults (120 s timeout, 7 retries with exponential backoff) block ~4 minutes per call
# against an unreachable server; a training job must notice within seconds instead.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}
VERSIONED_PACKAGES = ("jobspec", "deepspeed", "torch", "transformers", "mlflow")


def apply_http_env(environ: dict | os._Environ = os.environ) -> None:
    """Short MLflow HTTP timeouts/retries, unless the user set their own."""
    for key, value in HTTP_ENV_DEFAULTS.items():
        environ.setdefault(key, value)


# --- params and tags ---------------------------------------------------------------------------

def flatten(value, prefix: str = "") -> dict[str, str]:
    """Dotted keys for nested mappings (`model.config.hidden_size`); lists and scalars as JSON text."""
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, child in value.items():
            out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    text = value if isinstance(value, str) else json.dumps(value)
    return {prefix: mask_secrets(text)[:MAX_PARAM_VALUE_CHARS]}


def param_batches(params: dict[str, str]) -> list[dict[str, str]]:
    items = sorted(params.items())
    return [dict(items[i:i + MAX_PARAMS_PER_BATCH]) for i in range(0, len(items), MAX_PARAMS_PER_BATCH)]


def package_versions() -> dict[str, str]:
    """Installed versions without importing the packages (no torch import on the launcher)."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def run_tags(spec: dict, launch: dict, spec_text: str) -> dict[str, str]:
    tags = {f"jobspec.version.{name}": v for name, v in package_versions().items()}
    tags.update({
        "jobspec.job": spec["name"],
        "jobspec.world_size": str(launch.get("world_size", "")),
        "jobspec.nodes": str(launch.get("nodes", "")),
        "jobspec.hosts": socket.gethostname(),
        "jobspec.gpus": ",".join(sorted(set(hardware.gpu_names()))),
        "jobspec.spec_sha256": hashlib.sha256(spec_text.encode("utf-8")).hexdigest(),
    })
    if spec.get("description"):
        tags["mlflow.note.content"] = spec["description"]
    for key, value in spec["logging"]["mlflow"]["tags"].items():
        tags[str(key)] = str(value)
    return {k: mask_secrets(v)[:MAX_PARAM_VALUE_CHARS] for k, v in tags.items()}


# --- the launcher's run ------------------------------------------------------------------------

@dataclass
class TrackedRun:
    """An MLflow run the launcher created (or resumed) and will end."""
    tracking_uri: str     # without credentials
    experiment_id: str
    run_id: str
    client: object        # mlflow.MlflowClient

    def as_json(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": self.run_id}


class TrackingUnavailable(RuntimeError):
    """The tracking store could not be reached or used."""


def probe(tracking_uri: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, with a plain reason, when an http(s) tracking server cannot be reached at all."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise TrackingUnavailable(f"cannot connect to {parts.hostname}:{port} ({err.strerror or err})") from err


def _client(tracking_uri: str):
    apply_http_env()
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=tracking_uri)


def start_run(spec: dict, launch: dict, derived: dict, spec_text: str, run_dir: Path,
              resume_run_id: str | None = None) -> TrackedRun:
    """Create (or reopen, for a resumed job) the MLflow run, log params/tags/artifacts, write mlflow_run.json.

    Raises TrackingUnavailable with a credential-free message when the store cannot be used.
    """
    settings = spec["logging"]["mlflow"]
    uri, user, password = split_credentials(settings["tracking_uri"])
    if user:  # MLflow reads basic-auth credentials from the environment; the worker inherits it
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    try:
        client = _client(uri)
        experiment = client.get_experiment_by_name(settings["experiment"])
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(settings["experiment"]))
        run = _reopen(client, resume_run_id)
        if run is None:
            run = client.create_run(experiment_id, run_name=settings["run_name"] or spec["name"])
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        run_id = run.info.run_id
        tracked = TrackedRun(uri, run.info.experiment_id, run_id, client)
        _log_start(tracked, spec, launch, derived, spec_text, run_dir)
    except TrackingUnavailable:
        raise
    except Exception as err:  # MlflowException, requests errors, sqlite errors: all "unusable store"
        raise TrackingUnavailable(mask_secrets(f"{type(err).__name__}: {err}").splitlines()[0][:500]) from err
    rundir.write_mlflow_run(run_dir, tracked.as_json())
    return tracked


def _reopen(client, run_id: str | None):
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except Exception:
        log.warning("MLflow run %s of the checkpoints is not in this tracking store; starting a new run", run_id)
        return None


def _log_start(tracked: TrackedRun, spec: dict, launch: dict, derived: dict, spec_text: str,
               run_dir: Path) -> None:
    from mlflow.entities import Param, RunTag
    client, run_id = tracked.client, tracked.run_id
    params = flatten(spec)
    params.update(flatten(derived, "derived"))
    existing = client.get_run(run_id).data.params
    for batch in param_batches({k: v for k, v in params.items() if k not in existing}):
        client.log_batch(run_id, params=[Param(k, v) for k, v in batch.items()], synchronous=True)
    changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
    if changed:  # MLflow params are immutable: a resumed run keeps the first values
        log.warning("resumed run %s keeps its earlier values of %d changed params (%s)", run_id,
                    len(changed), ", ".join(changed[:5]))
    tags = run_tags(spec, launch, spec_text)
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
    log_artifacts(tracked, run_dir, rundir.START_ARTIFACTS)


def log_artifacts(tracked: TrackedRun, run_dir: Path, names) -> None:
    """Upload run-dir files, credentials masked (a spec may carry a tracking URI with a password)."""
    with tempfile.TemporaryDirectory(prefix="jobspec-artifacts-") as tmp:
        for name in names:
            source = run_dir / name
            if source.is_file():
                masked = Path(tmp) / name
                masked.write_text(mask_secrets(source.read_text(encoding="utf-8", errors="replace")),
                                  encoding="utf-8")
                tracked.client.log_artifact(tracked.run_id, str(masked))


def end_run(tracked: TrackedRun, run_dir: Path, *, status: str, exit_code: int,
            failure_reason: str | None = None) -> None:
    """Upload summary.json (a minimal one when the worker wrote none), set the reason and the final status."""
    rundir.write_fallback_summary(run_dir, status, exit_code)
    client, run_id = tracked.client, tracked.run_id
    try:
        log_artifacts(tracked, run_dir, rundir.END_ARTIFACTS)
        client.set_tag(run_id, "jobspec.exit_code", str(exit_code))
        if failure_reason:
            client.set_tag(run_id, "jobspec.failure_reason", mask_secrets(failure_reason)[-FAILURE_REASON_CHARS:])
        client.set_terminated(run_id, status=status)
    except Exception as err:
        log.warning("could not finish MLflow run %s: %s", run_id, mask_secrets(str(err)).splitlines()[0])


# --- the worker's metric sink ------------------------------------------------------------------

class MetricSink:
    """Non-blocking metrics for rank 0: `log` appends to metrics.jsonl and queues the points for MLflow.

    A background thread sends them, retrying each batch with backoff for as long as the job runs
    (a tracking server restarted mid-run gets every point). Memory stays bounded: past
    MAX_PENDING_POINTS queued points, new ones are only in metrics.jsonl and `close` uploads them
    from there when the server is back (`jobspec sync RUN_DIR` does it later if it never is).
    """

    def __init__(self, run_dir: Path, client=None, run_id: str | None = None, tracking_uri: str | None = None):
        """`client`, or `tracking_uri` for one the sender thread makes itself: importing mlflow takes
        1-2 s of CPU, which then overlaps the first training steps instead of delaying them."""
        self.run_dir = Path(run_dir)
        self.client, self.run_id, self._uri = client, run_id, tracking_uri
        self.sent = 0      # points MLflow acknowledged
        self.spilled = 0   # points kept only in metrics.jsonl (queue full)
        self.dropped = 0   # points still unsent when `close` gave up (all in metrics.jsonl)
        self._pending = 0
        self._jsonl = rundir.open_metrics(self.run_dir)
        self._queue: queue.Queue = queue.Queue()
        self._give_up_at: float | None = None
        self._wake = threading.Event()
        self._thread = None
        if client is not None or tracking_uri is not None:
            self._thread = threading.Thread(target=self._send_loop, name="jobspec-metric-sink", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, run_dir) -> "MetricSink":
        """A sink for the run in `run_dir/mlflow_run.json`; without that file, metrics.jsonl only."""
        info = rundir.read_mlflow_run(run_dir)
        if info is None:
            return cls(run_dir)
        return cls(run_dir, run_id=info["run_id"], tracking_uri=info["tracking_uri"])

    def log(self, metrics: dict, step: int) -> None:
        timestamp = int(time.time() * 1000)
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._jsonl.write(rundir.metric_line(clean, step, timestamp))
        self._jsonl.flush()
        if self._thread is None:
            return
        if self._pending + len(clean) > MAX_PENDING_POINTS:
            self.spilled += len(clean)
            return
        self._pending += len(clean)
        self._queue.put(("metrics", clean, int(step), timestamp))

    def log_params(self, params: dict) -> None:
        if self._thread is not None:
            self._queue.put(("params", flatten(params), None, None))

    def set_tags(self, tags: dict) -> None:
        if self._thread is not None:
            self._queue.put(("tags", {k: mask_secrets(str(v))[:MAX_PARAM_VALUE_CHARS] for k, v in tags.items()},
                             None, None))

    def close(self, timeout: float = 30) -> None:
        """Flush what is queued (retrying for at most `timeout` seconds), then stop the sender."""
        if self._thread is not None:
            self._give_up_at = time.monotonic() + timeout
            self._queue.put(None)
            self._wake.set()  # cut a long backoff short: try now, then until the deadline
            self._thread.join(timeout + 15)  # + one HTTP request's timeout and retries
            if self.spilled and not self.dropped and time.monotonic() < self._give_up_at:
                try:
                    self.spilled -= upload_missing(self.client, self.run_id, self.run_dir)
                except Exception as err:
                    log.warning("MLflow sink: could not upload spilled points: %s", _first_line(err))
            unsent = self.dropped + max(0, self.spilled)
            if unsent:
                log.warning("MLflow sink: %d metric points are only in %s; upload them with "
                            "`jobspec sync %s`", unsent, self.run_dir / rundir.METRICS, self.run_dir)
        self._jsonl.close()

    def _send_loop(self) -> None:
        if self.client is None:
            self.client = _client(self._uri)
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
            metrics = []
            for item in items:
                if item is None or item[0] != "metrics":
                    self._send_metrics(metrics)  # in order: points queued before params/tags go first
                    metrics = []
                if item is None:
                    return
                kind, payload, step, timestamp = item
                if kind == "params":
                    for batch in param_batches(payload):
                        self._send(params=[Param(k, v) for k, v in batch.items()])
                elif kind == "tags":
                    self._send(tags=[RunTag(k, v) for k, v in payload.items()])
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
        """Retry one batch with backoff until it is sent (True) or `close`'s deadline passes (False)."""
        delay, attempts = RETRY_FIRST_S, 0
        while True:
            try:
                self.client.log_batch(self.run_id, synchronous=True, **batch)
                if attempts:
                    log.warning("MLflow sink: tracking server reachable again after %d failed attempts", attempts)
                return True
            except Exception as err:
                attempts += 1
                if attempts == 1 or attempts % 20 == 0:
                    log.warning("MLflow sink: sending failed (attempt %d, retrying; metrics.jsonl has every "
                                "point): %s", attempts, _first_line(err))
            if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                return False
            if self._wake.wait(delay):
                self._wake.clear()
                delay = RETRY_FIRST_S
            else:
                delay = min(delay * 2, RETRY_MAX_S)
            if self._give_up_at is not None:
                delay = min(delay, max(0.05, self._give_up_at - time.monotonic()))


def _first_line(err: Exception) -> str:
    return (mask_secrets(str(err)).splitlines() or [type(err).__name__])[0][:300]


# --- metrics.jsonl -> MLflow, for points the sink could not send ----------------------------------

def upload_missing(client, run_id: str, run_dir: Path) -> int:
    """Send the points of metrics.jsonl that the run lacks (same key, step and timestamp); returns how many.

    Idempotent: a second call finds nothing missing.
    """
    from mlflow.entities import Metric
    points = rundir.read_metric_points(run_dir)
    known = {}
    for key in sorted({p[0] for p in points}):
        known[key] = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, key)}
    missing = [Metric(k, v, ts, step) for k, v, ts, step in points if (step, ts) not in known[k]]
    for i in range(0, len(missing), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[i:i + MAX_METRICS_PER_BATCH], synchronous=True)
    return len(missing)
