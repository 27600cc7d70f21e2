"""Slurm: sbatch scripts rendered from `resources.slurm`, and multi-node launches inside an
allocation.

Why one DeepSpeed runner per node (and not `deepspeed --launcher slurm`): DeepSpeed's Slurm launcher
runs `srun -n WORLD python -u WORKER` directly, and srun sets SLURM_PROCID but not RANK/LOCAL_RANK/
WORLD_SIZE; `deepspeed.init_distributed` then falls back to mpi4py discovery, which fails on
CPU-only hosts and on clusters without MPI. Instead `srun` starts one ordinary runner per node with
`--no_ssh --node_rank <SLURM_NODEID>` and a hostfile of the allocation: each runner starts its
node's ranks with torch's usual env:// rendezvous, exactly like a single-node launch. SLURM_NODEID
differs per node, so srun runs `python -m jobspec.launch.slurm node-runner RUNNER...`, which inserts
`--node_rank` from its own environment; no value is ever interpolated into a shell string.

Nothing here imports torch; `detect_allocation` and `allocation_backend` only run `scontrol`.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jobspec import rundir
from jobspec.compile.launch_plan import LaunchPlan
from jobspec.errors import RunFailure, SpecError, SpecIssue, spec_error

# launch.sh ships inside the wheel (pyproject's force-include); a source checkout has it at its
# root.
LAUNCH_SH_CANDIDATES = (
    Path(__file__).resolve().parents[1] / "_scripts" / "launch.sh",   # installed package
    # source checkout (editable install)
    Path(__file__).resolve().parents[2] / "launch.sh",
)


def launch_sh_path() -> Path:
    for candidate in LAUNCH_SH_CANDIDATES:
        if candidate.is_file():
            return candidate
    raise RunFailure(f"launch.sh is missing from the jobspec installation (looked at "
                     f"{', '.join(str(c) for c in LAUNCH_SH_CANDIDATES)}); reinstall jobspec")


# --- the allocation we run in -----------------------------------------------------------------

@dataclass(frozen=True)
class Allocation:
    job_id: str
    hosts: tuple[str, ...]  # node names in allocation order; the first one hosts rank 0
    node_id: int            # this process's node index in the allocation (0 in the batch script)
    num_nodes: int


def expand_hostlist(nodelist: str, run=None) -> list[str]:
    """`n[1-3],gpu7` -> ["n1", "n2", "n3", "gpu7"], by Slurm's own parser (`scontrol show
    hostnames`)."""
    try:
        result = (run or subprocess.run)(["scontrol", "show", "hostnames", nodelist],
                                         capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or err
        raise spec_error(f"cannot expand the Slurm node list {nodelist!r}: {detail}",
                         path=("resources", "nodes"),
                         hint="run inside a Slurm allocation with scontrol on PATH (and SLURM_CONF "
                              "if needed)")
    return result.stdout.split()


def detect_allocation(env=None, run=None) -> Allocation | None:
    """The Slurm allocation this process runs in (from SLURM_* variables), or None outside Slurm."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    hosts = tuple(expand_hostlist(nodelist, run))
    num_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts))
    return Allocation(job_id=job_id, hosts=hosts, node_id=int(env.get("SLURM_NODEID", "0")),
                      num_nodes=num_nodes)


def node_address(host: str, run=None) -> str:
    """Where `host` is reachable: its Slurm NodeAddr (often the host name itself), else the name."""
    result = (run or subprocess.run)(["scontrol", "show", "node", "--oneliner", host],
                                     capture_output=True, text=True, check=False)
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", result.stdout if result.returncode == 0 else "")
    return match.group(1) if match else host


def hostfile_text(hosts, slots: int) -> str:
    """DeepSpeed hostfile: one `host slots=N` line per node."""
    return "".join(f"{host} slots={slots}\n" for host in hosts)


@dataclass(frozen=True)
class SrunPerNode:
    """Backend: `srun` starting one DeepSpeed runner per node of the allocation (see the module doc
    for why), from `<run_dir>/hostfile` listing the plan's first `nodes` hosts of the allocation."""

    allocation: Allocation
    master_addr: str              # where rank 0's node is reachable (its NodeAddr)
    # DeepSpeed's runner of this interpreter (launch/runner.runner_prefix)
    runner: tuple[str, ...]

    def hostfile_text(self, plan: LaunchPlan) -> str | None:
        return hostfile_text(self.allocation.hosts[:plan.nodes], plan.gpus_per_node)

    def argv(self, plan: LaunchPlan) -> list[str]:
        nodes = plan.nodes
        return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1",  # one node's runner failing ends the step instead of a hang
                sys.executable, "-m", "jobspec.launch.slurm", "node-runner",
                *self.runner, "--no_ssh", "--hostfile", str(Path(plan.run_dir) / rundir.HOSTFILE),
                "--num_nodes", str(nodes), "--num_gpus", str(plan.gpus_per_node),
                "--master_addr", self.master_addr, "--master_port", str(plan.master_port),
                "--module", plan.module, *plan.worker_args]


def allocation_backend(plan: LaunchPlan, runner: Sequence[str], env=None, *,
                       master_addr: str | None = None) -> SrunPerNode | None:
    """The srun backend for a multi-node plan inside a Slurm allocation; None for one node or
    outside Slurm (DeepSpeed's runner then starts the ranks). `master_addr` defaults to the first
    host's NodeAddr."""
    nodes = plan.nodes
    if nodes <= 1:
        return None
    allocation = detect_allocation(env)
    if allocation is None:
        return None
    if allocation.num_nodes < nodes:
        raise spec_error(f"resources.nodes is {nodes} but Slurm job {allocation.job_id} has "
                         f"{allocation.num_nodes} node(s)", path=("resources", "nodes"),
                         hint=f"submit with --nodes={nodes} (jobspec sbatch does), or lower "
                              "resources.nodes")
    return SrunPerNode(allocation, master_addr or node_address(allocation.hosts[0]), tuple(runner))


# --- sbatch scripts ---------------------------------------------------------------------------

# sbatch reads `#SBATCH` lines with its own shell-like parser: quotes work, but a backslash escapes
# even inside single quotes and a line ends at a newline, so such values cannot be written safely.
_UNWRITABLE = re.compile(r"[\\\x00-\x1f\x7f]")


def _directive_value(resolved, path: tuple, value, issues: list) -> str:
    text = str(value)
    bad = _UNWRITABLE.search(text)
    if bad or text == "":
        what = f"contains {bad.group()!r}" if bad else "is empty"   # "" has no unwritable character
        issues.append(resolved.issue(path, f"{what}, which cannot be written in an #SBATCH line",
                                     hint="remove newlines, control characters and backslashes "
                                          "from the value"))
    return shlex.quote(text)


def sbatch_directives(resolved, *, gpus: bool = True) -> list[str]:
    """The `#SBATCH` lines for a resolved spec; SpecError (positioned) for values sbatch cannot
    read."""
    spec = resolved.spec
    res = spec["resources"]
    slurm = res["slurm"]
    issues: list[SpecIssue] = []

    def option(flag: str, field: str | None, value=None) -> str:
        if field is not None:
            value = _directive_value(resolved, ("resources", "slurm", field), value, issues)
        return f"#SBATCH --{flag}={value}"

    lines = [option("job-name", None, shlex.quote(spec["name"]))]
    for field in ("partition", "account", "qos"):
        if slurm[field] is not None:
            lines.append(option(field, field, slurm[field]))
    lines += [option("time", "time", slurm["time"]),
              option("nodes", None, res["nodes"]),
              option("ntasks-per-node", None, 1)]  # one DeepSpeed runner per node starts the ranks
    if gpus:
        lines.append(option("gpus-per-node", None, res["gpus_per_node"]))
    if slurm["cpus_per_task"] is not None:
        lines.append(option("cpus-per-task", None, slurm["cpus_per_task"]))
    if slurm["mem"] is not None:
        lines.append(option("mem", "mem", slurm["mem"]))
    if slurm["constraint"] is not None:
        lines.append(option("constraint", "constraint", slurm["constraint"]))
    if slurm["exclusive"]:
        lines.append("#SBATCH --exclusive")
    lines.append(option("output", "output", slurm["output"]))
    if slurm["error"] is not None:
        lines.append(option("error", "error", slurm["error"]))
    lines.append("#SBATCH --open-mode=append")  # a requeued job continues its log
    if slurm["requeue"]:
        lines.append("#SBATCH --requeue")
    lines.append(f"#SBATCH --signal=B:USR1@{int(slurm['signal_grace_seconds'])}")
    if issues:
        raise SpecError(issues)
    return lines


def render_sbatch(resolved, spec_path, overrides=(), *, launch_sh: Path | None = None,
                  gpus: bool = True) -> str:
    """A complete sbatch script running `launch.sh SPEC --set ...` with the spec's resources."""
    body = shlex.join([str(Path(launch_sh or launch_sh_path()).resolve()),
                       str(Path(spec_path).resolve()),
                       *[arg for override in overrides for arg in ("--set", override)]])
    return "\n".join([
        "#!/bin/bash",
        *sbatch_directives(resolved, gpus=gpus),
        # no paths in comments: a newline in a path would end the comment
        "# rendered by `jobspec sbatch`",
        "# launch.sh forwards SIGUSR1 (time limit / preemption warning) to jobspec, which "
        "checkpoints;",
        "# it then requeues this job, and the requeued run resumes from the checkpoint.",
        "set -euo pipefail",
        f"exec {body}",  # exec: launch.sh itself is the batch shell that handles the signal
        "",
    ])


def submit(script: str, run=None) -> str:
    """`sbatch --parsable` with the script on stdin; the job id."""
    try:
        result = (run or subprocess.run)(["sbatch", "--parsable"], input=script,
                                         capture_output=True, text=True, check=False)
    except OSError as err:
        raise spec_error(f"cannot run sbatch ({err})",
                         hint="run on a Slurm login node, or drop --submit and "
                                                            "submit the script with sbatch "
                                                            "yourself")
    if result.returncode != 0:
        raise spec_error("sbatch refused the job: "
                         f"{result.stderr.strip() or result.stdout.strip()}",
                         path=("resources", "slurm"),
                         hint="fix the Slurm settings of the spec (or the --set values)")
    return result.stdout.strip().split(";")[0]  # --parsable prints `jobid[;cluster]`


# --- `python -m jobspec.launch.slurm node-runner RUNNER...` ---------------------------------------

def node_runner_argv(runner_argv: list[str], env) -> list[str]:
    """The runner argv with `--node_rank <SLURM_NODEID>` added before `--no_ssh`."""
    if "SLURM_NODEID" not in env:
        raise SystemExit("jobspec.launch.slurm node-runner: SLURM_NODEID is not set (run it "
                         "through srun)")
    at = runner_argv.index("--no_ssh")
    return runner_argv[:at] + ["--node_rank", str(int(env["SLURM_NODEID"]))] + runner_argv[at:]


def _node_runner(argv: list[str]) -> int:
    import signal
    # The runner and DeepSpeed's launch.py would die of SIGUSR1 (srun forwards it to this task);
    # ignoring it across exec leaves it to the ranks, which install their own checkpoint handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    full = node_runner_argv(argv, os.environ)
    os.execvp(full[0], full)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node-runner"]:
        return _node_runner(argv[1:])
    print("usage: python -m jobspec.launch.slurm node-runner RUNNER_ARGV...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
