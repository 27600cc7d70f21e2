"""The compiler is the one writer of DeepSpeed's batch keys: compile_spec, and the ranks through
`rebatched` (train/oom) and `with_universal_load` (checkpoint/reshard), never by hand."""
from __future__ import annotations

from pathlib import Path

from jobspec.compile.compiler import BATCH_KEYS, batch_block, compile_spec, rebatched, with_universal_load
from jobspec.spec.derived import derive
from jobspec.spec.schema import fill_defaults

SPEC = fill_defaults({"model": {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                                  "num_attention_heads": 4, "vocab_size": 1000}},
                      "data": {"synthetic": {"num_samples": 100}},
                      "training": {"max_steps": 10, "micro_batch_size": 4, "global_batch_size": 32},
                      "resources": {"gpus_per_node": 2}})


def test_compile_spec_writes_the_batch_block_of_the_derived_job():
    job = derive(SPEC)
    ds_config = compile_spec(SPEC, job).ds_config
    assert {k: ds_config[k] for k in BATCH_KEYS} == batch_block(32, 4, 4) == {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    assert tuple(batch_block(1, 1, 1)) == BATCH_KEYS


def test_rebatched_keeps_the_global_batch_and_the_original():
    ds_config = compile_spec(SPEC, derive(SPEC)).ds_config
    halved = rebatched(ds_config, 2, 8)
    assert {k: halved[k] for k in BATCH_KEYS} == batch_block(32, 2, 8)
    assert {k: v for k, v in halved.items() if k not in BATCH_KEYS} == \
        {k: v for k, v in ds_config.items() if k not in BATCH_KEYS}
    assert ds_config["train_micro_batch_size_per_gpu"] == 4
    halved["zero_optimization"]["stage"] = 99
    assert ds_config["zero_optimization"]["stage"] != 99   # a deep copy


def test_with_universal_load():
    ds_config = {"train_batch_size": 8, "checkpoint": {"tag_validation": "Warn"}}
    assert with_universal_load(ds_config) == {"train_batch_size": 8, "checkpoint": {"tag_validation": "Warn",
                                                                                     "load_universal": True}}
    assert ds_config == {"train_batch_size": 8, "checkpoint": {"tag_validation": "Warn"}}


def test_the_ranks_write_no_deepspeed_batch_key_by_hand():
    """No dict literal and no item assignment of a batch key (or load_universal) under jobspec/train/."""
    import ast
    keys = set(BATCH_KEYS) | {"load_universal"}
    train = Path(__file__).resolve().parents[2] / "jobspec" / "train"
    written = []
    for path in sorted(train.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                written += [(path.name, k.value) for k in node.keys if isinstance(k, ast.Constant) and k.value in keys]
            targets = node.targets if isinstance(node, ast.Assign) else []
            written += [(path.name, t.slice.value) for t in targets if isinstance(t, ast.Subscript)
                        and isinstance(t.slice, ast.Constant) and t.slice.value in keys]
    assert written == []
