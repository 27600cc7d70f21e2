"""Print the job spec's JSON Schema or its Markdown reference.

The JSON form is what editors use for completion and inline errors; with the YAML language
server, start a spec with
  # yaml-language-server: $schema=<path to>/schemas/jobspec.schema.json
The Markdown form is docs/spec.md:
  jobspec schema --format markdown > docs/spec.md
"""
from __future__ import annotations

import argparse
import json

from jobspec.commands import add_format_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_format_argument(parser, {"json": "the JSON Schema", "markdown": "the field reference"})


def run(args: argparse.Namespace) -> int:
    from jobspec.spec.schema import load_schema

    if args.format == "markdown":
        from jobspec.spec.docs import render_markdown

        print(render_markdown(load_schema()), end="")
    else:
        print(json.dumps(load_schema(), indent=2))
    return 0
