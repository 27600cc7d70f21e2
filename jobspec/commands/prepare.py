"""Build the DeepSpeed ops a job needs ahead of time, so its first launch starts training at once.

DeepSpeed compiles some C++ ops (its fused Adam, CPU Adam for optimizer offload, NVMe I/O) the
first time a process loads them: 15 s to minutes each, cached afterwards in TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions/). A job on the default path needs none (torch's fused AdamW);
`jobspec launch` builds what a job's features need before training and says so; `prepare` does it
beforehand, e.g. in a CI job or while building a container image. It builds for this machine's
accelerator (CPU or CUDA): run it where the job will run, or on an identical image. Ops that
cannot be built here (a missing compiler or library) are listed with DeepSpeed's reason; exit 1 if
one of them is needed by a JOB.

examples:
  jobspec prepare jobs/quickstart.yaml
  jobspec prepare --all          # every op a jobspec job can load (CI, images)
"""
from __future__ import annotations

import argparse
import sys

from jobspec.commands import add_set_argument
from jobspec.errors import RunFailure, spec_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job spec YAML file(s)")
    add_set_argument(parser)
    parser.add_argument("--all", action="store_true", help="build every op a jobspec job can load")


def run(args: argparse.Namespace) -> int:
    from jobspec import ops
    from jobspec.launch.job_ops import job_ops

    if not args.jobs and not args.all:
        raise spec_error("name a job to prepare, or pass --all", path=("JOB",),
                         hint="e.g. jobspec prepare jobs/quickstart.yaml")
    needed = list(dict.fromkeys(op for job in args.jobs for op in job_ops(job, args.overrides)))
    wanted = list(dict.fromkeys(needed + (list(ops.ALL_OPS) if args.all else [])))
    states = ops.ensure_built(wanted, announce=lambda text: print(f"jobspec: {text}", flush=True))
    missing = []
    for op in states:
        if op.name is None:
            continue
        if op.why_not:
            print(f"jobspec: DeepSpeed op {op.short} cannot be built here: {op.why_not}", file=sys.stderr)
            if op.builder_name in needed:
                missing.append(op.short)
        else:
            print(f"jobspec: DeepSpeed op {op.short} ready ({ops.home_relative(op.build_dir)})", flush=True)
    if missing:
        raise RunFailure(f"the job needs DeepSpeed op(s) {', '.join(missing)}, which cannot be built on this "
                         "machine (reasons above)")
    return 0

