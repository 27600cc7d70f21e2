"""The real loading path: a local tokenizer, a local checkpoint and data files named in the spec.

The test builds everything a researcher would bring, offline: a WordPiece tokenizer trained with
`tokenizers` on the fixture reviews (tests/assets/text/), wrapped as `PreTrainedTokenizerFast`; a
tiny BERT saved with `save_pretrained`; the reviews split into train/eval files as jsonl, csv and
parquet. The spec names all of them by paths relative to the spec file. One real launch (parquet
train, jsonl eval); csv goes through `jobspec compile` and the data module directly, and the three
formats must give the same tensors.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
import yaml

from jobspec.cli import main
from test_matrix import launch

TEXT_DIR = Path(__file__).parent / "assets" / "text"
NUM_EVAL = 8
MICRO, WORLD, EPOCHS = 4, 2, 2
MAX_LENGTH = 24


def read_reviews() -> list[dict]:
    with (TEXT_DIR / "reviews.tsv").open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    wrapped.save_pretrained(out)


def save_tiny_bert(vocab_size: int, out: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    # a "pretrained" masked-LM checkpoint: the launch puts a fresh classification head on it
    BertForMaskedLM(config).save_pretrained(out)


def write_data(rows: list[dict], stem: Path) -> None:
    """rows as stem.jsonl, stem.csv and stem.parquet"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with stem.with_suffix(".jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with stem.with_suffix(".csv").open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), stem.with_suffix(".parquet"))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict:
    """A job directory with tokenizer/, model/, data/{train,eval}.{jsonl,csv,parquet} and job.yaml."""
    root = tmp_path_factory.mktemp("loading")
    job_dir = root / "job"
    (job_dir / "data").mkdir(parents=True)
    reviews = [{"text": r["text"], "label": r["label"]} for r in read_reviews()]
    train_rows, eval_rows = reviews[:-NUM_EVAL], reviews[-NUM_EVAL:]
    train_tokenizer([r["text"] for r in reviews], job_dir / "tokenizer")
    from transformers import AutoTokenizer
    vocab_size = len(AutoTokenizer.from_pretrained(job_dir / "tokenizer"))
    save_tiny_bert(vocab_size, job_dir / "model")
    write_data(train_rows, job_dir / "data" / "train")
    write_data(eval_rows, job_dir / "data" / "eval")
    spec = {
        "name": "loading-path",
        "output_dir": "out",
        "model": {"name_or_path": "model", "task": "sequence-classification", "num_labels": 2},
        "data": {"train": "data/train.parquet", "eval": "data/eval.jsonl", "tokenizer": "tokenizer",
                 "text_fields": ["text"], "label_field": "label", "max_length": MAX_LENGTH,
                 "num_workers": 0, "pin_memory": False},
        "training": {"epochs": EPOCHS, "micro_batch_size": MICRO, "optimizer": {"lr": 1e-3},
                     "eval_every": 4},
        "checkpoint": {"save_final": False},
        "export": {"best_eval": True, "best_metric": "accuracy"},
        "resources": {"gpus_per_node": WORLD},
        "logging": {"every_n_steps": 2, "progress": "lines",
                    "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "loading"}},
    }
    (job_dir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return {"root": root, "job_dir": job_dir, "job": job_dir / "job.yaml", "train_rows": train_rows,
            "eval_rows": eval_rows, "vocab_size": vocab_size}


def expected_steps(num_rows: int) -> int:
    steps_per_epoch = math.ceil(num_rows / (MICRO * WORLD))
    return EPOCHS * steps_per_epoch


def test_compile_counts_csv_rows_and_resolves_paths_against_the_spec(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths must be resolved against the spec file, not the cwd
    job_dir = project["job_dir"]
    out = tmp_path / "compiled"
    csv_job = job_dir / "job-csv.yaml"  # a sibling spec: its relative paths are its own directory's too
    csv_job.write_text(yaml.safe_dump({"extends": "job.yaml", "data": {"train": "data/train.csv"}}))
    assert main(["compile", str(csv_job), "--out", str(out)]) == 0
    launch = json.loads((out / "launch.json").read_text())
    assert launch["derived"]["total_steps"] == expected_steps(len(project["train_rows"]))
    resolved = yaml.safe_load((out / "resolved.yaml").read_text())
    assert resolved["data"]["train"] == str(job_dir / "data" / "train.csv")
    assert resolved["data"]["tokenizer"] == str(job_dir / "tokenizer")
    assert resolved["model"]["name_or_path"] == str(job_dir / "model")


def test_jsonl_csv_and_parquet_give_the_same_tensors(project):
    import torch

    from jobspec.data.loaders import build_datasets
    from jobspec.model.build import build_tokenizer
    from jobspec.spec.validation import load_and_validate

    built = {}
    for fmt in ("jsonl", "csv", "parquet"):
        data = project["job_dir"] / "data"  # --set paths are relative to the cwd: give absolute ones
        spec = load_and_validate(project["job"], [f"data.train={data / f'train.{fmt}'}",
                                                  f"data.eval={data / f'eval.{fmt}'}"]).spec
        tokenizer = build_tokenizer(spec)
        built[fmt] = build_datasets(spec, tokenizer)
    train, evaluation = built["jsonl"]
    assert (len(train), len(evaluation)) == (len(project["train_rows"]), len(project["eval_rows"]))
    first, text = train[0], project["train_rows"][0]["text"]
    expected = tokenizer(text, truncation=True, max_length=MAX_LENGTH, padding="max_length")
    assert first["input_ids"].tolist() == expected["input_ids"] and first["input_ids"][0] == tokenizer.cls_token_id
    assert first["attention_mask"].tolist() == expected["attention_mask"]
    assert tokenizer.decode(first["input_ids"], skip_special_tokens=True).startswith(" ".join(text.lower().split()[:3]))
    # string labels are numbered in sorted order: negative 0, positive 1
    labels = [int(train[i]["labels"]) for i in range(len(train))]
    assert labels == [int(r["label"] == "positive") for r in project["train_rows"]]
    for fmt in ("csv", "parquet"):
        for split in (0, 1):
            for name, column in built["jsonl"][split].columns.items():
                assert torch.equal(column, built[fmt][split].columns[name]), (fmt, split, name)


@pytest.mark.slow
def test_launch_trains_a_local_checkpoint_on_parquet_with_jsonl_eval(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # everything is local: a hub lookup would be a bug
    proc = launch(project["job"], elsewhere, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = list((project["job_dir"] / "out").glob("run-*"))  # output_dir is relative to the spec
    assert len(runs) == 1, runs
    run_dir = runs[0]

    total = expected_steps(len(project["train_rows"]))
    derived = json.loads((run_dir / "launch.json").read_text())["derived"]
    assert derived["total_steps"] == total
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["samples"]) == ("finished", total, total * MICRO * WORLD)
    assert summary["eval_loss"] is not None and math.isfinite(summary["eval_loss"])

    from jobspec.tracking import run as tracking
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = tracking.client_for(info["tracking_uri"])
    assert client.get_run(info["run_id"]).info.status == "FINISHED"
    eval_steps = [m.step for m in client.get_metric_history(info["run_id"], "eval/loss")]
    assert eval_steps == list(range(4, total + 1, 4))  # eval_every 4, and at the end
    assert all(m.value > 0 for m in client.get_metric_history(info["run_id"], "perf/samples_per_s"))

    # task metrics at every evaluation, reduced over both ranks: the eval rows split 4 + 4
    accuracy = sorted((m.step, m.value) for m in client.get_metric_history(info["run_id"], "eval/accuracy"))
    assert [step for step, _ in accuracy] == eval_steps
    assert all(value in (k / NUM_EVAL for k in range(NUM_EVAL + 1)) for _, value in accuracy)
    f1 = client.get_metric_history(info["run_id"], "eval/f1")
    assert len(f1) == len(eval_steps) and all(0 <= m.value <= 1 for m in f1)
    assert summary["eval_metrics"]["eval/accuracy"] == accuracy[-1][1]
    # best_metric: accuracy -- the model of the first evaluation with the highest accuracy
    best = json.loads((run_dir / "model" / "best" / "jobspec_export.json").read_text())
    top = max(value for _, value in accuracy)
    assert best["step"] == next(step for step, value in accuracy if value == top)
    assert best["metrics"]["eval/accuracy"] == top

    # the string labels' names in the exported config: a pipeline answers with them
    final = run_dir / "model" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["label2id"] == {"negative": 0, "positive": 1}
    from transformers import pipeline
    answers = pipeline("text-classification", model=str(final))(["the soup was cold", "fresh pasta"])
    assert {a["label"] for a in answers} <= {"negative", "positive"}
