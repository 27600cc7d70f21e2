"""What an export writes, file by file: a LoRA adapter directory carries the job's tokenizer (it
loads with `AutoTokenizer.from_pretrained`, its chat template the one training rendered with), and
every file's mode is what the umask gives a plain file (safetensors' private temporary files made
the weights 0600). `jobspec export --out` keeping everything inside DIR is held by the real export
of tests/test_quiet_commands.py (slow: it needs a checkpoint)."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import REPO_ROOT

from jobspec.spec.schema import fill_defaults

TOKENIZER = REPO_ROOT / "jobs" / "data" / "tokenizer"
QWEN = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 2048,
        "max_position_embeddings": 64}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


@pytest.fixture
def lora_job(tmp_path):
    from transformers import AutoTokenizer

    from jobspec.model.build import build_model
    from jobspec.model.lora import apply_lora
    (tmp_path / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    model = {"architecture": "qwen2", "task": "causal-lm", "config": QWEN, "lora": {"r": 2}}
    data = {"train": str(tmp_path / "train.jsonl"), "tokenizer": str(TOKENIZER),
            "chat_template": str(tmp_path / "template.jinja")}
    spec = fill_defaults({"name": "files", "model": model, "data": data,
                          "training": {"max_steps": 1}})
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    base = build_model({**spec, "model": {**spec["model"], "lora": None}}, tokenizer)
    return spec, apply_lora(base, spec).eval(), tokenizer


@pytest.fixture
def umask_027():
    before = os.umask(0o027)
    yield 0o640
    os.umask(before)


def modes(directory) -> dict[str, int]:
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode)
            for p in directory.rglob("*") if p.is_file()}


def test_the_adapter_directory_loads_with_the_jobs_tokenizer(tmp_path, lora_job):
    from transformers import AutoTokenizer

    from jobspec.export.lora import write_adapter_dir
    spec, peft_model, tokenizer = lora_job
    out = tmp_path / "final-adapter"
    info = {"name": "final", "step": 1, "dtype": "fp32"}
    write_adapter_dir(out, spec, peft_model, info, tokenizer=tokenizer)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.chat_template == TEMPLATE   # the job's data.chat_template, as training rendered
    assert (out / "adapter_config.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()


def test_every_exported_file_follows_the_umask(tmp_path, lora_job, umask_027):
    from jobspec.export.hf_dir import ExportInfo, umask, write_model_dir
    from jobspec.export.lora import merged_state_dict, write_adapter_dir
    spec, peft_model, tokenizer = lora_job
    assert umask() == 0o027   # read without changing it
    write_adapter_dir(tmp_path / "adapter", spec, peft_model,
                      {"name": "a", "step": 1, "dtype": "fp32"}, tokenizer=tokenizer)
    info = ExportInfo("m", 1, "fp32", "test", {}, [])
    write_model_dir(tmp_path / "merged", spec, merged_state_dict(peft_model), info,
                    tokenizer=tokenizer)
    for directory in (tmp_path / "adapter", tmp_path / "merged"):
        found = modes(directory)
        assert any(name.endswith(".safetensors") for name in found), found
        assert set(found.values()) == {umask_027}, found   # safetensors' 0600 among them before
