"""`data.packing`'s rules (jobspec/techniques/packing.py): refused where packed samples could not be
kept apart, positioned at `data.packing` with a rule code, exit 2; accepted for the families listed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO_ROOT

from jobspec.cli import main
from jobspec.techniques import packing as packing_rules

TOKENIZER = REPO_ROOT / "jobs" / "data" / "tokenizer"
TINY_LLAMA = {"architecture": "llama", "task": "causal-lm",
              "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}}


def write(tmp_path, model=None, data=None, training=None) -> str:
    (tmp_path / "train.jsonl").write_text('{"text": "a b c"}\n')
    raw = {"model": model or TINY_LLAMA,
           "data": {"train": "train.jsonl", "tokenizer": str(TOKENIZER), "packing": True, "max_length": 64,
                    **(data or {})},
           "training": training or {"max_steps": 2}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def report(capsys, job: str, *overrides: str) -> tuple[int, list[dict]]:
    args = ["validate", job, "--format", "json"]
    for override in overrides:
        args += ["--set", override]
    code = main(args)
    out = capsys.readouterr().out
    return code, json.loads(out)["errors"] if code == 2 else []


def packing_errors(errors: list[dict]) -> list[tuple[str, str]]:
    return [(e["dotted_path"], e["code"]) for e in errors if e["code"].startswith("packing-")]


def test_a_llama_causal_lm_job_packs(tmp_path, capsys):
    code, errors = report(capsys, write(tmp_path))
    assert packing_errors(errors) == []


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_attention_2"])
def test_every_attention_of_a_listed_family_is_accepted(attention):
    assert packing_rules.model_problem("llama", attention) is None
    assert packing_rules.model_problem("gpt2", attention) is None


def test_packing_is_refused_for_an_encoder_task_at_data_packing(tmp_path, capsys):
    job = write(tmp_path, model={**TINY_LLAMA, "architecture": "bert", "task": "masked-lm", "config": {}})
    code, errors = report(capsys, job)
    assert code == 2
    assert packing_errors(errors) == [("data.packing", "packing-task")]
    error = next(e for e in errors if e["code"] == "packing-task")
    assert "causal-lm" in error["message"] and error["hint"]
    lines = open(job).read().splitlines()
    assert lines[error["line"] - 1].strip() == "packing: true"   # positioned where packing was turned on


def test_a_family_that_cannot_keep_samples_apart_is_refused(tmp_path, capsys):
    job = write(tmp_path, model={"architecture": "opt", "task": "causal-lm",
                                 "config": {"hidden_size": 64, "num_hidden_layers": 2}})
    code, errors = report(capsys, job)
    assert code == 2 and packing_errors(errors) == [("data.packing", "packing-model")]
    error = next(e for e in errors if e["code"] == "packing-model")
    assert "opt" in error["message"] and "data.packing: false" in error["hint"] and "llama" in error["hint"]


def test_the_model_type_of_a_local_checkpoint_is_read_from_its_config(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "bloom", "hidden_size": 64, "n_layer": 2}))
    job = write(tmp_path, model={"name_or_path": "ckpt", "task": "causal-lm"})
    code, errors = report(capsys, job)
    assert packing_errors(errors) == [("data.packing", "packing-model")]
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    code, errors = report(capsys, job)
    assert packing_errors(errors) == []


def test_a_hub_id_is_left_to_the_ranks():
    """Validation cannot read a hub id's model type; the ranks ask `model_problem` with the built model's."""
    spec = {"data": {"packing": True, "synthetic": None}, "training": {"epochs": None},
            "model": {"task": "causal-lm", "architecture": None, "attention": "sdpa", "name_or_path": "org/model"}}
    assert packing_rules.packing_problems(spec, None) == []
    assert packing_rules.model_problem("opt", "sdpa") is not None


def test_synthetic_data_and_epochs_are_refused(tmp_path, capsys):
    job = write(tmp_path, data={"train": None, "tokenizer": None, "synthetic": {"num_samples": 8, "seq_len": 16}},
                training={"epochs": 1})
    code, errors = report(capsys, job)
    assert code == 2
    assert sorted(packing_errors(errors)) == [("data.packing", "packing-epochs"), ("data.packing", "packing-synthetic")]


def test_packing_off_is_never_refused(tmp_path, capsys):
    job = write(tmp_path, model={"architecture": "opt", "task": "causal-lm", "config": {"hidden_size": 64}},
                data={"packing": False})
    code, errors = report(capsys, job)
    assert packing_errors(errors) == []


def test_the_refusal_text_and_exit_code_on_the_command_line(tmp_path):
    job = write(tmp_path, model={**TINY_LLAMA, "task": "sequence-classification"})
    done = subprocess.run([sys.executable, "-m", "jobspec", "validate", job, "--set", "data.packing=true"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "data.packing: packing is for causal-lm; the task is sequence-classification" in done.stderr
    assert "Traceback" not in done.stderr
