"""Worker runs that more than one test module inspects, each started once per test process.

`plain_run`: 2 CPU ranks through the real deepspeed runner, 8 steps of the tiny BERT with dropout off,
global batch 16 (accumulation 2), a checkpoint every 2 steps (keep_last 2), `on_oom: halve_micro_batch`
that nothing triggers. tests/train/test_worker.py checks that it trains, logs, evaluates and checkpoints;
tests/train/test_oom.py uses it as the uninterrupted run an OOM-recovered one must follow.
"""
from __future__ import annotations

from pathlib import Path

from conftest import make_run_dir, run_worker

# No dropout: a step redone with half the micro-batch then computes the same gradients (up to
# float rounding), so a run after an OOM must follow the uninterrupted one closely.
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
PLAIN_SPEC = {"model": {"config": NO_DROPOUT},
              "training": {"max_steps": 8, "global_batch_size": 16, "on_oom": "halve_micro_batch"},
              "checkpoint": {"every_n_steps": 2, "keep_last": 2}}

_plain: Path | None = None


def plain_run(root: Path) -> Path:
    """The run dir of PLAIN_SPEC's run (its checkpoints under root/out/checkpoints), made under `root`
    on the first call of the process."""
    global _plain
    if _plain is None:
        run_dir = make_run_dir(Path(root), PLAIN_SPEC)
        result = run_worker(run_dir)
        assert result.returncode == 0, \
            f"worker failed ({result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
        _plain = run_dir
    return _plain
