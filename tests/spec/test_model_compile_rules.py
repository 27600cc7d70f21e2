"""`model.compile`'s rules (jobspec/techniques/regional_compile.py): what regional compilation cannot
run under is refused at `model.compile` with its rule code, exit 2; what it runs with validates;
`--fit` and the plan's advice offer nothing the rule refuses."""
from __future__ import annotations

import pytest
import yaml
from conftest import PROFILER
from spec_builder import BARE, build_spec, validate_errors

from jobspec.memory.fit import candidate_changes, fit
from jobspec.memory.planner import plan_memory
from jobspec.memory.remedies import remedies
from jobspec.spec.derived import derive

TINY_LLAMA = {"architecture": "llama", "task": "causal-lm",
              "config": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}}


def write(tmp_path, **sections) -> str:
    raw = {"model": {**TINY_LLAMA, "compile": True},
           "data": {"synthetic": {"num_samples": 64, "seq_len": 64}},
           "training": {"max_steps": 2, "micro_batch_size": 2}, "resources": {"gpus_per_node": 2},
           **sections}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def errors(capsys, job: str, *overrides: str) -> dict[str, list[str]]:
    """{dotted path: the rule codes there} of every problem validate reports (exit 2), {} when it
    accepts."""
    return {path: [e["code"] for e in found]
            for path, found in validate_errors(capsys, job, *overrides).items()}


@pytest.mark.parametrize("overrides", [
    [], ["memory.zero_stage=2"], ["memory.activation_checkpointing=true"],
    ["memory.tiled_loss=true"],
    ["model.lora={r: 4}"], ["memory.zero_stage=1", "memory.offload.optimizer=cpu"],
    ["memory.activation_checkpointing={every_n_layers: 2}"],
])
def test_what_regional_compilation_runs_with_validates(tmp_path, capsys, overrides):
    assert errors(capsys, write(tmp_path), *overrides) == {}


@pytest.mark.parametrize("overrides, code", [
    (["memory.zero_stage=3"], "compile-zero3"),
    (["model.lora={r: 4}", "model.quantization={bits: 4}"], "compile-quantized"),
    (["memory.tiled_mlp=true"], "compile-tiled-mlp"),
    (["memory.activation_checkpointing={every_n_layers: 1, offload: cpu}"],
     "compile-activation-offload"),
])
def test_what_it_cannot_run_under_is_refused_at_model_compile(tmp_path, capsys, overrides, code):
    assert errors(capsys, write(tmp_path), *overrides) == {"model.compile": [code]}
    assert errors(capsys, write(tmp_path), *overrides, "model.compile=false") == {}


def test_fit_and_the_advice_offer_nothing_the_rule_refuses(tmp_path):
    spec = build_spec(base=BARE, model={**TINY_LLAMA, "compile": True}, output_dir=str(tmp_path),
                      data={"synthetic": {"num_samples": 64, "seq_len": 64}},
                      training={"max_steps": 2, "micro_batch_size": 2},
                      resources={"gpus_per_node": 2})
    job = derive(spec, profiler=PROFILER)
    tried = list(candidate_changes(spec, job, True))
    def refused(changes: dict) -> bool:
        checkpointing = changes.get("memory.activation_checkpointing")
        offloaded = isinstance(checkpointing, dict) and checkpointing.get("offload") == "cpu"
        tiled_mlp = bool(changes.get("memory.tiled_mlp"))
        return changes.get("memory.zero_stage") == 3 or tiled_mlp or offloaded

    assert tried and not any(refused(c) for c in tried)
    uncompiled = {**spec, "model": {**spec["model"], "compile": False}}
    assert any(c.get("memory.zero_stage") == 3 for c in candidate_changes(uncompiled, job, True))
    plan = plan_memory(spec, job)
    offered = remedies("parameters", spec, plan) + remedies("activations", spec, plan)
    assert offered and not any(word in r for r in offered
                               for word in ("zero_stage: 3", "tiled_mlp", "QLoRA", "offload"))
    assert any("zero_stage: 3" in r for r in remedies("parameters", uncompiled, plan))
    nothing = fit(spec, job, 1024)   # 1 KiB: nothing fits; the way out names model.compile
    assert not nothing.fits and "`model.compile: false`" in nothing.reason
