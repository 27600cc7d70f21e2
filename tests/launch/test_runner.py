"""One node: jobspec starts DeepSpeed's launch.py with exactly the command DeepSpeed's runner would build.

The reference is DeepSpeed's own `deepspeed.launcher.runner.main`, run in process with its Popen
replaced by a recorder: whatever the runner would have started, jobspec starts, minus the runner.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys

import pytest

from jobspec.compile.launch_plan import LaunchPlan
from jobspec.launch import backends, rank_forks, runner, slurm

PLAN = LaunchPlan(nodes=1, gpus_per_node=2, world_size=2, master_port=29517, run_dir="/runs/job/run-1")
COMPILED = ["deepspeed", "--num_gpus", "2", "--master_port", "29517", "--module", "jobspec.train.worker",
            "--run-dir", "/runs/job/run-1"]


def launched(plan: LaunchPlan, environ: dict) -> list[str]:
    """The argv a launch of `plan` runs in `environ` (the backend launch/backends chooses)."""
    return backends.backend_for(plan, environ).argv(plan)


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
    plan = dataclasses.replace(PLAN, gpus_per_node=gpus, world_size=gpus)
    compiled = list(COMPILED)
    compiled[2] = str(gpus)
    assert plan.command == compiled   # what `jobspec compile` shows, given to the real runner below
    expected = runner_command(compiled[1:], monkeypatch)
    assert expected[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    # the same launch.py with the same arguments, run through jobspec.launch.ds_launch (tested below)
    assert launched(plan, {}) == [*expected[:3], runner.NODE_LAUNCHER, *expected[4:]]


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


def test_cpu_ranks_are_forked_from_launch_py_unless_turned_off():
    """CPU ranks on one node: ds_launch's own flag, first, so launch.py's arguments stay the
    runner's; not for GPU ranks, several nodes or JOBSPEC_FORK_RANKS=0."""
    plain = launched(PLAN, {})
    forked = backends.backend_for(PLAN, {}, cpu_ranks=True).argv(PLAN)
    assert forked == [*plain[:4], rank_forks.FORK_FLAG, *plain[4:]]
    assert backends.backend_for(PLAN, {"JOBSPEC_FORK_RANKS": "0"}, cpu_ranks=True).argv(PLAN) == plain
    two = LaunchPlan(nodes=2, gpus_per_node=2, world_size=4, master_port=29500, run_dir="/r")
    assert rank_forks.FORK_FLAG not in backends.backend_for(two, {}, cpu_ranks=True).argv(two)
    # GPU ranks: only when asked, to measure it on a GPU host
    assert backends.backend_for(PLAN, {}, cpu_ranks=False).argv(PLAN) == plain
    assert backends.backend_for(PLAN, {"JOBSPEC_FORK_RANKS": "1"}, cpu_ranks=False).argv(PLAN) == forked


def test_visible_devices_are_the_ones_used():
    # the GPU pre-flight measured the devices CUDA_VISIBLE_DEVICES lists; the ranks get those
    argv = launched(PLAN, {"CUDA_VISIBLE_DEVICES": "4,6,7"})
    encoded = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    world = json.loads(base64.urlsafe_b64decode(encoded))  # as launch.py decodes it
    assert world == {"localhost": [4, 6]}
    assert runner.local_devices(2, {"CUDA_VISIBLE_DEVICES": "GPU-3f2a,GPU-9b1c"}) == [0, 1]  # UUIDs: by index
    assert runner.local_devices(4, {"CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1, 2, 3]


def test_several_nodes_keep_the_runner():
    argv = ["deepspeed", "--num_nodes", "2", "--num_gpus", "4", "--master_port", "29500",
            "--module", "jobspec.train.worker", "--run-dir", "/r"]
    plan = LaunchPlan(nodes=2, gpus_per_node=4, world_size=8, master_port=29500, run_dir="/r")
    assert plan.command == argv
    backend = backends.backend_for(plan, {})   # outside Slurm: the runner reads the user's hostfile
    resolved = backend.argv(plan)
    assert resolved[:len(runner.runner_prefix())] == runner.runner_prefix()
    assert resolved[len(runner.runner_prefix()):] == argv[1:]
    assert backend.hostfile_text(plan) is None
    named = dataclasses.replace(plan, master_addr="node1")   # resources.master_addr reaches the runner
    assert launched(named, {})[len(runner.runner_prefix()):][:4] == ["--num_nodes", "2", "--master_addr", "node1"]
    forced = launched(PLAN, {"JOBSPEC_DEEPSPEED_RUNNER": "1"})
    assert forced == runner.runner_prefix() + COMPILED[1:]


def test_inside_slurm_several_nodes_run_srun_one_runner_per_node(monkeypatch):
    from test_slurm import fake_scontrol
    monkeypatch.setattr(slurm.subprocess, "run", fake_scontrol({"n1": "10.0.0.5", "n2": "10.0.0.6"}))
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    plan = LaunchPlan(nodes=2, gpus_per_node=4, world_size=8, master_port=29123, run_dir="/runs/r 1")
    backend = backends.backend_for(plan, env)
    assert backend.argv(plan) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        sys.executable, "-m", "jobspec.launch.slurm", "node-runner", *runner.runner_prefix(),
        "--no_ssh", "--hostfile", "/runs/r 1/hostfile", "--num_nodes", "2", "--num_gpus", "4",
        "--master_addr", "10.0.0.5", "--master_port", "29123", "--module", "jobspec.train.worker",
        "--run-dir", "/runs/r 1"]
    assert backend.hostfile_text(plan) == "n1 slots=4\nn2 slots=4\n"   # written into the run dir first
    one = LaunchPlan(nodes=1, gpus_per_node=2, world_size=2, master_port=29123, run_dir="/r")
    assert launched(one, env)[3] == runner.NODE_LAUNCHER   # one node in an allocation: launch.py as anywhere


@pytest.mark.slow
def test_the_direct_command_starts_ranks(tmp_path):
    # launch.py itself, with the argv above, really starts a rank with the env:// rendezvous set
    script = tmp_path / "rank.py"
    # one write(2) per line: under `python -u` a print() of several values is several writes, and the
    # two ranks' words interleave in the shared pipe ("RANKRANK 0 2 ...")
    script.write_text("import os, sys\nos.write(1, ' '.join(['RANK', os.environ['RANK'], os.environ['WORLD_SIZE'], "
                      "os.environ['MASTER_PORT'], str(sys.argv[1:])]).encode() + b'\\n')\n")
    plan = LaunchPlan(nodes=1, gpus_per_node=2, world_size=2, master_port=runner.free_port(), run_dir="x",
                      module="rank")
    argv = launched(plan, {})
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = sorted(line for line in out.stdout.splitlines() if line.startswith("RANK"))
    assert [line.split()[1:3] for line in ranks] == [["0", "2"], ["1", "2"]]
    assert all(line.endswith("['--local_rank=0', '--run-dir', 'x']") or "--local_rank=1" in line for line in ranks)
