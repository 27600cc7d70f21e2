"""validate reads the local data files' records, as --dry-run did, and reports every bad one (up to
MAX_REPORTED a file, then a count) at its file:line; plan and compile give the same answer."""
from __future__ import annotations

import json

import yaml
from conftest import REPO_ROOT

from jobspec.cli import main
from jobspec.data import record_checks as datacheck

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def chat_job(tmp_path, lines: list[str]) -> str:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    spec = {"model": {"architecture": "qwen2", "task": "causal-lm",
                      "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 2048}},
            "data": {"train": "chat.jsonl", "tokenizer": str(REPO_ROOT / "jobs" / "data" / "tokenizer"),
                     "records": "chat", "max_length": 64},
            "training": {"max_steps": 1}, "logging": {"mlflow": {"enabled": False}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_every_bad_record_at_its_line_from_validate_plan_and_compile(tmp_path, capsys):
    lines = [json.dumps(GOOD)] * 12
    lines[4] = '{"messages": [{"role": "user", "content": "cut'
    lines[9] = json.dumps({"messages": [{"role": "human", "content": "hi"}]})
    path = chat_job(tmp_path, lines)
    data = tmp_path / "chat.jsonl"
    for command in ("validate", "plan", "compile"):
        assert main([command, path]) == 2
        err = capsys.readouterr().err
        assert f"data.train: {data}:5: not valid JSON" in err, (command, err)
        assert f"data.train: {data}:10: message 1 has role 'human'" in err, (command, err)
        assert "2 problems found" in err and "Traceback" not in err


def test_a_limit_then_a_count(tmp_path, capsys):
    bad = json.dumps({"messages": []})
    path = chat_job(tmp_path, [json.dumps(GOOD)] + [bad] * (datacheck.MAX_REPORTED + 5))
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert err.count("'messages' is a list of 0") == datacheck.MAX_REPORTED
    assert f"chat.jsonl:{datacheck.MAX_REPORTED + 1}:" in err and f"chat.jsonl:{datacheck.MAX_REPORTED + 2}:" not in err
    assert f"5 more bad records after these {datacheck.MAX_REPORTED}" in err


def test_what_is_not_read_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(datacheck, "PREFLIGHT_BYTES", 200)
    lines = [json.dumps(GOOD)] * 50
    lines[40] = "{not json"    # past the bytes read: left to the launch's data pass
    path = chat_job(tmp_path, lines)
    assert main(["validate", path]) == 0
    out = capsys.readouterr().out
    assert "note: data.train: the first 200 bytes of 4.5 KiB checked; the rest when the launch's data pass" in out


def test_the_record_check_is_importable_alone():
    columns = datacheck.Columns(text_fields=("text",), label_field=None, task="causal-lm", num_labels=2,
                                records="chat")
    checker = datacheck.RecordChecker(columns, "train")
    assert checker.problem("f:1", GOOD) is None
    problem = checker.problem("f:2", {"messages": [{"role": "bot", "content": "x"}]})
    assert problem is not None and problem.message.startswith("f:2: message 1 has role 'bot'")
