"""The command line itself: one summary and one help text per command, shared flags declared once."""
from __future__ import annotations

import argparse
import importlib

import pytest

from jobspec.cli import COMMANDS, build_parser, main
from jobspec.commands import SET_METAVAR


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_its_docstring_as_help_and_the_shared_flags(name):
    module = importlib.import_module(f"jobspec.commands.{name}")
    assert not hasattr(module, "HELP")  # the summary lives in cli.COMMANDS only
    sub = subparser(name)
    assert sub.description == module.__doc__ and module.__doc__.strip()
    flags = {option: action for action in sub._actions for option in action.option_strings}
    if "--set" in flags:
        assert flags["--set"].metavar == SET_METAVAR and flags["--set"].dest == "overrides"
    if "--format" in flags:
        assert flags["--format"].default == flags["--format"].choices[0]
        assert "(default)" in flags["--format"].help


def test_top_level_help_lists_every_command_summary(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, summary in COMMANDS.items():
        assert name in out and summary[:40] in " ".join(out.split())
    # what jobspec is for, not how its code is laid out
    said = " ".join(out.split())
    assert "one YAML file per training job" in said and "DeepSpeed config" in said
    assert "MLflow" in said
    assert "dispatcher" not in said and "module" not in said


def test_a_run_failure_exits_1_with_one_line_and_bad_input_exits_2(monkeypatch, capsys, tmp_path):
    from jobspec.commands import validate
    from jobspec.errors import RunFailure, spec_error

    def fail(args):
        raise RunFailure("out of memory in optimizer step 3 (forward); run `jobspec plan JOB --fit`\n"
                         "Traceback (most recent call last): ...")
    monkeypatch.setattr(validate, "run", fail)
    assert main(["validate", str(tmp_path / "job.yaml")]) == 1
    err = capsys.readouterr().err
    assert err == "jobspec: run failed: out of memory in optimizer step 3 (forward); run `jobspec plan JOB --fit`\n"

    def bad_input(args):
        raise spec_error("unknown key `zero_stag`", path=("memory", "zero_stag"), hint="did you mean `zero_stage`?")
    monkeypatch.setattr(validate, "run", bad_input)
    assert main(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "memory.zero_stag: unknown key" in err and "Traceback" not in err


def test_a_closed_pipe_ends_a_command_quietly():
    """`jobspec schema | head -1`: the reader goes away after one line; no BrokenPipeError traceback.
    The pipe is shrunk to one page so that the 40 KB schema cannot all fit in it before the reader
    closes (what a real pager or `head` sees with a longer output)."""
    import fcntl
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    proc = subprocess.Popen([sys.executable, "-m", "jobspec", "schema"], stdout=write_end,
                            stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        assert reader.readline().strip() == "{"
    _, err = proc.communicate(timeout=120)   # the reader is closed: the next write meets EPIPE
    assert proc.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
