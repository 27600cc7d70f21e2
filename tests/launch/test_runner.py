"""One node: jobspec starts DeepSpeed's launch.py with exactly the command DeepSpeed's runner would build.

The reference is DeepSpeed's own `deepspeed.launcher.runner.main`, run in process with its Popen
replaced by a recorder: whatever the runner would have started, jobspec starts, minus the runner.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from jobspec.launch import runner

COMPILED = ["deepspeed", "--num_gpus", "2", "--master_port", "29517", "--module", "jobspec.train.worker",
            "--run-dir", "/runs/job/run-1"]


def runner_command(argv: list[str], monkeypatch) -> list[str]:
    """The launch.py command DeepSpeed's runner builds for `deepspeed ARGV...` (not run)."""
    from deepspeed.launcher import runner as ds_runner
    started, real_popen = [], subprocess.Popen

    class Recorder:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def wait(self):
            return 0

    def popen(cmd, **kwargs):  # what the runner asks of the system itself still runs
        return Recorder(cmd) if "deepspeed.launcher.launch" in cmd else real_popen(cmd, **kwargs)

    monkeypatch.setattr(ds_runner.subprocess, "Popen", popen)
    monkeypatch.setattr(ds_runner, "fetch_hostfile", lambda path: None)  # no /job/hostfile on any test host
    ds_runner.main(argv)
    return started[0]


@pytest.mark.parametrize("gpus", [1, 2])
def test_one_node_runs_the_command_the_runner_would(gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    compiled = list(COMPILED)
    compiled[2] = str(gpus)
    expected = runner_command(compiled[1:], monkeypatch)
    assert expected[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    # the same launch.py with the same arguments, run through jobspec.launch.ds_launch (tested below)
    assert runner.resolve_runner(compiled, environ={}) == [*expected[:3], runner.NODE_LAUNCHER, *expected[4:]]


def test_ds_launch_is_launch_py_imported_without_mlflow():
    def run(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    ours, theirs = run("-m", runner.NODE_LAUNCHER, "--help"), run("-m", "deepspeed.launcher.launch", "--help")
    def usage(out):   # DeepSpeed's timestamped accelerator warning comes first
        return out[out.index("usage:"):]
    assert ours.returncode == theirs.returncode == 0 and usage(ours.stdout) == usage(theirs.stdout)
    check = run("-c", "import sys; from jobspec.ops import import_deepspeed; import_deepspeed(); "
                      "print('mlflow' in sys.modules); import mlflow; print(mlflow.__name__)")
    assert check.stdout.split()[-2:] == ["False", "mlflow"], check.stderr[-2000:]   # later imports still work


def test_visible_devices_are_the_ones_used():
    # the GPU pre-flight measured the devices CUDA_VISIBLE_DEVICES lists; the ranks get those
    argv = runner.resolve_runner(COMPILED, environ={"CUDA_VISIBLE_DEVICES": "4,6,7"})
    encoded = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    world = json.loads(base64.urlsafe_b64decode(encoded))  # as launch.py decodes it
    assert world == {"localhost": [4, 6]}
    assert runner.local_devices(2, {"CUDA_VISIBLE_DEVICES": "GPU-3f2a,GPU-9b1c"}) == [0, 1]  # UUIDs: by index
    assert runner.local_devices(4, {"CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1, 2, 3]


def test_several_nodes_keep_the_runner():
    argv = ["deepspeed", "--num_nodes", "2", "--num_gpus", "4", "--master_port", "29500",
            "--module", "jobspec.train.worker", "--run-dir", "/r"]
    resolved = runner.resolve_runner(argv, environ={})
    assert resolved[:len(runner.runner_prefix())] == runner.runner_prefix()
    assert resolved[len(runner.runner_prefix()):] == argv[1:]
    assert runner.resolve_runner(["python", "x.py"]) == ["python", "x.py"]  # not a deepspeed argv: as is
    forced = runner.resolve_runner(COMPILED, environ={"JOBSPEC_DEEPSPEED_RUNNER": "1"})
    assert forced == runner.runner_prefix() + COMPILED[1:]


@pytest.mark.slow
def test_the_direct_command_starts_ranks(tmp_path):
    # launch.py itself, with the argv above, really starts a rank with the env:// rendezvous set
    script = tmp_path / "rank.py"
    # one write(2) per line: under `python -u` a print() of several values is several writes, and the
    # two ranks' words interleave in the shared pipe ("RANKRANK 0 2 ...")
    script.write_text("import os, sys\nos.write(1, ' '.join(['RANK', os.environ['RANK'], os.environ['WORLD_SIZE'], "
                      "os.environ['MASTER_PORT'], str(sys.argv[1:])]).encode() + b'\\n')\n")
    argv = runner.resolve_runner(["deepspeed", "--num_gpus", "2", "--master_port", str(runner.free_port()),
                                  str(script), "--run-dir", "x"], environ={})
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = sorted(line for line in out.stdout.splitlines() if line.startswith("RANK"))
    assert [line.split()[1:3] for line in ranks] == [["0", "2"], ["1", "2"]]
    assert all(line.endswith("['--local_rank=0', '--run-dir', 'x']") or "--local_rank=1" in line for line in ranks)
