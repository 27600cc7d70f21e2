"""Check one or more job specs without running anything.

Every problem is reported at once, sorted by position, as
`file:line:col: dotted.path: what is wrong (how to fix it)`; the exit status is 2 if any file
has a problem, 0 if all are valid. `--set` overrides are checked exactly as `jobspec launch`
would apply them; their problems are reported at `<--set>:1:N` (N: the override's position
among the --set flags).

examples:
  jobspec validate jobs/xlmr-large.yaml
  jobspec validate jobs/*.yaml --set training.max_steps=10 --format json
"""
from __future__ import annotations

import argparse
import json
import sys

from jobspec.commands import add_format_argument, add_set_argument
from jobspec.errors import EXIT_INVALID, SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="+", metavar="JOB", help="job spec YAML file(s)")
    add_set_argument(parser)
    add_format_argument(parser, {"text": "one line per spec, problems on stderr",
                                 "json": "machine-readable, on stdout (errors too)"})


def run(args: argparse.Namespace) -> int:
    from jobspec.data import record_checks
    from jobspec.spec.derived import derive
    from jobspec.spec.freeform import unchecked_model_config
    from jobspec.spec.validation import load_and_validate
    from jobspec.techniques.lora import random_base_note

    reports, failed = [], False
    for job in args.jobs:
        try:
            resolved = load_and_validate(job, args.overrides)
        except SpecError as err:
            failed = True
            if args.format == "json":
                reports.append({"file": job, **json.loads(err.render("json"))})
            else:
                print(err.render(), file=sys.stderr)
            continue
        spec = resolved.spec
        for warning in resolved.warnings:
            print(f"warning: {warning.render()}", file=sys.stderr)
        world = derive(spec).world_size
        said = (unchecked_model_config(resolved), random_base_note(spec))
        notes = [note for note in said if note]
        notes += record_checks.unread(spec)
        if args.format == "json":
            reports.append({"valid": True, "file": job, "name": spec["name"], "world_size": world,
                            "notes": notes, "spec": spec})
        else:
            print(f"{job}: ok (name {spec['name']}, world size {world})")
            for note in notes:
                print(f"note: {note}")
    if args.format == "json":
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return EXIT_INVALID if failed else 0
