"""`memory.sequence_parallel`'s rules (jobspec/techniques/sequence_parallel.py, spec/derived.py): what
Ulysses cannot wrap is refused at its field with a rule code, exit 2; the derived job counts world / N
data-parallel ranks; the compiled config tells DeepSpeed N."""
from __future__ import annotations

import pytest
import yaml
from conftest import REPO_ROOT
from spec_builder import BARE, build_spec, validate_errors

from jobspec.cli import main
from jobspec.compile.compiler import compile_spec
from jobspec.spec.derived import derive

TOKENIZER = REPO_ROOT / "jobs" / "data" / "tokenizer"
TINY_LLAMA = {"architecture": "llama", "task": "causal-lm",
              "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}}


def write(tmp_path, *, model=None, data=None, memory=None, gpus: int = 4) -> str:
    raw = {"model": model or TINY_LLAMA,
           "data": data or {"synthetic": {"num_samples": 64, "seq_len": 64}},
           "training": {"max_steps": 2, "micro_batch_size": 1},
           "memory": {"sequence_parallel": 2, **(memory or {})},
           "resources": {"gpus_per_node": gpus}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def errors(capsys, job: str, *overrides: str) -> dict[str, list[str]]:
    """{dotted path: the rule codes there} of every problem validate reports (exit 2), {} when it
    accepts."""
    return {path: [e["code"] for e in found]
            for path, found in validate_errors(capsys, job, *overrides).items()}


def test_a_job_ulysses_can_wrap_is_accepted(tmp_path, capsys):
    job = write(tmp_path)
    assert errors(capsys, job) == {}
    for n in ("4", "1"):
        assert errors(capsys, job, f"memory.sequence_parallel={n}") == {}
    # fewer key/value heads than ranks: DeepSpeed replicates each over N / kv ranks
    assert errors(capsys, write(tmp_path, gpus=8), "memory.sequence_parallel=8") == {}


@pytest.mark.parametrize("overrides, path, code", [
    (["resources.gpus_per_node=3"], "memory.sequence_parallel", "sequence-parallel-world"),
    (["memory.sequence_parallel=3"], "memory.sequence_parallel", "sequence-parallel-world"),
    (["model.config.num_attention_heads=6", "memory.sequence_parallel=4"], "memory.sequence_parallel",
     "sequence-parallel-heads"),
    (["data.synthetic.seq_len=63"], "data.synthetic.seq_len", "sequence-parallel-seq-len"),
    (["model.attention=eager"], "model.attention", "sequence-parallel-attention"),
    (["model.compile=true"], "model.compile", "sequence-parallel-compile"),
])
def test_what_ulysses_cannot_split_is_refused_at_its_field(tmp_path, capsys, overrides, path, code):
    assert code in errors(capsys, write(tmp_path), *overrides).get(path, [])


def test_key_value_heads_neither_dividing_nor_divided_are_refused(tmp_path, capsys):
    model = {**TINY_LLAMA, "config": {**TINY_LLAMA["config"], "num_attention_heads": 12, "num_key_value_heads": 3}}
    assert errors(capsys, write(tmp_path, model=model, gpus=4), "memory.sequence_parallel=4") == {
        "memory.sequence_parallel": ["sequence-parallel-kv-heads"]}


def test_other_tasks_and_families_are_refused(tmp_path, capsys):
    bert = {"architecture": "bert", "task": "masked-lm",
            "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 300}}
    assert errors(capsys, write(tmp_path, model=bert)) == {
        "memory.sequence_parallel": ["sequence-parallel-task", "sequence-parallel-model"]}
    text_job = write(tmp_path, data={"train": str(REPO_ROOT / "jobs" / "data" / "corpus-sample.txt"),
                                     "tokenizer": str(TOKENIZER), "max_length": 63, "packing": True})
    found = errors(capsys, text_job)
    assert "sequence-parallel-packing" in found["data.packing"]
    assert found["data.max_length"] == ["sequence-parallel-seq-len"]


def test_the_messages_say_why_and_how(tmp_path, capsys):
    job = write(tmp_path)
    assert main(["validate", job, "--set", "model.attention=eager", "--set", "model.config.num_attention_heads=6",
                 "--set", "memory.sequence_parallel=4"]) == 2
    err = capsys.readouterr().err
    assert "cannot wrap eager attention" in err and "model.attention: sdpa" in err
    assert "does not divide the model's 6 attention heads" in err and "1, 2, 3, 6" in err


def _spec(**memory) -> dict:
    return build_spec(base=BARE, model=TINY_LLAMA, data={"synthetic": {"num_samples": 64, "seq_len": 64}},
                      training={"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 8},
                      memory=memory, resources={"gpus_per_node": 4})


def test_the_data_parallel_world_is_the_world_over_n():
    plain, sp = derive(_spec()), derive(_spec(sequence_parallel=2))
    assert (plain.data_parallel_size, plain.gradient_accumulation_steps) == (4, 1)
    assert (sp.world_size, sp.sequence_parallel, sp.data_parallel_size) == (4, 2, 2)
    assert sp.gradient_accumulation_steps == 2        # 8 = micro 2 x 2 data-parallel ranks x 2
    assert sp.global_batch_size == plain.global_batch_size
    config = compile_spec(_spec(sequence_parallel=2), sp).ds_config
    assert config["sequence_parallel_size"] == 2
    # DeepSpeed's own check: train_batch_size = micro x accumulation x (world / N)
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * \
        config["gradient_accumulation_steps"] * sp.data_parallel_size
    assert "sequence_parallel_size" not in compile_spec(_spec(), plain).ds_config


def test_epochs_count_the_data_parallel_ranks_only():
    spec = _spec(sequence_parallel=4)
    spec["training"].update(max_steps=None, epochs=1, global_batch_size=None)
    job = derive(spec)   # 64 samples over 1 data-parallel rank, micro 2: 32 steps (4 ranks without SP: 8)
    assert (job.data_parallel_size, job.total_steps) == (1, 32)
