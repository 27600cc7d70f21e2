"""jobs/llama-instruct-packing.yaml launched on a CPU rank, shrunk with `--set`s to a tiny Llama (issue 24
item 8): the prompt/completion records go through the chat template with the loss on the completions,
packed, and training ends with a finite loss."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT

JOB = REPO_ROOT / "jobs" / "llama-instruct-packing.yaml"
DATA = REPO_ROOT / "jobs" / "data" / "instruct-sample.jsonl"
TINY = ["model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, max_position_embeddings: 256, vocab_size: 2048, tie_word_embeddings: true}",
        "memory.precision=fp32", "data.max_length=256", "training.max_steps=4", "training.micro_batch_size=2",
        "training.global_batch_size=4", "logging.every_n_steps=1", "logging.mlflow.enabled=false",
        "logging.progress=lines", "checkpoint.save_final=false", "export.final=false"]


@pytest.mark.slow
def test_the_instruction_job_trains_packed_with_the_loss_on_the_completions(tmp_path):
    sets = [*TINY, f"output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(JOB),
                           *[x for s in sets for x in ("--set", s)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = next((tmp_path / "out").glob("run-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("finished", 4)
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    # the ranks packed the 300 records (their note, in launcher.log) ...
    log = (run_dir / "launcher.log").read_text(errors="replace")
    assert "packing: 300 samples in " in log and "rows of at most 256 tokens" in log
    assert "Traceback" not in proc.stderr
    # the records were tokenised once, by the launcher before the ranks (one cache entry, its counts in
    # the launch's output and summary.json), and the ranks mapped that entry
    assert "jobspec: tokenised data.train: 300 records in " in proc.stdout
    assert "jobspec: data.train: 300 prompt/completion records -> 300 samples, " in proc.stdout
    entries = [p for p in (Path(os.environ["JOBSPEC_CACHE_DIR"]) / "data").iterdir() if not p.name.startswith(".")]
    built = [p for p in entries if json.loads((p / "meta.json").read_text())["source"] == str(DATA)]
    assert len(built) == 1 and summary["data"]["data.train.records"] == 300
    assert summary["data"]["data.train.tokens"] == json.loads((built[0] / "meta.json").read_text())["tokens"]

    # ... built from the records as the ranks build them from the run's spec: through the tokenizer's
    # chat template, labels -100 on the prompt and its headers, the completion's tokens trained on
    from jobspec.model.build import build_tokenizer
    from jobspec.rundir import read_run_files
    from jobspec.data.loaders import build_datasets
    from jobspec.tasks.base import IGNORE_INDEX
    from jobspec.data.sample_packing import pack_datasets

    spec = read_run_files(run_dir).spec
    assert (spec["data"]["records"], spec["data"]["loss_on"], spec["data"]["packing"]) == \
        ("prompt_completion", "answers", True)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    assert train.cached.path == built[0]   # the launch's entry, found again by its key
    first = json.loads(DATA.read_text().splitlines()[0])
    sample = train[0]
    real = sample["attention_mask"].bool()
    ids, labels = sample["input_ids"][real], sample["labels"][real]
    trained = labels != IGNORE_INDEX
    assert 0 < int(trained.sum()) < len(ids)
    assert torch.equal(labels[trained], ids[trained])
    answer = tokenizer.decode(ids[trained])
    assert first["completion"].strip() in answer and first["prompt"].strip() not in answer
    assert tokenizer.decode(ids[~trained]).count(first["prompt"].strip()) == 1
    packed, _ = pack_datasets(spec, train, None)
    assert packed.packing.samples == 300 and f"packing: 300 samples in {packed.packing.rows} rows" in log
