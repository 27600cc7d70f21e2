"""Exported model directories recorded in the MLflow run (jobspec/export/artifacts.py), with a
fake client: uploaded up to `export.mlflow_max_mb`, above it (or with 0) recorded by path only, and an
upload that fails recorded by path with the reason, never raising."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from jobspec import rundir
from jobspec.export.artifacts import log_exported_models


class FakeClient:
    def __init__(self, upload_error: Exception | None = None):
        self.upload_error, self.uploads, self.tags = upload_error, [], {}

    def log_artifacts(self, run_id, local_dir, artifact_path=None):
        if self.upload_error is not None:
            raise self.upload_error
        self.uploads.append((run_id, local_dir, artifact_path))

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=True):
        self.tags.update({tag.key: tag.value for tag in tags})


def exported(tmp_path: Path, **sizes: int) -> Path:
    """A run directory whose summary.json records one exported directory per name, of `bytes` size."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    exports = {}
    for name, size in sizes.items():
        model = tmp_path / "model" / name
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(b"w" * 1000)
        exports[name] = {"path": str(model), "step": 6, "dtype": "fp32", "bytes": size, "seconds": 0.1}
    exports["gone"] = {"path": str(tmp_path / "model" / "removed"), "step": 3, "bytes": 10}  # pruned since
    rundir.write_summary(run_dir, rundir.RunSummary(status="finished", exports=exports))
    return run_dir


def record(tmp_path, limit_mb, client, **sizes):
    tracked = SimpleNamespace(client=client, run_id="r1")
    return log_exported_models(tracked, exported(tmp_path, **sizes), {"export": {"mlflow_max_mb": limit_mb}})


def test_a_model_above_the_threshold_is_recorded_by_path_and_not_uploaded(tmp_path):
    client = FakeClient()
    tags = record(tmp_path, 1, client, final=400_000, best=2_500_000)
    model = tmp_path / "model"
    assert client.uploads == [("r1", str(model / "final"), "model/final")]  # 0.4 MB <= 1 MB
    assert client.tags == tags == {
        "jobspec.export.final": str(model / "final"), "jobspec.export.final.artifact": "model/final",
        "jobspec.export.best": str(model / "best"),
        "jobspec.export.best.artifact": "not uploaded: 2.5 MB > export.mlflow_max_mb 1"}


def test_mlflow_max_mb_0_uploads_none(tmp_path):
    client = FakeClient()
    tags = record(tmp_path, 0, client, final=1000)
    assert client.uploads == []
    assert client.tags == tags == {"jobspec.export.final": str(tmp_path / "model" / "final"),
                                   "jobspec.export.final.artifact": "not uploaded: export.mlflow_max_mb is 0"}


def test_a_failed_upload_is_recorded_by_path_with_the_reason_and_does_not_raise(tmp_path, caplog):
    client = FakeClient(OSError("POST http://alice:PASSWORD@mlflow:5000/api/2.0/mlflow-artifacts failed: 503\n"
                                "details"))
    with caplog.at_level(logging.WARNING, logger="jobspec.export.artifacts"):
        tags = record(tmp_path, 200, client, final=1000)
    reason = "POST http://***@mlflow:5000/api/2.0/mlflow-artifacts failed: 503"
    assert client.tags == tags == {"jobspec.export.final": str(tmp_path / "model" / "final"),
                                   "jobspec.export.final.artifact": f"upload failed: {reason}"}
    assert caplog.messages == [f"could not upload model final to MLflow ({reason}); recorded by its path"]
    assert "PASSWORD" not in caplog.text

    client.upload_error = OSError()  # a message-less error still gives a reason
    assert record(tmp_path / "again", 200, client, final=1000)["jobspec.export.final.artifact"] == \
        "upload failed: OSError"
