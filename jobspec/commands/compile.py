"""Compile a job spec into the exact DeepSpeed config, model patches and command it will run.

Without --out, prints the DeepSpeed config (JSON on stdout; notes on stderr). With --out DIR,
writes the run-directory files a launch would use:

  spec.yaml        the spec exactly as written
  resolved.yaml    every default filled, paths absolute
  ds_config.json   the complete DeepSpeed config (no "auto")
  patches.json     model changes the worker applies (checkpointing, attention, ...)
  command.txt      the `deepspeed` command line
  launch.json      world size, batch arithmetic, total steps, notes

Notes list every value a `deepspeed:` override replaced. Exit code 2 on an invalid spec.

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

import yaml

from jobspec.errors import spec_error
from jobspec.secrets import mask_secrets

COMPILE_FILES = ("spec.yaml", "resolved.yaml", "ds_config.json", "patches.json", "command.txt", "launch.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job spec file (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set training.max_steps=10 (repeatable)")
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="write the run-directory files here instead of printing the DeepSpeed config")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="text: the config and notes; json: one object (also used for errors)")


def run(args: argparse.Namespace) -> int:
    # Imported here so `jobspec compile --help` stays instant.
    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(args.job, overrides=args.overrides)
    run_dir = str(args.out.resolve()) if args.out else "RUN_DIR"
    compiled = compile_spec(resolved.spec, derive_job(resolved.spec), run_dir=run_dir)

    if args.out:
        write_run_files(args.out, resolved, compiled)
        if args.format == "json":
            print(json.dumps({"out": run_dir, "files": list(COMPILE_FILES), "notes": compiled.notes}, indent=2))
        else:
            print(f"wrote {', '.join(COMPILE_FILES)} to {run_dir}")
            print(f"command: {shlex.join(compiled.launch['argv'])}")
            for note in compiled.notes:
                print(f"note: {note}")
        return 0
    if args.format == "json":
        print(json.dumps({"ds_config": compiled.ds_config, "patches": compiled.patches, "launch": compiled.launch,
                          "derived": compiled.derived.as_dict(), "notes": compiled.notes}, indent=2))
    else:
        print(json.dumps(compiled.ds_config, indent=2))
        # Notes go to stderr so stdout stays a valid ds_config.json.
        for note in compiled.notes:
            print(f"note: {note}", file=sys.stderr)
    return 0


def write_run_files(out: Path, resolved, compiled) -> None:
    """Write the compile outputs into `out`; refuse a non-empty directory holding anything else."""
    if out.exists() and not out.is_dir():
        raise spec_error(f"--out {out} exists and is not a directory", hint="choose a directory path")
    if out.is_dir():
        # a multi-node launch writes its hostfile into the run directory before these files
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (*COMPILE_FILES, "hostfile"))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise spec_error(f"--out {out} is not empty and is not a previous compile output (has {shown})",
                             hint="choose a new or empty directory; compile only overwrites its own files")
    out.mkdir(parents=True, exist_ok=True)
    launch = {**compiled.launch, "derived": compiled.derived.as_dict(), "notes": compiled.notes,
              "source": str(resolved.source.resolve())}
    contents = {
        # a password in a tracking URI or a planted token must not reach files that become artifacts
        "spec.yaml": mask_secrets(resolved.text),
        "resolved.yaml": mask_secrets(yaml.safe_dump(resolved.spec, sort_keys=False)),
        "ds_config.json": json.dumps(compiled.ds_config, indent=2) + "\n",
        "patches.json": json.dumps(compiled.patches, indent=2) + "\n",
        "command.txt": shlex.join(compiled.launch["argv"]) + "\n",
        "launch.json": json.dumps(launch, indent=2) + "\n",
    }
    for name, text in contents.items():
        (out / name).write_text(text, encoding="utf-8")
