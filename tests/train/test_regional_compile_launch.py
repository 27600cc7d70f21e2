"""`model.compile` in a real launch on 2 CPU ranks (inductor: C++ kernels built here), against the
same job uncompiled: a tiny Llama causal LM with LoRA adapters, one layer in 2 checkpointed, ZeRO-2.
Every step's loss and gradient norm are the uncompiled run's within fp32 rounding (a wrong compiled
backward moves the gradient norm by its own size), and each rank reports its compile time: the
`compiled` start-up phase before its `first-step` phase, and the `torch.compile` note in
launcher.log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fp_bounds import forward_bound

pytestmark = pytest.mark.slow

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 64}
SEQ_LEN, STEPS = 32, 6
JOB = {"name": "compile-launch",
       "model": {"architecture": "llama", "task": "causal-lm", "attention": "sdpa", "config": LLAMA,
                 "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
       "data": {"synthetic": {"num_samples": 64, "seq_len": SEQ_LEN, "vocab_range": [5, 256]}},
       # SGD: a rounding difference in a near-zero gradient stays that small (Adam scales it to lr)
       "training": {"max_steps": STEPS, "micro_batch_size": 4, "global_batch_size": 8, "seed": 5,
                    "optimizer": {"name": "sgd", "lr": 0.5}},
       "memory": {"zero_stage": 2, "precision": "fp32",
                  "activation_checkpointing": {"every_n_layers": 2}},
       "resources": {"gpus_per_node": 2},
       "logging": {"every_n_steps": 1, "progress": "lines", "mlflow": {"enabled": False}},
       "checkpoint": {"save_final": False}, "export": {"final": False}}
PHASE = re.compile(r"^jobspec-log: phase (rank\d) (\S+) ([0-9.]+) ", re.M)


def launch(tmp_path: Path, compiled: bool) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB, sort_keys=False))
    out = tmp_path / f"out-{compiled}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "jobspec", "launch", str(path),
               "--set", f"model.compile={compiled}", "--set", f"output_dir={out}"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return next(out.glob("run-*"))


def steps(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return {row["step"]: row for row in rows if "train/loss" in row}


def test_compiled_layers_train_to_the_same_losses_and_report_their_compile_time(tmp_path):
    plain, compiled = launch(tmp_path, False), launch(tmp_path, True)
    expected, got = steps(plain), steps(compiled)
    assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1))
    bound = forward_bound(LLAMA, SEQ_LEN)   # the order of the sums alone: inductor fuses, reorders
    for step in expected:
        for name in ("train/loss", "train/grad_norm"):
            assert got[step][name] == pytest.approx(expected[step][name], rel=bound), (step, name)
    log = (compiled / "launcher.log").read_text(errors="replace")
    assert "torch.compile: regional, on each of the 4 layers (LlamaDecoderLayer)" in log
    phases = {(rank, name): float(at) for rank, name, at in PHASE.findall(log)}
    for rank in ("rank0", "rank1"):   # compiled inside the first step: after the engine, by its end
        assert phases[(rank, "engine")] < phases[(rank, "compiled")] <= phases[(rank, "first-step")]
    notes = re.findall(r"^jobspec-log: torch\.compile: ([0-9.]+) s for (\d+) compilations", log,
                       re.M)
    assert len(notes) == 2 and all(float(seconds) > 0 for seconds, _ in notes)
    # a graph per layer kind (checkpointed or not) and its backward: no more than 2 layers would
    assert all(int(count) <= 4 for _, count in notes)
    plain_log = (plain / "launcher.log").read_text(errors="replace")
    assert "torch.compile" not in plain_log and " compiled " not in plain_log
