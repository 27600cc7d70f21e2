"""The training worker, its checkpoints and its progress output.

Fast tests cover the pure pieces; `slow` ones start 2 CPU ranks through the real deepspeed runner.
"""
from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import pytest

from conftest import make_run_dir, read_metrics, run_worker
from worker_runs import plain_run
from jobspec.checkpoint import save_load
from jobspec.errors import SpecError
from jobspec.train.progress import Progress, RunState, format_eta, format_line, progress_mode, summarize
from jobspec.rundir import read_run_files
from jobspec.train.worker import StopFlag

GPU_ONLY_METRICS = ("mem/peak_allocated_mib_max", "mem/peak_allocated_mib_rank0", "mem/peak_reserved_mib_max",
                    "mem/peak_reserved_mib_rank0", "mem/nvml_used_mib_max", "perf/mfu", "perf/tflops_per_device")


def _client_state(ckpt_dir: Path, tag: str) -> dict:
    import torch
    return torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- fast, no ranks

def test_progress_line_has_step_loss_lr_throughput_and_eta():
    line = format_line(20, 100, {"train/loss": 0.693147, "train/lr": 4e-5, "perf/samples_per_s": 12.34}, 65)
    assert line == "step 20/100 loss 0.6931 lr 4.0e-05 12.3 samples/s eta 0:01:05"
    assert format_line(3, 9, {}, None) == "step 3/9 eta ?"
    assert format_eta(3661) == "1:01:01"


def test_progress_mode_comes_from_env_and_unknown_falls_back_to_lines():
    assert progress_mode({"JOBSPEC_PROGRESS": "bar"}) == "bar"
    assert progress_mode({"JOBSPEC_PROGRESS": "none"}) == "none"
    assert progress_mode({"JOBSPEC_PROGRESS": "fancy"}) == "lines"


@pytest.mark.parametrize("mode", ["lines", "none", "bar"])
def test_progress_modes_print_what_they_promise(mode):
    out = io.StringIO()
    progress = Progress(10, mode=mode, stream=out)
    progress.update(5)
    progress.log(5, {"train/loss": 1.5, "perf/samples_per_s": 3.0})
    progress.close()
    text = out.getvalue()
    if mode == "none":
        assert text == ""
    else:
        assert "1.5000" in text
    if mode == "lines":
        assert text.startswith("step 5/10 loss 1.5000")


def test_prune_keeps_the_newest_and_never_the_one_latest_names(tmp_path):
    for step in (10, 20, 30, 40):
        (tmp_path / save_load.tag_for(step)).mkdir()
    save_load.publish_latest(tmp_path, "step40")
    assert save_load.prune(tmp_path, keep_last=2) == ["step10", "step20"]
    assert save_load.completed_steps(tmp_path) == [30, 40]
    # `latest` still points at an older one (a newer save did not complete): it survives
    (tmp_path / "step50").mkdir()
    (tmp_path / "step60").mkdir()
    save_load.publish_latest(tmp_path, "step30")
    save_load.prune(tmp_path, keep_last=1)
    assert save_load.completed_steps(tmp_path) == [30, 60]


def test_publish_latest_replaces_without_leaving_temp_files(tmp_path):
    save_load.publish_latest(tmp_path, "step1")
    save_load.publish_latest(tmp_path, "step2")
    assert save_load.read_latest(tmp_path) == "step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_resume_target_auto_never_and_paths(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert save_load.resume_target("auto", ckpt) is None
    (ckpt / "step4").mkdir(parents=True)
    assert save_load.resume_target("auto", ckpt) is None  # a save without `latest` is incomplete
    save_load.publish_latest(ckpt, "step4")
    assert save_load.resume_target("auto", ckpt) == (str(ckpt), "step4")
    assert save_load.resume_target("never", ckpt) is None
    assert save_load.resume_target(str(ckpt), tmp_path / "other") == (str(ckpt), "step4")
    assert save_load.resume_target(str(ckpt / "step4"), tmp_path / "other") == (str(ckpt), "step4")
    with pytest.raises(SpecError, match="checkpoint.resume"):
        save_load.resume_target(str(tmp_path / "nope"), ckpt)


def test_rng_state_round_trip():
    import random

    import numpy as np
    import torch
    state = save_load.capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    save_load.restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_read_run_dir_names_the_missing_files(tmp_path):
    with pytest.raises(SpecError, match="ds_config.json, patches.json, launch.json"):
        (tmp_path / "resolved.yaml").write_text("name: x\n")
        read_run_files(tmp_path)


def test_summary_throughput_is_the_launchs_average_not_a_mean_of_windows():
    state = RunState(step=3, samples_per_s=[1.0, 10.0, 20.0], last_loss=0.5,
                     rates={"tokens_per_s": [16.0, 160.0, 320.0], "mfu": [0.1]},
                     run_perf={"perf/run_samples_per_s": 12.5, "perf/run_tokens_per_s": 200.0, "perf/run_mfu": 0.1})
    summary = summarize(state, "finished", 3, started=0.0)
    assert summary.samples_per_s == 12.5 and summary.tokens_per_s == 200.0   # not the windows' mean 15.0
    assert summary.mfu == 0.1 and summary.tflops_per_device is None  # measured: kept; none (CPU): None
    assert summary.status == "finished" and summary.steps == 3 and summary.final_loss == 0.5


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_flag_is_set_by_slurms_warning_and_by_preemption(signum):
    """SIGUSR1 (Slurm's warning), SIGTERM (scancel, launch.py), SIGINT (Ctrl-C to the group: no
    KeyboardInterrupt mid-step), SIGHUP (a dropped session): each only a flag, the first one kept."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        flag = StopFlag()
        flag.install()
        assert not flag.requested
        os.kill(os.getpid(), signum)
        assert flag.requested and flag.signum == signum
        os.kill(os.getpid(), signum)  # a repeat (group signal + launch.py's) must not kill the rank
        assert flag.requested
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("rank_flag", [["--local_rank=1"], ["--local_rank", "1"]])
def test_worker_without_run_files_exits_2_with_a_clear_message(tmp_path, capsys, rank_flag):
    from jobspec.train.worker import main
    assert main([*rank_flag, "--run-dir", str(tmp_path)]) == 2
    assert "lacks resolved.yaml" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


# ----------------------------------------------------------------------------- real ranks

@pytest.mark.slow
def test_trains_logs_evaluates_and_checkpoints(tmp_path_factory):
    # worker_runs.plain_run: 8 steps, global batch 16, a checkpoint every 2 steps, keep_last 2 (the
    # uninterrupted run of tests/train/test_oom.py too: started once per session)
    run_dir = plain_run(tmp_path_factory.mktemp("plain"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["steps"] == 8
    assert summary["samples"] == 8 * 16  # micro 4 x 2 ranks x 2 accumulated
    assert summary["eval_loss"] is not None and summary["samples_per_s"] > 0
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # learnable labels: the loss goes down
    perf_rows = [r for r in rows if "perf/samples_per_s" in r]  # at most one per logging.perf_window_s
    assert perf_rows and perf_rows[-1]["step"] == 8  # and the last step's, whatever its window
    for row in perf_rows:
        assert row["perf/samples_per_s"] > 0 and row["perf/tokens_per_s"] > 0
        assert row["mem/host_rss_mib_max"] > 0
    assert not any(set(GPU_ONLY_METRICS) & set(row) for row in rows), "GPU-only metrics must be absent on CPU"
    assert any("eval/loss" in r for r in read_metrics(run_dir))
    # token classification on integer labels: token accuracy, no entity F1 (that needs BIO tags)
    evals = [r for r in read_metrics(run_dir) if "eval/loss" in r]
    assert all(0 <= r["eval/accuracy"] <= 1 and "eval/f1" not in r for r in evals)
    assert summary["eval_metrics"] == {"eval/accuracy": evals[-1]["eval/accuracy"]}
    ckpt_dir = run_dir.parent / "out" / "checkpoints"
    assert save_load.completed_steps(ckpt_dir) == [6, 8]  # keep_last 2 of 2, 4, 6, 8
    assert save_load.read_latest(ckpt_dir) == "step8"
    state = _client_state(ckpt_dir, "step8")
    assert (state["step"], state["job_name"], len(state["rng"])) == (8, "tiny", 2)
    # 8 steps of 2 micro-batches of 4 on each rank: 16 consumed from the epoch (128 samples, 8 steps)
    assert (state["global_steps"], state["batches_in_epoch"]) == (8, 16)


@pytest.mark.slow
def test_a_bad_run_fails_with_a_clear_error_and_a_failed_summary(tmp_path):
    run_dir = make_run_dir(tmp_path)
    (run_dir / "patches.json").write_text(json.dumps([{"name": "warp_drive", "args": {}}]))
    result = run_worker(run_dir)
    assert result.returncode != 0
    assert "unknown patch 'warp_drive'" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr  # a spec problem, not a crash
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "warp_drive" in summary["error"]
