"""validate knows every transformers model type (schemas/transformers-configs/, spec/model_table): the
config keys, the LoRA target names of each head, the task heads, the attention default, the padding
id against the vocabulary; a hub id in the local cache is typed without transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO_ROOT

from jobspec.cli import main
from jobspec.spec import model_table

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


def job(tmp_path, model: dict, name: str = "job.yaml") -> str:
    spec = {"model": {"task": "causal-lm", **model},
            "data": {"synthetic": {"num_samples": 16, "seq_len": 16, "vocab_range": [3, 500]}},
            "training": {"max_steps": 1}, "logging": {"mlflow": {"enabled": False}}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_every_registered_type_has_an_entry_read_alone():
    types = model_table.model_types()
    assert len(types) > 800 and {"qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "mixtral"} <= set(types)
    qwen2 = model_table.entry("qwen2")
    assert qwen2["class"].endswith("Qwen2Config") and "hidden_size" in qwen2["fields"]
    assert model_table.entry("../index") is None and model_table.entry("no-such-type") is None


def test_lora_target_typos_are_refused_by_validate_with_did_you_mean(tmp_path, capsys):
    path = job(tmp_path, {"architecture": "qwen2", "config": TINY,
                          "lora": {"target_modules": ["q_prj", "k_proj", "model.layers.0.self_attn.v_proj"]}})
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "model.lora.target_modules[0]: target module pattern 'q_prj' matches no module LoRA can adapt in " \
           "Qwen2ForCausalLM (causal-lm) (did you mean 'q_proj'" in err
    assert "target_modules[1]" not in err and "target_modules[2]" not in err   # a dotted, numbered name matches
    assert ":8:" in err or "job.yaml:" in err


def test_a_local_checkpoint_names_the_type_whose_modules_are_checked(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    path = job(tmp_path, {"name_or_path": "ckpt", "task": "sequence-classification",
                          "lora": {"target_modules": ["quer", "value"]}})
    assert main(["validate", path]) == 2
    assert "pattern 'quer' matches no module" in capsys.readouterr().err


def test_all_linear_means_the_heads_linear_layers_but_the_output():
    assert model_table.all_linear_modules(model_table.head("phi3", "causal-lm")) == \
        ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert "lm_head" not in model_table.all_linear_modules(model_table.head("gpt2", "causal-lm"))


def test_a_task_the_type_has_no_head_for_is_refused(tmp_path, capsys):
    assert main(["validate", job(tmp_path, {"architecture": "clip"})]) == 2
    err = capsys.readouterr().err
    assert "model.task: model type `clip` has no causal-lm head in transformers" in err


def test_attention_left_out_is_the_best_the_model_supports(tmp_path, capsys):
    gemma2 = {**TINY, "head_dim": 8, "pad_token_id": 0}
    assert main(["validate", job(tmp_path, {"architecture": "gemma2", "config": gemma2}), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["model"]["attention"] == "eager"
    assert main(["validate", job(tmp_path, {"architecture": "qwen2", "config": TINY}), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["model"]["attention"] == "sdpa"
    written = job(tmp_path, {"architecture": "gemma2", "config": gemma2, "attention": "sdpa"})
    assert main(["validate", written, "--format", "json"]) == 0   # written: kept (the build says it fails)
    assert json.loads(capsys.readouterr().out)["spec"]["model"]["attention"] == "sdpa"


def test_phi3s_default_padding_id_beyond_a_small_vocabulary_is_refused_at_the_key(tmp_path, capsys):
    path = job(tmp_path, {"architecture": "phi3", "config": {**TINY, "num_key_value_heads": 4}})
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "model.config.vocab_size: pad_token_id 32000 (Phi3Config's default) is not below vocab_size 512 " \
           "(set model.config.pad_token_id: 511" in err
    # the fix it names works: plan builds and traces the model
    assert main(["plan", path, "--set", "model.config.pad_token_id=511"]) == 0
    out = capsys.readouterr()
    assert "attention sdpa" in out.out
    assert "Padding_idx" not in out.err and "Warning" not in out.err   # library output went to the log


def test_a_hub_id_in_the_local_cache_is_typed_without_transformers(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    path = job(tmp_path, {"name_or_path": "someone/tiny", "config": {"hiden_size": 8}})
    code = ("import sys; from jobspec.cli import main; rc = main(['validate', sys.argv[1]]); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr
    assert "unknown key `hiden_size` for Qwen2Config (qwen2) (did you mean `hidden_size`?)" in done.stderr


def test_a_hub_id_outside_the_cache_gets_one_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert main(["validate", job(tmp_path, {"name_or_path": "someone/else", "lora": {}})]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: model.lora's module names of `someone/else` not checked here (its model type is in "
                     "its config.json, not in the local cache): plan, compile and launch --dry-run read it and "
                     "check them"]


@pytest.mark.parametrize("command", ["plan", "compile"])
def test_plan_and_compile_keep_library_output_in_a_log(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("JOBSPEC_LOG_DIR", str(tmp_path / "logs"))
    path = str(REPO_ROOT / "jobs" / "lora-causal-lm.yaml")
    assert main([command, path]) == 0
    err = capsys.readouterr().err
    assert "Warning" not in err and "warnings.warn" not in err and "[transformers]" not in err, err
    assert (tmp_path / "logs" / f"{command}.log").exists()


def test_a_sequence_past_a_rotary_models_positions_is_a_warning_at_the_field(tmp_path, capsys):
    config = {**TINY, "max_position_embeddings": 8}
    path = job(tmp_path, {"architecture": "qwen2", "config": config})
    assert main(["validate", path]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "data.synthetic.seq_len: 16 tokens per sequence, beyond the 8 positions qwen2 " \
           "is trained for (max_position_embeddings; rotary, no rope_scaling)" in err
    assert "rope_type: yarn, factor: 2.0" in err
    scaled = job(tmp_path, {"architecture": "qwen2",
                            "config": {**config, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}}, "scaled.yaml")
    assert main(["validate", scaled]) == 0
    assert "warning" not in capsys.readouterr().err
    learned = job(tmp_path, {"architecture": "gpt2", "config": {"n_positions": 8, "n_embd": 16, "n_layer": 1,
                                                                "n_head": 2, "vocab_size": 512}}, "gpt2.yaml")
    assert main(["validate", learned]) == 2   # a learned table stays refused
    assert "position table has 8" in capsys.readouterr().err
