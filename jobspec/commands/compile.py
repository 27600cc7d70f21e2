"""Compile a job spec into the exact DeepSpeed config, model patches and command it will run.

Without --out, prints the DeepSpeed config (JSON on stdout) and, on stderr, the model patches
(patches.json: attention, tf32, freezing, checkpointing, LoRA, ...), an optimizer jobspec builds
on the ranks, and the notes.
With --out DIR, writes the run-directory files a launch would use:

  spec.yaml        the spec exactly as written
  resolved.yaml    every default filled, paths absolute
  ds_config.json   the complete DeepSpeed config (no "auto")
  patches.json     model changes the worker applies (checkpointing, attention, ...)
  command.txt      the `deepspeed` command line
  launch.json      world size, batch arithmetic, total steps, notes

Notes list every value a `deepspeed:` override replaced. With `memory.fit: auto` and a budget
(`memory.gpu_memory`, else this machine's free GPU memory) the fit's changes are applied first, as
`jobspec launch` applies them: the config shown is the config that runs. Exit code 2 on an invalid
spec.

examples:
  jobspec compile jobs/quickstart.yaml
  jobspec compile jobs/xlmr-large.yaml --set training.micro_batch_size=4 --out /tmp/xlmr
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from jobspec.commands import add_format_argument, add_set_argument
from jobspec.spec.types import JobSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job spec file (YAML)")
    add_set_argument(parser)
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="write the run-directory files here instead of printing the DeepSpeed "
                             "config")
    add_format_argument(parser, {"text": "the config and notes", "json": "one object (errors too)"})


def run(args: argparse.Namespace) -> int:
    # Imported here so `jobspec compile --help` stays instant.
    from jobspec import rundir
    from jobspec.job.prepare import Preparation, prepare_job

    run_dir = str(args.out.resolve()) if args.out else "RUN_DIR"
    # memory.fit: auto applied as launch does
    job = prepare_job(args.job, args.overrides, how=Preparation(run_dir=run_dir))
    resolved, compiled = job.resolved, job.compiled
    assert compiled is not None   # compiled for run_dir
    fit_lines = [f"note: {line}" for line in (job.memory.lines if job.memory else [])]

    if args.out:
        rundir.write_compiled(args.out, resolved, compiled)
        if args.format == "json":
            print(json.dumps({"out": run_dir, "files": list(rundir.COMPILE_FILES),
                              "notes": compiled.notes}, indent=2))
        else:
            print(f"wrote {', '.join(rundir.COMPILE_FILES)} to {run_dir}")
            print(f"command: {shlex.join(compiled.plan.command)}")
            for line in fit_lines:
                print(line)
            for note in compiled.notes:
                print(f"note: {note}")
        return 0
    if args.format == "json":
        print(json.dumps({"ds_config": compiled.ds_config, "patches": compiled.patches,
                          "launch": compiled.plan.record(), "derived": compiled.derived.as_dict(),
                          "notes": compiled.notes}, indent=2))
    else:
        print(json.dumps(compiled.ds_config, indent=2))
        # Patches and notes go to stderr so stdout stays a valid ds_config.json.
        for line in [*patch_lines(compiled.patches), *optimizer_lines(resolved.spec), *fit_lines]:
            print(line, file=sys.stderr)
        for note in compiled.notes:
            print(f"note: {note}", file=sys.stderr)
    return 0


def optimizer_lines(spec: JobSpec) -> list[str]:
    """The optimizer the ranks build themselves (DeepSpeed's config has no block for it), with the
    args its module's `build` gets (jobspec/optimizers: `client_args`); none for DeepSpeed's own."""
    from jobspec import optimizers

    section = spec["training"]["optimizer"]
    chosen = optimizers.get(section["name"])
    if chosen.client_args is None:
        return []
    args = " ".join(f"{k}={json.dumps(v)}" for k, v in chosen.client_args(section).items())
    return [f"optimizer: {args}  (built by jobspec on the ranks)"]


def patch_lines(patches: list) -> list[str]:
    """patches.json, readable: what the ranks change in the model before DeepSpeed sees it."""
    from jobspec.compile.compiler import patch_text

    lines = []
    for patch in patches:
        args = " ".join(f"{k}={json.dumps(v)}" for k, v in (patch.get("args") or {}).items())
        lines.append(f"patch: {patch['name']}" + (f" {args}" if args else "")
                     + f"  ({patch_text(patch)})")
    return lines or ["patch: none (the model runs as transformers builds it)"]
