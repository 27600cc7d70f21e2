"""Every stop is graceful (issue 34): real `jobspec launch`es on 2 CPU ranks, stopped the ways users
stop them, then resumed with the command the stop printed. Few launches, each checking several things:

- ZeRO 3, in a real pseudo-terminal: the terminal's own Ctrl-C (the line discipline turns ^C into
  SIGINT for the foreground process group) -> the ranks finish the step and checkpoint, exit 75,
  no traceback or KeyboardInterrupt on the terminal, MLflow KILLED/preempted with the step and the
  checkpoint. The printed command, run in the terminal, resumes from that checkpoint; Ctrl-C twice
  then ends it at once: exit 130, "no checkpoint was saved by this stop" and what the command resumes.
- ZeRO 0, a finished run and then a `--new-run` of it stopped by SIGTERM to every process of the
  job at once (what `scancel`, `docker stop` on a process group or `kill -- -PGID` do) -> exit 75
  with the checkpoint in checkpoints-2; the printed command resumes checkpoints-2 (not "already
  complete" at checkpoints) and finishes.

The Slurm `scancel` case is tests/launch/test_slurm.py's preemption test; the launcher's signal
handling without real ranks (a second Ctrl-C, repeated SIGTERMs, SIGHUP) is tests/launch/test_launch.py.
"""
from __future__ import annotations

import json
import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import spec_builder
from conftest import read_metrics
from mlflow_server import ENV

from jobspec.tracking.run import client_for

pytestmark = pytest.mark.slow

MAX_STEPS = 400   # far more than a stop needs: the signal always lands mid-run
FINISHED_STEPS = 200   # long enough that a stop sent after step 3 lands before the end on a quiet machine


@pytest.fixture(autouse=True)
def file_store(monkeypatch):
    """A file-store tracking URI (no sqlite schema creation per launch), read in-process too."""
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)


def write_job(tmp_path: Path, zero_stage: int, max_steps: int = MAX_STEPS) -> Path:
    return spec_builder.write_job(tmp_path, training={"max_steps": max_steps}, memory={"zero_stage": zero_stage},
                                  output_dir=str(tmp_path / "out"),
                                  logging={"progress": "auto", "mlflow": {
                                      "enabled": True, "tracking_uri": str(tmp_path / "mlruns"),
                                      "experiment": "stop"}})


def env() -> dict:
    return {**os.environ, **ENV}


def trained_steps(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in read_metrics(run_dir) if "train/loss" in r), default=0)


def wait_for_new_run(tmp_path: Path, known: set, done, steps: int) -> Path:
    """The run directory a launch made, once it has trained `steps` steps."""
    deadline = time.monotonic() + 400
    while True:
        runs = [d for d in (tmp_path / "out").glob("run-*") if d not in known] if (tmp_path / "out").exists() else []
        if runs and trained_steps(runs[0]) >= steps:
            return runs[0]
        assert not done() and time.monotonic() < deadline, "the launch ended or stalled before training"
        time.sleep(0.2)


def mlflow_run(run_dir: Path):
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    return client_for(info["tracking_uri"]).get_run(info["run_id"])


def resume_command(text: str) -> list[str]:
    """The printed resume command, as argv; `jobspec` resolved to this interpreter's entry point."""
    found = re.findall(r"^jobspec: resume with: (.+?)\r?$", text, re.M)
    assert found, text[-3000:]
    argv = shlex.split(found[-1])
    assert argv[:2] == ["jobspec", "launch"] and "--new-run" not in argv
    return [sys.executable, "-m", "jobspec", *argv[1:]]


class Terminal:
    """A command run as the foreground job of a new pseudo-terminal, as in an interactive shell."""

    def __init__(self, argv: list[str], cwd: Path):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:   # the child: session leader, the pty its controlling terminal
            os.chdir(cwd)
            os.execve(argv[0], argv, env())
        self.output = bytearray()
        self.status: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:   # EIO: the terminal's last process closed it
                return
            if not chunk:
                return
            self.output += chunk

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")   # the terminal's line discipline sends SIGINT, as a keyboard does

    def done(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def wait(self, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while not self.done():
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.3)   # the last bytes
        return self.status

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def wait_for(self, shown: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while shown not in self.text():
            assert not self.done() and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.01)


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]


def test_ctrl_c_in_a_terminal_at_zero3_checkpoints_and_a_second_ctrl_c_ends_at_once(tmp_path):
    job = write_job(tmp_path, zero_stage=3)
    term = Terminal([sys.executable, "-m", "jobspec", "launch", str(job)], tmp_path)
    first = wait_for_new_run(tmp_path, set(), term.done, 3)
    term.ctrl_c()
    assert term.wait() == 75, term.text()[-4000:]
    shown = term.text()
    assert_no_traceback(shown)
    summary = json.loads((first / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["status"] == "preempted" and 3 <= stopped < MAX_STEPS
    assert summary["checkpoint"] == f"step{stopped}"
    assert (tmp_path / "out" / "checkpoints" / f"step{stopped}").is_dir()
    assert "jobspec: SIGINT: the ranks finish the current step and save a checkpoint" in shown
    assert f"stopped by SIGINT at step {stopped} of {MAX_STEPS} with a checkpoint (exit 75)" in shown
    run = mlflow_run(first)
    assert run.info.status == "KILLED" and run.data.tags["jobspec.status"] == "preempted"
    assert run.data.tags["jobspec.stop_reason"] == (f"stopped by SIGINT (Ctrl-C) at step {stopped} of {MAX_STEPS}; "
                                                    f"checkpoint step{stopped}")
    assert "KeyboardInterrupt" not in (first / "launcher.log").read_text()   # the ranks never raised it

    # the printed command resumes it; Ctrl-C twice ends that launch at once, without a checkpoint
    again = Terminal(resume_command(shown), tmp_path)
    second = wait_for_new_run(tmp_path, {first}, again.done, stopped + 2)
    again.ctrl_c()
    # pressed again once the first is seen (two SIGINTs that reach the launcher before it runs are
    # one pending signal), and before the ranks, one step apart in their vote, checkpoint
    again.wait_for("jobspec: SIGINT: the ranks finish the current step")
    again.ctrl_c()
    assert again.wait() == 130, again.text()[-4000:]
    shown = again.text()
    assert_no_traceback(shown)
    assert re.search(rf"resumed from \S*step{stopped} at step {stopped}\b", shown), shown[-3000:]
    assert "SIGINT again: ending the job now, without waiting for the checkpoint" in shown
    checkpoint = tmp_path / "out" / "checkpoints" / f"step{stopped}"
    assert re.search(r"jobspec: no checkpoint was saved by this stop; jobspec launch .+ resumes from the last one "
                     rf"saved before it, checkpoint {re.escape(str(checkpoint))} \(step {stopped} of {MAX_STEPS}\)",
                     shown), shown[-3000:]
    run = mlflow_run(second)
    assert run.info.status == "KILLED" and run.data.tags["jobspec.status"] == "killed"


def job_processes(launcher: int) -> list[psutil.Process]:
    """The launcher and every process it started (runner, launch.py, ranks), as `scancel` sees a job."""
    parent = psutil.Process(launcher)
    return [parent, *parent.children(recursive=True)]


def test_sigterm_to_every_process_of_a_new_run_at_zero0_and_the_printed_command_resumes_it(tmp_path):
    job = write_job(tmp_path, zero_stage=0, max_steps=FINISHED_STEPS)
    cli = [sys.executable, "-m", "jobspec", "launch", str(job)]
    finished = subprocess.run(cli, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    (first,) = (tmp_path / "out").glob("run-*")

    proc = subprocess.Popen([*cli, "--new-run"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    second = wait_for_new_run(tmp_path, {first}, lambda: proc.poll() is not None, 3)
    processes = job_processes(proc.pid)
    assert len({p.pid for p in processes}) >= 4   # launcher, launch.py, two ranks
    for process in processes:   # every task at once, as scancel signals them
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out[-4000:]
    assert_no_traceback(out)
    summary = json.loads((second / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["status"] == "preempted" and summary["checkpoint"] == f"step{stopped}" and stopped < FINISHED_STEPS
    assert (tmp_path / "out" / "checkpoints-2" / f"step{stopped}").is_dir()
    assert f"stopped by SIGTERM from the user at step {stopped} of {FINISHED_STEPS}; checkpoint step{stopped}" in out

    # the printed command continues checkpoints-2 (not "already complete" at checkpoints/step12)
    resumed = subprocess.run(resume_command(out), cwd=tmp_path, env=env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "already complete" not in resumed.stdout
    (third,) = set((tmp_path / "out").glob("run-*")) - {first, second}
    done = json.loads((third / "summary.json").read_text())
    assert done["status"] == "finished" and done["steps"] == FINISHED_STEPS
    assert done["resumed_from"].endswith(str(Path("checkpoints-2") / f"step{stopped}")), done["resumed_from"]
    assert mlflow_run(third).info.run_id == mlflow_run(second).info.run_id != mlflow_run(first).info.run_id
