"""Two ways of starting a launch plan's ranks (launch/backends.py chooses), and the rendezvous port.

One node: jobspec runs DeepSpeed's per-node launcher (launch.py, through `python -u -m
jobspec.launch.ds_launch`, which runs it unchanged but imports DeepSpeed without MLflow) itself,
with the arguments DeepSpeed's `deepspeed` runner would give it. On one node the runner does nothing
else (no hostfile, no ssh, no environment changes), but it is a Python process that imports all of
DeepSpeed, torch and mlflow (DeepSpeed's autotuner) before launch.py imports them again: ~2.7 s of
CPU on the start-up's critical path (docs/benchmarks.md). One difference, on purpose: the runner
drops a CUDA_VISIBLE_DEVICES it finds when `--num_gpus` is given and uses devices 0..N-1, while
jobspec's GPU pre-flight reads the devices CUDA_VISIBLE_DEVICES lists (a Slurm job's GPUs): the
ranks get those. Several nodes keep the runner (its hostfile, pdsh or `--no_ssh` per node under
srun), and so does any launch with JOBSPEC_DEEPSPEED_RUNNER=1 in the environment (to compare, or to
rule jobspec out).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.compile.launch_plan import LaunchPlan
from jobspec.launch import rank_forks

# DeepSpeed's launch.py, run unchanged, with DeepSpeed imported without MLflow
# (jobspec/launch/ds_launch.py)
NODE_LAUNCHER = "jobspec.launch.ds_launch"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def runner_prefix() -> list[str]:
    """How to start DeepSpeed's runner with *this* interpreter.

    The `deepspeed` script next to sys.executable is used when present (it is what a user would
    type); otherwise `python -m deepspeed.launcher.runner`, because a `deepspeed` found elsewhere on
    PATH (another venv, a pyenv shim) may run a different Python than the one jobspec runs in.
    """
    script = shutil.which("deepspeed")
    if script and Path(script).resolve().parent == Path(sys.executable).resolve().parent:
        return [script]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


@dataclass(frozen=True)
class DeepSpeedRunner:
    """Backend: DeepSpeed's runner with this interpreter (several nodes: its hostfile, pdsh; or any
    launch with JOBSPEC_DEEPSPEED_RUNNER=1), given the plan's runner arguments."""

    prefix: tuple[str, ...] = field(default_factory=lambda: tuple(runner_prefix()))

    def argv(self, plan: LaunchPlan) -> list[str]:
        return [*self.prefix, *plan.runner_arguments()]

    def hostfile_text(self, plan: LaunchPlan) -> str | None:
        # the runner reads the hostfile the user keeps (DeepSpeed's default /job/hostfile)
        return None


@dataclass(frozen=True)
class NodeLauncher:
    """Backend: DeepSpeed's launch.py on this one node (see the module doc), with the arguments its
    runner would give it (tests/launch/test_runner.py compares them with the runner's own)."""

    devices: tuple[int, ...]   # the device ids of the node's ranks (`local_devices`)
    fork_ranks: bool = False   # CPU ranks forked from launch.py's process (launch/rank_forks.py)

    @classmethod
    def for_plan(cls, plan: LaunchPlan, environ: Mapping[str, str] = os.environ,
                 fork_ranks: bool = False) -> NodeLauncher:
        return cls(tuple(local_devices(plan.gpus_per_node, environ)), fork_ranks)

    def argv(self, plan: LaunchPlan) -> list[str]:
        world_info = {"localhost": list(self.devices)}
        encoded = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
        fork = [rank_forks.FORK_FLAG] if self.fork_ranks else []
        return [sys.executable, "-u", "-m", NODE_LAUNCHER, *fork, f"--world_info={encoded}",
                "--master_addr=127.0.0.1", f"--master_port={plan.master_port}",
                "--module", "--enable_each_rank_log=None", "--log_level=info", plan.module,
                *plan.worker_args]

    def hostfile_text(self, plan: LaunchPlan) -> str | None:
        return None


def local_devices(count: int, environ: Mapping[str, str] = os.environ) -> list[int]:
    """The first `count` devices CUDA_VISIBLE_DEVICES lists (integer ids), else 0..count-1."""
    listed = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(listed) >= count and all(v.isdigit() for v in listed[:count]):
        return [int(v) for v in listed[:count]]
    return list(range(count))
