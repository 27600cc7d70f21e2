"""Loader: positions, safety limits, extends, --set."""
from __future__ import annotations

import json

import re
import textwrap

import pytest

from conftest import REPO_ROOT
from jobspec.errors import SpecError
from jobspec.spec.loader import MAX_NODES, SET_FILE, Position, load_spec
from jobspec.spec.overrides import apply_overrides


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def only_issue(excinfo):
    (issue,) = excinfo.value.issues
    return issue


def test_positions_of_keys_and_values_are_one_based(tmp_path):
    path = write(tmp_path, "job.yaml", """\
        # comment
        model:
          architecture: bert
          freeze: [embeddings.*, pooler.*]
        """)
    loaded = load_spec(path)
    assert loaded.spec == {"model": {"architecture": "bert", "freeze": ["embeddings.*", "pooler.*"]}, "extends": None}
    assert loaded.key_positions[("model",)] == Position(str(path), 2, 1)
    assert loaded.key_positions[("model", "architecture")] == Position(str(path), 3, 3)
    assert loaded.positions[("model", "architecture")] == Position(str(path), 3, 17)
    assert loaded.positions[("model", "freeze", 1)] == Position(str(path), 4, 26)


def test_duplicate_key_names_both_positions(tmp_path):
    path = write(tmp_path, "job.yaml", "model:\n  task: masked-lm\n  task: causal-lm\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    issue = only_issue(caught)
    assert (issue.line, issue.column, issue.dotted_path) == (3, 3, "model.task")
    assert "line 2, column 3" in issue.message


def test_yaml_1_1_surprises_are_kept_as_written(tmp_path):
    path = write(tmp_path, "job.yaml", "on: 1\ndate: 2024-01-02\n")
    assert load_spec(path).spec == {"on": 1, "date": "2024-01-02", "extends": None}


def test_merge_keys_fill_missing_keys_only(tmp_path):
    path = write(tmp_path, "job.yaml", """\
        defaults: &defaults {lr: 1.0, eps: 2.0}
        optimizer:
          <<: *defaults
          lr: 3.0
        """)
    assert load_spec(path).spec["optimizer"] == {"lr": 3.0, "eps": 2.0}


def test_alias_bomb_is_stopped(tmp_path):
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcdef", "bcdefg"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    path = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(MAX_NODES) in only_issue(caught).message


def test_small_alias_reuse_is_fine(tmp_path):
    path = write(tmp_path, "job.yaml", "a: &a [1, 2]\nb: *a\n")
    assert load_spec(path).spec["b"] == [1, 2]


@pytest.mark.parametrize("text,phrase", [
    ("", "this file is empty"),
    ("- a\n", "this file is a list"),
    ("just text\n", "this file is a string"),
    ("a: 1\n---\nb: 2\n", "expected a single document"),
    ("a: !custom 1\n", "YAML tag `!custom` is not allowed"),
    ("a: !!binary aGk=\n", "YAML tag `!!binary` is not allowed"),
    ("? [a, b]\n: 1\n", "mapping keys must be plain words"),
    ("a: &x [*x]\n", "nested more than"),
    ("a: " + "{b: " * 80 + "1" + "}" * 80 + "\n", "nested more than"),
])
def test_unsafe_or_odd_yaml_is_a_clean_error(tmp_path, text, phrase):
    path = write(tmp_path, "job.yaml", text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    issue = only_issue(caught)
    assert phrase in issue.message and issue.file == str(path) and issue.line is not None


def test_extends_merges_mappings_and_replaces_the_rest(tmp_path):
    write(tmp_path, "base.yaml", """\
        model: {architecture: bert, config: {hidden_size: 64, num_hidden_layers: 2}}
        data: {text_fields: [a, b]}
        training: {max_steps: 5}
        """)
    (tmp_path / "jobs").mkdir()
    child = write(tmp_path, "jobs/child.yaml", """\
        extends: ../base.yaml
        model:
          config: {num_hidden_layers: 4}
        data: {text_fields: [c]}
        """)
    loaded = load_spec(child)
    assert loaded.spec["model"] == {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 4}}
    assert loaded.spec["data"]["text_fields"] == ["c"]
    assert loaded.spec["extends"] is None
    base_file = str(tmp_path / "base.yaml")
    assert loaded.positions[("model", "config", "hidden_size")].file == base_file
    assert loaded.positions[("model", "config", "num_hidden_layers")] == Position(str(child), 3, 31)
    assert loaded.positions[("training", "max_steps")] == Position(base_file, 3, 23)
    assert ("data", "text_fields", 1) not in loaded.positions   # the child's list replaced the base's
    assert loaded.text.startswith("extends: ../base.yaml")


def test_extends_missing_base_points_at_the_extends_line(tmp_path):
    path = write(tmp_path, "job.yaml", "model: {}\nextends: nowhere.yaml\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    issue = only_issue(caught)
    assert (issue.line, issue.column, issue.dotted_path) == (2, 10, "extends") and "not found" in issue.message


def test_self_extension_is_a_cycle(tmp_path):
    path = write(tmp_path, "job.yaml", "extends: job.yaml\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert "cycle" in only_issue(caught).message


def test_set_types_values_by_the_schema(tmp_path):
    path = write(tmp_path, "job.yaml", "model: {architecture: bert}\n")
    loaded = apply_overrides(load_spec(path), ["logging.mlflow.experiment=3", "training.epochs=2", "name=null",
                              "memory.activation_checkpointing.every_n_layers=2", "deepspeed.zero_optimization.stage=3",
                              "training.optimizer.betas=[0.9, 0.95]"])
    spec = loaded.spec
    assert spec["logging"]["mlflow"]["experiment"] == "3"
    assert spec["training"]["epochs"] == 2 and spec["name"] is None
    assert spec["memory"]["activation_checkpointing"] == {"every_n_layers": 2}
    assert spec["deepspeed"] == {"zero_optimization": {"stage": 3}}
    assert spec["training"]["optimizer"]["betas"] == [0.9, 0.95]
    assert loaded.positions[("training", "epochs")] == Position(SET_FILE, 1, 2)
    assert loaded.positions[("training", "optimizer", "betas", 1)] == Position(SET_FILE, 1, 6)


def test_set_replaces_a_value_and_its_positions(tmp_path):
    path = write(tmp_path, "job.yaml", "model: {architecture: bert, freeze: [a, b, c]}\n")
    loaded = apply_overrides(load_spec(path), ["model.freeze=[x]"])
    assert loaded.spec["model"]["freeze"] == ["x"]
    assert ("model", "freeze", 2) not in loaded.positions
    assert loaded.positions[("model", "freeze", 0)].file == SET_FILE


@pytest.mark.parametrize("override,phrase,hint", [
    ("training.epochs=abc", "expected a number or null, got string `abc`", "pass a value"),
    ("memory.zero_stag=1", "unknown key `zero_stag`", "did you mean `memory.zero_stage`?"),
    ("trainingg=1", "unknown key `trainingg`", "did you mean `training`?"),
    ("training.max_steps", "expected KEY.PATH=VALUE", "--set training.max_steps=100"),
    ("model.task.x=1", "`model.task` is not a mapping", "set the whole value"),
    ("memory.zero_stage=!!python/object:os.system {}", "cannot read the value", "quote"),
])
def test_bad_set_is_a_positioned_error(tmp_path, override, phrase, hint):
    path = write(tmp_path, "job.yaml", "model: {architecture: bert}\n")
    with pytest.raises(SpecError) as caught:
        apply_overrides(load_spec(path), ["training.max_steps=3", override])
    issue = only_issue(caught)
    assert (issue.file, issue.line, issue.column) == (SET_FILE, 1, 2)
    assert phrase in issue.message and hint in issue.hint


def test_a_set_value_written_as_json_is_reported_at_the_column_pythons_parser_gives(tmp_path):
    path = write(tmp_path, "job.yaml", "model: {architecture: bert}\n")
    value = ('{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2 '
             '"num_hidden_layers": 2}')
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(value)
    with pytest.raises(SpecError) as caught:
        apply_overrides(load_spec(path), [f"model.config={value}"])
    issue = only_issue(caught)
    assert parsed.value.colno == 72
    assert f"not valid JSON: {parsed.value.msg} at column 72 of the value" in issue.message
    assert "column 1)" not in issue.message   # YAML's "mapping opened at column 1": not the place
    with pytest.raises(SpecError) as caught:   # YAML flow style: YAML's own mark, in the value
        apply_overrides(load_spec(path), ["model.config={hidden_size: 64 num_hidden_layers: 2}"])
    assert "at column 35 of the value" in only_issue(caught).message


def test_every_bad_set_is_reported(tmp_path):
    path = write(tmp_path, "job.yaml", "model: {architecture: bert}\n")
    with pytest.raises(SpecError) as caught:
        apply_overrides(load_spec(path), ["a=1", "b=2"])
    assert [i.column for i in caught.value.issues] == [1, 2]


@pytest.mark.parametrize("text", ["a: {é: 1, bb: [x, y]}\nc: &q {d: 2}\ne: *q\n", "x: " + "[" * 70 + "]" * 70 + "\n"])
def test_pure_python_yaml_gives_the_same_result_as_libyaml(monkeypatch, text):
    import jobspec.spec.loader as loader

    def outcome():
        try:
            return loader.parse_yaml(text, "f.yaml")[:2]
        except SpecError as err:
            return [i.render() for i in err.issues]

    fast = outcome()
    monkeypatch.setattr(loader, "_FAST_LOADER", None)
    assert outcome() == fast


@pytest.mark.parametrize("written, value", [("1e-3", 1e-3), ("1E-3", 1e-3), ("2e5", 2e5), ("-1.5e-4", -1.5e-4),
                                            ("+3e2", 300.0), (".5e1", 5.0), ("1.0e-3", 1e-3)])
def test_numbers_in_yaml_1_2_and_json_syntax_are_numbers(tmp_path, written, value):
    # PyYAML resolves by YAML 1.1, where `1e-3` is a string; people (and JSON) write it as a number
    path = write(tmp_path, "job.yaml", f"training:\n  optimizer:\n    lr: {written}\n")
    assert load_spec(path).spec["training"]["optimizer"]["lr"] == value
    over = apply_overrides(load_spec(write(tmp_path, "base.yaml", "name: x\n")), [f"training.optimizer.lr={written}"])
    assert over.spec["training"]["optimizer"]["lr"] == value


@pytest.mark.parametrize("written", ['"1e-3"', "'1e-3'", "1e-3x", "e5", "1e"])
def test_quoted_or_malformed_exponents_stay_strings(tmp_path, written):
    path = write(tmp_path, "job.yaml", f"name: {written}\n")
    assert isinstance(load_spec(path).spec["name"], str)


def test_exponent_learning_rate_validates_from_file_and_set(tmp_path):
    from jobspec.spec.validation import load_and_validate
    text = (REPO_ROOT / "jobs" / "quickstart.yaml").read_text()
    path = write(tmp_path, "job.yaml", re.sub(r"\blr: [0-9.eE+-]+", "lr: 1e-3", text))
    assert load_and_validate(path).spec["training"]["optimizer"]["lr"] == 1e-3
    assert load_and_validate(path, ["training.optimizer.lr=2E-4"]).spec["training"]["optimizer"]["lr"] == 2e-4
    with pytest.raises(SpecError) as caught:
        load_and_validate(path, ['training.optimizer.lr="2e-4"'])
    assert "without quotes" in str(caught.value)
