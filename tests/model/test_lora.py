"""jobspec/model/lora.py: PEFT's config from model.lora, the target patterns checked against the model's real
module names (did-you-mean), the classification head trained by default, bitsandbytes' config."""
from __future__ import annotations

import pytest
from spec_builder import BARE, build_spec

from jobspec.errors import SpecError
from jobspec.model.build import build_skeleton
from jobspec.model.lora import (
    apply_lora,
    check_targets,
    lora_config,
    modules_to_save,
    parameter_counts,
    quantization_config,
    quantized_linear_names,
    resolve_targets,
)
from jobspec.spec.schema import fill_defaults

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 128}


def make_spec(architecture="llama", task="causal-lm", config=LLAMA, lora=None, quantization=None):
    return build_spec(base=BARE, model={"architecture": architecture, "task": task, "config": config,
                                        "lora": lora if lora is not None else {}, "quantization": quantization},
                      data={"synthetic": {}}, training={"max_steps": 1})


def unchecked_spec(architecture="llama", task="causal-lm", config=LLAMA, lora=None) -> dict:
    """Defaults filled, no rule run: a job whose targets the loader refuses, for check_targets itself."""
    spec = fill_defaults({"model": {"architecture": architecture, "task": task, "config": config, "lora": lora or {}},
                          "data": {"synthetic": {}}, "training": {"max_steps": 1}})
    spec["model"]["lora"] = fill_defaults({"model": {"lora": spec["model"]["lora"]}})["model"]["lora"]
    return spec


def test_a_misspelt_pattern_is_refused_at_its_index_with_did_you_mean():
    spec = unchecked_spec(lora={"target_modules": ["v_proj", "q_prj", "self_attn"]})
    with pytest.raises(SpecError) as err:
        check_targets(spec, build_skeleton(spec))
    issues = {issue.path: issue for issue in err.value.issues}
    assert set(issues) == {("model", "lora", "target_modules", 1), ("model", "lora", "target_modules", 2)}
    assert "'q_proj'" in issues[("model", "lora", "target_modules", 1)].hint
    assert "LlamaAttention" in issues[("model", "lora", "target_modules", 2)].message
    assert "q_proj" in issues[("model", "lora", "target_modules", 2)].hint
    assert all(issue.code == "lora-targets" for issue in err.value.issues)


def test_patterns_match_as_peft_matches_them():
    spec = make_spec(lora={"target_modules": ["q_proj", "layers.1.mlp.down_proj"]})
    model = build_skeleton(spec)
    targets = resolve_targets(spec, model)
    assert targets == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                       "model.layers.1.mlp.down_proj"]
    wrapped = apply_lora(model, spec)
    adapted = sorted(name.removeprefix("base_model.model.").removesuffix(".lora_A.default")
                     for name, _ in wrapped.named_modules() if name.endswith("lora_A.default"))
    assert adapted == sorted(targets)   # PEFT put adapters exactly where the check said


def test_all_linear_freezes_the_base_and_trains_r_times_in_plus_out_per_layer():
    spec = make_spec(lora={"r": 4})
    model = build_skeleton(spec)
    total_before = sum(p.numel() for p in model.parameters())
    wrapped = apply_lora(model, spec)
    counts = parameter_counts(wrapped)
    trainable, total = counts["trainable"], counts["total"]
    linears = [m for name, m in build_skeleton(spec).named_modules()
               if type(m).__name__ == "Linear" and "lm_head" not in name]
    assert trainable == sum(4 * (m.in_features + m.out_features) for m in linears)
    assert total == total_before + trainable
    assert all(not p.requires_grad for n, p in wrapped.named_parameters() if "lora_" not in n)


def test_the_classification_head_is_trained_by_default_and_not_adapted():
    spec = make_spec("bert", "sequence-classification", BERT)
    model = build_skeleton(spec)
    assert modules_to_save(spec, model) == ["classifier"]
    assert "classifier" not in resolve_targets(spec, model)
    wrapped = apply_lora(model, spec)
    trained = {n for n, p in wrapped.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained and all(".classifier.modules_to_save." in n for n in trained)
    spec["model"]["lora"]["modules_to_save"] = []
    assert modules_to_save(spec, build_skeleton(spec)) == []
    assert "classifier" in resolve_targets(spec, build_skeleton(spec))   # `[]`: the head gets adapters


def test_a_modules_to_save_entry_naming_nothing_is_refused():
    spec = unchecked_spec("bert", "sequence-classification", BERT, lora={"modules_to_save": ["clasifier"]})
    with pytest.raises(SpecError) as err:
        check_targets(spec, build_skeleton(spec))
    (issue,) = err.value.issues
    assert issue.path == ("model", "lora", "modules_to_save", 0) and "'classifier'" in issue.hint


def test_lora_config_carries_every_field():
    spec = make_spec(lora={"r": 16, "alpha": 32, "dropout": 0.1, "target_modules": ["q_proj"], "bias": "lora_only",
                           "use_rslora": True, "use_dora": True})
    config = lora_config(spec, build_skeleton(spec))
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (16, 32, 0.1, "lora_only")
    assert config.use_rslora and config.use_dora and set(config.target_modules) == {"q_proj"}
    assert config.modules_to_save is None


def test_quantization_config_and_the_layers_it_quantises():
    spec = make_spec(quantization={"bits": 4})
    spec["memory"]["precision"] = "bf16"
    model = build_skeleton(spec)
    config = quantization_config(spec, model)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert str(config.bnb_4bit_compute_dtype) == "torch.bfloat16" and config.llm_int8_skip_modules is None
    names = quantized_linear_names(spec, model)
    assert len(names) == 14 and not any("lm_head" in n for n in names)   # 7 linears x 2 layers, head kept
    # a classification head trained in full stays unquantised, and so do transformers' default skips
    spec = make_spec("bert", "sequence-classification", BERT, quantization={"bits": 8})
    model = build_skeleton(spec)
    assert quantization_config(spec, model).load_in_8bit
    assert "classifier" in quantization_config(spec, model).llm_int8_skip_modules
    assert not any("classifier" in n for n in quantized_linear_names(spec, model))
    assert make_spec()["model"]["quantization"] is None and quantization_config(make_spec()) is None


def test_build_and_lora_import_each_other_in_one_direction_only():
    """model/build quantises a QLoRA base with model/lora's config; the meta build the target check needs
    is job/checks' (lora_target_check), so model/lora imports no model/build, not even inside a function."""
    import ast
    from pathlib import Path

    import jobspec.model.build
    import jobspec.model.lora

    def imported(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
            {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}

    assert "jobspec.model.lora" in imported(jobspec.model.build)
    assert not {"jobspec.model.build", "jobspec.model"} & imported(jobspec.model.lora)
