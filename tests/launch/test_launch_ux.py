"""`jobspec launch` as a user sees it, through the CLI with a stand-in runner: the header before the
runner's output, a terminal without DeepSpeed's INFO lines (unless --verbose), the closing summary
(also in summary.json and the MLflow run's description), a re-run of a complete job that starts
nothing and leaves the finished run's results alone, and --dry-run saying what a launch would do."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from jobspec import rundir
from jobspec.cli import main
from jobspec.launch import backends
from jobspec.tracking import run as telemetry
from jobspec.units import fmt_mib_gib
from conftest import REPO_ROOT
from test_launch import ScriptedBackend

# Prints what DeepSpeed's runner, launch.py and two ranks print, then writes what rank 0 writes:
# metrics, summary.json and a complete final checkpoint.
FAKE_DEEPSPEED = textwrap.dedent('''
    import json, sys, time, yaml
    from pathlib import Path
    run_dir = Path(sys.argv[1])
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    total = spec["training"]["max_steps"]
    print("[2026-11-23 07:40:14,080] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
          "to CPU. If you have GPU or other accelerator, we were unable to detect it.", flush=True)
    print("[2026-11-23 07:40:19,681] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}", flush=True)
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", flush=True)
    print("jobspec-log: attention: sdpa", flush=True)
    print("[2026-11-23 07:40:41,104] [WARNING] [engine.py:1:x] a warning that matters", flush=True)
    print(f"step {total}/{total} loss 0.0155 lr 0.0e+00 432.2 samples/s eta 0:00:00", flush=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": total, "timestamp": int(time.time() * 1000), "train/loss": 0.0155}) + "\\n")
    ckpt = Path(spec["checkpoint"]["dir"]) / f"step{total}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "jobspec_manifest.json").write_text("{}")
    (ckpt.parent / "latest").write_text(f"step{total}")
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "finished", "steps": total, "total_steps": total, "samples": 1280, "final_loss": 0.0155,
        "eval_loss": 0.0135, "samples_per_s": 432.2, "tokens_per_s": 27659.0,
        "peak_memory": {"mem/host_rss_mib_max": 613.8}, "elapsed_s": 3.2, "checkpoint": f"step{total}"}))
    print("[2026-11-23 07:40:50,915] [INFO] [launch.py:285:main] Process 31543 exits successfully.", flush=True)
''')


@pytest.fixture
def job(tmp_path, monkeypatch):
    script = tmp_path / "fake_deepspeed.py"
    script.write_text(FAKE_DEEPSPEED)
    monkeypatch.setattr(backends, "backend_for",
                        lambda plan, **_: ScriptedBackend([sys.executable, str(script), plan.run_dir]))
    monkeypatch.setenv("JOBSPEC_FORK_RANKS", "0")   # no standby node launcher for a scripted runner
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load((REPO_ROOT / "jobs" / "quickstart.yaml").read_text())
    spec.update(output_dir=str(tmp_path / "out"))
    spec["logging"]["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_dirs(tmp_path):
    return sorted((tmp_path / "out").glob("run-*"))


@pytest.mark.parametrize("progress", ["lines", "bar"])
def test_launch_prints_a_header_a_quiet_terminal_and_a_closing_summary(job, tmp_path, capfd, progress):
    assert main(["launch", str(job), "--set", f"logging.progress={progress}"]) == 0
    out = capfd.readouterr().out
    plain = out.replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert ("\x1b[1m" in out) == (progress == "bar")  # bold labels on a terminal only
    (run_dir,) = run_dirs(tmp_path)
    header_end = plain.index("step 40/40")
    header = plain[:header_end]
    assert header.startswith("jobspec: quickstart: xlm-roberta sequence-classification, 143.8K parameters\n")
    for expected in ("fp32 · ZeRO-0 · no offload", "no GPU: 2 CPU ranks on", "plan ", "host RAM",
                     "model       attention sdpa", f"run dir     {run_dir}", "MLflow      run ",
                     "in experiment 'quickstart'", "mlflow ui --backend-store-uri sqlite:///"):
        assert expected in header, expected
    # the library chatter is in launcher.log, not on the terminal; the warning that matters is on both
    log = (run_dir / rundir.LAUNCHER_LOG).read_text()
    for hidden in ("[INFO]", "Setting accelerator to CPU", "built successfully", "jobspec-log:",
                   "Creating initial MLflow database tables"):  # the launcher's own MLflow records, new store
        assert hidden not in plain and hidden in log, hidden
    assert "a warning that matters" in plain
    closing = plain[plain.index("jobspec: quickstart finished"):]
    assert closing.startswith("jobspec: quickstart finished: 40/40 steps in 3.2 s (exit 0)\n")
    for expected in ("train 0.0155 · eval 0.0135", "432.2 samples/s · 27,659 tokens/s",
                     "host RAM    peak RSS 613.8 MiB (plan ",
                     f"checkpoint  {tmp_path / 'out' / 'checkpoints' / 'step40'}",
                     f"run dir     {run_dir}"):
        assert expected in closing, expected
    # the same block in summary.json and as the MLflow run's description
    summary = json.loads((run_dir / rundir.SUMMARY).read_text())
    assert summary["report"] == closing.strip()
    info = rundir.read_mlflow_run(run_dir)
    run = telemetry.client_for(info["tracking_uri"]).get_run(info["run_id"])
    # one planned figure on CPU ranks, host RAM, the same in header, closing, summary.json, MLflow
    host = json.loads((run_dir / rundir.LAUNCH).read_text())["plan"]["host_total_mib"]
    shown = fmt_mib_gib(host * 2**20)
    assert f"host RAM    plan {shown} per rank" in header and f"(plan {shown}) per rank" in closing
    assert summary["planned_memory"] == {"mem/host_rss_mib_max": host}
    assert run.data.params["plan.host_total_mib"] == f"{host:.1f}"
    assert "plan.nvml_total_mib" not in run.data.params
    assert summary["report"] in run.data.tags["mlflow.note.content"]
    assert run.data.tags["mlflow.note.content"].startswith("Tiny XLM-R")  # the spec's description first
    assert run.info.experiment_id == info["experiment_id"] and run.info.status == "FINISHED"


def test_verbose_shows_the_library_lines(job, tmp_path, capfd):
    assert main(["launch", str(job), "--verbose"]) == 0
    out = capfd.readouterr().out
    assert "[INFO] [launch.py:152:main] WORLD INFO DICT" in out and "built successfully" in out


def test_the_mlflow_run_is_named_by_the_overrides_that_change_training(job, tmp_path, capfd):
    assert main(["launch", str(job), "--set", "training.optimizer.lr=0.001", "--set", "logging.progress=lines",
                 "--set", f"output_dir={tmp_path / 'out'}"]) == 0
    (run_dir,) = run_dirs(tmp_path)
    assert rundir.read_launch(run_dir)["overrides"] == ["training.optimizer.lr=0.001", "logging.progress=lines",
                                                         f"output_dir={tmp_path / 'out'}"]
    info = rundir.read_mlflow_run(run_dir)
    client = telemetry.client_for(info["tracking_uri"])
    assert client.get_run(info["run_id"]).info.run_name == "quickstart lr=0.001"   # where output goes: left out
    assert client.get_experiment(info["experiment_id"]).tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_complete_job_is_not_launched_again_and_its_results_stay(job, tmp_path, capfd):
    assert main(["launch", str(job)]) == 0
    (first,) = run_dirs(tmp_path)
    info = rundir.read_mlflow_run(first)
    client = telemetry.client_for(info["tracking_uri"])
    summary_before = (first / rundir.SUMMARY).read_text()
    capfd.readouterr()

    assert main(["launch", str(job), "--dry-run"]) == 0
    assert "a launch would do nothing: the job is complete" in capfd.readouterr().out
    assert main(["launch", str(job)]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"jobspec: quickstart is already complete: checkpoint "
                          f"{tmp_path / 'out' / 'checkpoints' / 'step40'} is at step 40 of 40. Nothing was started")
    assert f"results     {first}" in out and info["run_id"] in out
    assert "--new-run" in out and "--set output_dir=" in out and "training.max_steps=N" in out and "--continue" in out
    assert run_dirs(tmp_path) == [first] and (first / rundir.SUMMARY).read_text() == summary_before
    assert len(client.search_runs([info["experiment_id"]])) == 1

    # more steps: a launch with --continue resumes, and --dry-run says so
    assert main(["launch", str(job), "--dry-run", "--set", "training.max_steps=50", "--continue"]) == 0
    assert f"a launch would resume from {tmp_path / 'out' / 'checkpoints' / 'step40'} at step 40 and train " \
           "to step 50" in capfd.readouterr().out


def test_dry_run_of_a_new_job_says_it_starts_fresh(job, tmp_path, capfd):
    assert main(["launch", str(job), "--dry-run"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("jobspec: quickstart: xlm-roberta")
    assert "jobspec: a launch would start fresh and train steps 1-40" in out
    assert not (tmp_path / "out").exists()


def test_dry_run_refuses_what_a_launch_would_refuse(job, tmp_path, capfd):
    """--dry-run runs the checkpoint-ownership checks read-only: it does not say "start fresh" over
    checkpoints a launch would refuse to touch."""
    assert main(["launch", str(job)]) == 0
    capfd.readouterr()
    assert main(["launch", str(job), "--dry-run", "--set", "checkpoint.resume=never"]) == 2
    err = capfd.readouterr().err
    assert "checkpoint.resume: " in err and "checkpoint.resume is 'never'" in err and "Traceback" not in err
    assert main(["launch", str(job), "--dry-run", "--set", "name=another-job"]) == 2
    assert "belongs to job 'quickstart'" in capfd.readouterr().err
