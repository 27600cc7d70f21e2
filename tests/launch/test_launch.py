"""`jobspec launch`: the supervised runner (fake runner scripts), checkpoint ownership, MLflow run
lifecycle through the CLI, and one real 2-rank launch (slow)."""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from io import BytesIO
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from jobspec import lifeline, rundir
from jobspec import status as run_status
from jobspec.launch import backends, ownership, runner, supervise as supervision
from jobspec.tracking import orphans
from jobspec.tracking import run as tracking
from jobspec.cli import main
from jobspec.errors import SpecError
from conftest import REPO_ROOT

# A stand-in for DeepSpeed's runner: starts two "ranks" (LOCAL_RANK in their env, the run dir in
# their argv) and exits with the worst rank's code. Like DeepSpeed's runner it has no signal handlers.
FAKE_RUNNER = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    run_dir, mode = sys.argv[1], sys.argv[2]
    print("runner up", os.environ.get("JOBSPEC_PROGRESS"), os.environ.get("JOBSPEC_STOP_AFTER_STEPS"), flush=True)
    if mode == "exit3":
        print("Traceback: something broke", flush=True)
        sys.exit(3)
    if mode == "ds-sigkill":  # DeepSpeed's launch.py after a rank died of SIGKILL: sys.exit(-9), i.e. 247
        print("[ERROR] [launch.py:329:sigkill_handler] ['python', '-u'] exits with return code = -9", flush=True)
        sys.exit(247)
    ranks = [subprocess.Popen([sys.executable, __file__, run_dir, "rank:" + mode],
                              env={**os.environ, "LOCAL_RANK": str(i)}) for i in range(2)]
    sys.exit(max(abs(r.wait()) for r in ranks))
''')
DISK_FULL = ("checkpoint step4 could not be saved to /ckpt: No space left on device (writing /ckpt/step4/x.pt on "
             "rank 1); the incomplete step4 was removed and `latest` still names step2: free space, or set "
             "checkpoint.dir to a disk with room")
FAKE_RANK = f"DISK_FULL = {DISK_FULL!r}\n" + textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    run_dir, mode = Path(sys.argv[1]), sys.argv[2].split(":", 1)[1]
    rank = int(os.environ["LOCAL_RANK"])
    def write_summary(kind):  # rank 0 writes summary.json as the worker does
        import json, yaml
        ckpt = Path(yaml.safe_load((run_dir / "resolved.yaml").read_text())["checkpoint"]["dir"])
        if rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "latest").write_text("step3")
            summary = {"preempt": {"status": "preempted", "steps": 3, "total_steps": 6, "checkpoint": "step3"},
                       "finish": {"status": "finished", "steps": 6, "total_steps": 6, "checkpoint": "step6"},
                       "diskfull": {"status": "failed", "steps": 4, "error": DISK_FULL}}[kind]
            (run_dir / "summary.json").write_text(json.dumps(summary))
    def graceful(sig, frame):
        (run_dir / f"{signal.Signals(sig).name}-{rank}").write_text("x")
        if mode == "stop":  # the worker: a SIGUSR1/SIGTERM stops it at a step boundary, with a checkpoint
            write_summary("preempt")
        sys.exit(0)
    signal.signal(signal.SIGUSR1, graceful)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else graceful)
    if mode == "stubborn":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if mode == "watch":  # what jobspec.train.worker does: end the job once the launcher is gone
        from jobspec import lifeline
        lifeline.watch_launcher(lambda record: lifeline.end_orphaned_job(record), interval_s=0.2)
    (run_dir / f"ready-{rank}").write_text("x")
    print(f"rank {rank} ready", flush=True)
    if mode == "quick":
        sys.exit(0)
    if mode == "dataerror":  # the real worker's error path, its data build failing as on a bad row past
        os.environ["RANK"] = str(rank)  # the pre-flight's (build_datasets raises datacheck.locate_error)
        import yaml
        from jobspec.data import record_checks as datacheck
        from jobspec.train import worker
        def train(run_dir, state, started):
            raise datacheck.locate_error(yaml.safe_load((run_dir / "resolved.yaml").read_text()), "train")
        worker.train = train
        worker._destroy_process_group = lambda: None  # no process group here (and no torch import)
        sys.exit(worker.main(["--run-dir", str(run_dir)]))
    if mode in ("preempt", "finish", "diskfull"):
        write_summary(mode)
        if mode == "diskfull":
            print("ERROR: " + DISK_FULL, flush=True)
            for i in range(40):  # what a failing job prints after the line that matters
                print(f"rank {rank} traceback line {i}", flush=True)
        sys.exit(1 if mode == "diskfull" else 0)
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


def test_a_second_sigint_ends_the_job_at_once_as_130(tmp_path, fake_runner):
    """Ctrl-C, then Ctrl-C again: the second one does not wait out the checkpoint's grace (60 s here)."""
    send_when_ready(tmp_path, signal.SIGINT, times=2)
    started = time.monotonic()
    outcome, echoed = supervise(fake_runner(tmp_path, "stubborn"), tmp_path, kill_grace_s=60)
    assert time.monotonic() - started < 15   # bound: the 0.2 s between the signals, the 0.2 s poll, the kill
    assert outcome.exit_code == 130 and outcome.at_once and outcome.user_signal == signal.SIGINT
    assert "the ranks finish the current step and save a checkpoint" in echoed
    assert "SIGINT again: ending the job now, without waiting for the checkpoint" in echoed
    assert survivors(tmp_path) == []
    end = run_status.ending(outcome.exit_code, outcome.user_signal, outcome.reason, None, at_once=True)
    assert (end.label, end.exit_code) == ("killed", 130)
    line = run_status.closing_line(end, tmp_path, "jobspec launch job.yaml", "checkpoint /c/step4 (step 4 of 9)")
    assert "no checkpoint was saved by this stop; jobspec launch job.yaml resumes from the last one saved " \
           "before it, checkpoint /c/step4 (step 4 of 9)" in line
    assert "starts it again from step 0" in run_status.closing_line(end, tmp_path, "jobspec launch job.yaml")


def test_repeated_sigterms_keep_waiting_for_the_checkpoint(tmp_path, fake_runner):
    """`scancel` signals every task, launch.sh passes a TERM on: a repeat is not a second Ctrl-C."""
    send_when_ready(tmp_path, signal.SIGTERM, times=3)
    started = time.monotonic()
    outcome, _ = supervise(fake_runner(tmp_path, "stubborn"), tmp_path, kill_grace_s=3)
    assert outcome.exit_code == 128 + signal.SIGTERM and not outcome.at_once
    assert time.monotonic() - started >= 3   # the repeats did not cut the grace short (a second SIGINT would)
    assert survivors(tmp_path) == []


HANGUP = textwrap.dedent('''
    import os, sys
    from pathlib import Path
    from jobspec.launch import supervise
    run_dir = Path(sys.argv[1])
    with supervise.HeldStops() as stops:
        stops.running(run_dir)
        outcome = supervise.run(sys.argv[2:], {**os.environ}, run_dir, kill_grace_s=60)
        print(f"closing: exit {outcome.exit_code} user_signal {outcome.user_signal}", flush=True)
''')


def test_sighup_stops_gracefully_and_what_follows_goes_to_launcher_log(tmp_path, fake_runner):
    """A closed terminal or a dropped ssh session (SIGHUP): the ranks checkpoint as for SIGTERM, and the
    launcher's later output (the closing lines) lands in launcher.log instead of a dead terminal."""
    script = tmp_path / "hangup.py"
    script.write_text(HANGUP)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), *fake_runner(tmp_path, "wait")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (tmp_path / "ready-0").exists() and (tmp_path / "ready-1").exists())
    time.sleep(0.3)   # the fake ranks print "ready" after writing the file: let the relay pass it on
    proc.send_signal(signal.SIGHUP)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0 and "closing" not in out and "Traceback" not in out, out
    assert (tmp_path / "SIGTERM-0").exists() and (tmp_path / "SIGTERM-1").exists()  # forwarded as SIGTERM
    assert f"closing: exit {128 + signal.SIGHUP} user_signal {int(signal.SIGHUP)}" in \
        (tmp_path / rundir.LAUNCHER_LOG).read_text()
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


class ScriptedBackend:
    """A launch backend (launch/backends.Backend) starting a given command instead of DeepSpeed's."""

    def __init__(self, argv: list[str]):
        self.command = argv

    def argv(self, plan) -> list[str]:
        return self.command

    def hostfile_text(self, plan) -> None:
        return None


def use_fake_runner(monkeypatch, fake_runner, mode):
    monkeypatch.setattr(backends, "backend_for", lambda plan, **_: ScriptedBackend(fake_runner(plan.run_dir, mode)))
    monkeypatch.setenv("JOBSPEC_FORK_RANKS", "0")   # no standby node launcher for a scripted runner


def mlflow_run_of(run_dir: Path):
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = tracking.client_for(info["tracking_uri"])
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
    before = time.time()
    assert main(["launch", str(job), "--stop-after-steps", "3"]) == 0
    run_dir = only_run_dir(tmp_path)
    # the launcher's share of the start-up the ranks print (train/startup.py): no data pass
    startup = json.loads((run_dir / "launch.json").read_text())["startup"]
    assert startup["data"] is None and 0 <= startup["data_s"] < 5
    assert startup["started"] <= before   # this process started before the launch was called
    assert "runner up lines 3" in (run_dir / rundir.LAUNCHER_LOG).read_text()
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED" and "jobspec.failure_reason" not in run.data.tags
    command = (run_dir / "command.txt").read_text()  # what really ran (here: the fake runner)
    assert command.split() == fake_runner(run_dir, "quick")


def test_a_stop_with_a_checkpoint_is_exit_75_killed_preempted_and_the_resume_supersedes_it(
        tmp_path, fake_runner, monkeypatch, capsys):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "preempt")
    assert main(["launch", str(job), "--stop-after-steps", "3", "--set", "training.max_steps=6"]) == 75
    out = capsys.readouterr().out
    first = only_run_dir(tmp_path)
    assert "jobspec: stopped, not finished (exit 75): stopped by --stop-after-steps 3 at step 3 of 6; " \
           "checkpoint step3" in out
    assert f"jobspec: resume with: jobspec launch {job} --set training.max_steps=6\n" in out
    client, run = mlflow_run_of(first)
    assert run.info.status == "KILLED"
    assert run.data.tags["jobspec.status"] == "preempted" and "step 3 of 6" in run.data.tags["jobspec.stop_reason"]
    assert run.data.tags["jobspec.exit_code"] == "75" and "jobspec.failure_reason" not in run.data.tags

    # the printed command resumes (same checkpoints, same MLflow run) and the finish supersedes the stop
    use_fake_runner(monkeypatch, fake_runner, "finish")
    assert main(["launch", str(job), "--set", "training.max_steps=6"]) == 0
    out = capsys.readouterr().out
    assert " finished: " in out and "(exit 0)" in out and "stopped" not in out
    _, run = mlflow_run_of(first)
    assert run.info.status == "FINISHED" and run.data.tags["jobspec.status"] == "finished"
    assert "jobspec.stop_reason" not in run.data.tags and run.data.tags["jobspec.exit_code"] == "0"


def test_sigterm_with_a_checkpoint_is_exit_75_killed_preempted_and_says_how_to_resume(tmp_path, fake_runner,
                                                                                      monkeypatch, capsys):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "stop")

    def terminate_when_ready():  # `kill PID`, systemd, a scheduler's preemption: SIGTERM to the launcher
        wait_for(lambda: len(list((tmp_path / "out").glob("run-*/ready-*"))) == 2
                 and callable(signal.getsignal(signal.SIGTERM)), timeout=60)  # supervise's handler is in place
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=terminate_when_ready, daemon=True).start()
    assert main(["launch", str(job), "--set", "training.max_steps=6"]) == 75
    out = capsys.readouterr().out
    run_dir = only_run_dir(tmp_path)
    assert (run_dir / "SIGTERM-0").exists() and (run_dir / "SIGTERM-1").exists()  # forwarded to both ranks
    assert "jobspec: stopped, not finished (exit 75): stopped by SIGTERM from the user at step 3 of 6; " \
           "checkpoint step3" in out
    assert f"jobspec: resume with: jobspec launch {job} --set training.max_steps=6\n" in out
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "KILLED" and run.data.tags["jobspec.status"] == "preempted"
    assert run.data.tags["jobspec.stop_reason"].startswith("stopped by SIGTERM from the user at step 3 of 6")
    assert run.data.tags["jobspec.exit_code"] == "75" and "jobspec.failure_reason" not in run.data.tags
    assert survivors(run_dir) == []


def test_a_bad_data_row_found_on_the_ranks_is_exit_2_naming_file_and_line_once(tmp_path, fake_runner,
                                                                              monkeypatch, capsys):
    # 1,500 rows, a non-UTF-8 byte in row 1,200: past the bytes the pre-launch data check reads (made
    # 4 KiB here, as a file past its 32 MiB would be), so the ranks are the ones that find it
    from jobspec.data import record_checks as datacheck
    monkeypatch.setattr(datacheck, "PREFLIGHT_BYTES", 4096)
    rows = [json.dumps({"text": f"row {i}", "label": i % 2}).encode() for i in range(1500)]
    rows[1199] = b'{"text": "b\xffd", "label": 0}'
    data = tmp_path / "train.jsonl"
    data.write_bytes(b"\n".join(rows) + b"\n")
    job = write_job(tmp_path)
    spec = yaml.safe_load(job.read_text())
    # a real tokenizer: launch's data pre-flight loads it before any rank starts
    spec["data"] = {"train": str(data), "tokenizer": str(REPO_ROOT / "jobs" / "data" / "tokenizer"), "max_length": 64,
                    "num_workers": 0, "pin_memory": False}
    spec["model"]["config"]["vocab_size"] = 2048   # the tokenizer's (a smaller vocabulary is refused first)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    use_fake_runner(monkeypatch, fake_runner, "dataerror")
    assert main(["launch", str(job)]) == 2
    out, err = capsys.readouterr()
    message = f"data.train: {data}:1200: byte 12 of the line (0xff) is not valid UTF-8"
    assert "Traceback" not in out + err
    printed = [line for line in out.splitlines() if message in line]
    # rank 0's line and the launcher's last line; rank 1's copy only in launcher.log
    assert len(printed) == 2 and printed[-1] == out.strip().splitlines()[-1] and printed[-1].startswith("jobspec: ")
    run_dir = only_run_dir(tmp_path)
    assert f"jobspec-log: rank 1: <spec>: {message}" in (run_dir / rundir.LAUNCHER_LOG).read_text()
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FAILED" and message in run.data.tags["jobspec.failure_reason"]
    assert run.data.tags["jobspec.exit_code"] == "2" and run.data.tags["jobspec.status"] == "failed"


def test_a_rank_failure_reason_is_rank_0s_line_and_a_later_finish_clears_it(tmp_path, fake_runner, monkeypatch,
                                                                           capsys):
    job = write_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "diskfull")
    assert main(["launch", str(job)]) == 1
    out = capsys.readouterr().out
    assert out.strip().endswith(f"jobspec: {DISK_FULL}")  # the line that matters, not the last rank output
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["error"] == DISK_FULL
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FAILED" and run.data.tags["jobspec.failure_reason"] == DISK_FULL
    assert run.data.tags["jobspec.status"] == "failed"
    use_fake_runner(monkeypatch, fake_runner, "finish")
    assert main(["launch", str(job)]) == 0
    _, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED" and "jobspec.failure_reason" not in run.data.tags


def test_a_rank_killed_by_a_signal_is_128_plus_n_not_deepspeeds_247(tmp_path, fake_runner):
    outcome, _ = supervise(fake_runner(tmp_path, "ds-sigkill"), tmp_path)
    assert outcome.exit_code == 128 + signal.SIGKILL
    assert supervision.exit_code_of(247) == 247  # a plain 247 without DeepSpeed's line stays what it is


def test_the_resume_command_turns_resume_to_auto():
    assert run_status.resume_command("job.yaml", ["a=1"], "auto") == "jobspec launch job.yaml --set a=1"
    assert run_status.resume_command("j b.yaml", ["checkpoint.resume=never", "a=1"], "never") == \
        "jobspec launch 'j b.yaml' --set a=1 --set checkpoint.resume=auto"


# --- ranks never outlive the launcher; a run whose launcher is gone is closed by the next command ----

LAUNCHER = textwrap.dedent('''
    import os, sys
    from io import BytesIO
    from pathlib import Path
    from jobspec.launch import supervise
    argv, run_dir = sys.argv[1:-1], Path(sys.argv[-1])
    supervise.run(argv, dict(os.environ), run_dir, echo=BytesIO())
''')


def test_sigkill_of_the_launcher_takes_the_runner_and_the_ranks_with_it(tmp_path, fake_runner):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *fake_runner(tmp_path, "watch"), str(tmp_path)])
    try:
        wait_for(lambda: (tmp_path / "ready-0").exists() and (tmp_path / "ready-1").exists())
        job = survivors(tmp_path)
        assert len(job) >= 3, job  # the runner and two ranks (plus the launcher's own cmdline)
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        wait_for(lambda: survivors(tmp_path) == [], timeout=10)
        assert time.monotonic() - killed < 5
    finally:
        for pid in survivors(tmp_path):
            os.kill(pid, signal.SIGKILL)


def dead_launcher() -> dict:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    record = {"host": socket.gethostname(), "pid": proc.pid, "started": psutil.Process(proc.pid).create_time()}
    proc.kill()
    proc.wait()
    return record


def orphaned_run(tmp_path, name: str, record: dict, summary: dict | None = None) -> Path:
    """A run directory whose MLflow run is RUNNING and whose launcher is `record`."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.client_for(uri)
    experiment = client.get_experiment_by_name("launch-tests") or client.get_experiment(
        client.create_experiment("launch-tests"))
    run = client.create_run(experiment.experiment_id, run_name=name)
    run_dir = tmp_path / "out" / f"run-{name}"
    run_dir.mkdir(parents=True)
    rundir.write_mlflow_run(run_dir, {"tracking_uri": uri, "experiment_id": experiment.experiment_id,
                                      "run_id": run.info.run_id})
    (run_dir / "metrics.jsonl").write_text("")
    rundir.write_launcher(run_dir, record)
    client.set_tag(run.info.run_id, orphans.RUN_DIR_TAG, str(run_dir))
    if summary:
        rundir.write_summary(run_dir, rundir.RunSummary.from_dict(summary))
    return run_dir


def test_a_run_whose_launcher_is_gone_is_closed_by_the_next_sync_launch_or_report(tmp_path, fake_runner,
                                                                               monkeypatch, capsys):
    here = socket.gethostname()
    by_sync = orphaned_run(tmp_path, "sync", dead_launcher())
    alive = orphaned_run(tmp_path, "alive", lifeline.identity())
    remote = orphaned_run(tmp_path, "remote", {"host": here + "-elsewhere", "pid": 1, "started": 0})
    assert main(["sync", str(by_sync)]) == 0
    assert "closed run run-sync as FAILED: its launcher" in capsys.readouterr().err
    _, run = mlflow_run_of(by_sync)
    assert run.info.status == "FAILED" and run.data.tags["jobspec.status"] == "failed"
    assert "is gone and the run never ended; found by `jobspec sync`" in run.data.tags["jobspec.failure_reason"]
    assert rundir.read_launcher(by_sync)["ended"]["by"] == "jobspec sync"
    assert json.loads((by_sync / "summary.json").read_text())["status"] == "failed"

    # rank 0 had written its summary (preempted) before the launcher died: closed as what it was
    by_launch = orphaned_run(tmp_path, "launch", dead_launcher(),
                             {"status": "preempted", "steps": 3, "total_steps": 6, "checkpoint": "step3"})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(write_job(tmp_path)), "--set", "checkpoint.resume=never"]) == 0
    _, run = mlflow_run_of(by_launch)
    assert run.info.status == "KILLED" and run.data.tags["jobspec.status"] == "preempted"

    by_report = orphaned_run(tmp_path, "report", dead_launcher())
    assert main(["report", "launch-tests", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                 "--no-plots", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert "closed run run-report as FAILED" in err and "closed run" not in out  # the csv stays clean
    _, run = mlflow_run_of(by_report)
    assert run.info.status == "FAILED" and "found by `jobspec report`" in run.data.tags["jobspec.failure_reason"]
    for untouched in (alive, remote):  # a live launcher, or one on a host we cannot see, is left alone
        assert mlflow_run_of(untouched)[1].info.status == "RUNNING"
        assert "ended" not in rundir.read_launcher(untouched)


def test_lifeline_knows_a_dead_launcher_from_a_live_or_remote_one():
    assert lifeline.is_alive(lifeline.identity()) is True
    assert lifeline.is_alive(dead_launcher()) is False
    reused = {**lifeline.identity(), "started": lifeline.identity()["started"] - 100}  # the pid, reused
    assert lifeline.is_alive(reused) is False
    assert lifeline.is_alive({"host": "elsewhere", "pid": os.getpid(), "started": 0}) is None


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
    # one node: DeepSpeed's launch.py itself, two local ranks (tests/launch/test_runner.py)
    assert "-m jobspec.launch.ds_launch" in command and "jobspec.train.worker --run-dir" in command
    world_info = next(a for a in command.split() if a.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(world_info)) == {"localhost": [0, 1]}
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

def tensorboard_events(run_dir: Path):
    """The run's TensorBoard directory as TensorBoard's own reader loads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_status(events) -> str:
    """The final status of the run's HParams session (written by the launcher when the ranks are gone)."""
    from tensorboard.plugins.hparams import api_pb2
    from tensorboard.plugins.hparams import metadata as hparams
    content = events.PluginTagToContent(hparams.PLUGIN_NAME)[hparams.SESSION_END_INFO_TAG]
    return api_pb2.Status.Name(hparams.parse_session_end_info_plugin_data(content).status)


@pytest.mark.slow
def test_real_two_rank_launch_logs_a_finished_mlflow_run(tmp_path):
    job = write_job(tmp_path)
    env = {**os.environ, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.2"}  # MLflow's 10 s, for a short run
    proc = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(job), "--set", "logging.system_metrics=true",
                           "--set", "logging.tensorboard.enabled=true"],   # the second tracker beside MLflow
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    client, run = mlflow_run_of(run_dir)
    assert run.info.status == "FINISHED"
    assert "system/cpu_utilization_percentage" in run.data.metrics  # one node: no node prefix
    assert run.data.params["training.max_steps"] == "6" and run.data.params["derived.world_size"] == "2"
    assert set(rundir.START_ARTIFACTS) | {"summary.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    samples = client.get_metric_history(run.info.run_id, "perf/samples_per_s")
    rss = client.get_metric_history(run.info.run_id, "mem/host_rss_mib_max")
    assert samples and all(m.value > 0 for m in samples)
    assert rss and all(m.value > 0 for m in rss)
    assert not client.get_metric_history(run.info.run_id, "mem/peak_allocated_mib_max")  # no GPU here
    assert survivors(run_dir) == []
    # command.txt is the argv that ran, as launch.json records it: one node, DeepSpeed's launch.py itself
    command = shlex.split((run_dir / "command.txt").read_text())
    assert command == json.loads((run_dir / "launch.json").read_text())["argv"]
    assert command[:4] == [sys.executable, "-u", "-m", runner.NODE_LAUNCHER] and command[-2:] == ["--run-dir", str(run_dir)]
    # TensorBoard, fed by the same sink: every point of metrics.jsonl at its step, MLflow's values, the end
    events = tensorboard_events(run_dir)
    assert sorted((tag, e.step) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)) == \
        sorted((key, step) for key, _, _, step in rundir.read_metric_points(run_dir))
    assert [(e.step, e.value) for e in events.Scalars("perf/samples_per_s")] == \
        [(m.step, float(np.float32(m.value))) for m in samples]   # event files hold float32
    assert "tiny-launch" in events.Tensors("jobspec/resolved_spec")[0].tensor_proto.string_val[0].decode()
    assert tensorboard_status(events) == "STATUS_SUCCESS"
    # what the user saw: the header, no DeepSpeed INFO lines, the closing summary (also in summary.json)
    out = proc.stdout
    assert out.startswith("jobspec: tiny-launch: bert sequence-classification, ") and "no GPU: 2 CPU ranks" in out
    assert "[INFO]" not in out and "Setting accelerator" not in out and "[INFO]" in (run_dir / "launcher.log").read_text()
    assert "before it has started" not in (run_dir / "launcher.log").read_text()  # the scheduler starts at step 0
    closing = out[out.index("jobspec: tiny-launch finished: 6/6 steps"):].strip()
    assert json.loads((run_dir / "summary.json").read_text())["report"] == closing
    assert closing in run.data.tags["mlflow.note.content"]
    # launched again, the complete job starts nothing
    again = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(job)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "is already complete" in again.stdout and only_run_dir(tmp_path) == run_dir
    assert f"results     {run_dir}" in again.stdout   # the run that wrote the checkpoint
    # more steps: refused without --continue (the checkpoints were trained under max_steps 6) ...
    longer = [sys.executable, "-m", "jobspec", "launch", str(job), "--set", "training.max_steps=8"]
    refused = subprocess.run(longer, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "training.max_steps: changed since those checkpoints: 6 -> 8" in refused.stderr
    # ... and with it, the same MLflow run goes on and records the change as its segment 2
    going_on = subprocess.run(longer + ["--continue"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert going_on.returncode == 0, going_on.stdout[-3000:] + going_on.stderr[-3000:]
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.params["training.max_steps"] == "6"   # params are immutable
    assert run.data.tags["jobspec.segments"] == "2" and run.data.tags["jobspec.segment.2.start_step"] == "6"
    assert run.data.tags["jobspec.changed.training.max_steps"] == "6 -> 8 at step 6"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "jobspec/segment")] == [(6, 2.0)]
    first_spec = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "resolved.yaml", str(tmp_path / "a"))).read_text())
    later_spec = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "segments/2/resolved.yaml",
                                                               str(tmp_path / "b"))).read_text())
    assert first_spec["training"]["max_steps"] == 6 and later_spec["training"]["max_steps"] == 8
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == 8
