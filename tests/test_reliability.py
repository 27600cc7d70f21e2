"""Faults during training, injected for real: kill -9 of a rank, NaN losses (stop / skip), a full
checkpoint disk, a crash between DeepSpeed's write and `latest`, a truncated checkpoint file."""
from __future__ import annotations

from conftest import PROFILER

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow_server import ENV, launch_argv, only_run_dir, write_job

from jobspec.memory.planner import checkpoint_bytes
from jobspec.spec.derived import derive
from jobspec.checkpoint import save_load

from jobspec.launch import preflight, supervise as supervision

from jobspec.tracking import run as tracking
from jobspec.cli import main
from jobspec.errors import RunFailure, SpecError
from jobspec.train.faults import INJECT_ENV, SKIPPED_METRIC
from jobspec.units import fmt_bytes_any_unit


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file-store tracking URI: no sqlite schema creation (7-28 s) per test."""
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    return str(tmp_path / "mlruns")


def run_of(run_dir: Path):
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = tracking.client_for(info["tracking_uri"])
    return client, client.get_run(info["run_id"])


def survivors(run_dir: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(p.info["cmdline"] or [])]


def launch(job: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(launch_argv(job, *args), cwd=job.parent, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV, **(env or {})})


# --- cheap: pre-flight and atomic publication --------------------------------------------------------

def test_a_disk_too_small_for_one_checkpoint_is_refused_before_anything_starts(tmp_path, store, monkeypatch,
                                                                                  capsys):
    huge = {"model": {"architecture": "bert", "task": "token-classification",
                      "config": {"hidden_size": 65536, "num_hidden_layers": 200, "num_attention_heads": 64,
                                 "intermediate_size": 262144, "vocab_size": 512}},
            "checkpoint": {"save_final": True}}
    job = write_job(tmp_path, "huge", store, extra=huge)
    monkeypatch.setattr(supervision, "run", lambda *a, **k: pytest.fail("a job started"))
    assert main(["launch", str(job)]) == 2
    err = capsys.readouterr().err
    # positioned at the field it concerns (here the `checkpoint:` line: `dir` is defaulted), not the root
    line = job.read_text().splitlines().index("checkpoint:") + 1
    assert f"{job}:{line}:1: checkpoint.dir: " in err, err
    # the checkpoint and the exported model (export.final is on by default) share tmp_path's disk
    assert re.search(r"share a disk with [\d.]+ (KiB|MiB|GiB|TiB) free but one checkpoint \([\d.]+ TiB\) and "
                     r"the exported model \([\d.]+ TiB\) need about [\d.]+ TiB", err), err
    assert "--ignore-preflight" in err
    assert not list((tmp_path / "out-huge").glob("run-*"))
    # the estimate follows the model: the tiny one fits easily
    from jobspec.spec.validation import load_and_validate
    tiny = load_and_validate(write_job(tmp_path, "tiny", store))
    run_dir = tmp_path / "run"
    assert 0 < checkpoint_bytes(tiny.spec, derive(tiny.spec, profiler=PROFILER)) < 10 * 2**20
    assert preflight.disk_space_issues(tiny.spec, derive(tiny.spec, profiler=PROFILER), run_dir) == []
    # a small disk is described in units that show the numbers (was "0.0 GiB free ... about 0.0 GiB")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(10 * 2**20, 0, 3 * 2**10))
    tiny.spec["checkpoint"]["save_final"] = True
    tiny.spec["export"]["final"] = False
    [issue] = preflight.disk_space_issues(tiny.spec, derive(tiny.spec, profiler=PROFILER), run_dir)
    assert issue.path == ("checkpoint", "dir")
    assert re.search(r"has 3\.0 KiB free but one checkpoint needs about [1-9][\d.]* (KiB|MiB)", issue.message)


def test_the_exported_model_counts_on_its_own_disk_and_with_the_checkpoints_on_a_shared_one(tmp_path, store,
                                                                                          monkeypatch):
    from jobspec.memory.planner import export_bytes
    from jobspec.spec.validation import load_and_validate
    spec = load_and_validate(write_job(tmp_path, "tiny", store)).spec
    spec["checkpoint"].update(save_final=True)
    spec["export"].update(final=True, dtype="fp32")
    job = derive(spec, profiler=PROFILER)
    checkpoint, export = checkpoint_bytes(spec, job), export_bytes(spec, job)
    assert 0 < export < checkpoint
    free = {"bytes": checkpoint + export}
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(2**40, 0, free["bytes"]))
    run_dir = tmp_path / "run"
    assert preflight.disk_space_issues(spec, job, run_dir) == []           # exactly enough for both
    free["bytes"] -= 1
    [both] = preflight.disk_space_issues(spec, job, run_dir)
    assert both.path == ("checkpoint", "dir") and f"{run_dir / 'model'}" in both.message
    assert "one checkpoint (" in both.message and "the exported model (" in both.message
    # on another disk, each is judged alone: the export dir's disk is the one short of space
    export_disk = tmp_path / "export-disk"
    export_disk.mkdir()
    spec["export"]["dir"] = str(export_disk / "models")
    monkeypatch.setattr(preflight, "disk_of", lambda d: (2, export - 1) if export_disk in d.parents else (1, 2**40))
    [alone] = preflight.disk_space_issues(spec, job, run_dir)
    assert alone.path == ("export", "dir")
    assert alone.message.startswith(f"{export_disk / 'models'} has ") and "(parameters x fp32 weights)" in alone.message
    assert alone.hint.endswith("or set export.final: false")
    spec["export"]["best_eval"] = True        # the hint names every export setting that is on
    [alone] = preflight.disk_space_issues(spec, job, run_dir)
    assert alone.hint.endswith("or set export.final: false and export.best_eval: false")
    spec["export"]["best_eval"] = False
    spec["export"]["final"] = False                                          # nothing exported: nothing counted
    assert preflight.disk_space_issues(spec, job, run_dir) == []


@pytest.mark.parametrize("n, text", [(0, "0 bytes"), (1023, "1023 bytes"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"),
                                     (int(2.25 * 2**30), "2.2 GiB"), (3 * 2**40, "3.0 TiB")])
def test_disk_sizes_take_the_unit_that_shows_them(n, text):
    assert fmt_bytes_any_unit(n) == text


class FakeEngine:
    """Writes a DeepSpeed-like tag directory, as engine.save_checkpoint does."""

    def save_checkpoint(self, ckpt_dir, tag, client_state, save_latest):
        assert save_latest is False  # DeepSpeed's own `latest` would be written before all ranks finish
        (Path(ckpt_dir) / tag).mkdir(parents=True)
        (Path(ckpt_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"w" * 1000)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save(ckpt: Path, step: int) -> str:
    return save_load.save(FakeEngine(), ckpt, step=step, epoch=0, batches_in_epoch=step, job_name="j",
                              keep_last=5)


def test_a_crash_after_deepspeed_wrote_the_tag_leaves_latest_on_the_previous_checkpoint(
        tmp_path, one_rank_group, monkeypatch):
    ckpt = tmp_path / "ckpt"
    assert save(ckpt, 2) == "step2" and save_load.read_latest(ckpt) == "step2"

    def crash(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(save_load, "write_manifest", crash)
    with pytest.raises(RunFailure, match="No space left on device"):
        save(ckpt, 4)
    assert not (ckpt / "step4").exists()  # DeepSpeed's part was written; the torn directory is removed
    assert save_load.read_latest(ckpt) == "step2"
    assert save_load.resume_candidates("auto", ckpt) == [(str(ckpt), "step2")]
    assert not list(ckpt.glob(".latest.tmp*"))


# --- disk full during a save: one line, the torn step removed, `latest` unchanged (issue 13) ----------

class DeepSpeedLikeEngine:
    """Saves as DeepSpeed's engine does: through its TorchCheckpointEngine, between two barriers."""

    def __init__(self, nbytes: int, legacy: bool = False):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        self.checkpoint_engine = TorchCheckpointEngine()
        self.checkpoint_engine.zipfile_serialization = legacy is False  # DeepSpeed's default: zip
        self.nbytes = nbytes

    def save_checkpoint(self, ckpt_dir, tag, client_state, save_latest):
        import torch
        import torch.distributed as dist
        self.checkpoint_engine.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        self.checkpoint_engine.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            self.checkpoint_engine.save({"w": torch.ones(self.nbytes // 4), **client_state},
                                        os.path.join(ckpt_dir, tag, name))
        dist.barrier()


def deepspeed_save(ckpt: Path, step: int, nbytes: int, legacy: bool = False) -> str:
    return save_load.save(DeepSpeedLikeEngine(nbytes, legacy), ckpt, step=step, epoch=0, batches_in_epoch=step,
                              job_name="j", keep_last=5)


def assert_clean_failure(failure, ckpt: Path, tag: str, latest: str):
    text = str(failure)
    assert len(text.splitlines()) == 1 and failure.collective
    assert f"checkpoint {tag} could not be saved to {ckpt}: No space left on device (writing {ckpt / tag}/" in text
    assert f"the incomplete {tag} was removed and `latest` still names {latest}" in text
    assert not (ckpt / tag).exists() and save_load.read_latest(ckpt) == latest
    assert save_load.completed_steps(ckpt) == [int(latest[4:])]


def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, one_rank_group,
                                                                                   monkeypatch):
    ckpt = tmp_path / "ckpt"
    assert deepspeed_save(ckpt, 2, 4096) == "step2"
    real_save = save_load.torch.save

    def half_then_enospc(obj, fh, **kwargs):  # what a write into a full disk does: part lands, then ENOSPC
        if not str(getattr(fh, "name", "")).startswith(str(ckpt)):
            return real_save(obj, fh, **kwargs)  # torch.distributed pickles objects with torch.save too
        fh.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(save_load.torch, "save", half_then_enospc)
    with pytest.raises(RunFailure) as failure:
        deepspeed_save(ckpt, 4, 4096)
    assert_clean_failure(failure.value, ckpt, "step4", "step2")
    monkeypatch.setattr(save_load.torch, "save", real_save)
    assert deepspeed_save(ckpt, 6, 4096) == "step6"  # room again: the next save works


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and a kernel that lets us mount): a disk that really fills up."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}): the "
                    "faked-ENOSPC test above covers the same path")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("legacy", [False, True])  # torch's zip writer, and its direct writes to the fd
def test_a_really_full_tmpfs_during_a_save(small_tmpfs, one_rank_group, legacy):
    ckpt = small_tmpfs / "ckpt"
    assert deepspeed_save(ckpt, 2, 200 * 1024, legacy) == "step2"          # 2 x 200 KiB fit in 1 MiB
    with pytest.raises(RunFailure) as failure:
        deepspeed_save(ckpt, 4, 600 * 1024, legacy)                          # 2 x 600 KiB do not
    assert_clean_failure(failure.value, ckpt, "step4", "step2")
    assert save_load.verify(ckpt, "step2") is None               # the previous checkpoint is intact


def test_a_truncated_file_makes_verification_fail(tmp_path, one_rank_group):
    ckpt = tmp_path / "ckpt"
    save(ckpt, 2), save(ckpt, 4)
    assert save_load.verify(ckpt, "step4") is None
    with open(ckpt / "step4" / "mp_rank_00_model_states.pt", "r+b") as fh:
        fh.truncate(10)
    assert "10 bytes, 1000 were written" in save_load.verify(ckpt, "step4")
    assert save_load.resume_candidates("auto", ckpt) == [(str(ckpt), "step4"), (str(ckpt), "step2")]


# --- real 2-rank launches --------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_9_of_a_real_rank_fails_the_run_fast_and_leaves_no_orphans(tmp_path, store):
    job = write_job(tmp_path, "killed", store, ranks=2, max_steps=100_000)
    proc = subprocess.Popen(launch_argv(job), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **ENV})
    deadline = time.monotonic() + 300
    while not list((tmp_path / "out-killed").glob("run-*/metrics.jsonl")) or \
            len(next((tmp_path / "out-killed").glob("run-*/metrics.jsonl")).read_text().splitlines()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.3)
    run_dir = only_run_dir(tmp_path, "killed")
    # a forked rank's command line is one title (launch/rank_forks.py): read as a string
    rank1 = [p for p in psutil.process_iter(["cmdline"])
             if "--local_rank=1 " in " ".join(p.info["cmdline"] or []) + " "
             and str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert len(rank1) == 1
    killed_at = time.monotonic()
    os.kill(rank1[0].pid, signal.SIGKILL)
    code = proc.wait(timeout=120)
    assert time.monotonic() - killed_at < 30 and code == 128 + signal.SIGKILL  # not DeepSpeed's 247
    assert survivors(run_dir) == []
    _, run = run_of(run_dir)
    assert run.info.status == "FAILED" and run.data.tags["jobspec.exit_code"] == str(code)
    assert run.data.tags["jobspec.failure_reason"]


@pytest.mark.slow
def test_nan_stop_keeps_the_last_good_checkpoint_and_a_corrupt_one_is_passed_over_on_resume(tmp_path, store):
    job = write_job(tmp_path, "nan-stop", store, ranks=2, max_steps=8,
                    extra={"checkpoint": {"every_n_steps": 2, "keep_last": 3, "save_final": True}})
    first = launch(job, env={INJECT_ENV: "5"})
    assert first.returncode != 0
    assert "training loss is not finite at optimizer step 5" in first.stderr + first.stdout
    assert "Traceback" not in first.stderr + first.stdout
    ckpt = tmp_path / "out-nan-stop" / "checkpoints"
    assert save_load.read_latest(ckpt) == "step4" and save_load.completed_steps(ckpt) == [2, 4]
    run_dir = only_run_dir(tmp_path, "nan-stop")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "on_nan: stop" in summary["error"] and summary["steps"] == 4
    _, run = run_of(run_dir)
    assert run.info.status == "FAILED" and "not finite" in run.data.tags["jobspec.failure_reason"]

    # a torn write in the newest checkpoint: resume falls back to step2, loudly
    shard = next((ckpt / "step4").glob("*model_states.pt"))
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    second = launch(job)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "WARNING: checkpoint passed over on resume" in second.stdout + second.stderr
    run_dir2 = [d for d in (tmp_path / "out-nan-stop").glob("run-*") if d != run_dir][0]
    summary2 = json.loads((run_dir2 / "summary.json").read_text())
    assert summary2["resumed_from"].endswith("step2") and summary2["status"] == "finished"
    _, run2 = run_of(run_dir2)
    assert run2.info.run_id == run.info.run_id  # the same MLflow run continues
    assert "step4" in run2.data.tags["jobspec.resume_fallback"]


@pytest.mark.slow
def test_nan_skip_drops_the_update_and_counts_it(tmp_path, store):
    import torch
    job = write_job(tmp_path, "nan-skip", store, ranks=2, max_steps=5,
                    extra={"training": {"on_nan": "skip"},
                           "checkpoint": {"every_n_steps": 1, "keep_last": 10, "save_final": True}})
    done = launch(job, env={INJECT_ENV: "3"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "update skipped" in done.stdout + done.stderr
    run_dir = only_run_dir(tmp_path, "nan-skip")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if SKIPPED_METRIC in r] == [3]
    assert all(r["train/loss"] == r["train/loss"] for r in rows if "train/loss" in r)  # no NaN reported
    client, run = run_of(run_dir)
    assert [m.value for m in client.get_metric_history(run.info.run_id, SKIPPED_METRIC)] == [1.0]

    def weights(step):
        state = torch.load(next((tmp_path / "out-nan-skip" / "checkpoints" / f"step{step}").glob("mp_rank_00*")),
                           map_location="cpu", weights_only=False)["module"]
        return {k: v.float() for k, v in state.items()}
    before, skipped, after = weights(2), weights(3), weights(4)
    assert all(torch.equal(before[k], skipped[k]) for k in before)          # step 3 changed nothing
    assert not all(torch.equal(skipped[k], after[k]) for k in skipped)      # step 4 trained again
    assert all(torch.isfinite(v).all() for v in after.values())
