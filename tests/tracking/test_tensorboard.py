"""The tracker seam (jobspec/tracking/base.py) with its second tracker, TensorBoard: metric rows go
through the sink to metrics.jsonl, MLflow's sender and TensorBoard's event files alike, and
TensorBoard's own reader (EventAccumulator) gets back every scalar at its step, the spec and config
as text and the HParams session with its final status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from spec_builder import build_spec
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.util import tensor_util

from jobspec.errors import RunFailure
from jobspec.status import Ending
from jobspec.tracking import tensorboard, trackers
from jobspec.tracking.base import MetricWriter, RunStart
from jobspec.tracking.mlflow_sender import MlflowSender
from jobspec.tracking.sink import MetricSink

SECRET = "s3cr3t-pa55"
ROWS = [  # (metrics as the ranks log them, step): None and non-finite values are dropped by the sink
    ({"train/loss": 2.5, "train/lr": 1e-4, "perf/samples_per_s": 12.25, "mem/nvml_used_mib_max": None}, 1),
    ({"train/loss": 2.125, "train/lr": 2e-4, "perf/samples_per_s": float("nan")}, 3),
    ({"train/loss": 1.75, "train/lr": 3e-4, "eval/loss": 1.9}, 5),
]


class RecordingClient:
    """What MLflow's sender hands its client: every log_batch, in order."""

    def __init__(self):
        self.metrics, self.params, self.tags = [], [], []

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        self.metrics += list(metrics)
        self.params += list(params)
        self.tags += list(tags)


def read_events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / tensorboard.LOG_DIR), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def text_of(events: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors(tag)]


def make_spec(tensorboard_on: bool) -> dict:
    return build_spec(base={"name": "tb-job", "model": {"architecture": "bert"}, "data": {"synthetic": {}},
                            "training": {"max_steps": 5},
                            "logging": {"mlflow": {"tracking_uri": f"http://alice:{SECRET}@127.0.0.1:5000"},
                                        "tensorboard": {"enabled": tensorboard_on}}})


def test_metric_rows_reach_metrics_jsonl_mlflow_and_tensorboard_alike(tmp_path):
    client = RecordingClient()
    sender = MlflowSender(tmp_path, client=client, run_id="r")
    sink = MetricSink(tmp_path, [sender, tensorboard.TRACKER.writer(tmp_path, make_spec(True))])
    assert all(isinstance(writer, MetricWriter) for writer in sink.writers)
    for metrics, step in ROWS:
        sink.log(metrics, step=step)
    sink.log_params({"lora": {"trainable": 1024}})
    sink.close(timeout=10)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    points = sorted((key, value, row["timestamp"], row["step"]) for row in rows
                    for key, value in row.items() if key not in ("step", "timestamp"))
    assert len(points) == 8   # 10 values logged, the None and the NaN dropped
    # MLflow gets exactly the points of metrics.jsonl (key, value, timestamp, step), as before the seam
    assert sorted((m.key, m.value, m.timestamp, m.step) for m in client.metrics) == points
    assert sender.sent == 8 and sender.dropped == 0
    assert [(p.key, p.value) for p in client.params] == [("lora.trainable", "1024")]

    events = read_events(tmp_path)
    scalars = sorted((tag, e.value, e.wall_time, e.step) for tag in events.Tags()["scalars"]
                     for e in events.Scalars(tag))
    # TensorBoard stores float32 and seconds: the same points, at the same steps
    assert [(k, s) for k, _, _, s in scalars] == [(k, s) for k, _, _, s in points]
    for (_, tb_value, wall_time, _), (_, value, timestamp, _) in zip(scalars, points):
        assert tb_value == np.float32(value) and wall_time == timestamp / 1000
    assert text_of(events, "jobspec/params") == [(5, "| param | value |\n|---|---|\n| lora.trainable | 1024 |")]


def test_generation_tables_and_tags_are_text_at_their_step(tmp_path):
    writer = tensorboard.TRACKER.writer(tmp_path, make_spec(True))
    writer.log_metrics({"eval/loss": 1.0}, 4, 1_000)
    writer.log_table(4, [{"prompt": "2+2=", "reference": "4", "generation": "4 | four\nok", "exact_match": 1.0}])
    writer.set_tags({"jobspec.resume_fallback": "resumed from step 2"})
    writer.close(timeout=1)
    events = read_events(tmp_path)
    assert text_of(events, "eval/generations") == [(4, "| prompt | reference | generation | exact_match |\n"
                                                       "|---|---|---|---|\n| 2+2= | 4 | 4 \\| four<br>ok | 1.0 |")]
    assert text_of(events, "jobspec/tags") == [(4, "| tag | value |\n|---|---|\n"
                                                   "| jobspec.resume_fallback | resumed from step 2 |")]


def test_the_launcher_writes_spec_config_and_hparams_and_ends_with_the_status(tmp_path):
    spec = make_spec(True)
    (tmp_path / "resolved.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_batch_size": 16}))
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "timestamp": 5, "train/loss": 1.0}\n')
    tracker = trackers.TRACKERS["tensorboard"]
    started = tracker.start(RunStart(tmp_path, spec, "name: tb-job\n", {"world_size": 2},
                                     {"total_steps": 5, "world_size": 2}, {"plan.peak_mib": 812.5}))
    tracker.end(started, tmp_path, Ending("FAILED", "failed", 1, f"rank 1 died (uri http://alice:{SECRET}@x)"))

    events = read_events(tmp_path)
    [(step, resolved)] = text_of(events, "jobspec/resolved_spec")
    assert step == 0 and "train_batch_size" not in resolved and "tb-job" in resolved and SECRET not in resolved
    assert yaml.safe_load("\n".join(line[4:] for line in resolved.splitlines()))["name"] == "tb-job"
    assert json.loads(text_of(events, "jobspec/ds_config")[0][1]) == {"train_batch_size": 16}
    [(end_step, ending)] = text_of(events, "jobspec/ending")
    assert end_step == 7 and ending.startswith("**FAILED** (failed), exit code 1") and SECRET not in ending

    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    assert start.group_name == "tb-job"
    assert start.hparams["training.max_steps"].number_value == 5
    assert start.hparams["derived.world_size"].number_value == 2
    assert start.hparams["plan.peak_mib"].number_value == 812.5
    assert start.hparams["logging.tensorboard.enabled"].bool_value is True
    assert SECRET not in start.hparams["logging.mlflow.tracking_uri"].string_value
    end = hparams_metadata.parse_session_end_info_plugin_data(content[hparams_metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_FAILURE")


def test_the_sink_opens_the_writers_the_run_enables(tmp_path):
    for on in (True, False):
        run_dir = tmp_path / str(on)
        run_dir.mkdir()
        (run_dir / "resolved.yaml").write_text(yaml.safe_dump(make_spec(on)))
        sink = MetricSink.open(run_dir)   # no mlflow_run.json: MLflow has no run to send to
        assert [type(w).__name__ for w in sink.writers] == (["TensorBoardWriter"] if on else [])
        sink.log({"train/loss": 1.0}, step=1)
        sink.close()
        assert (run_dir / tensorboard.LOG_DIR).is_dir() == on


def test_nothing_imports_tensorboard_unless_it_is_enabled(tmp_path):
    (tmp_path / "resolved.yaml").write_text(yaml.safe_dump(make_spec(False)))
    code = ("import sys; from jobspec.tracking.sink import MetricSink; import jobspec.launch.tracking; "
            f"MetricSink.open({str(tmp_path)!r}).close(); "
            "print([m for m in ('tensorboard', 'mlflow') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_event_files_that_cannot_be_written_refuse_the_start_and_never_stop_training(tmp_path, caplog):
    (tmp_path / tensorboard.LOG_DIR).write_text("a file where the directory goes")
    spec = make_spec(True)
    with pytest.raises(RunFailure, match="logging.tensorboard.enabled: false"):
        tensorboard.TRACKER.start(RunStart(tmp_path, spec, "", {}, {}))
    sink = MetricSink(tmp_path, [tensorboard.TRACKER.writer(tmp_path, spec)])   # on rank 0: a warning
    sink.log({"train/loss": 1.0}, step=1)
    sink.close()
    assert "metrics.jsonl only" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == 1.0


def test_the_launcher_starts_and_ends_tensorboard_without_mlflow(tmp_path):
    from types import SimpleNamespace

    from jobspec.launch.tracking import BackgroundTracking

    spec = make_spec(True)
    spec["logging"]["mlflow"]["enabled"] = False
    spec["checkpoint"]["dir"] = str(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec))
    resolved = SimpleNamespace(spec=spec, text="name: tb-job\n", source=tmp_path / "job.yaml")
    compiled = SimpleNamespace(derived=SimpleNamespace(as_dict=lambda: {"world_size": 2}))
    tracking = BackgroundTracking(resolved, compiled, run_dir, None, {"plan.peak_mib": 1.0}, launch={}).start()
    assert tracking.wait() is None and list(tracking.started) == ["tensorboard"]
    assert (run_dir / "mlflow_off").exists()   # rank 0 does not wait for an MLflow run
    tracking.end(Ending("KILLED", "preempted", 75, "stopped by SIGTERM with a checkpoint at step 4"))
    events = read_events(run_dir)
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    end = hparams_metadata.parse_session_end_info_plugin_data(content[hparams_metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_UNKNOWN")   # stopped: neither a success nor a failure
    assert text_of(events, "jobspec/ending") == [(0, "**KILLED** (preempted), exit code 75\n\n"
                                                     "stopped by SIGTERM with a checkpoint at step 4")]
