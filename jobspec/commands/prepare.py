"""Build what a job needs ahead of time, so its first launch starts training at once: the DeepSpeed
ops and the tokenised data.

The tokenised data: a job's chat and prompt/completion records are tokenised once into the data
cache (JOBSPEC_CACHE_DIR, beside the planner's traces; jobspec/data/cache.py) that every launch with
the same data, tokenizer, template and data settings reuses; `prepare` builds it (every record
checked: a bad one is named at its file:line, exit 2), on a login node or in CI, with the same cache
directory as the launch.

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
  jobspec prepare JOB --data-only   # just the tokenised data
"""
from __future__ import annotations

import argparse
import sys

from jobspec.commands import add_set_argument
from jobspec.errors import RunFailure, SpecError, spec_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job spec YAML file(s)")
    add_set_argument(parser)
    parser.add_argument("--all", action="store_true", help="build every op a jobspec job can load")
    parser.add_argument("--data-only", action="store_true",
                        help="build the jobs' tokenised data, not the ops")


def run(args: argparse.Namespace) -> int:
    from jobspec import ops
    from jobspec.launch.job_ops import job_ops

    if not args.jobs and not args.all:
        raise spec_error("name a job to prepare, or pass --all", path=("JOB",),
                         hint="e.g. jobspec prepare jobs/quickstart.yaml")
    for job in args.jobs:
        prepare_data(job, args.overrides)
    if args.data_only:
        return 0
    needed = list(dict.fromkeys(op for job in args.jobs for op in job_ops(job, args.overrides)))
    wanted = list(dict.fromkeys(needed + (list(ops.ALL_OPS) if args.all else [])))
    states = ops.ensure_built(wanted, announce=lambda text: print(f"jobspec: {text}", flush=True))
    missing = []
    for op in states:
        if op.name is None:
            continue
        if op.why_not:
            print(f"jobspec: DeepSpeed op {op.short} cannot be built here: {op.why_not}",
                  file=sys.stderr)
            if op.builder_name in needed:
                missing.append(op.short)
        else:
            print(f"jobspec: DeepSpeed op {op.short} ready ({ops.home_relative(op.build_dir)})",
                  flush=True)
    if missing:
        raise RunFailure(f"the job needs DeepSpeed op(s) {', '.join(missing)}, which cannot be "
                         "built on this machine (reasons above)")
    return 0



def prepare_data(job: str, overrides: list[str]) -> None:
    """The job's tokenised data, built into the cache (nothing for synthetic data or text files)."""
    from jobspec.data.prepare import prepare_data as build
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(job, overrides)
    try:
        lines, _ = build(resolved.spec, build=True, show="bar" if sys.stdout.isatty() else "lines")
    except SpecError as err:
        raise resolved.locate(err) from None
    for line in lines:
        print(f"jobspec: {line}", flush=True)
