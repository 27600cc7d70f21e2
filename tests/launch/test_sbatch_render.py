"""`jobspec sbatch`: #SBATCH lines from the spec, safe quoting of hostile values, rejected values,
and the script body actually run by bash against a stand-in launch.sh (no Slurm needed)."""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT as REPO
from jobspec.launch import slurm
from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.spec.validation import load_and_validate

ASSETS = REPO / "tests" / "assets" / "slurm"
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
HOSTILE = ASSETS / "hostile.yaml"


def directives(script: str) -> dict[str, str | None]:
    """`#SBATCH --flag=value` lines parsed the way a shell-like reader would (quotes removed)."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            (word,) = shlex.split(line[len("#SBATCH "):])  # one word: the value cannot split the line
            flag, _, value = word.partition("=")
            out[flag] = value if _ else None
    return out


def render(path=QUICKSTART, overrides=(), **kwargs) -> str:
    return slurm.render_sbatch(load_and_validate(path, list(overrides)), path, list(overrides), **kwargs)


def test_directives_follow_the_spec_resources():
    script = render(overrides=["resources.nodes=3", "resources.gpus_per_node=4",
                               "resources.slurm.partition=gpu", "resources.slurm.time=02:30:00",
                               "resources.slurm.signal_grace_seconds=240", "resources.slurm.mem=80G"])
    got = directives(script)
    assert script.startswith("#!/bin/bash\n")
    assert got["--job-name"] == "quickstart"
    assert got["--nodes"] == "3"
    assert got["--ntasks-per-node"] == "1"
    assert got["--gpus-per-node"] == "4"
    assert got["--partition"] == "gpu"
    assert got["--time"] == "02:30:00"
    assert got["--mem"] == "80G"
    assert got["--signal"] == "B:USR1@240"
    assert got["--output"] == "slurm-%x-%j.out"
    assert "--requeue" in got and "--open-mode" in got
    for unset in ("--account", "--qos", "--constraint", "--error", "--exclusive", "--cpus-per-task"):
        assert unset not in got


def test_requeue_and_gpus_can_be_left_out():
    got = directives(render(overrides=["resources.slurm.requeue=false"], gpus=False))
    assert "--requeue" not in got
    assert "--gpus-per-node" not in got
    assert got["--nodes"] == "1"


def test_hostile_values_survive_quoting_literally():
    got = directives(render(HOSTILE))
    assert got["--partition"] == "gpu;touch PWNED"
    assert got["--account"] == "it's $(touch PWNED)"
    assert got["--qos"] == "`touch PWNED`"
    assert got["--constraint"] == "a100|h100 && touch PWNED"
    assert got["--output"] == 'logs/%x #1 "quoted" $HOME.out'
    assert got["--error"] == "err > PWNED"
    assert got["--cpus-per-task"] == "8" and "--exclusive" in got
    assert got["--time"] == "1-02:00:00" and got["--signal"] == "B:USR1@300"


def _fake_launch_sh(tmp_path: Path) -> Path:
    fake = tmp_path / "bin dir" / "launch.sh"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_body_passes_spec_and_overrides_verbatim_and_runs_nothing_else(tmp_path):
    overrides = ["description=$(touch PWNED); `touch PWNED` 'x' \"y\"",
                 "logging.mlflow.tags.note=a\nb;touch PWNED", "training.max_steps=7"]
    script = render(HOSTILE, overrides, launch_sh=_fake_launch_sh(tmp_path))
    (tmp_path / "job.sbatch").write_text(script)
    result = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)
    assert argv == [str(HOSTILE), *[x for o in overrides for x in ("--set", o)]]
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.parametrize("field, value, bad", [
    ("account", "research\n#SBATCH --partition=admin", "\\n"),
    ("output", "C:\\logs\\%j.out", "\\\\"),
    ("qos", "a\x1bb", "\\x1b"),
    ("partition", "", "empty"),
])
def test_unwritable_values_are_positioned_spec_errors(tmp_path, field, value, bad):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"extends: {QUICKSTART}\nresources:\n  slurm:\n    {field}: {json.dumps(value)}\n")
    with pytest.raises(SpecError) as caught:
        render(spec)
    (issue,) = caught.value.issues
    assert issue.path == ("resources", "slurm", field)
    assert (issue.file, issue.line) == (str(spec), 4)
    assert bad in issue.message


def test_cli_rejects_with_exit_2_and_file_line(capsys):
    assert main(["sbatch", str(ASSETS / "newline.yaml")]) == 2
    err = capsys.readouterr().err
    assert "newline.yaml:5:" in err and "resources.slurm.account" in err
    assert "newline.yaml:6:" in err and "resources.slurm.output" in err


def test_cli_out_writes_an_executable_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["sbatch", str(QUICKSTART), "--cpu-ranks", "--set", "training.max_steps=3", "--out", str(out)]) == 0
    text = out.read_text()
    assert os.access(out, os.X_OK)
    assert capsys.readouterr().out == ""
    last = shlex.split(text.strip().splitlines()[-1])
    assert last == ["exec", str(REPO / "launch.sh"), str(QUICKSTART), "--set", "training.max_steps=3"]
    assert "--gpus-per-node" not in directives(text)


def test_cli_submit_runs_sbatch_parsable_with_the_script(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat > {tmp_path}/stdin\necho '4242;cluster'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert main(["sbatch", str(QUICKSTART), "--submit"]) == 0
    assert capsys.readouterr().out.strip() == "4242"
    assert (tmp_path / "args").read_text().split() == ["--parsable"]
    assert (tmp_path / "stdin").read_text() == render()


def test_cli_submit_reports_sbatch_refusal(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert main(["sbatch", str(QUICKSTART), "--submit"]) == 2
    assert "invalid partition specified: nope" in capsys.readouterr().err
