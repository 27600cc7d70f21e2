"""`model.lora` / `model.quantization` / `export.adapter` in `jobspec validate` (jobspec/techniques/lora.py) and
the target-module check on the job-preparation path (compile): positioned issues, rule codes, exit 2."""
from __future__ import annotations

import importlib.util
import json

import yaml

from jobspec.cli import main

TINY_LLAMA = {"architecture": "llama", "task": "causal-lm",
              "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}}


def write(tmp_path, model: dict, export: dict | None = None) -> str:
    raw = {"model": model, "data": {"synthetic": {"seq_len": 16, "vocab_range": [0, 300]}},
           "training": {"max_steps": 2}, "logging": {"mlflow": {"enabled": False}}}
    if export:
        raw["export"] = export
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def line_of(job: str, needle: str) -> int:
    return next(i for i, line in enumerate(open(job).read().splitlines(), 1) if needle in line)


def errors(capsys, command: str, job: str) -> tuple[int, list[dict]]:
    code = main([command, job, "--format", "json"] if command == "validate" else [command, job])
    captured = capsys.readouterr()
    if command == "validate":
        return code, json.loads(captured.out)["errors"] if code == 2 else []
    return code, [{"text": captured.err}]


def test_a_lora_job_validates_with_defaults(tmp_path, capsys):
    job = write(tmp_path, {**TINY_LLAMA, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    assert errors(capsys, "validate", job) == (0, [])


def test_static_rules_each_positioned_with_its_code(tmp_path, capsys):
    job = write(tmp_path, {**TINY_LLAMA, "freeze": ["embed_tokens.*"],
                           "quantization": {"bits": 8, "quant_type": "fp4"}}, export={"adapter": "merged"})
    code, found = errors(capsys, "validate", job)
    assert code == 2
    by_code = {e["code"]: e for e in found}
    assert set(by_code) == {"quantization-needs-lora", "quantization-4bit-field", "export-adapter"}
    assert by_code["quantization-4bit-field"]["dotted_path"] == "model.quantization.quant_type"
    assert by_code["quantization-4bit-field"]["line"] == line_of(job, "quant_type:")   # where it was written
    assert by_code["export-adapter"]["dotted_path"] == "export.adapter"
    job = write(tmp_path, {**TINY_LLAMA, "freeze": ["embed_tokens.*"], "lora": {}})
    code, found = errors(capsys, "validate", job)
    assert code == 2 and [e["code"] for e in found] == ["lora-freeze"]


def test_written_defaults_are_not_refused(tmp_path, capsys):
    # resolved.yaml and an MLflow run's spec write every default: launching them again must validate
    job = write(tmp_path, {**TINY_LLAMA, "lora": {}, "quantization": {"bits": 8, "quant_type": "nf4",
                                                                      "double_quant": True}})
    assert errors(capsys, "validate", job) == (0, [])
    job = write(tmp_path, dict(TINY_LLAMA), export={"adapter": "both"})
    assert errors(capsys, "validate", job) == (0, [])


def test_schema_bounds(tmp_path, capsys):
    job = write(tmp_path, {**TINY_LLAMA, "lora": {"r": 0, "dropout": 1.0, "target_modules": []},
                           "quantization": {"bits": 3}})
    code, found = errors(capsys, "validate", job)
    assert code == 2
    paths = {e["dotted_path"] for e in found}
    assert {"model.lora.r", "model.lora.dropout", "model.lora.target_modules",
            "model.quantization.bits"} <= paths


def test_missing_bitsandbytes_is_refused_without_importing_it(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    job = write(tmp_path, {**TINY_LLAMA, "lora": {}, "quantization": {"bits": 4}})
    code, found = errors(capsys, "validate", job)
    assert code == 2 and [e["code"] for e in found] == ["quantization-package"]
    assert "pip install bitsandbytes" in found[0]["hint"]


def test_compile_refuses_a_misspelt_target_at_its_line_with_did_you_mean(tmp_path, capsys):
    job = write(tmp_path, {**TINY_LLAMA, "lora": {"target_modules": ["v_proj", "q_prj"]}})
    # validate knows the model type's module names (schemas/transformers-configs/), compile too
    code, (found,) = errors(capsys, "validate", job)
    assert code == 2 and found["line"] == line_of(job, "q_prj") and found["file"].endswith("job.yaml")
    assert found["dotted_path"] == "model.lora.target_modules[1]" and "'q_proj'" in found["hint"]
    code, (report,) = errors(capsys, "compile", job)
    assert code == 2
    text = report["text"]
    assert f"job.yaml:{line_of(job, 'q_prj')}:" in text
    assert "model.lora.target_modules[1]" in text and "'q_proj'" in text
    assert "Traceback" not in text


def test_jobspecs_own_mlp_takes_lora_but_not_quantisation(tmp_path, capsys):
    mlp = {"architecture": "mlp", "config": {"hidden_size": 32, "num_layers": 2, "vocab_size": 300}}
    assert errors(capsys, "validate", write(tmp_path, {**mlp, "lora": {}})) == (0, [])
    code, found = errors(capsys, "validate", write(tmp_path, {**mlp, "lora": {}, "quantization": {"bits": 4}}))
    assert code == 2 and [e["code"] for e in found] == ["quantization-architecture"]


def test_a_hub_model_this_machine_cannot_read_still_compiles(tmp_path, capsys, monkeypatch):
    """The target check needs the model's module names; for a hub id without network it gives way (a
    launch refuses the unreadable id before any rank, and the ranks check the patterns on the model)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = write(tmp_path, {"name_or_path": "no-such-org/no-such-model", "task": "causal-lm", "lora": {}})
    code, (report,) = errors(capsys, "compile", job)
    assert code == 0, report["text"]


def test_lora_on_a_model_built_from_its_config_is_said_in_one_note(tmp_path, capsys):
    """The base is random and frozen: validate and plan say so in a note (the launch header too:
    tests/launch/test_console.py); a pretrained base or no LoRA: no note."""
    from jobspec.techniques.lora import random_base_note

    job = write(tmp_path, {**TINY_LLAMA, "lora": {"r": 4}})
    assert main(["validate", job]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "random weights" in line]
    assert notes == ["note: model.lora on a llama built from model.config: the adapters train on a "
                     "frozen base of random weights (set model.name_or_path to adapt a pretrained "
                     "model)"]
    assert main(["plan", job, "--gpu-mem", "8GiB"]) == 0
    assert notes[0] in capsys.readouterr().out.splitlines()
    pretrained = {"model": {"lora": {"r": 4}, "name_or_path": "org/model", "architecture": None}}
    assert random_base_note(pretrained) is None
    assert random_base_note({"model": {"lora": None}}) is None
