"""Data files checked before any rank starts (jobspec/data/record_checks.py), and named by file and line when a
rank trips over a row after the ones checked (issue 13: non-UTF-8 bytes, a malformed line, an empty
file, a missing column, a directory -- each found minutes late or named wrong)."""
from __future__ import annotations

import json
import os
import time

import pytest
import spec_builder
import yaml
from train.test_model_data import BERT, SENTENCES, make_spec, tokenizer_dir  # noqa: F401 (a fixture)

from jobspec.cli import main
from jobspec.data import record_checks as datacheck
from jobspec.data.record_checks import Columns, check_file
from jobspec.data.loaders import build_datasets
from jobspec.errors import SpecError
from jobspec.launch import supervise
from jobspec.model.build import build_tokenizer

SEQ = Columns(("text",), "label", "sequence-classification", 2)


def jsonl(tmp_path, rows, name="train.jsonl", tamper=None) -> str:
    lines = [json.dumps(r).encode() for r in rows]
    if tamper:
        for index, line in tamper.items():
            lines[index - 1] = line
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def rows(n=200):
    return [{"text": f"row {i}", "label": i % 2} for i in range(n)]


def problem(path, columns=SEQ, split="train", fmt="auto", **kw):
    issue = check_file(path, fmt, columns, split, **kw)
    return issue and (issue.path, issue.message)


def test_a_clean_file_has_no_problem(tmp_path):
    assert problem(jsonl(tmp_path, rows())) is None


def test_non_utf8_bytes_name_the_file_line_and_byte(tmp_path):
    path = jsonl(tmp_path, rows(), tamper={51: b'{"text": "r\xff\xfeow 50", "label": 0}'})
    field, message = problem(path)
    assert field == ("data", "train")
    assert message == f"{path}:51: byte 12 of the line (0xff) is not valid UTF-8"


def test_a_malformed_json_line_is_named(tmp_path):
    path = jsonl(tmp_path, rows(), tamper={101: b'{"text": "row 100", "label": '})
    field, message = problem(path)
    assert field == ("data", "train") and message.startswith(f"{path}:101: not valid JSON (")
    path = jsonl(tmp_path, rows(), name="list.jsonl", tamper={3: b'["row", 1]'})
    assert problem(path)[1] == f"{path}:3: a JSON object per line expected, found a list of 2"


def test_empty_blank_a_directory_and_a_missing_file(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n\n  \n")
    (tmp_path / "dir.jsonl").mkdir()
    assert problem(tmp_path / "empty.jsonl") == (("data", "train"), f"{tmp_path / 'empty.jsonl'} is empty (0 bytes)")
    assert problem(tmp_path / "blank.jsonl") == (("data", "train"), f"{tmp_path / 'blank.jsonl'} has no rows")
    assert problem(tmp_path / "dir.jsonl", split="eval") == (
        ("data", "eval"), f"{tmp_path / 'dir.jsonl'} is a directory, not a data file")
    assert "not found" in problem(tmp_path / "absent.jsonl")[1]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_file(tmp_path):
    path = jsonl(tmp_path, rows())
    os.chmod(path, 0)
    assert "not readable (Permission denied)" in problem(path)[1]


def test_missing_columns_point_at_the_field_that_names_them(tmp_path):
    path = jsonl(tmp_path, [{"sentence": "a b", "label": 0}])
    assert problem(path) == (("data", "text_fields"), f"{path}:1: no 'text' field (it has: sentence, label)")
    path = jsonl(tmp_path, [{"text": "a", "label": 0}, {"text": "b"}], name="nolabel.jsonl")
    assert problem(path) == (("data", "label_field"), f"{path}:2: no 'label' field (it has: text)")
    lm = Columns(("text",), None, "causal-lm", 2)  # language models need no label
    assert problem(path, lm) is None


@pytest.mark.parametrize("labels, field, expected", [
    ([0, 1, 2], ("model", "num_labels"), ":3: label 2 is not a class id in [0, 2)"),
    (["pos", "neg", "meh"], ("model", "num_labels"), ":3: 3 different label names ('meh', 'neg', 'pos') but "
                                                     "model.num_labels is 2"),
    ([0, "neg"], ("data", "train"), ":2: label 'neg' is a class name but earlier labels are class ids"),
    ([0, None], ("data", "train"), ":2: label None is null; an integer class id or a class name expected"),
    ([0, 1.5], ("data", "train"), ":2: label 1.5 is a number (1.5); an integer class id or a class name expected"),
    ([True], ("data", "train"), ":1: label True is a boolean (true); an integer class id or a class name expected"),
])
def test_label_values(tmp_path, labels, field, expected):
    path = jsonl(tmp_path, [{"text": "t", "label": v} for v in labels])
    assert problem(path) == (field, path + expected)


def test_text_values_and_token_classification_lists(tmp_path):
    path = jsonl(tmp_path, [{"text": "a", "label": 0}, {"text": None, "label": 1}])
    assert problem(path) == (("data", "train"), f"{path}:2: 'text' is null, text expected")
    tokens = Columns(("words",), "tags", "token-classification", 3)
    path = jsonl(tmp_path, [{"words": ["a", "b"], "tags": [0, 1]}, {"words": ["a", "b"], "tags": [0]}], name="t.jsonl")
    assert problem(path, tokens) == (("data", "train"), f"{path}:2: 'tags' is a list of 1 for 2 words; one label "
                                                        "per word expected")
    path = jsonl(tmp_path, [{"words": "a b", "tags": [0, 1]}], name="s.jsonl")
    assert problem(path, tokens)[0] == ("data", "text_fields")


def test_csv_header_fields_empty_values_and_encoding(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("text,label\n\"a, quoted\",0\nb,1\nc,1,extra\n")
    assert problem(path) == (("data", "train"), f"{path}:4: 3 fields, the header names 2")
    path.write_text("sentence,label\na,0\n")
    assert problem(path) == (("data", "text_fields"), f"{path}: the header has no column 'text' (columns: sentence, "
                                                      "label)")
    path.write_text("text,label\na,0\n,1\n")
    assert problem(path) == (("data", "train"), f"{path}:3: 'text' is empty, text expected")
    path.write_text("text,label\na,0\nb,7\n")
    assert problem(path) == (("model", "num_labels"), f"{path}:3: label 7 is not a class id in [0, 2)")
    path.write_bytes(b"text,label\na,0\nb\xe9,1\n")
    assert problem(path) == (("data", "train"), f"{path}:3: byte 2 of the line (0xe9) is not valid UTF-8")
    path.write_text('text,label\n"multi\nline",neg\nb,pos\n')
    assert problem(path) is None


def test_parquet_schema_and_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "label": [0, 5]}), path)
    assert problem(path) == (("model", "num_labels"), f"{path}: row 2: label 5 is not a class id in [0, 2)")
    pq.write_table(pa.table({"sentence": ["a"], "label": [0]}), path)
    assert problem(path)[0] == ("data", "text_fields")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    assert "is not a readable parquet file" in problem(tmp_path / "fake.parquet")[1]


def test_large_files_cost_only_their_first_rows_and_a_full_scan_finds_the_rest(tmp_path):
    # ~60 MB; a bad byte 400,000 lines in: the pre-flight reads its first 1000 rows only
    good = b"".join(json.dumps({"text": "lorem ipsum " * 10 + str(i), "label": i % 2}).encode() + b"\n"
                    for i in range(1000))
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as fh:
        for _ in range(400):
            fh.write(good)
        fh.write(b'{"text": "\xff", "label": 0}\n')
        for _ in range(40):
            fh.write(good)
    assert path.stat().st_size > 50 * 2**20
    started = time.perf_counter()
    assert check_file(path, "auto", SEQ, "train") is None
    assert time.perf_counter() - started < 0.5
    assert check_file(path, "auto", SEQ, "train", max_rows=None, max_bytes=None).message == \
        f"{path}:400001: byte 11 of the line (0xff) is not valid UTF-8"


# --- in `jobspec launch`: refused before anything is created, at the spec field ----------------------

def write_job(tmp_path, train: str, **data) -> str:
    spec = {"name": "data-job", "model": {"architecture": "bert", "config": BERT},
            "data": {"train": train, "tokenizer": str(tmp_path), "max_length": BERT.get("max_position_embeddings", 512),
                     **data},
            "training": {"max_steps": 2, "micro_batch_size": 2}, "resources": {"gpus_per_node": 1},
            "output_dir": "out", "logging": {"mlflow": {"enabled": False}}}
    return str(spec_builder.write_job(tmp_path, base=spec))


@pytest.mark.parametrize("max_steps", [2, None])  # None: epochs, so the launcher counts rows first
def test_launch_refuses_bad_data_before_any_rank_and_points_at_the_field(tmp_path, monkeypatch, capsys, max_steps):
    data = jsonl(tmp_path, rows(), tamper={51: b'{"text": "\xff", "label": 0}'})
    job = write_job(tmp_path, data)
    if max_steps is None:
        job_spec = yaml.safe_load(open(job))
        job_spec["training"] = {"epochs": 1, "micro_batch_size": 2}
        open(job, "w").write(yaml.safe_dump(job_spec, sort_keys=False))
    monkeypatch.setattr(supervise, "run", lambda *a, **k: pytest.fail("ranks started"))
    started = time.monotonic()
    assert main(["launch", job]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(open(job).read().splitlines(), 1) if text.strip().startswith("train:"))
    assert f"{job}:{line}:" in err and f"data.train: {data}:51: byte 11 of the line (0xff) is not valid UTF-8" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_validate_reports_a_directory_as_a_directory(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    job = write_job(tmp_path, str(tmp_path / "data"))
    assert main(["validate", job]) == 2
    assert "is a directory, not a data file" in capsys.readouterr().err


# --- on a rank: a bad row after the checked ones is named by file and line, exit 2 -------------------

def test_a_rank_names_the_file_and_line_of_a_bad_row_past_the_preflight(tmp_path, tokenizer_dir):  # noqa: F811
    many = [{"text": SENTENCES[i % len(SENTENCES)], "label": i % 2} for i in range(1500)]
    bad_bytes = jsonl(tmp_path, many, name="bytes.jsonl", tamper={1200: b'{"text": "b\xffd", "label": 0}'})
    malformed = jsonl(tmp_path, many, name="json.jsonl", tamper={1300: b'{"text": "x", "label": 0'})
    null_text = jsonl(tmp_path, many, name="null.jsonl", tamper={1400: b'{"text": null, "label": 0}'})
    expected = {bad_bytes: ":1200: byte 12 of the line (0xff) is not valid UTF-8",
                malformed: ":1300: not valid JSON (", null_text: ":1400: 'text' is null, text expected"}
    for path, message in expected.items():
        spec = make_spec({"architecture": "bert", "config": BERT}, {"train": path, "tokenizer": tokenizer_dir})
        assert datacheck.preflight_issues(spec) == []  # past the rows the launcher reads
        with pytest.raises(SpecError) as err:
            build_datasets(spec, build_tokenizer(spec))
        issue = err.value.issues[0]
        assert issue.path == ("data", "train") and issue.message.startswith(path + message), issue.message
