"""Hostile input through the real CLI entry point (in-process, so >1,000 examples stay fast):
every outcome is exit 0 (a valid compile) or exit 2 with positioned errors, never a traceback.

JOBSPEC_FUZZ_EXAMPLES scales the example counts (the default: 3 x 300 examples here
plus 244 in tests/spec/test_fuzz_spec.py).
"""
from __future__ import annotations

import copy
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.cli import main
from jobspec.spec.loader import MAX_FILE_BYTES

VALID_TEXT = (Path(__file__).parent / "assets" / "valid" / "tiny-bert.yaml").read_text()
VALID_SPEC = yaml.safe_load(VALID_TEXT)
SCALE = int(os.environ.get("JOBSPEC_FUZZ_EXAMPLES", 60)) / 60
MANY = settings(max_examples=int(300 * SCALE), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])  # capsys is drained per call


def run_cli(capsys, argv) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def check_outcome(code: int, out: str, err: str, path: Path) -> None:
    assert code in (0, 2), (code, err[-2000:])
    assert "Traceback" not in out + err
    if code == 2:  # positioned: `file:line:col: path: message`, `<--set>:1:N: ...`, or at least `file: ...`
        assert err.startswith((f"{path}:", "<--set>:1:")) and re.search(r"^\d+ problems? found$", err, re.M), err


def validate_text(capsys, data: bytes, *overrides: str) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(data)
        argv = ["validate", str(path)] + [a for o in overrides for a in ("--set", o)]
        result = run_cli(capsys, argv)
    check_outcome(*result, path)
    return result


# YAML fragments a hostile or careless author writes
FRAGMENTS = ["a: &x [1, 2]\n", "b: *x\n", "c: !!python/object:os.system {}\n", "d: !!python/name:os.system\n",
             "\tmodel: {}\n", "model: {}\nmodel: {}\n", "e: " + "[" * 70 + "]" * 70 + "\n", "? [k]\n: v\n",
             "f: !!binary aGk=\n", "---\n", "g: {h: *undefined}\n", "i: '\\xff'\n", "%YAML 1.1\n---\n",
             "training: {max_steps: 1e400}\n", "name: ../../etc\n", "output_dir: /etc\n",
             "checkpoint: {dir: /proc/self}\n", "model: {architecture: bert, trust_remote_code: yes}\n"]


@MANY
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=30), min_size=1, max_size=6),
       st.booleans())
def test_hostile_yaml_through_the_cli(capsys, pieces, prepend_valid):
    text = (VALID_TEXT if prepend_valid else "") + "".join(pieces)
    validate_text(capsys, text.encode("utf-8", "surrogatepass"))


@MANY
@given(st.binary(max_size=200), st.integers(0, len(VALID_TEXT)))
def test_random_bytes_spliced_into_a_valid_spec(capsys, junk, offset):
    data = VALID_TEXT.encode()
    validate_text(capsys, data[:offset] + junk + data[offset:])


def leaf_paths(value, prefix=()):
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from leaf_paths(sub, prefix + (key,))
    else:
        yield prefix


LEAVES = [".".join(p) for p in leaf_paths(VALID_SPEC)] + ["training.on_nan", "checkpoint.dir", "output_dir",
                                                          "model.trust_remote_code", "resources.master_port"]
RAW_VALUES = st.sampled_from(["null", "true", "[1, 2]", "{a: 1}", "1e3", "-1", "0", "'x'", "/etc", "../..",
                              "!!python/object:os.system {}", "*a", "&a 1", "\t", "", "stop", "skip", "99999999999"])


@MANY
@given(st.lists(st.tuples(st.sampled_from(LEAVES), RAW_VALUES | st.text(max_size=8)), min_size=1, max_size=3))
def test_set_overrides_of_any_type_through_the_cli(capsys, pairs):
    validate_text(capsys, VALID_TEXT.encode(), *[f"{k}={v}" for k, v in pairs])


# --- explicit hostile inputs (test_loader.py covers alias bombs, tags, tabs, duplicates in the loader) ---

def test_a_50_mb_file_is_refused_quickly_without_reading_it(tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as fh:
        fh.write(b"model: {architecture: bert}\n")
        fh.truncate(50 * 2**20)
    started = time.perf_counter()
    code, _, err = run_cli(capsys, ["validate", str(path)])
    assert time.perf_counter() - started < 2
    assert code == 2 and f"{path}:1:1" in err and f"at most {MAX_FILE_BYTES:,}" in err


@pytest.mark.parametrize("data,phrase", [
    (b"model:\n  architecture: bert\n\xff\xfe: 1\n", "is not valid utf-8"),
    (b"model:\n\tarchitecture: bert\n", "tab"),
    (b"model: {architecture: bert}\nmodel: {architecture: gpt2}\n", "duplicate"),
    (b"model: !!python/object/apply:os.system ['touch /tmp/jobspec-pwned']\n", "not allowed"),
    (b"a: &a [x]\n" + b"".join(b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((c, c) + (c - 1,) * 9)
                                for c in range(ord("b"), ord("l"))), "expands to more than"),
    (b"x: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than"),
])
def test_hostile_files_are_positioned_exit_2(tmp_path, capsys, data, phrase):
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    code, _, err = run_cli(capsys, ["validate", str(path)])
    assert code == 2 and phrase in err.lower() and f"{path}:" in err and "Traceback" not in err
    assert not Path("/tmp/jobspec-pwned").exists()


@pytest.mark.parametrize("override,phrase", [
    ("resources.gpus_per_node=true", "resources.gpus_per_node"),
    ("training.max_steps=2.0", "training.max_steps"),
    ("training.optimizer.betas=[0.9]", "training.optimizer.betas"),
    ("model=5", "model"),
    ("training.on_nan=ignore", "training.on_nan"),
    ("logging.mlflow.tags={a: [1]}", "logging.mlflow.tags"),
])
def test_set_wrong_types_are_positioned_exit_2(capsys, override, phrase, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(VALID_TEXT)
    code, _, err = run_cli(capsys, ["validate", str(path), "--set", "training.max_steps=3", "--set", override])
    assert code == 2 and "Traceback" not in err
    assert any(line.startswith("<--set>:1:2: ") and phrase in line for line in err.splitlines()), err


def test_on_nan_skip_is_valid_so_the_fuzzers_reach_exit_0_too(tmp_path, capsys):
    spec = copy.deepcopy(VALID_SPEC)
    spec["training"]["on_nan"] = "skip"
    code, out, err = validate_text(capsys, yaml.safe_dump(spec).encode())
    assert code == 0, err
