"""QLoRA under DeepSpeed (techniques/quantization): ZeRO 0-2 validate, ZeRO-3 is refused at
model.quantization with its reason and what to change, exit 2, no traceback."""
from __future__ import annotations

import json

import pytest
import yaml

from jobspec.cli import main

JOB = {"model": {"architecture": "llama", "task": "causal-lm",
                 "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "vocab_size": 128},
                 "lora": {"r": 4}, "quantization": {"bits": 4}},
       "data": {"synthetic": {"num_samples": 16, "vocab_range": [5, 128]}}, "training": {"max_steps": 2}}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_quantised_base_under_each_zero_stage(tmp_path, capsys, stage):
    job = tmp_path / "qlora.yaml"
    job.write_text(yaml.safe_dump({**JOB, "memory": {"zero_stage": stage}}, sort_keys=False))
    code = main(["validate", str(job), "--format", "json"])
    report = json.loads(capsys.readouterr().out or "{}")
    errors = {e["dotted_path"]: e for e in report.get("errors", [])}
    if stage < 3:
        assert code == 0 and not errors
        return
    assert code == 2 and list(errors) == ["model.quantization"]
    error = errors["model.quantization"]
    assert error["code"] == "quantization-zero3" and "ZeRO stage 3" in error["message"]
    lines = job.read_text().splitlines()
    key = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("quantization:"))
    assert "zero_stage: 2" in error["hint"] and error["line"] in (key, key + 1)   # the key or its block
