"""MLflow telemetry against a local sqlite store, a real `mlflow server`, and an unreachable one."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import fresh_store
from jobspec import rundir
from jobspec.tracking import run as tracking
from jobspec.tracking.mlflow_sender import MlflowSender
from jobspec.tracking.sink import MetricSink
from jobspec.tracking.system import SystemMetrics
from jobspec.secrets import mask_secrets, split_credentials
from jobspec.spec.schema import fill_defaults

SECRET = "s3cr3t-pa55"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_spec(tmp_path: Path, uri: str, **mlflow) -> dict:
    spec = fill_defaults({
        "name": "tele-job", "description": "telemetry test",
        "model": {"architecture": "bert", "config": {f"extra_{i:03d}": i for i in range(150)}
                  | {"long_value": "x" * 10_000}},
        "data": {"synthetic": {}}, "training": {"max_steps": 3},
        "logging": {"mlflow": {"tracking_uri": uri, "experiment": "tele-exp",
                               "tags": {"team": "infra", "ticket": 42}, **mlflow}},
    })
    spec["output_dir"] = str(tmp_path / "out")
    spec["checkpoint"]["dir"] = str(tmp_path / "out" / "checkpoints")
    return spec


def make_run_dir(tmp_path: Path, spec: dict, text: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(text)
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec))
    (run_dir / "ds_config.json").write_text(json.dumps({"train_batch_size": 16}))
    (run_dir / "command.txt").write_text("deepspeed --num_gpus 2 --module jobspec.train.worker\n")
    return run_dir


LAUNCH = {"argv": ["deepspeed"], "world_size": 2, "nodes": 1, "gpus_per_node": 2, "master_port": 29500}
DERIVED = {"gradient_accumulation_steps": 2, "total_steps": 3, "world_size": 2}


@pytest.fixture
def sqlite_run(tmp_path, empty_store):
    uri = fresh_store(empty_store, tmp_path / "mlflow.db")
    spec = make_spec(tmp_path, uri)
    text = f"name: tele-job\nlogging: {{mlflow: {{tracking_uri: '{uri}'}}}}\n"
    run_dir = make_run_dir(tmp_path, spec, text)
    tracked = tracking.start_run(spec, LAUNCH, DERIVED, text, run_dir)
    return tracked, run_dir, spec, text


def artifact_names(tracked) -> set[str]:
    return {a.path for a in tracked.client.list_artifacts(tracked.run_id)}


def test_flatten_dotted_keys_lists_and_truncation():
    flat = tracking.flatten({"model": {"config": {"hidden_size": 64}, "freeze": ["a.*"]}, "x": "y" * 7000,
                              "empty": {}})
    assert flat["model.config.hidden_size"] == "64"
    assert flat["model.freeze"] == '["a.*"]'
    assert len(flat["x"]) == tracking.MAX_PARAM_VALUE_CHARS
    assert flat["empty"] == "{}"


def test_param_batches_respect_the_limit():
    batches = tracking.param_batches({f"k{i}": str(i) for i in range(250)})
    assert [len(b) for b in batches] == [100, 100, 50]


def test_mask_secrets_in_uris_and_env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdef123456")
    text = mask_secrets(f"uri http://bob:{SECRET}@host:5000/x token hf_abcdef123456")
    assert SECRET not in text and "hf_abcdef123456" not in text and "http://***@host:5000/x" in text
    assert split_credentials(f"https://bob:{SECRET}@h:1/p") == ("https://h:1/p", "bob", SECRET)


def test_start_run_logs_params_tags_artifacts(sqlite_run):
    tracked, run_dir, spec, text = sqlite_run
    run = tracked.client.get_run(tracked.run_id)
    params, tags = run.data.params, run.data.tags
    assert params["model.config.extra_149"] == "149"
    assert len(params["model.config.long_value"]) == tracking.MAX_PARAM_VALUE_CHARS
    assert params["training.max_steps"] == "3" and params["derived.gradient_accumulation_steps"] == "2"
    assert len(params) > 150  # more than one batch of 100 went through
    assert tags["mlflow.runName"] == "tele-job"
    assert tags["team"] == "infra" and tags["ticket"] == "42"
    assert tags["jobspec.world_size"] == "2" and tags["jobspec.nodes"] == "1"
    assert tags["jobspec.gpus"] == "cpu"
    import hashlib
    assert tags["jobspec.spec_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    import mlflow
    assert tags["jobspec.version.mlflow"] == mlflow.__version__
    assert {"jobspec.version.torch", "jobspec.version.deepspeed", "jobspec.version.transformers"} <= set(tags)
    assert artifact_names(tracked) == set(rundir.START_ARTIFACTS)
    assert json.loads((run_dir / "mlflow_run.json").read_text()) == tracked.as_json()
    assert run.info.status == "RUNNING"
    assert tracked.client.get_experiment(run.info.experiment_id).name == "tele-exp"


@pytest.mark.parametrize("status,code,reason", [("FINISHED", 0, None), ("FAILED", 1, "boom: last log line"),
                                                ("KILLED", 130, "stopped by SIGINT from the user")])
def test_end_run_status_reason_and_minimal_summary(sqlite_run, status, code, reason):
    tracked, run_dir, _, _ = sqlite_run
    tracking.end_run(tracked, run_dir, status=status, exit_code=code, failure_reason=reason)
    run = tracked.client.get_run(tracked.run_id)
    assert run.info.status == status
    assert run.data.tags.get("jobspec.failure_reason") == reason
    assert json.loads((run_dir / "summary.json").read_text())["exit_code"] == code
    assert "summary.json" in artifact_names(tracked)


def test_end_run_keeps_the_workers_summary(sqlite_run):
    tracked, run_dir, _, _ = sqlite_run
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished", "steps": 3}))
    tracking.end_run(tracked, run_dir, status="FINISHED", exit_code=0)
    local = tracked.client.download_artifacts(tracked.run_id, "summary.json", str(run_dir / "dl"))
    assert json.loads(Path(local).read_text()) == {"status": "finished", "steps": 3}


def test_resumed_run_is_the_same_run(sqlite_run, tmp_path):
    tracked, run_dir, spec, text = sqlite_run
    tracking.end_run(tracked, run_dir, status="KILLED", exit_code=143)
    again = tracking.start_run(spec, LAUNCH, DERIVED, text, tmp_path, resume_run_id=tracked.run_id)
    assert again.run_id == tracked.run_id
    assert tracked.client.get_run(tracked.run_id).info.status == "RUNNING"


def test_metric_sink_sends_off_thread_and_flushes(sqlite_run):
    tracked, run_dir, _, _ = sqlite_run
    sink = MetricSink.open(run_dir)
    for step in range(1, 6):
        sink.log({"train/loss": 1.0 / step, "perf/samples_per_s": 10.0 * step, "mem/nvml_used_mib_max": None},
                 step=step)
    sink.log_params({"plan": {"note": "x"}})
    sink.log_params({})   # no data params (a run without the data cache): nothing to send, nothing to retry
    started = time.monotonic()
    sink.close(timeout=30)
    assert time.monotonic() - started < 20   # bound: the sender's 5 s batching, not the 30 s give-up
    history = tracked.client.get_metric_history(tracked.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 6)]
    assert tracked.client.get_run(tracked.run_id).data.params["plan.note"] == "x"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["perf/samples_per_s"] == 30.0 and "mem/nvml_used_mib_max" not in rows[2]


class SlowFlakyClient:
    """log_batch takes `delay` s and fails the first `failures` calls."""

    def __init__(self, delay=0.0, failures=0):
        self.delay, self.failures, self.batches = delay, failures, []
        self.thread_ids = set()

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.delay)
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("server down")
        self.batches.append(list(metrics))


def test_metric_sink_log_never_blocks_on_a_slow_server(tmp_path):
    client = SlowFlakyClient(delay=0.3)
    sender = MlflowSender(tmp_path, client=client, run_id="r")
    sink = MetricSink(tmp_path, [sender])
    started = time.perf_counter()
    for step in range(5):
        sink.log({"train/loss": 1.0}, step=step)
    assert time.perf_counter() - started < 0.2  # 5 sends would take 1.5 s in line
    sink.close(timeout=30)
    assert [m.step for batch in client.batches for m in batch] == [0, 1, 2, 3, 4]
    assert threading.get_ident() not in client.thread_ids
    # coalesced: the first point goes at once, the rest wait for SEND_INTERVAL_S in one log_batch
    assert len(client.batches) <= 2 and sender.sent == 5


def test_metric_sink_retries_then_drops_and_close_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)
    client = SlowFlakyClient(failures=2)
    sender = MlflowSender(tmp_path, client=client, run_id="r")
    sink = MetricSink(tmp_path, [sender])
    sink.log({"train/loss": 2.0}, step=1)
    sink.close(timeout=30)
    assert [m.value for m in client.batches[0]] == [2.0] and sender.dropped == 0

    dead = SlowFlakyClient(failures=10**6)
    sender = MlflowSender(tmp_path, client=dead, run_id="r")
    sink = MetricSink(tmp_path, [sender])
    sink.log({"train/loss": 3.0}, step=2)
    started = time.monotonic()
    sink.close(timeout=1)
    assert time.monotonic() - started < 10  # a dead server cannot hold the end of training
    assert dead.batches == [] and sender.dropped == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # both points kept locally


def test_metric_sink_without_mlflow_run_writes_jsonl_only(tmp_path):
    sink = MetricSink.open(tmp_path)
    sink.log({"perf/samples_per_s": 5.0}, step=10)
    sink.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["step"] == 10 and row["perf/samples_per_s"] == 5.0 and row["timestamp"] > 0


def test_unreachable_server_fails_fast_with_a_clean_message(tmp_path, monkeypatch):
    for key in tracking.HTTP_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    uri = "http://127.0.0.1:1"
    spec = make_spec(tmp_path, uri)
    run_dir = make_run_dir(tmp_path, spec, "name: x\n")
    started = time.monotonic()
    with pytest.raises(tracking.TrackingUnavailable) as probe_err:
        tracking.probe(uri)
    with pytest.raises(tracking.TrackingUnavailable) as start_err:  # the HTTP client itself, no probe
        tracking.start_run(spec, LAUNCH, DERIVED, "name: x\n", run_dir)
    assert time.monotonic() - started < 20
    assert "127.0.0.1:1" in str(probe_err.value)
    assert "\n" not in str(start_err.value) and not (run_dir / "mlflow_run.json").exists()


@pytest.fixture
def mlflow_server(tmp_path, empty_store):
    port = free_port()
    fresh_store(empty_store, tmp_path / "server.db")   # the server would migrate a new one first
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not come up"
            time.sleep(0.5)
        yield port
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_real_mlflow_server_run_without_leaking_credentials(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    uri = f"http://alice:{SECRET}@127.0.0.1:{mlflow_server}"
    spec = make_spec(tmp_path, uri)
    text = f"logging:\n  mlflow:\n    tracking_uri: {uri}\n"
    run_dir = make_run_dir(tmp_path, spec, text)
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec))
    tracking.probe(uri)
    tracked = tracking.start_run(spec, LAUNCH, DERIVED, text, run_dir)
    assert tracked.tracking_uri == f"http://127.0.0.1:{mlflow_server}"
    sink = MetricSink.open(run_dir)
    sink.log({"perf/samples_per_s": 12.5}, step=1)
    sink.close()
    tracking.end_run(tracked, run_dir, status="FINISHED", exit_code=0)

    run = tracked.client.get_run(tracked.run_id)
    assert run.info.status == "FINISHED"
    assert [m.value for m in tracked.client.get_metric_history(run.info.run_id, "perf/samples_per_s")] == [12.5]
    assert artifact_names(tracked) == set(rundir.START_ARTIFACTS) | {"summary.json"}
    assert params_and_tags_free_of(run, SECRET)
    downloaded = Path(tracked.client.download_artifacts(run.info.run_id, "", str(tmp_path / "dl")))
    for path in downloaded.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(), path.name
    assert SECRET not in (run_dir / "mlflow_run.json").read_text()


def params_and_tags_free_of(run, secret: str) -> bool:
    return not any(secret in v for v in list(run.data.params.values()) + list(run.data.tags.values()))


# --- logging.system_metrics: MLflow's monitor records the machine in the job's run, per node ---

@pytest.fixture
def sqlite_run_dir(tmp_path, monkeypatch, empty_store):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's own override
    uri = fresh_store(empty_store, tmp_path / "mlflow.db")
    spec = make_spec(tmp_path, uri)
    text = f"name: tele-job\nlogging: {{system_metrics: true, mlflow: {{tracking_uri: '{uri}'}}}}\n"
    run_dir = make_run_dir(tmp_path, spec, text)
    return tracking.start_run(spec, LAUNCH, DERIVED, text, run_dir), run_dir


def system_keys(tracked) -> set[str]:
    return {k for k in tracked.client.get_run(tracked.run_id).data.metrics if k.startswith("system/")}


@pytest.mark.parametrize("nodes, prefix", [(1, "system/"), (2, "system/node1/")])
def test_the_monitor_records_the_machine_in_the_run_and_stops(sqlite_run_dir, nodes, prefix):
    tracked, run_dir = sqlite_run_dir
    monitor = SystemMetrics.start(run_dir, node_index=1, nodes=nodes)
    assert monitor is not None
    deadline = time.monotonic() + 30
    while not system_keys(tracked) and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.stop()
    keys = system_keys(tracked)
    assert f"{prefix}cpu_utilization_percentage" in keys and f"{prefix}system_memory_usage_megabytes" in keys
    assert all(k.startswith(prefix) for k in keys)
    count = len(tracked.client.get_metric_history(tracked.run_id, f"{prefix}cpu_utilization_percentage"))
    time.sleep(0.6)  # stopped: no sample after it
    assert len(tracked.client.get_metric_history(tracked.run_id, f"{prefix}cpu_utilization_percentage")) == count


def test_a_run_shorter_than_the_interval_still_gets_a_sample(sqlite_run_dir, monkeypatch):
    tracked, run_dir = sqlite_run_dir
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "600")
    SystemMetrics.start(run_dir, node_index=0, nodes=1).stop()
    assert "system/cpu_utilization_percentage" in system_keys(tracked)


def test_the_monitor_starts_in_the_background_and_stop_waits_for_it(sqlite_run_dir, monkeypatch, caplog):
    # its ~1.5 s of start-up is not spent before the rank's first step
    from mlflow.system_metrics import system_metrics_monitor as mlflow_monitor
    tracked, run_dir = sqlite_run_dir
    real_init = mlflow_monitor.SystemMetricsMonitor.__init__

    def slow_init(self, *args, **kwargs):
        time.sleep(1.0)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(mlflow_monitor.SystemMetricsMonitor, "__init__", slow_init)
    started = time.monotonic()
    monitor = SystemMetrics.start(run_dir, node_index=0, nodes=1)
    assert monitor is not None and time.monotonic() - started < 0.5
    monitor.stop()
    assert "system/cpu_utilization_percentage" in system_keys(tracked)
    # a monitor that cannot start: a warning, and stop() has nothing to do
    monkeypatch.setattr(mlflow_monitor.SystemMetricsMonitor, "__init__", lambda *a, **k: 1 / 0)
    with caplog.at_level("WARNING", logger="jobspec.tracking"):
        SystemMetrics.start(run_dir, node_index=0, nodes=1).stop()
    assert "MLflow's monitor did not start: division by zero" in caplog.text


def test_a_run_dir_without_an_mlflow_run_starts_no_monitor(tmp_path, capsys):
    assert SystemMetrics.start(tmp_path, node_index=0, nodes=1) is None
    # said to launcher.log only (a `jobspec-log:` line): the terminal already said MLflow is off
    assert capsys.readouterr().out == "jobspec-log: logging.system_metrics: no MLflow run to record system metrics into\n"
