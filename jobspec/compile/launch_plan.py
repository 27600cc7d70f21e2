"""What a compiled job runs: the launch plan, decided once by `compile` and read by every way of
starting the ranks (launch/backends.py), so no command line is ever parsed back.

    ranks        `python -m jobspec.train.worker --run-dir RUN_DIR` on `gpus_per_node` devices of
                 each of `nodes` nodes, rendezvous at `master_addr:master_port`
    environment  what every rank gets on top of the launcher's environment (the host's own
                 variables, such as the allocator's or the progress mode, are added by the launcher)
    run dir      the ranks read rundir.WORKER_INPUTS there and write everything else of the run
                 there

`command` is DeepSpeed's runner command a user would type for the plan (`deepspeed --num_gpus 2
...`): what `jobspec compile` shows and writes into command.txt. A launch writes the command its
backend built instead, so command.txt always says what ran.

Pure: no I/O, no imports beyond the standard library.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_MASTER_PORT = 29500  # placeholder: the launcher passes a free port when the spec names none
WORKER_MODULE = "jobspec.train.worker"
# the ranks' output must reach the launcher's relay (and launcher.log) as it happens
RANK_ENVIRONMENT: Mapping[str, str] = MappingProxyType({"PYTHONUNBUFFERED": "1"})


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of one job: how many, where they meet, what they run and where they read it."""

    nodes: int
    gpus_per_node: int
    world_size: int
    master_port: int
    run_dir: str
    # resources.master_addr (several nodes); None: the runner's choice
    master_addr: str | None = None
    module: str = WORKER_MODULE
    environment: Mapping[str, str] = field(default_factory=lambda: RANK_ENVIRONMENT)

    @property
    def worker_args(self) -> list[str]:
        """The arguments each rank's `python -m MODULE` gets (DeepSpeed adds `--local_rank`)."""
        return ["--run-dir", self.run_dir]

    def runner_arguments(self) -> list[str]:
        """DeepSpeed's runner's arguments for this plan. Several nodes: the runner reads its
        hostfile, the plan only gives counts (and the rendezvous host when the spec names one)."""
        args = []
        if self.nodes > 1:
            args += ["--num_nodes", str(self.nodes)]
            if self.master_addr:
                args += ["--master_addr", self.master_addr]
        return args + ["--num_gpus", str(self.gpus_per_node), "--master_port",
                       str(self.master_port), "--module", self.module, *self.worker_args]

    @property
    def command(self) -> list[str]:
        """`deepspeed ...`: the runner command for this plan as a user would type it."""
        return ["deepspeed", *self.runner_arguments()]

    def record(self, argv: Sequence[str] | None = None) -> dict:
        """launch.json's launch fields: the command that runs (`argv`, default `command`) and the
        counts."""
        return {"argv": [str(a) for a in (self.command if argv is None else argv)],
                "world_size": self.world_size,
                "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "master_port": self.master_port}
