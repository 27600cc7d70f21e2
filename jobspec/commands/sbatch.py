"""Render (and optionally submit) a Slurm batch script for a job spec.

The `#SBATCH` lines come from `resources` (nodes, gpus_per_node) and `resources.slurm` (partition,
account, qos, time, cpus_per_task, mem, constraint, exclusive, output, error, requeue,
signal_grace_seconds); the job name is the spec's name. One task per node: each node runs one
DeepSpeed runner that starts its ranks. The body runs `launch.sh SPEC --set ...` (absolute paths),
which forwards the time-limit / preemption warning (SIGUSR1) to jobspec, requeues the job once the
checkpoint is written, and the requeued run resumes from it (`checkpoint.resume: auto`).

Every value is shell-quoted; values sbatch cannot read in an `#SBATCH` line (newlines, control
characters, backslashes) are reported as spec errors (exit 2). Without --out or --submit the script
goes to stdout; --submit runs `sbatch --parsable` and prints the job id.

examples:
  jobspec sbatch jobs/xlmr-large.yaml > xlmr.sbatch && sbatch xlmr.sbatch
  jobspec sbatch jobs/xlmr-large.yaml --set resources.nodes=2 --submit
  jobspec sbatch jobs/quickstart.yaml --cpu-ranks --out quickstart.sbatch
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobspec.commands import add_set_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job spec file (YAML)")
    add_set_argument(parser, "passed on to the job")
    parser.add_argument("--out", metavar="FILE", type=Path,
                        help="write the script to FILE instead of stdout")
    parser.add_argument("--submit", action="store_true",
                        help="submit with `sbatch --parsable`; print the job id")
    parser.add_argument("--cpu-ranks", action="store_true",
                        help="the nodes have no GPUs: request no --gpus-per-node "
                             "(resources.gpus_per_node is then the CPU ranks per node)")


def run(args: argparse.Namespace) -> int:
    from jobspec import hardware
    from jobspec.launch import slurm
    from jobspec.spec.validation import load_and_validate

    # checked for the compute nodes the script asks for, not the login node that writes it
    with hardware.runs_elsewhere(gpus=not args.cpu_ranks):
        resolved = load_and_validate(args.job, args.overrides)
    script = slurm.render_sbatch(resolved, args.job, args.overrides, gpus=not args.cpu_ranks)
    if args.out is not None:
        args.out.write_text(script, encoding="utf-8")
        args.out.chmod(0o755)
        print(f"jobspec: wrote {args.out}", file=sys.stderr)
    if args.submit:
        print(slurm.submit(script))
    elif args.out is None:
        sys.stdout.write(script)
    return 0
