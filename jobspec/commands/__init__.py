"""One module per `jobspec` subcommand: its docstring is the `--help` text, `add_arguments(parser)`
declares its flags and `run(args) -> int` calls the library. The one-line summaries shown by
`jobspec --help` live in jobspec/cli.py's COMMANDS (so listing them imports no command).

The arguments several commands share are declared here, once, so they read the same everywhere.
"""
from __future__ import annotations

import argparse

SET_METAVAR = "KEY.PATH=VALUE"


def add_set_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    """`--set KEY.PATH=VALUE` (repeatable) into `args.overrides`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar=SET_METAVAR,
                        help="override a spec field, e.g. --set training.max_steps=10 (repeatable)"
                             + (f"; {note}" if note else ""))


def add_format_argument(parser: argparse.ArgumentParser, formats: dict[str, str]) -> None:
    """`--format` choosing among `formats` (name -> what it prints); the first one is the
    default."""
    default = next(iter(formats))
    parser.add_argument("--format", choices=tuple(formats), default=default,
                        help="; ".join(f"{name}{' (default)' if name == default else ''}: {what}"
                                       for name, what in formats.items()))
