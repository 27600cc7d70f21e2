"""The ways of starting a launch plan's ranks, and which one a launch uses.

Each backend builds its whole argv from the plan (compile/launch_plan.LaunchPlan) once; nothing
reads a command line back. The argv a launch runs is the argv command.txt and launch.json record.

    one node, this host           runner.NodeLauncher   DeepSpeed's launch.py, no runner process
    several nodes                 runner.DeepSpeedRunner  DeepSpeed's runner (its hostfile, pdsh)
    several nodes, inside Slurm   slurm.SrunPerNode     srun: one runner per node, `--no_ssh`
    JOBSPEC_DEEPSPEED_RUNNER=1    the runner for one node too (to compare, or to rule jobspec out)

On one node with CPU ranks, launch.py's ranks are forked from it once it has imported what they
import (launch/rank_forks.py); JOBSPEC_FORK_RANKS=0 starts each as its own `python -m` instead, and
JOBSPEC_FORK_RANKS=1 forks GPU ranks too (to measure it on a GPU host: not the default there yet).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from jobspec.compile.launch_plan import LaunchPlan
from jobspec.launch import runner, slurm


class Backend(Protocol):
    """One way of starting the ranks of a plan."""

    def argv(self, plan: LaunchPlan) -> list[str]:
        """The command that starts every rank of `plan` (run by launch/supervise, written to
        command.txt)."""
        ...

    def hostfile_text(self, plan: LaunchPlan) -> str | None:
        """The DeepSpeed hostfile the run directory must hold before `argv` runs, or None."""
        ...


def backend_for(plan: LaunchPlan, environ: Mapping[str, str] = os.environ, *,
                cpu_ranks: bool = False) -> Backend:
    """The backend for `plan` on this host, in this environment (a Slurm allocation,
    CUDA_VISIBLE_DEVICES, JOBSPEC_DEEPSPEED_RUNNER, JOBSPEC_FORK_RANKS); `cpu_ranks`: the ranks run
    on this host's CPUs. A multi-node plan in an allocation too small for it is refused
    (SpecError)."""
    if plan.nodes > 1:
        in_slurm = slurm.allocation_backend(plan, runner.runner_prefix(), environ)
        return in_slurm if in_slurm is not None else runner.DeepSpeedRunner()
    if environ.get("JOBSPEC_DEEPSPEED_RUNNER") == "1":
        return runner.DeepSpeedRunner()
    fork = forks_ranks(environ, cpu_ranks)
    return runner.NodeLauncher.for_plan(plan, environ, fork_ranks=fork)


def forks_ranks(environ: Mapping[str, str], cpu_ranks: bool) -> bool:
    """Whether one node's ranks are forked from its node launcher: CPU ranks unless
    JOBSPEC_FORK_RANKS=0, GPU ranks only with JOBSPEC_FORK_RANKS=1."""
    asked = environ.get("JOBSPEC_FORK_RANKS")
    return asked == "1" or (cpu_ranks and asked != "0")
