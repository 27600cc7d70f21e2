"""Ranks forked from the node launcher (jobspec/launch/rank_forks.py): a forked rank runs its
module as `__main__` with the environment launch.py gives it, and exits, is signalled and is
recognised as a rank the way a `python -u -m MODULE` process is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from jobspec.launch import rank_forks, supervise

RANK_MODULE = """
import os, sys, time
print("argv", sys.argv[1:], "rank", os.environ["RANK"], "name", __name__, flush=True)
action = os.environ.get("ACTION")
if action == "fail":
    raise RuntimeError("this rank failed")
if action == "wait":
    print("waiting", flush=True)
    time.sleep(60)
if action == "sleep-short":
    started = time.monotonic()
    time.sleep(0.5)
    print("slept", round(time.monotonic() - started, 1), flush=True)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def rank_module(tmp_path, monkeypatch):
    (tmp_path / "fake_rank.py").write_text(RANK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_rank"


def fork(module: str, env: dict, out) -> rank_forks.ForkedRank:
    """A rank forked with its output in `out` (launch.py's ranks write to the stdout it has)."""
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        cmd = [sys.executable, "-u", "-m", module, "--local_rank=0", "--run-dir", "/nowhere"]
        return rank_forks.ForkedRank(cmd, {**os.environ, **env}, *rank_forks.rank_module(cmd))
    finally:
        sys.stdout, sys.stderr = saved


def test_a_forked_rank_runs_its_module_as_main_with_its_env_and_exit_code(rank_module, tmp_path):
    with open(tmp_path / "out", "w", buffering=1) as out:
        rank = fork(rank_module, {"RANK": "3", "CODE": "7"}, out)
        assert rank.wait(timeout=30) == 7 and rank.poll() == 7
    text = (tmp_path / "out").read_text()
    assert "argv ['--local_rank=0', '--run-dir', '/nowhere'] rank 3 name __main__" in text
    assert "RANK" not in os.environ or os.environ["RANK"] != "3"   # the parent's env is its own


def test_a_failing_rank_prints_its_traceback_and_exits_1(rank_module, tmp_path):
    with open(tmp_path / "out", "w", buffering=1) as out:
        rank = fork(rank_module, {"RANK": "0", "ACTION": "fail"}, out)
        assert rank.wait(timeout=30) == 1
    text = (tmp_path / "out").read_text()
    assert "Traceback" in text and "RuntimeError: this rank failed" in text


def test_a_forked_rank_is_signalled_like_a_process_and_recognised_as_a_rank(rank_module, tmp_path):
    with open(tmp_path / "out", "w", buffering=1) as out:
        rank = fork(rank_module, {"RANK": "0", "ACTION": "wait"}, out)
        deadline = time.monotonic() + 30
        while "waiting" not in (tmp_path / "out").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        me = psutil.Process()
        assert psutil.Process(rank.pid).name() == rank_forks.FORKED_RANK_NAME
        shown = " ".join(psutil.Process(rank.pid).cmdline()).strip()   # ps: one title
        assert shown == f"{sys.executable} -u -m {rank_module} --local_rank=0 --run-dir /nowhere"
        assert supervise.rank_pids([me, psutil.Process(rank.pid)]) == {rank.pid}
        rank.terminate()
        assert rank.wait(timeout=30) == -signal.SIGTERM


def test_a_forked_rank_sleeps_as_asked_though_launch_py_sleeps_are_shortened(rank_module, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)   # as ds_launch shortens launch.py's
    with open(tmp_path / "out", "w", buffering=1) as out:
        rank = fork(rank_module, {"RANK": "0", "ACTION": "sleep-short"}, out)
        while rank.poll() is None:
            os.sched_yield()
    slept = (tmp_path / "out").read_text().split("slept ")[1]
    assert float(slept) >= 0.5


def test_install_forks_only_the_rank_command(rank_module, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", subprocess.Popen)   # restored after the test
    rank_forks.install()
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    assert isinstance(other, rank_forks._REAL_POPEN) and other.wait() == 0
    env = {**os.environ, "RANK": "0", "PYTHONPATH": str(tmp_path)}
    piped = subprocess.Popen([sys.executable, "-u", "-m", rank_module], env=env,
                             stdout=subprocess.PIPE)   # output not inherited: a real process
    assert isinstance(piped, rank_forks._REAL_POPEN)
    assert b"rank 0" in piped.communicate(timeout=30)[0]
    assert rank_forks.rank_module(["python3", "-u", "-m", "x"]) is None   # another interpreter
    assert rank_forks.rank_module([sys.executable, "-m", "x"]) is None    # not launch.py's shape
    assert rank_forks.run_dir_of(["--world_info=x", "jobspec.train.worker", "--run-dir", "/r"]) \
        == __import__("pathlib").Path("/r")


def test_preload_calls_the_rank_modules_hook_with_the_spec(tmp_path, monkeypatch):
    (tmp_path / "hooked_rank.py").write_text(
        "import pathlib\ndef preload(spec):\n    pathlib.Path(spec['out'], 'preloaded').touch()\n")
    (tmp_path / "broken_rank.py").write_text("def preload(spec):\n    raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--world_info=e30=", "--master_port=1", "--module", "--log_level=info", "hooked_rank",
            "--run-dir", str(tmp_path)]
    assert rank_forks.rank_module_name(args) == "hooked_rank"
    assert rank_forks.spec_of(args) is None   # no resolved.yaml there
    for module in ("hooked_rank", "broken_rank", "no_such_rank"):   # a failure costs only time
        rank_forks.preload(module, {"out": str(tmp_path)})
    assert (tmp_path / "preloaded").is_file()


def test_a_node_launcher_that_initialised_cuda_starts_its_ranks_as_processes(rank_module, tmp_path,
                                                                            monkeypatch, capfd):
    import torch
    monkeypatch.setattr(subprocess, "Popen", subprocess.Popen)   # restored after the test
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rank_forks.install()
    env = {**os.environ, "RANK": "0", "PYTHONPATH": str(tmp_path)}
    rank = subprocess.Popen([sys.executable, "-u", "-m", rank_module], env=env)
    assert isinstance(rank, rank_forks._REAL_POPEN) and rank.wait(timeout=60) == 0
    assert "CUDA is initialised in the node launcher" in capfd.readouterr().err
