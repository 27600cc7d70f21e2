"""`memory.sequence_parallel: 2` on 2 CPU ranks (gloo's all-to-all) trains to the losses of 1 rank without
it: same data, same global batch, step by step, and evaluates to the same loss and perplexity.

The job makes the shards uneven: chat records with the loss on the answers only (each micro-batch, and
each half of a sequence, holds a different number of labelled tokens), `padding: longest` (odd lengths
padded to a multiple of 2 on the ranks), accumulation 4. SGD without momentum: its update is the
gradient itself, so a loss scaled wrongly on the shards (a sum over ranks instead of the sequence's
mean) changes the next steps' losses, which Adam's normalisation would hide.

Tolerance, fp32: the two runs compute the same per-token losses up to the order of summation
(tests/train/test_sequence_parallel.py: 2e-5 relative for one forward and backward, measured ~1e-7);
over 4 SGD steps that difference feeds back through the weights, so the bound per step is the same
2e-5 relative times the step number (a linear growth bound; the measured growth is far below it).
A wrong shard or loss scale differs by 1e-2 or more from the first step on.
"""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO_ROOT, deep_merge, read_metrics, run_worker

from jobspec.cli import main

FP32_STEP_TOLERANCE = 2e-5
DATA = REPO_ROOT / "jobs" / "data"

SP_JOB = {
    "name": "sp",
    "model": {"architecture": "llama", "task": "causal-lm", "num_labels": 2,
              "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                         "max_position_embeddings": 128}},
    "data": {"train": str(DATA / "chat-sample.jsonl"), "eval": str(DATA / "chat-sample.jsonl"),
             "tokenizer": str(DATA / "tokenizer"), "records": "chat", "loss_on": "answers", "max_length": 96,
             "padding": "longest", "shuffle": True, "num_workers": 0, "pin_memory": False},
    "training": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 8, "seed": 5, "eval_every": 2,
                 "gradient_clipping": 0.0, "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
                 "scheduler": {"name": "constant", "warmup_steps": 0}},
    "memory": {"precision": "fp32", "sequence_parallel": 2},
    "checkpoint": {"save_final": True},
    "logging": {"every_n_steps": 1, "mlflow": {"enabled": False}, "progress": "lines"},
    "resources": {"gpus_per_node": 2},
}
REFERENCE = {"memory": {"sequence_parallel": 1}, "resources": {"gpus_per_node": 1}}


def _run(root, overrides: dict, ranks: int, *, name: str = "run", env: dict | None = None):
    """The job validated and compiled by `jobspec compile --out` (the refusals included), then its ranks;
    a second run under the same `root` resumes from the first one's checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    spec = deep_merge(SP_JOB, overrides)
    spec["output_dir"] = str(root / "out")
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = root / name
    assert main(["compile", str(job), "--out", str(run_dir)]) == 0
    result = run_worker(run_dir, num_ranks=ranks, env=env)
    assert result.returncode == 0, \
        f"worker failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return run_dir


@pytest.mark.slow   # three worker runs through the deepspeed runner: 2 ranks with SP, 1 without, 1 resuming
def test_two_sequence_shards_train_evaluate_and_resume_as_one_rank(tmp_path):
    sp_dir = _run(tmp_path / "sp", {"checkpoint": {"every_n_steps": 2, "keep_last": 2}}, ranks=2)
    reference_dir = _run(tmp_path / "one", REFERENCE, ranks=1)
    sp_rows, reference_rows = read_metrics(sp_dir), read_metrics(reference_dir)
    sp_loss, reference_loss = _losses(sp_rows), _losses(reference_rows)
    assert len(sp_loss) == len(reference_loss) == 4
    for step, (got, want) in enumerate(zip(sp_loss, reference_loss), start=1):
        assert abs(got - want) <= FP32_STEP_TOLERANCE * step * abs(want), (step, sp_loss, reference_loss)
    assert reference_loss[0] != pytest.approx(reference_loss[-1], rel=1e-3)   # it trained: the check has teeth
    sp_eval = [r for r in sp_rows if "eval/loss" in r]
    reference_eval = [r for r in reference_rows if "eval/loss" in r]
    assert len(sp_eval) == len(reference_eval) == 2
    for got, want in zip(sp_eval, reference_eval):
        for name in ("eval/loss", "eval/perplexity"):
            assert got[name] == pytest.approx(want[name], rel=FP32_STEP_TOLERANCE * 4), name
    # throughput counts each sample and token once (the group's rank 0), not once per shard
    sp_summary = json.loads((sp_dir / "summary.json").read_text())
    reference_summary = json.loads((reference_dir / "summary.json").read_text())
    assert sp_summary["samples"] == reference_summary["samples"] == 4 * 8
    assert sp_summary["tokens_per_s"] is not None

    # the step-2 checkpoint of the 2 sequence shards, resumed on 1 rank without them (another world size
    # and data-parallel split: the data position is counted in world / N data-parallel ranks)
    step2 = tmp_path / "sp" / "out" / "checkpoints" / "step2"
    assert json.loads((step2 / "jobspec_manifest.json").read_text())["layout"]["sequence_parallel"] == 2
    resumed_dir = _run(tmp_path / "resumed", {**REFERENCE, "checkpoint": {"resume": str(step2)}}, ranks=1)
    resumed_loss = _losses(read_metrics(resumed_dir))
    assert len(resumed_loss) == 2
    for step, (got, want) in enumerate(zip(resumed_loss, reference_loss[2:]), start=3):
        assert abs(got - want) <= FP32_STEP_TOLERANCE * step * abs(want), (step, resumed_loss, reference_loss)


def _losses(rows: list[dict]) -> list[float]:
    return [r["train/loss"] for r in rows if "train/loss" in r]
