"""`model.kernels: liger` in a real launch on CPU ranks, Liger's kernels swapped for their PyTorch
references by the test hook (JOBSPEC_KERNELS_REFERENCE=1): the ranks apply the compiled
`fused_kernels` patch, the fused linear cross-entropy computes the loss and jobspec's token-weighted
loss takes it (docs/loss.md), and the run trains and evaluates to the losses of the unfused job step
by step: on 2 data-parallel ranks, and on 2 sequence shards (the fused head takes a shard's
next-token labels, as the tiled one does). Under ZeRO-3 with the head tied to the input
embeddings: the fused loss runs as the head module's forward, so ZeRO-3 gathers the weight it
reads, and the tied weight's two gradients (the head's, made in the forward, and the embeddings')
are summed into one, where the tiled loss is refused (techniques/tiled_loss.py).

The job is tests/train/test_sequence_parallel_launch.py's: chat records with the loss on the answers
(micro-batches and shards of unequal labelled tokens), accumulation 4, SGD without momentum (a loss
scaled wrongly changes the next steps' losses). Tolerance, fp32: that test's 2e-5 relative per step
(the same per-token losses summed in another order, fed back through the weights).
"""
from __future__ import annotations

import pytest
from conftest import deep_merge, read_metrics, run_worker
from test_sequence_parallel_launch import FP32_STEP_TOLERANCE, SP_JOB

from jobspec.cli import main
from jobspec.techniques.fused_kernels import REFERENCE_ENV

HOOK = {REFERENCE_ENV: "1"}
TIED_ZERO3 = {"memory": {"zero_stage": 3}, "model": {"config": {"tie_word_embeddings": True}}}
DATA_PARALLEL = deep_merge(TIED_ZERO3, {"memory": {"sequence_parallel": 1}})
LIGER = {"model": {"kernels": "liger"}}


def _run(root, overrides: dict, monkeypatch):
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    spec = deep_merge(SP_JOB, overrides)
    spec["output_dir"] = str(root / "out")
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = root / "run"
    monkeypatch.setenv(REFERENCE_ENV, "1")   # validate and compile on this CPU host
    assert main(["compile", str(job), "--out", str(run_dir)]) == 0
    result = run_worker(run_dir, num_ranks=2, env=HOOK)
    assert result.returncode == 0, \
        f"worker failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return run_dir, result.stdout + result.stderr


def _losses(rows: list[dict], name: str) -> list[float]:
    return [r[name] for r in rows if name in r]


def _assert_same_training(got_dir, want_dir):
    got_rows, want_rows = read_metrics(got_dir), read_metrics(want_dir)
    got, want = _losses(got_rows, "train/loss"), _losses(want_rows, "train/loss")
    assert len(got) == len(want) == 4
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= FP32_STEP_TOLERANCE * step * abs(b), (step, got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-3)   # it trained: the comparison has teeth
    got_eval, want_eval = _losses(got_rows, "eval/loss"), _losses(want_rows, "eval/loss")
    assert len(got_eval) == len(want_eval) == 2
    for a, b in zip(got_eval, want_eval):
        assert a == pytest.approx(b, rel=FP32_STEP_TOLERANCE * 4)


@pytest.mark.slow   # three worker runs through the deepspeed runner, 2 CPU ranks each
def test_the_fused_kernels_train_as_the_unfused_model_on_cpu_ranks(tmp_path, monkeypatch):
    plain_dir, _ = _run(tmp_path / "plain", DATA_PARALLEL, monkeypatch)
    fused_dir, output = _run(tmp_path / "fused", deep_merge(DATA_PARALLEL, LIGER), monkeypatch)
    assert '"name": "fused_kernels"' in (fused_dir / "patches.json").read_text()
    # the ranks' patch note (launcher.log's jobspec-log lines; here the runner's output)
    assert "fused kernels (PyTorch reference)" in output and "fused linear cross-entropy" in output
    _assert_same_training(fused_dir, plain_dir)
    sharded_dir, _ = _run(tmp_path / "sharded", deep_merge(TIED_ZERO3, LIGER), monkeypatch)
    _assert_same_training(sharded_dir, plain_dir)
