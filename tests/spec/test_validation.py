"""Validation: the broken-spec corpus (exact positions and messages), valid specs, the CLI."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from jobspec.errors import SpecError
from jobspec.spec.validation import job_name, load_and_validate

ASSETS = REPO_ROOT / "tests" / "assets"
BROKEN = ASSETS / "broken"
VALID = ASSETS / "valid"
CASES = sorted(BROKEN.glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (?:(?P<file>\S+):)?(?P<line>\d+):(?P<col>\d+) (?P<path>\S+) \| (?P<phrases>.*)$")


def expectations(case: Path) -> tuple[list[dict], list[str]]:
    text = case.read_bytes().decode("utf-8", "replace")
    expected = [EXPECT.match(line).groupdict() for line in text.splitlines() if line.startswith("# expect:")]
    overrides = re.findall(r"^# set: (.*)$", text, re.M)
    return expected, overrides


def test_corpus_is_big_enough():
    assert len(CASES) >= 20
    for case in CASES:
        assert expectations(case)[0], f"{case.name} has no `# expect:` line"


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_broken_spec_reports_exactly_the_expected_problems(case: Path):
    expected, overrides = expectations(case)
    with pytest.raises(SpecError) as caught:
        load_and_validate(str(case), overrides)
    issues = sorted(caught.value.issues, key=lambda i: (i.file, i.line, i.column, i.message))
    expected = sorted(expected, key=lambda e: (str(BROKEN / e["file"]) if e["file"] and e["file"] != "<--set>"
                                               else e["file"] or str(case), int(e["line"]), int(e["col"]),
                                               e["phrases"]))
    assert len(issues) == len(expected), "\n".join(i.render() for i in issues)
    for issue, want in zip(issues, expected):
        want_file = str(case) if want["file"] is None else (
            want["file"] if want["file"] == "<--set>" else os.path.normpath(BROKEN / want["file"]))
        assert (issue.file, issue.line, issue.column, issue.dotted_path) == \
            (want_file, int(want["line"]), int(want["col"]), want["path"]), issue.render()
        for phrase in want["phrases"].split(" | "):
            assert phrase in issue.render(), f"{phrase!r} not in {issue.render()!r}"


def test_valid_spec_is_filled_and_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolved = load_and_validate(VALID / "tiny-bert.yaml")
    spec = resolved.spec
    assert spec["name"] == "tiny-bert"
    assert spec["extends"] is None
    assert spec["output_dir"] == str(tmp_path / "runs" / "tiny-bert")
    assert spec["checkpoint"]["dir"] == str((VALID / "ckpt").resolve())
    assert spec["training"]["scheduler"]["name"] == "linear"          # a default
    assert spec["memory"]["activation_checkpointing"] == {"every_n_layers": 2, "use_reentrant": False, "offload": "none"}
    assert resolved.text == (VALID / "tiny-bert.yaml").read_text()


def test_extends_and_paths_resolve_against_the_spec_files():
    resolved = load_and_validate(VALID / "file-data.yaml")
    spec = resolved.spec
    assert spec["data"]["train"] == str((VALID / "train.jsonl").resolve())
    assert spec["model"]["name_or_path"] == "bert-base-uncased"   # not a local path: a hub id
    assert spec["output_dir"] == str((VALID / "out").resolve())
    assert spec["checkpoint"]["dir"] == str((VALID / "out" / "checkpoints").resolve())
    assert spec["memory"]["zero_stage"] == 1 and spec["logging"]["mlflow"]["tags"] == {"team": "nlp"}
    base_pos = resolved.position(("memory", "zero_stage"))
    assert (Path(base_pos.file).name, base_pos.line) == ("base-family.yaml", 11)
    assert Path(resolved.position(("data", "train")).file).name == "file-data.yaml"


def test_position_of_a_defaulted_field_is_its_nearest_written_ancestor():
    resolved = load_and_validate(VALID / "tiny-bert.yaml")
    assert resolved.position(("training", "scheduler", "warmup_steps"))[1:] == (17, 1)   # `training:`
    assert resolved.position(("training", "max_steps"))[1:] == (18, 14)
    assert resolved.position(("training", "max_steps"), key=True)[1:] == (18, 3)
    assert resolved.position(("checkpoint", "keep_last"))[1:] == (36, 1)
    assert resolved.position(("resources", "slurm", "time"))[1:] == (31, 1)
    assert resolved.position(("name",))[1:] == (1, 1)


@pytest.mark.parametrize("stem,expected", [("xlmr-large", "xlmr-large"), ("my job (v2)", "my-job-v2-"),
                                           ("__x", "x"), ("###", "job")])
def test_job_name_from_the_file_stem(stem, expected):
    assert job_name(Path(f"/tmp/{stem}.yaml")) == expected


def test_set_overrides_reach_the_resolved_spec():
    spec = load_and_validate(VALID / "tiny-bert.yaml",
                             ["name=007", "training.max_steps=9", "model.config.hidden_size=32"]).spec
    assert spec["name"] == "007" and spec["training"]["max_steps"] == 9
    assert spec["model"]["config"]["hidden_size"] == 32


def test_a_valid_override_can_still_break_a_cross_field_rule():
    with pytest.raises(SpecError) as caught:
        load_and_validate(VALID / "tiny-bert.yaml", ["memory.zero_stage=0"])
    (issue,) = caught.value.issues
    assert issue.dotted_path == "memory.offload.optimizer" and "ZeRO stage >= 1" in issue.message


def test_system_metrics_need_an_mlflow_run():
    assert load_and_validate(VALID / "tiny-bert.yaml").spec["logging"]["system_metrics"] is True   # on by default
    # with MLflow off the default is off, and only a written `true` is refused
    off = load_and_validate(VALID / "tiny-bert.yaml", ["logging.mlflow.enabled=false"])
    assert off.spec["logging"]["system_metrics"] is False
    load_and_validate(VALID / "tiny-bert.yaml", ["logging.system_metrics=false", "logging.mlflow.enabled=false"])
    with pytest.raises(SpecError) as caught:
        load_and_validate(VALID / "tiny-bert.yaml", ["logging.system_metrics=true", "logging.mlflow.enabled=false"])
    (issue,) = caught.value.issues
    assert issue.dotted_path == "logging.system_metrics" and "MLflow is off" in issue.message


@pytest.mark.parametrize("overrides, layers", [
    (["model.config.num_hidden_layers=3"], 3),
    (["model.config={hidden_size: 64}"], 12),                      # bert's default, from the derived dims
    (["model.architecture=gpt2", "model.config={n_embd: 64, n_layer: 5, n_head: 2, vocab_size: 1000}"], 5),
])
def test_every_n_layers_is_checked_against_the_derived_layer_count(overrides, layers):
    too_many = f"memory.activation_checkpointing.every_n_layers={layers + 1}"
    just_enough = f"memory.activation_checkpointing.every_n_layers={layers}"
    load_and_validate(VALID / "tiny-bert.yaml", overrides + [just_enough])
    with pytest.raises(SpecError) as caught:
        load_and_validate(VALID / "tiny-bert.yaml", overrides + [too_many])
    (issue,) = caught.value.issues
    assert issue.dotted_path == "memory.activation_checkpointing.every_n_layers"
    assert f"every_n_layers = {layers + 1} but the model has {layers} layers" in issue.message


def test_every_n_layers_reads_a_local_checkpoints_layer_count(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64,
                                                               "num_hidden_layers": 4}))
    job = tmp_path / "job.yaml"
    job.write_text((VALID / "tiny-bert.yaml").read_text().replace("architecture: bert", "name_or_path: ckpt")
                   .replace("    num_hidden_layers: 2\n", ""))
    with pytest.raises(SpecError) as caught:
        load_and_validate(job, ["memory.activation_checkpointing.every_n_layers=5"])
    assert [i.message for i in caught.value.issues] == ["every_n_layers = 5 but the model has 4 layers"]


def test_validation_does_not_import_heavy_libraries():
    code = ("import sys; from jobspec.spec.validation import load_and_validate; "
            f"load_and_validate({str(VALID / 'tiny-bert.yaml')!r}); "
            "print(sorted(m for m in ('torch','deepspeed','transformers','mlflow','datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def jobspec(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "jobspec", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_valid_file_prints_ok():
    out = jobspec("validate", str(VALID / "tiny-bert.yaml"), str(VALID / "file-data.yaml"))
    assert out.returncode == 0, out.stderr
    assert [line.split(": ")[1][:2] for line in out.stdout.splitlines()] == ["ok", "ok"]


def test_cli_reports_every_problem_sorted_and_exits_2():
    out = jobspec("validate", "offload_rules.yaml", "--set", "training.max_steps=x", cwd=BROKEN)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("<--set>:1:1: training.max_steps: expected an integer or null")
    assert lines[-1] == "1 problem found"
    out = jobspec("validate", "offload_rules.yaml", cwd=BROKEN)
    lines = out.stderr.splitlines()
    assert [line.split(": ")[0] for line in lines[:-1]] == \
        ["offload_rules.yaml:10:16", "offload_rules.yaml:10:16", "offload_rules.yaml:11:13"]
    assert lines[-1] == "3 problems found"


def test_cli_json_format():
    out = jobspec("validate", str(BROKEN / "unknown_key_nested.yaml"), "--format", "json")
    assert out.returncode == 2
    report = json.loads(out.stdout)
    assert report["valid"] is False
    assert [(e["dotted_path"], e["line"], e["column"]) for e in report["errors"]] == [("memory.zero_stag", 8, 3)]
    out = jobspec("validate", str(VALID / "tiny-bert.yaml"), "--format", "json")
    assert out.returncode == 0
    report = json.loads(out.stdout)
    assert report["valid"] is True and report["spec"]["name"] == "tiny-bert"


@pytest.mark.parametrize("target", ["does-not-exist.yaml", "."])
def test_cli_unreadable_input_is_a_clean_error(target, tmp_path):
    out = jobspec("validate", target, cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and out.stderr.startswith(f"{target}: ")


def test_cli_schema_json_is_the_schema():
    from jobspec.spec.schema import load_schema

    out = jobspec("schema")
    assert out.returncode == 0 and json.loads(out.stdout) == load_schema()


def test_locate_gives_unpositioned_issues_a_position():
    from jobspec.errors import spec_error

    resolved = load_and_validate(VALID / "tiny-bert.yaml")
    located = resolved.locate(spec_error("too big", path=("memory", "zero_stage"), hint="smaller"))
    (issue,) = located.issues
    assert (Path(issue.file).name, issue.line, issue.column, issue.hint) == ("tiny-bert.yaml", 26, 15, "smaller")


@pytest.mark.parametrize("field, value, ok", [
    ("sub_group_size", 0, True),            # DeepSpeed accepts 0 (peer configs use it)
    ("reduce_bucket_size", 0, False),       # DeepSpeedZeroConfig: gt=0
    ("allgather_bucket_size", 0, False),    # ZeRO 1/2 divide by it
    ("reduce_bucket_size", 1, True),
    ("stage3_prefetch_bucket_size", 0, True),
])
def test_zero_bounds_match_deepspeeds(field, value, ok):
    job = str(REPO_ROOT / "jobs" / "quickstart.yaml")
    overrides = ["memory.zero_stage=3", f"memory.zero.{field}={value}"]
    if ok:
        spec = load_and_validate(job, overrides).spec
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        from jobspec.compile.compiler import compile_spec
        from jobspec.spec.derived import derive
        DeepSpeedZeroConfig(**compile_spec(spec, derive(spec)).ds_config["zero_optimization"])  # DeepSpeed agrees
    else:
        with pytest.raises(SpecError, match=field):
            load_and_validate(job, overrides)


GPT2_64 = ["model.architecture=gpt2", "model.config={n_embd: 32, n_layer: 2, n_head: 2, n_positions: 64, vocab_size: 1000}",
           "data.synthetic.vocab_range=[5, 1000]"]


@pytest.mark.parametrize("sets, longest", [([], 128), (GPT2_64, 64)], ids=["xlm-roberta-130", "gpt2-64"])
def test_a_sequence_longer_than_the_position_table_is_refused_by_validate(sets, longest, capsys):
    """Issue 24: found by validate (exit 2, at the field), not by the ranks after 19 s of start-up.
    XLM-R's table of 130 positions takes 128 tokens (its ids start after the padding index)."""
    from jobspec.cli import main

    job = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"
    argv = ["validate", str(job)] + [x for s in sets for x in ("--set", s)]
    assert main(argv + ["--set", f"data.synthetic.seq_len={longest + 1}"]) == 2
    err = capsys.readouterr().err
    assert f"data.synthetic.seq_len: {longest + 1} tokens per sequence" in err
    assert f"position table has {longest}" in err
    assert main(argv + ["--set", f"data.synthetic.seq_len={longest}"]) == 0
