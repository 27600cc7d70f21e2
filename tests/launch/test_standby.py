"""The node launcher started while `jobspec launch` plans (jobspec/launch/standby.py): it takes only
the command that forks CPU ranks, leaves nothing behind when a launch abandons it, and a launch that
refuses after validation abandons it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import spec_builder

from jobspec.launch import rank_forks, runner, standby
from jobspec.spec.validation import load_and_validate


def gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def spec(tmp_path):
    return load_and_validate(str(spec_builder.write_job(tmp_path))).spec


def test_an_abandoned_standby_leaves_no_process(spec):
    waiting = standby.Standby.start(spec)
    pid = waiting.proc.pid
    assert os.getpgid(pid) == pid   # its own session and group, as the runner's
    plain = [sys.executable, "-u", "-m", runner.NODE_LAUNCHER, "--world_info=e30="]
    assert not waiting.takes(plain)   # not a forking launch: the runner starts anew
    assert waiting.takes([*plain[:4], rank_forks.FORK_FLAG, *plain[4:]])
    waiting.abandon()
    assert gone(pid) and not waiting.takes([*plain[:4], rank_forks.FORK_FLAG])
    waiting.abandon()   # twice: nothing more to do


def test_a_standby_whose_launch_never_comes_exits_quietly(spec):
    waiting = standby.Standby.start(spec)
    assert waiting.proc.stdin is not None
    waiting.proc.stdin.close()   # the launcher went away without a word
    assert waiting.proc.wait(timeout=120) == 0
    os.close(waiting.read_fd)


def test_wanted_for_one_node_of_cpu_ranks_only(spec, monkeypatch):
    monkeypatch.delenv("JOBSPEC_FAKE_GPU_FREE_BYTES", raising=False)
    assert standby.wanted(spec, {})   # this machine has no GPU
    assert not standby.wanted(spec, {"JOBSPEC_FORK_RANKS": "0"})
    assert not standby.wanted(spec, {"JOBSPEC_DEEPSPEED_RUNNER": "1"})
    assert not standby.wanted({**spec, "resources": {**spec["resources"], "nodes": 2}}, {})
    monkeypatch.setenv("JOBSPEC_FAKE_GPU_FREE_BYTES", str(80 << 30))   # GPU ranks, as planned
    assert not standby.wanted(spec, {})
    assert standby.wanted(spec, {"JOBSPEC_FORK_RANKS": "1"})   # asked for, to measure on a GPU


def test_a_launch_refused_after_validation_abandons_its_standby(tmp_path):
    """A checkpoint directory holding files no job claims is refused once the spec is planned: exit
    2, and the standby the launch started is gone before the launcher exits (not only by its
    parent-death signal)."""
    job = spec_builder.write_job(tmp_path, output_dir=str(tmp_path / "out"))
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "notes.txt").write_text("mine")
    proc = subprocess.Popen([sys.executable, "-m", "jobspec", "launch", str(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            seen |= {child.pid for child in launcher.children()
                     if standby.STANDBY_FLAG in child.cmdline()}
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 2, out + err
    assert seen and all(gone(pid, 5) for pid in seen)
    assert "no jobspec job claims" in err and "Traceback" not in err
