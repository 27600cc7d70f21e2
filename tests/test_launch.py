"""`jobspec launch`: the supervised runner (fake runner scripts), checkpoint ownership, MLflow run
lifecycle through the CLI, and one real 2-rank launch (slow)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from io import BytesIO
from pathlib import Path

import psutil
import pytest
import yaml

from jobspec import rundir
from jobspec.launch import ownership, runner, supervise as supervision
from jobspec.tracking import telemetry
from jobspec.cli import main
from jobspec.errors import SpecError

# A stand-in for DeepSpeed's runner: starts two "ranks" (LOCAL_RANK in their env, the run dir in
# their argv) and exits with the worst rank's code. Like DeepSpeed's runner it has no signal handlers.
FAKE_RUNNER = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    run_dir, mode = sys.argv[1], sys.argv[2]
    print("runner up", os.environ.get("JOBSPEC_PROGRESS"), os.environ.get("JOBSPEC_STOP_AFTER_STEPS"), flush=True)
    if mode == "exit3":
        print("Traceback: something broke", flush=True)
        sys.exit(3)
    ranks = [subprocess.Popen([sys.executable, __file__, run_dir, "rank:" + mode],
                              env={**os.environ, "LOCAL_RANK": str(i)}) for i in range(2)]
    sys.exit(max(abs(r.wait()) for r in ranks))
''')
FAKE_RANK = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    run_dir, mode = Path(sys.argv[1]), sys.argv[2].split(":", 1)[1]
    rank = int(os.environ["LOCAL_RANK"])
    def graceful(sig, frame):
        (run_dir / f"{signal.Signals(sig).name}-{rank}").write_text("x")
        sys.exit(0)
    signal.signal(signal.SIGUSR1, graceful)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else graceful)
    if mode == "stubborn":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    (run_dir / f"ready-{rank}").write_text("x")
    print(f"rank {rank} ready", flush=True)
    if mode == "quick":
        sys.exit(0)
    if mode == "one-dies" and rank == 1:
        time.sleep(3)  # long enough to be seen alive, as real ranks are (model loading)
        os._exit(9)
    time.sleep(120)
''')


@pytest.fixture
def fake_runner(tmp_path):
    script = tmp_path / "fake_runner.py"
    script.write_text(f"import sys\nRANK, RUNNER = {FAKE_RANK!r}, {FAKE_RUNNER!r}\n"
                      "exec(RANK if sys.argv[2].startswith('rank:') else RUNNER)\n")
    return lambda run_dir, mode: [sys.executable, str(script), str(run_dir), mode]


def survivors(run_dir: Path) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def send_when_ready(run_dir: Path, sig: int, *, times: int = 1):
    def go():
        wait_for(lambda: (run_dir / "ready-0").exists() and (run_dir / "ready-1").exists())
        for _ in range(times):
            os.kill(os.getpid(), sig)
            time.sleep(0.2)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def supervise(argv, run_dir, **kw):
    echo = BytesIO()
    env = {**os.environ, "JOBSPEC_PROGRESS": "lines", "JOBSPEC_STOP_AFTER_STEPS": "4"}
    return supervision.run(argv, env, run_dir, echo=echo, **kw), echo.getvalue().decode()


def test_output_is_streamed_to_stdout_and_the_log(tmp_path, fake_runner):
    outcome, echoed = supervise(fake_runner(tmp_path, "quick"), tmp_path)
    assert outcome.exit_code == 0 and outcome.reason is None
    assert "runner up lines 4" in echoed and "rank 0 ready" in echoed and "rank 1 ready" in echoed
    assert (tmp_path / rundir.LAUNCHER_LOG).read_text() == echoed
    assert survivors(tmp_path) == []


def test_runner_exit_code_and_failure_reason(tmp_path, fake_runner):
    outcome, _ = supervise(fake_runner(tmp_path, "exit3"), tmp_path)
    assert outcome.exit_code == 3 and outcome.user_signal is None
    assert "exit" in outcome.reason and "Traceback: something broke" in outcome.reason


def test_sigusr1_reaches_the_ranks_and_not_the_runner(tmp_path, fake_runner):
    send_when_ready(tmp_path, signal.SIGUSR1)
    outcome, _ = supervise(fake_runner(tmp_path, "wait"), tmp_path)
    assert outcome.exit_code == 0 and outcome.user_signal is None  # the runner survived SIGUSR1
    assert (tmp_path / "SIGUSR1-0").exists() and (tmp_path / "SIGUSR1-1").exists()
    assert survivors(tmp_path) == []


def test_sigterm_is_forwarded_and_reported_as_128_plus_sig(tmp_path, fake_runner):
    send_when_ready(tmp_path, signal.SIGTERM)
    outcome, _ = supervise(fake_runner(tmp_path, "wait"), tmp_path, kill_grace_s=20)
    assert outcome.exit_code == 128 + signal.SIGTERM and outcome.user_signal == signal.SIGTERM
    assert (tmp_path / "SIGTERM-0").exists() and (tmp_path / "SIGTERM-1").exists()
    assert "SIGTERM" in outcome.reason
    assert survivors(tmp_path) == []


def test_sigint_then_grace_then_sigkill_leaves_no_orphans(tmp_path, fake_runner):
    send_when_ready(tmp_path, signal.SIGINT)
    started = time.monotonic()
    outcome, _ = supervise(fake_runner(tmp_path, "stubborn"), tmp_path, kill_grace_s=1.5)
    assert 1.5 <= time.monotonic() - started < 15
    assert outcome.exit_code == 130 and outcome.user_signal == signal.SIGINT
    assert survivors(tmp_path) == []


def test_a_dead_rank_brings_the_job_down(tmp_path, fake_runner):
    started = time.monotonic()
    outcome, _ = supervise(fake_runner(tmp_path, "one-dies"), tmp_path, rank_exit_grace_s=2)
    assert time.monotonic() - started < 30
    assert outcome.exit_code != 0 and outcome.user_signal is None
    assert "a rank exited" in outcome.reason
    assert survivors(tmp_path) == []


def test_run_dirs_are_new_and_named_by_utc_time(tmp_path):
    first, second = rundir.create_run_dir(tmp_path), rundir.create_run_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{4}", first.name)


def test_free_port_is_bindable():
    port = runner.free_port()
    assert 1024 <= port <= 65535 and not runner.port_in_use(port)


def test_unwritable_directories_are_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SpecError) as err:
        rundir.ensure_writable(blocker / "runs", ("output_dir",))
    assert "output_dir" in err.value.render() and "writable" in err.value.render()


def ckpt_spec(tmp_path, name="job-a", resume="auto") -> dict:
    return {"name": name, "checkpoint": {"dir": str(tmp_path / "ckpt"), "resume": resume}}


def test_checkpoint_ownership(tmp_path):
    spec = ckpt_spec(tmp_path)
    assert ownership.claim_checkpoints(spec) is None  # empty: nothing to resume
    ownership.write_owner(spec, tmp_path / "a.yaml", "run-123")
    owner = json.loads((tmp_path / "ckpt" / ownership.OWNER_FILE).read_text())
    assert owner["job"] == "job-a" and owner["mlflow_run_id"] == "run-123" and owner["spec"].endswith("a.yaml")
    assert ownership.claim_checkpoints(spec) is None  # still no checkpoints
    (tmp_path / "ckpt" / "step4").mkdir()
    assert ownership.claim_checkpoints(spec) == "run-123"  # resume auto: same MLflow run
    with pytest.raises(SpecError, match="resume is 'never'"):
        ownership.claim_checkpoints(ckpt_spec(tmp_path, resume="never"))
    with pytest.raises(SpecError, match="belongs to job 'job-a'"):
        ownership.claim_checkpoints(ckpt_spec(tmp_path, name="job-b"))


def test_unclaimed_checkpoints_are_refused(tmp_path):
    (tmp_path / "ckpt" / "latest").parent.mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step2")
    with pytest.raises(SpecError, match="no jobspec job claims"):
        ownership.claim_checkpoints(ckpt_spec(tmp_path))


# --- through the CLI, with the real validation/compiler and a fake runner ----------------------

def write_job(tmp_path: Path, mlflow: dict | None = None, name: str = "tiny-launch") -> Path:
    spec = {
        "name": name,
        "model": {"architecture": "bert", "config": {"hidden_size": 32, "num_hidden_layers": 2,
                                                     "num_attention_heads": 2, "intermediate_size": 64,
                                                     "vocab_size": 512, "max_position_embeddings": 64}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 16, "vocab_range": [5, 500],
                               "labels": "learnable"}, "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": 6, "micro_batch_size": 4, "optimizer": {"lr": 1e-3}},
        "resources": {"gpus_per_node": 2},
        "output_dir": "out",
        "logging": {"every_n_steps": 1, "progress": "lines",
                    "mlflow": mlflow or {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                         "experiment": "launch-tests"}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def only_run_dir(tmp_path: Path, name: str = "tiny-launch") -> Path:
    runs = list((tmp_path / "out").glob("run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def use_fake_runner(monkeypatch, fake_runner, mode):
    monkeypatch.setattr(runner, "resolve_runner", lambda argv: fake_runner(argv[argv.index("--run-dir") + 1], mode))


def mlflow_run_of(run_dir: Path):
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = telemetry._client(info["tracking_uri"])
    return client, client.get_run(info["run_id"])


def test_launch_kill_9_of_a_rank_ends_in_a_failed_run(tmp_path, fake_runner, monkeypatch):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "wait")

    def kill_a_rank():
        wait_for(lambda: list((tmp_path / "out").glob("run-*/ready-1")))
        run_dir = only_run_dir(tmp_path)
        time.sleep(1.5)  # real ranks live for a while before dying; let the watchdog see them
        ranks = [p for p in psutil.process_iter(["cmdline"]) if "rank:wait" in (p.info["cmdline"] or [])
                 and str(run_dir) in p.info["cmdline"]]
        ranks[0].kill()
    threading.Thread(target=kill_a_rank, daemon=True).start()
    monkeypatch.setattr(supervision, "RANK_EXIT_GRACE_S", 2.0)
    started = time.monotonic()
    code = main(["launch", str(job), "--set", "checkpoint.resume=never"])
    assert time.monotonic() - started < 60
    run_dir = only_run_dir(tmp_path)
    assert code == 128 + 9 or code != 0
    client, run = mlflow_run_of(run_dir)
    assert run.info.status == "FAILED"
    assert run.data.tags["jobspec.exit_code"] == str(code) and run.data.tags["jobspec.failure_reason"]
    assert json.loads((run_dir / "summary.json").read_text())["exit_code"] == code
    assert {"spec.yaml", "resolved.yaml", "ds_config.json", "command.txt", "summary.json"} <= \
        {a.path for a in client.list_artifacts(run.info.run_id)}
    owner = json.loads((tmp_path / "out" / "checkpoints" / ownership.OWNER_FILE).read_text())
    assert owner["mlflow_run_id"] == run.info.run_id and owner["job"] == "tiny-launch"
    assert survivors(run_dir) == []


def test_launch_success_is_finished_and_passes_the_stop_flag(tmp_path, fake_runner, monkeypatch, capfd):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job), "--stop-after-steps", "3"]) == 0
    run_dir = only_run_dir(tmp_path)
    assert "runner up lines 3" in (run_dir / rundir.LAUNCHER_LOG).read_text()
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED" and "jobspec.failure_reason" not in run.data.tags
    command = (run_dir / "command.txt").read_text()  # what really ran (here: the fake runner)
    assert command.split() == fake_runner(run_dir, "quick")


def test_unreachable_required_mlflow_is_a_clean_exit_1(tmp_path, fake_runner, monkeypatch, capsys):
    job = write_job(tmp_path, mlflow={"tracking_uri": "http://bob:pw123456@127.0.0.1:1", "required": True})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    started = time.monotonic()
    assert main(["launch", str(job)]) == 1   # the spec is fine; the server is down: a runtime failure
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert "http://***@127.0.0.1:1" in err and "pw123456" not in err and "Traceback" not in err
    assert err.startswith("jobspec: run failed: ") and len(err.strip().splitlines()) == 1
    assert list((tmp_path / "out").glob("run-*")) == []  # nothing half-made is left


def test_unreachable_optional_mlflow_warns_and_keeps_going(tmp_path, fake_runner, monkeypatch, caplog):
    job = write_job(tmp_path, mlflow={"tracking_uri": "http://127.0.0.1:1", "required": False})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    run_dir = only_run_dir(tmp_path)
    assert not (run_dir / "mlflow_run.json").exists()
    assert "unavailable" in caplog.text and "metrics.jsonl" in caplog.text


def test_dry_run_starts_nothing(tmp_path, monkeypatch, capsys):
    job = write_job(tmp_path)
    monkeypatch.setattr(supervision, "run", lambda *a, **k: pytest.fail("dry run started the runner"))
    assert main(["launch", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"train_micro_batch_size_per_gpu": 4' in out
    command = out.strip().splitlines()[-1]
    assert "--module jobspec.train.worker --run-dir" in command and "--num_gpus 2" in command
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


def test_resume_never_over_existing_checkpoints_refuses(tmp_path, fake_runner, monkeypatch, capsys):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    ckpt = tmp_path / "out" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / ownership.OWNER_FILE).write_text(json.dumps({"job": "tiny-launch", "mlflow_run_id": None}))
    (ckpt / "latest").write_text("step6")
    assert main(["launch", str(job), "--set", "checkpoint.resume=never"]) == 2
    assert "checkpoint.resume=auto" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("run-*"))


# --- the real thing ------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_two_rank_launch_logs_a_finished_mlflow_run(tmp_path):
    job = write_job(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(job)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    client, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "6" and run.data.params["derived.world_size"] == "2"
    assert set(rundir.START_ARTIFACTS) | {"summary.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    samples = client.get_metric_history(run.info.run_id, "perf/samples_per_s")
    rss = client.get_metric_history(run.info.run_id, "mem/host_rss_mib_max")
    assert samples and all(m.value > 0 for m in samples)
    assert rss and all(m.value > 0 for m in rss)
    assert not client.get_metric_history(run.info.run_id, "mem/peak_allocated_mib_max")  # no GPU here
    assert survivors(run_dir) == []


# --- the MLflow run is made while the runner starts (jobspec/launch/tracking_start.py) -----------

def test_the_runner_starts_before_the_mlflow_run_is_made(tmp_path, fake_runner, monkeypatch):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    real_start_run, seen = telemetry.start_run, {}

    def slow_start_run(spec, launch, derived, text, run_dir, **kwargs):
        deadline = time.monotonic() + 30
        while not (Path(run_dir) / "ready-1").exists():  # the ranks are up before the run exists
            assert time.monotonic() < deadline
            time.sleep(0.02)
        seen["ranks_env"] = rundir.read_tracking(run_dir)  # not decided yet while the ranks start
        return real_start_run(spec, launch, derived, text, run_dir, **kwargs)
    monkeypatch.setattr(telemetry, "start_run", slow_start_run)
    assert main(["launch", str(job)]) == 0
    run_dir = only_run_dir(tmp_path)
    assert seen["ranks_env"] is None and rundir.read_tracking(run_dir) == {"status": "on", "reason": None}
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED" and "plan.peak_allocated_mib" in run.data.params
    owner = json.loads((tmp_path / "out" / "checkpoints" / ownership.OWNER_FILE).read_text())
    assert owner["mlflow_run_id"] == run.info.run_id


def test_a_required_run_that_cannot_be_made_fails_the_launch_and_tells_the_ranks(tmp_path, fake_runner,
                                                                                 monkeypatch, capsys):
    job = write_job(tmp_path, mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "required": True})
    use_fake_runner(monkeypatch, fake_runner, "quick")

    def broken(*args, **kwargs):
        raise telemetry.TrackingUnavailable("OperationalError: database is locked")
    monkeypatch.setattr(telemetry, "start_run", broken)
    assert main(["launch", str(job)]) == 1
    err = capsys.readouterr().err
    assert "database is locked" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    decision = rundir.read_tracking(only_run_dir(tmp_path))
    assert decision["status"] == "failed" and "database is locked" in decision["reason"]
    with pytest.raises(Exception, match="database is locked"):  # what every rank does with it
        rundir.wait_for_tracking(only_run_dir(tmp_path), environ={rundir.TRACKING_PENDING_ENV: "1"})


def test_ranks_wait_for_the_decision_only_when_told_to(tmp_path):
    assert rundir.wait_for_tracking(tmp_path, environ={}) is None  # a worker started by hand
    pending = {rundir.TRACKING_PENDING_ENV: "1"}
    assert rundir.wait_for_tracking(tmp_path, environ=pending, timeout_s=0.1) is None  # gave up: jsonl only
    threading.Timer(0.2, rundir.write_tracking, args=(tmp_path, "off")).start()
    assert rundir.wait_for_tracking(tmp_path, environ=pending, timeout_s=10)["status"] == "off"
