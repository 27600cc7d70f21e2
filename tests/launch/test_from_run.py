"""`jobspec launch --from-run`: the logged spec of an MLflow run compiles to the same DeepSpeed config;
unknown runs, runs without a logged spec and unreachable stores are clear errors (exit 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobspec.cli import main
from jobspec.launch import from_run
from jobspec.tracking import run as telemetry
from conftest import REPO_ROOT

REPO = REPO_ROOT


def compile_and_log(tmp_path: Path, job: str, uri: str, *sets: str) -> tuple[str, Path]:
    """A parent run as `jobspec launch` leaves it before training: run-dir files and a logged MLflow run."""
    run_dir = tmp_path / "parent"
    args = ["compile", str(REPO / job), "--out", str(run_dir), "--set", f"logging.mlflow.tracking_uri={uri}",
            "--set", f"output_dir={tmp_path / 'out'}"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    launch = json.loads((run_dir / "launch.json").read_text())
    tracked = telemetry.start_run(spec, launch, launch["derived"], (run_dir / "spec.yaml").read_text(), run_dir)
    return tracked.run_id, run_dir


def dry_run_ds_config(text: str) -> str:
    """The DeepSpeed config `launch --dry-run` prints, as the text ds_config.json holds."""
    lines = text.splitlines()
    start = lines.index("{")
    return "\n".join(lines[start:lines.index("}", start) + 1]) + "\n"


@pytest.mark.parametrize("job, sets", [
    ("jobs/quickstart.yaml", ()),
    ("jobs/quickstart.yaml", ("memory.zero_stage=3", "memory.precision=bf16", "export.at_checkpoints=true",
                              "training.optimizer.bias_correction=false")),
    ("jobs/xlmr-large.yaml", ()),
])
def test_dry_run_compiles_the_parents_ds_config_byte_for_byte(tmp_path, capsys, job, sets):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, parent = compile_and_log(tmp_path, job, uri, *sets)
    capsys.readouterr()
    assert main(["launch", "--from-run", run_id, "--tracking-uri", uri, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert dry_run_ds_config(out) == (parent / "ds_config.json").read_text()
    assert "checkpoint.dir" not in out   # the parent saved no checkpoint: its directory is kept


def test_relaunch_spec_tags_the_parent_and_starts_fresh_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step10").mkdir(parents=True)
    logged = tmp_path / "resolved.yaml"
    logged.write_text(yaml.safe_dump({"name": "j", "logging": {"mlflow": {"tracking_uri": "sqlite:///mlflow.db",
                                                                          "tags": {"team": "x"}}},
                                      "memory": {"fit": "auto"}, "checkpoint": {"dir": str(ckpt)}}))
    path, notes = from_run.relaunch_spec(logged, "abcdef0123456789", "sqlite:////data/m.db", [])
    spec = yaml.safe_load(path.read_text())
    assert spec["logging"]["mlflow"]["tags"] == {"team": "x", from_run.PARENT_TAG: "abcdef0123456789"}
    assert spec["logging"]["mlflow"]["tracking_uri"] == "sqlite:////data/m.db"
    assert spec["memory"]["fit"] == "off"
    assert spec["checkpoint"]["dir"].startswith(f"{ckpt}-from-abcdef01-")
    assert len(notes) == 3
    # what the user --sets is theirs: nothing of it is replaced
    path, notes = from_run.relaunch_spec(logged, "abcdef0123456789", "sqlite:////data/m.db",
                                         ["checkpoint.dir=/elsewhere", "memory.fit=auto",
                                          "logging.mlflow.tracking_uri=sqlite:///x.db"])
    spec = yaml.safe_load(path.read_text())
    assert (spec["checkpoint"]["dir"], spec["memory"]["fit"]) == (str(ckpt), "auto")
    assert spec["logging"]["mlflow"]["tracking_uri"] == "sqlite:///mlflow.db" and notes == []


def test_unknown_run_and_run_without_spec_exit_2(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = telemetry.client_for(uri)
    bare = client.create_run(client.create_experiment("bare")).info.run_id
    assert main(["launch", "--from-run", "0123456789abcdef0123456789abcdef", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert "MLflow run 0123456789abcdef0123456789abcdef not found" in err and "Traceback" not in err
    assert main(["launch", "--from-run", bare, "--tracking-uri", uri, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"MLflow run {bare} has no logged job spec" in err and "Traceback" not in err


def test_unreachable_store_and_bad_arguments_exit_2(capsys):
    assert main(["launch", "--from-run", "abc", "--tracking-uri", "http://user:pw123456@127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "unavailable" in err and "pw123456" not in err and "Traceback" not in err
    assert main(["launch", "jobs/quickstart.yaml", "--from-run", "abc"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["launch"]) == 2
    assert "no job spec given" in capsys.readouterr().err


def test_a_from_run_read_creates_no_store(tmp_path, capsys, monkeypatch):
    # from another directory, without --tracking-uri: the default store (sqlite:///mlflow.db here) is
    # not there, which says "not found" and leaves no empty mlflow.db behind
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["launch", "--from-run", "0123456789abcdef0123456789abcdef"]) == 2
    err = capsys.readouterr().err
    assert "not found: no MLflow store at" in err and str(tmp_path / "mlflow.db") in err and "Traceback" not in err
    elsewhere = tmp_path / "sub" / "none.db"
    assert main(["launch", "--from-run", "abc", "--tracking-uri", f"sqlite:///{elsewhere}", "--dry-run"]) == 2
    assert str(elsewhere) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
