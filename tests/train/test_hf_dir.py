"""Hugging Face model directories (jobspec/export/hf_dir.py) and `jobspec export` on checkpoints made here,
in process: no ranks. The ranks' side (ZeRO-2/3 gathers, DeepSpeed's converter) is in test_export.py."""
from __future__ import annotations

from conftest import PROFILER

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.memory.planner import export_bytes
from jobspec.spec.derived import derive
from jobspec.export.rules import resolve_dtype
from jobspec.spec.schema import fill_defaults
from jobspec.export.hf_dir import INJECT_ERROR_ENV, ExportFailed, ExportInfo, write_model_dir
from jobspec.model.build import build_model

BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 300, "max_position_embeddings": 64}
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 300, "n_positions": 64}
SECRET = "hf_planted_secret_1234"


def make_spec(tmp_path: Path, model: dict, data: dict | None = None, **sections) -> dict:
    spec = fill_defaults({"name": "unit", "model": model, "training": {"max_steps": 1},
                          "data": data or {"synthetic": {"vocab_range": [5, 300], "seq_len": 16}}, **sections})
    spec["output_dir"] = str(tmp_path / "out")
    spec["checkpoint"]["dir"] = str(tmp_path / "out" / "checkpoints")
    return spec


def info(name="final", dtype="fp32", step=3) -> ExportInfo:
    return ExportInfo(name=name, step=step, dtype=dtype, source="a unit test", metrics={"train/loss": 0.5},
                      notes=[])


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


@pytest.mark.parametrize("arch, config, task, auto", [
    ("bert", BERT, "token-classification", "AutoModelForTokenClassification"),
    ("xlm-roberta", BERT, "masked-lm", "AutoModelForMaskedLM"),       # decoder tied to the embeddings
    ("gpt2", GPT2, "causal-lm", "AutoModelForCausalLM"),               # lm_head tied to wte
    ("gpt2", GPT2, "sequence-classification", "AutoModelForSequenceClassification"),
])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip_reproduces_the_model(tmp_path, arch, config, task, auto, dtype):
    import transformers
    spec = make_spec(tmp_path, {"architecture": arch, "config": config, "task": task, "num_labels": 3})
    model = build_model(spec)
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = logits_of(model.to(torch.bfloat16) if dtype == "bf16" else model, ids)
    record = write_model_dir(tmp_path / "m", spec, dict(model.state_dict()), info(dtype=dtype))
    loaded = getattr(transformers, auto).from_pretrained(tmp_path / "m")
    assert loaded.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    got = logits_of(loaded, ids)
    # the same weights in the same dtype through the same code, in the same process (same kernels,
    # same threads, so the same summation order): equal, bit for bit
    assert torch.equal(got, expected), (got - expected).abs().max()
    if hasattr(loaded, "get_output_embeddings") and loaded.get_output_embeddings() is not None \
            and loaded.config.tie_word_embeddings:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert record["bytes"] > 0 and record["path"] == str(tmp_path / "m")
    # the launch's disk pre-flight counts exactly the tensor bytes safetensors writes
    weights = tmp_path / "m" / "model.safetensors"
    header = int.from_bytes(weights.read_bytes()[:8], "little")
    spec["export"]["dtype"] = dtype
    assert export_bytes(spec, derive(spec, profiler=PROFILER)) == weights.stat().st_size - 8 - header
    generation = ["generation_config.json"] if task == "causal-lm" else []
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == \
        sorted(["README.md", "config.json", "jobspec_export.json", "model.safetensors", *generation])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.")]   # no temp or old copy left


def test_mlp_directory_loads_with_safetensors(tmp_path):
    from safetensors.torch import load_model

    from jobspec.model.mlp import MLPClassifier, MLPConfig
    spec = make_spec(tmp_path, {"architecture": "mlp", "config": {"hidden_size": 16, "num_layers": 2,
                                                                   "vocab_size": 300}})
    model = build_model(spec)
    write_model_dir(tmp_path / "m", spec, dict(model.state_dict()), info())
    again = MLPClassifier(MLPConfig(**json.loads((tmp_path / "m" / "config.json").read_text())))
    load_model(again, str(tmp_path / "m" / "model.safetensors"))
    ids = torch.randint(5, 300, (2, 16))
    assert torch.equal(logits_of(model, ids), logits_of(again, ids))


def test_tokenizer_and_model_card(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "cat": 2, "mat": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text('{"text": "cat mat", "label": 1}\n')
    monkeypatch.setenv("HF_TOKEN", SECRET)
    spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT},
                     {"train": str(tmp_path / "train.jsonl"), "tokenizer": str(tmp_path / "tok")},
                     logging={"mlflow": {"tags": {"token": SECRET}}}, description="a card test")
    from jobspec.export.hf_dir import job_tokenizer
    tokenizer, note = job_tokenizer(spec)
    write_model_dir(tmp_path / "m", spec, dict(build_model(spec, tokenizer).state_dict()), info(),
                    tokenizer=tokenizer)
    again = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert again("cat mat dog")["input_ids"] == tokenizer("cat mat dog")["input_ids"] and note is None
    card = (tmp_path / "m" / "README.md").read_text()
    assert SECRET not in card
    assert "token: '***'" in card
    assert "AutoModelForSequenceClassification.from_pretrained" in card and "AutoTokenizer" in card
    assert "| train/loss | 0.5 |" in card and "a card test" in card and "step 3" in card
    assert yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])["model"]["architecture"] == "bert"


def test_weights_of_another_model_are_a_spec_error(tmp_path):
    spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT})
    other = make_spec(tmp_path, {"architecture": "bert", "config": {**BERT, "num_hidden_layers": 3}})
    with pytest.raises(SpecError) as caught:
        write_model_dir(tmp_path / "m", spec, dict(build_model(other).state_dict()), info())
    assert "do not fit the model of job 'unit'" in caught.value.issues[0].message
    assert "encoder.layer.2" in caught.value.issues[0].message and not (tmp_path / "m").exists()


def test_a_failed_write_keeps_the_previous_directory_and_no_partial_one(tmp_path, monkeypatch):
    spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT})
    state = build_model(spec).state_dict()
    write_model_dir(tmp_path / "m", spec, dict(state), info(step=1))
    monkeypatch.setenv(INJECT_ERROR_ENV, "final:ENOSPC")
    with pytest.raises(ExportFailed) as caught:
        write_model_dir(tmp_path / "m", spec, dict(state), info(step=2))
    assert str(caught.value) == f"cannot write the model directory {tmp_path / 'm'}: No space left on device"
    assert json.loads((tmp_path / "m" / "jobspec_export.json").read_text())["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    write_model_dir(tmp_path / "best", spec, dict(state), info(name="best"))   # another name: not injected
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportFailed) as caught:
        write_model_dir(tmp_path / "file" / "m", spec, dict(state), info(name="other"))
    assert str(caught.value) == f"cannot write the model directory {tmp_path / 'file' / 'm'}: " \
                                f"{tmp_path / 'file'} is a file, not a directory"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_really_full_disk(tmp_path):
    """A 64 KiB tmpfs: safetensors' own write fails with ENOSPC (its error type, not an OSError)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT})
        with pytest.raises(ExportFailed) as caught:
            write_model_dir(disk / "m", spec, dict(build_model(spec).state_dict()), info())
        assert str(caught.value).startswith(f"cannot write the model directory {disk / 'm'}: ")
        assert "No space left on device" in str(caught.value) and list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)])


def test_resolve_dtype():
    spec = {"memory": {"precision": "bf16"}, "export": {"dtype": "auto"}}
    assert resolve_dtype(spec) == "bf16" and resolve_dtype(spec, "fp32") == "fp32"
    assert resolve_dtype({"memory": {"precision": "fp32"}, "export": {"dtype": "fp16"}}) == "fp16"


# --- `jobspec export` on a ZeRO-0 checkpoint written here (DeepSpeed's layout: module in mp_rank_00) ----

@pytest.fixture
def zero0_checkpoint(tmp_path):
    spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT, "task": "token-classification"})
    model = build_model(spec)
    tag_dir = Path(spec["checkpoint"]["dir"]) / "step4"
    tag_dir.mkdir(parents=True)
    torch.save({"module": model.state_dict(), "step": 4, "zero_stage": 0}, tag_dir / "mp_rank_00_model_states.pt")
    (tag_dir / "jobspec_resolved.yaml").write_text(yaml.safe_dump(spec))
    (tag_dir.parent / "latest").write_text("step4")
    return spec, model, tag_dir


def test_export_cli_converts_a_checkpoint(zero0_checkpoint, tmp_path, capsys):
    from transformers import AutoModelForTokenClassification
    spec, model, tag_dir = zero0_checkpoint
    ids = torch.randint(5, 300, (2, 16))
    expected = logits_of(model, ids)
    assert main(["export", str(tag_dir.parent), "--out", str(tmp_path / "m"), "--dtype", "bf16"]) == 0
    assert "step 4" in capsys.readouterr().out
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "m")
    assert loaded.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits (2**-9 relative rounding per weight and activation): the logits
    # agree with fp32's to a few units of 2**-8 of their scale (as tests/train/test_export.py bounds it)
    scale = max(1.0, expected.abs().max().item())
    assert (logits_of(loaded, ids).float() - expected).abs().max().item() <= 2 ** -6 * scale
    # a non-empty DIR needs --force; then it is replaced
    assert main(["export", str(tag_dir), "--out", str(tmp_path / "m")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", str(tag_dir), "--out", str(tmp_path / "m"), "--force", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["dtype"], record["step"]) == ("fp32", 4)
    # fp32: the checkpoint's weights copied, the same code in the same process: bit for bit
    assert torch.equal(logits_of(AutoModelForTokenClassification.from_pretrained(tmp_path / "m"), ids), expected)


@pytest.mark.parametrize("case, phrase", [
    ("missing", "does not exist"),
    ("not_checkpoint", "is not a run directory, a checkpoint directory or a checkpoint"),
    ("inside", "contains the checkpoint"),
    ("truncated", "is incomplete"),
    ("no_spec", "cannot find the job spec"),
    ("system", "is a system location"),
])
def test_export_cli_bad_input_exit_2(zero0_checkpoint, tmp_path, capsys, case, phrase):
    _, _, tag_dir = zero0_checkpoint
    source, out = str(tag_dir), str(tmp_path / "m")
    if case == "missing":
        source = str(tmp_path / "nowhere")
    elif case == "not_checkpoint":
        source = str(tmp_path)
    elif case == "inside":
        out = str(tag_dir.parent)
    elif case == "truncated":
        from jobspec.checkpoint.save_load import write_manifest
        write_manifest(tag_dir.parent, "step4")
        with open(tag_dir / "mp_rank_00_model_states.pt", "r+b") as fh:
            fh.truncate(100)
    elif case == "no_spec":
        (tag_dir / "jobspec_resolved.yaml").unlink()
    elif case == "system":
        out = "/etc/jobspec-model"
    assert main(["export", source, "--out", out]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err


def test_export_help_lists_the_command():
    out = subprocess.run([sys.executable, "-m", "jobspec", "--help"], capture_output=True, text=True).stdout
    assert "export" in out


def word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, "ada": 2, "met": 3, "bob": 4, "in": 5, "paris": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(path)


@pytest.mark.parametrize("task, rows, names", [
    ("sequence-classification", [{"text": "ada met bob", "label": "positive"},
                                 {"text": "bob in paris", "label": "negative"}], ["negative", "positive"]),
    ("token-classification", [{"words": ["ada", "met", "bob"], "tags": ["B-PER", "O", "B-PER"]},
                              {"words": ["in", "paris"], "tags": ["O", "B-LOC"]}], ["B-LOC", "B-PER", "O"]),
])
def test_string_labels_become_the_exported_configs_label_names(tmp_path, task, rows, names):
    """The data's names (numbered in sorted order) reach config.json: transformers' pipeline answers
    with them, not LABEL_<id>."""
    from transformers import pipeline

    from jobspec.model.build import build_tokenizer
    from jobspec.data.loaders import build_datasets
    word_tokenizer(tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"train": str(tmp_path / "train.jsonl"), "tokenizer": str(tmp_path / "tok"), "max_length": 8}
    if task == "token-classification":
        data.update(text_fields=["words"], label_field="tags")
    spec = make_spec(tmp_path, {"architecture": "bert", "config": BERT, "task": task, "num_labels": len(names)},
                     data)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    assert train.label_names == {name: i for i, name in enumerate(names)}
    write_model_dir(tmp_path / "m", spec, dict(build_model(spec, tokenizer).state_dict()), info(),
                    tokenizer=tokenizer, label_names=train.label_names)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["id2label"] == {str(i): name for i, name in enumerate(names)}
    assert config["label2id"] == {name: i for i, name in enumerate(names)}
    kind = "text-classification" if task == "sequence-classification" else "token-classification"
    answers = pipeline(kind, model=str(tmp_path / "m"))("ada met bob")
    found = {a["label"] for a in answers} if kind == "text-classification" else {a["entity"] for a in answers}
    assert found and found <= set(names)


def test_checkpoint_label_names_round_trip(tmp_path):
    from jobspec.export.exporter import read_label_names, write_label_names
    assert read_label_names(tmp_path) is None   # integer labels, or a checkpoint of an older jobspec
    write_label_names(tmp_path, {"negative": 0, "positive": 1})
    assert read_label_names(tmp_path) == {"negative": 0, "positive": 1}
