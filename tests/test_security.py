"""Security: no shell strings, trust_remote_code off and loud, credentials never recorded, paths
relative to the spec file, and no writing into system directories."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
import mlflow_server
from mlflow_server import HF, PASSWORD, TOKEN

from jobspec.tracking import run as tracking
from jobspec.cli import main
from jobspec.spec.schema import fill_defaults

PACKAGE = Path(__file__).resolve().parent.parent / "jobspec"
VALID = Path(__file__).parent / "assets" / "valid" / "tiny-bert.yaml"


def test_no_shell_strings_anywhere_in_the_package():
    pattern = re.compile(r"shell\s*=\s*True|os\.system\s*\(|os\.popen\s*\(|subprocess\.getoutput|commands\.getoutput")
    offenders = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_trust_remote_code_is_off_by_default_and_loud_when_on(capsys):
    from jobspec.model.build import _warn_remote_code
    assert fill_defaults({"model": {"architecture": "bert"}})["model"]["trust_remote_code"] is False
    _warn_remote_code({"name_or_path": "someone/model", "trust_remote_code": False})
    assert capsys.readouterr().err == ""
    _warn_remote_code({"name_or_path": "someone/model", "trust_remote_code": True})
    err = capsys.readouterr().err
    assert "WARNING" in err and "trust_remote_code" in err and "someone/model" in err


@pytest.mark.parametrize("field,value", [
    ("output_dir", "/etc/jobspec"), ("output_dir", "/"), ("checkpoint.dir", "/usr/lib/ckpt"),
    ("checkpoint.dir", "/proc/self"), ("checkpoint.dir", "/sys"), ("checkpoint.dir", "/dev/shm/x"),
    ("checkpoint.dir", "/boot"), ("output_dir", "/bin/../etc"), ("checkpoint.dir", "../../../../../../../../etc"),
])
def test_system_directories_are_refused_with_a_position(tmp_path, capsys, field, value):
    text = VALID.read_text()
    text = text + f"output_dir: {value}\n" if field == "output_dir" else text.replace("dir: ckpt", f"dir: {value}")
    job = tmp_path / "job.yaml"
    job.write_text(text)
    assert main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^{re.escape(str(job))}:\d+:\d+: {re.escape(field)}: .*jobspec will not write there", err, re.M), err


def test_a_symlink_into_a_system_directory_is_refused(tmp_path, capsys):
    (tmp_path / "innocent").symlink_to("/etc")
    job = tmp_path / "job.yaml"
    job.write_text(VALID.read_text().replace("dir: ckpt", "dir: innocent/ckpt"))
    assert main(["validate", str(job)]) == 2
    assert "/etc/ckpt is inside /etc" in capsys.readouterr().err


def test_spec_paths_resolve_against_the_spec_file_not_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    job = tmp_path / "specs" / "job.yaml"
    job.write_text(VALID.read_text() + "output_dir: ../runs\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["compile", "../specs/job.yaml", "--out", "c"]) == 0
    resolved = yaml.safe_load((tmp_path / "elsewhere" / "c" / "resolved.yaml").read_text())
    assert resolved["output_dir"] == str(tmp_path / "runs")
    assert resolved["checkpoint"]["dir"] == str(tmp_path / "specs" / "ckpt")


# --- credentials planted in a real launch ------------------------------------------------------------



def everything_recorded(tmp_path: Path, run_dir: Path, stdout: str) -> dict[str, str]:
    """name -> text of everything the launch left: MLflow params/tags/artifacts/metrics, files, output."""
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = tracking.client_for(info["tracking_uri"])
    run = client.get_run(info["run_id"])
    texts = {"stdout+stderr": stdout, "params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags),
             "metrics": json.dumps(run.data.metrics)}
    downloaded = Path(client.download_artifacts(info["run_id"], "", str(tmp_path / "artifacts")))
    for path in downloaded.rglob("*"):
        if path.is_file():
            texts[f"artifact {path.name}"] = path.read_text(errors="replace")
    for path in run_dir.rglob("*"):
        if path.is_file():
            texts[f"run dir {path.name}"] = path.read_text(errors="replace")
    return texts


@pytest.fixture(scope="module")
def planted_launch(tmp_path_factory):
    """Everything mlflow_server.planted_launch's run left (it is also one of the load test's launches)."""
    directory, run_dir, output = mlflow_server.planted_launch(tmp_path_factory.mktemp("secrets"))
    return everything_recorded(tmp_path_factory.mktemp("secrets-read"), run_dir, output)


SPEC_COPIES = ("run dir spec.yaml", "run dir resolved.yaml")  # verbatim copies of the user's own spec


@pytest.mark.slow
def test_credentials_never_reach_mlflow_logs_or_run_files(planted_launch):
    assert "artifact spec.yaml" in planted_launch and "run dir launcher.log" in planted_launch
    assert "run dir metrics.jsonl" in planted_launch and "params" in planted_launch
    leaks = [(name, secret) for name, text in planted_launch.items() if name not in SPEC_COPIES
             for secret in (TOKEN, HF, PASSWORD) if secret in text]
    assert leaks == []
    assert "alice:***" not in planted_launch["params"] and "***@127.0.0.1" in planted_launch["params"]


@pytest.mark.slow
def test_run_dir_copies_of_the_spec_hide_uri_passwords(planted_launch):
    assert all(PASSWORD not in planted_launch[name] for name in SPEC_COPIES)


def test_a_secret_that_is_a_whole_value_leaves_resolved_yaml_loadable(tmp_path, monkeypatch):
    # masking the dumped text would turn `note: <token>` into `note: ***`, a YAML alias the worker
    # cannot load; the tree is masked before it is dumped
    import yaml

    from jobspec.compile.compiler import compile_spec
    from jobspec.rundir import RESOLVED, write_compiled
    from jobspec.spec.derived import derive
    from jobspec.spec.validation import load_and_validate

    secret = "hf_wholevalue_1234567"
    monkeypatch.setenv("HF_TOKEN", secret)
    job = Path(__file__).resolve().parent.parent / "jobs" / "quickstart.yaml"
    resolved = load_and_validate(job, [f"description={secret}"])
    compiled = compile_spec(resolved.spec, derive(resolved.spec), run_dir=str(tmp_path / "run"))
    write_compiled(tmp_path / "run", resolved, compiled)
    text = (tmp_path / "run" / RESOLVED).read_text()
    assert secret not in text
    assert yaml.safe_load(text)["description"] == "***"
