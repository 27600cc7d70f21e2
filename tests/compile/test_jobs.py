"""Every jobs/*.yaml validates, compiles to a config DeepSpeed accepts, and says what its comments claim.

Also the `jobspec compile` command end to end: printing, --out files, refusals, row counting.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT as REPO
from jobspec.cli import main
from jobspec.rundir import COMPILE_FILES
from jobspec.spec.derived import derive
from jobspec.data.formats import count_rows
from jobspec.compile.compiler import compile_spec, find_auto
from jobspec.spec.model_dims import model_dims
from test_compiler import check_scheduler_constructs, deepspeed_config  # noqa: F401 (fixture)

JOBS = sorted((REPO / "jobs").glob("*.yaml"))
SCHEMA_LINE = "# yaml-language-server: $schema=../schemas/jobspec.schema.json"


def load(job: Path):
    from jobspec.spec.validation import load_and_validate
    return load_and_validate(job)


def compiled(job: Path):
    spec = load(job).spec
    return spec, compile_spec(spec, derive(spec))


def test_there_are_jobs():
    names = {p.name for p in JOBS}
    assert {"quickstart.yaml", "xlmr-large.yaml", "gpt2-xl-12gb.yaml", "bert-large-base.yaml"} <= names
    assert len([n for n in names if n.startswith("bert-large-") and n != "bert-large-base.yaml"]) == 7


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_job_validates_compiles_and_deepspeed_accepts_it(job, deepspeed_config):
    text = job.read_text()
    assert text.splitlines()[0] == SCHEMA_LINE
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith("#")) >= 3, "explain the choices"
    spec, c = compiled(job)
    assert spec["model"]["architecture"]   # no hub; data synthetic or the shipped samples (jobs/data)
    for key in ("train", "eval", "tokenizer", "chat_template"):
        if spec["data"]["synthetic"] is None and spec["data"].get(key):
            assert Path(spec["data"][key]).resolve().is_relative_to(REPO / "jobs" / "data"), key
    assert find_auto(c.ds_config) == []
    # DeepSpeed's batch check counts data-parallel ranks (world / memory.sequence_parallel under Ulysses' mpu)
    config = deepspeed_config(c.ds_config, c.derived.data_parallel_size)
    assert config.train_batch_size == c.derived.global_batch_size
    assert config.gradient_accumulation_steps == c.derived.gradient_accumulation_steps
    check_scheduler_constructs(c.ds_config)


def _summary(job: str) -> dict:
    spec, c = compiled(REPO / "jobs" / job)
    cfg = c.ds_config
    return {"micro": cfg["train_micro_batch_size_per_gpu"], "accumulation": cfg["gradient_accumulation_steps"],
            "global": cfg["train_batch_size"], "fp16": cfg["fp16"]["enabled"], "bf16": cfg["bf16"]["enabled"],
            "stage": cfg["zero_optimization"]["stage"], "world": c.derived.world_size,
            "checkpointing": any(p["name"] == "gradient_checkpointing" for p in c.patches),
            "optimizer": cfg["optimizer"]["type"] if "optimizer" in cfg else
            spec["training"]["optimizer"]["name"],   # built by the ranks from the spec (no patch)
            "steps": c.derived.total_steps, "seq": spec["data"]["synthetic"]["seq_len"]}


# The 7 rows of the HF single-GPU guide (bert-large-uncased, seq 512, 512 samples: 128 steps at batch 4).
BERT_ROWS = [
    ("bert-large-1-vanilla.yaml", 4, 1, False, False, "AdamW"),
    ("bert-large-2-accum.yaml", 1, 4, False, False, "AdamW"),
    ("bert-large-3-accum-ckpt.yaml", 1, 4, True, False, "AdamW"),
    ("bert-large-4-fp16.yaml", 4, 1, False, True, "AdamW"),
    ("bert-large-5-accum-ckpt-fp16.yaml", 1, 4, True, True, "AdamW"),
    ("bert-large-6-adamw8bit.yaml", 4, 1, False, False, "adamw_8bit"),
    ("bert-large-7-all.yaml", 1, 4, True, True, "adamw_8bit"),
]


@pytest.mark.parametrize("job, micro, accumulation, checkpointing, fp16, optimizer", BERT_ROWS)
def test_bert_large_family_reproduces_the_guide(job, micro, accumulation, checkpointing, fp16, optimizer):
    s = _summary(job)
    assert (s["micro"], s["accumulation"], s["global"]) == (micro, accumulation, 4)
    assert (s["checkpointing"], s["fp16"], s["bf16"], s["optimizer"]) == (checkpointing, fp16, False, optimizer)
    assert (s["steps"], s["seq"], s["world"], s["stage"]) == (128, 512, 1, 0)
    dims = model_dims(load(REPO / "jobs" / job).spec)
    assert (dims.hidden_size, dims.num_layers, dims.vocab_size) == (1024, 24, 30522)  # bert-large-uncased


def test_quickstart_is_tiny_and_on_two_ranks():
    s = _summary("quickstart.yaml")
    assert (s["world"], s["stage"], s["fp16"], s["bf16"]) == (2, 0, False, False)
    assert 20 <= s["steps"] <= 40 and s["seq"] == 64
    dims = model_dims(load(REPO / "jobs" / "quickstart.yaml").spec)
    assert dims.hidden_size <= 128 and _parameters("quickstart.yaml") < 1_000_000


def test_xlmr_large_is_the_seed_setting():
    s = _summary("xlmr-large.yaml")
    assert (s["micro"], s["seq"], s["bf16"], s["checkpointing"], s["world"]) == (8, 512, True, True, 1)
    dims = model_dims(load(REPO / "jobs" / "xlmr-large.yaml").spec)
    assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.intermediate_size, dims.vocab_size,
            dims.max_position_embeddings) == (1024, 24, 16, 4096, 250002, 514)
    assert 555e6 < _parameters("xlmr-large.yaml") < 565e6  # XLM-R large: 560M


def test_gpt2_xl_offloads_the_optimizer():
    spec, c = compiled(REPO / "jobs" / "gpt2-xl-12gb.yaml")
    s = _summary("gpt2-xl-12gb.yaml")
    assert (s["bf16"], s["checkpointing"], s["stage"]) == (True, True, 2) and s["accumulation"] > 1
    assert c.ds_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert c.ds_config["zero_optimization"]["reduce_bucket_size"] == 1600 * 1600
    assert 1.5e9 < _parameters("gpt2-xl-12gb.yaml") < 1.6e9


def _parameters(job: str) -> int:
    """The job's parameter count as the planner has it: from its model, built on the meta device."""
    from jobspec.model.planner_trace import ModelTracer
    return ModelTracer(load(REPO / "jobs" / job).spec).inventory().total


# ----------------------------------------------------------------- the `jobspec compile` command

def test_compile_prints_ds_config(capsys):
    assert main(["compile", str(REPO / "jobs" / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["train_batch_size"] == 32


def test_compile_json_and_set(capsys):
    assert main(["compile", str(REPO / "jobs" / "quickstart.yaml"), "--set", "training.micro_batch_size=4",
                 "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ds_config"]["train_batch_size"] == 8 and result["derived"]["world_size"] == 2


def test_compile_out_writes_the_run_files(tmp_path, capsys):
    out = tmp_path / "run"
    job = REPO / "jobs" / "xlmr-large.yaml"
    assert main(["compile", str(job), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(COMPILE_FILES)
    assert (out / "spec.yaml").read_text() == job.read_text()
    launch = json.loads((out / "launch.json").read_text())
    assert launch["derived"]["total_steps"] == 200 and launch["source"] == str(job)
    assert (out / "command.txt").read_text().split()[-2:] == ["--run-dir", str(out)]
    assert json.loads((out / "patches.json").read_text())[1]["name"] == "gradient_checkpointing"
    # a previous compile output may be overwritten; anything else is refused
    assert main(["compile", str(job), "--out", str(out)]) == 0
    (out / "summary.json").write_text("{}")
    capsys.readouterr()
    assert main(["compile", str(job), "--out", str(out)]) == 2
    assert "summary.json" in capsys.readouterr().err


def test_compile_out_lists_lora_in_patches_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["compile", str(REPO / "jobs" / "lora-classification.yaml"), "--out", str(out)]) == 0
    patches = json.loads((out / "patches.json").read_text())
    assert [p["name"] for p in patches] == ["attention_implementation", "lora"]
    assert patches[1]["args"] == {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["query", "value"],
                                  "modules_to_save": ["pre_classifier", "classifier", "score"], "bias": "none",
                                  "use_rslora": False, "use_dora": False, "enable_input_require_grads": False}
    capsys.readouterr()
    assert main(["compile", str(REPO / "jobs" / "lora-classification.yaml")]) == 0
    assert "patch: lora r=8 alpha=16 dropout=0.1" in capsys.readouterr().err


def test_compile_prints_the_optimizer_the_ranks_build(capsys):
    assert main(["compile", str(REPO / "jobs" / "quickstart.yaml"), "--set", "training.optimizer.name=adafactor"]) == 0
    err = capsys.readouterr().err
    assert 'optimizer: name="adafactor" lr=0.003 eps=[1e-30, 0.001]' in err and "(built by jobspec on the ranks)" in err
    assert "client_optimizer" not in err   # no patch: the ranks build it from the resolved spec


def test_compile_bad_spec_exits_2(tmp_path, capsys):
    job = tmp_path / "bad.yaml"
    job.write_text("model: {architecture: bert}\ndata: {synthetic: {}}\ntraining: {max_steps: 1}\n"
                   "deepspeed: {zero_optimization: {reduce_bucket_size: auto}}\n")
    assert main(["compile", str(job)]) == 2
    assert '"auto"' in capsys.readouterr().err


def test_compile_counts_rows_for_epochs(tmp_path, capsys):
    rows = [{"text": f"sample {i}", "label": i % 2} for i in range(37)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = tmp_path / "job.yaml"
    # a local tokenizer: compile loads it as --dry-run does (job/checks), and a hub id needs the network
    job.write_text(f"model: {{architecture: bert}}\ndata: {{train: train.jsonl, tokenizer: {REPO / 'jobs/data/tokenizer'}}}\n"
                   "training: {epochs: 2, micro_batch_size: 8}\n")
    assert main(["compile", str(job), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["derived"]["total_steps"] == 2 * 4  # 37 // 8 full micro-batches per epoch


def test_count_rows(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n\n{"text": "y"}\n')
    assert count_rows(tmp_path / "a.jsonl") == 2
    with (tmp_path / "b.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerows([["text", "label"], ["multi\nline", 1], ["plain", 0], ["third", 1]])
    assert count_rows(tmp_path / "b.csv") == 3
    assert count_rows(tmp_path / "b.csv", "csv") == 3
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a"] * 11, "label": [0] * 11}), tmp_path / "c.parquet")
    assert count_rows(tmp_path / "c.parquet") == 11


def test_compile_does_not_import_torch():
    code = ("import sys; from jobspec.cli import main; rc = main(['compile', 'jobs/gpt2-xl-12gb.yaml']); "
            "assert rc == 0; heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
