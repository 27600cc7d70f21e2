"""jobspec: one YAML file per training job, validated, compiled to the exact DeepSpeed config,
memory-planned, launched on GPUs or CPU ranks and logged to MLflow, its model exported.

The command line dispatches to one module per subcommand. Each module in `jobspec.commands` defines
`add_arguments(parser)` and `run(args) -> int`; its docstring is the subcommand's `--help` text, and
its one-line summary is in COMMANDS below. Modules are imported only for the subcommand that runs,
so `jobspec validate` never pays for torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from jobspec import __version__, library_log
from jobspec.errors import EXIT_INVALID, EXIT_RUN_FAILED, RunFailure, SpecError

# name -> module under jobspec.commands; the one-line help lives here so `jobspec --help`
# does not have to import every command.
COMMANDS: dict[str, str] = {
    "validate": "Check a job spec; report every problem with file:line:col.",
    "compile": "Write the exact DeepSpeed config, patches and command a job will run.",
    "schema": "Print the job spec's JSON Schema (for editors) or its Markdown reference.",
    "launch": "Validate, compile and run a job through DeepSpeed, logging it to MLflow.",
    "plan": "Predict per-GPU memory of a job; --fit finds the fastest settings that fit a budget.",
    "prepare": "Build the DeepSpeed ops a job needs (first-run compiles) ahead of time, e.g. for "
               "CI and images.",
    "sbatch": "Render a Slurm batch script for a job (launch.sh + #SBATCH lines); --submit to "
              "sbatch it.",
    "report": "Tabulate and plot an MLflow experiment's runs: settings, throughput, memory vs "
              "prediction.",
    "sync": "Upload metrics.jsonl points that MLflow lacks into the run's MLflow run (idempotent).",
    "export": "Convert a checkpoint (any ZeRO stage, any world size) into a Hugging Face model "
              "directory.",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split())   # the docstring's first paragraph
    parser = argparse.ArgumentParser(prog="jobspec", description=summary)
    parser.add_argument("--version", action="version", version=f"jobspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        if name == command:
            module = importlib.import_module(f"jobspec.commands.{name}")
            p = sub.add_parser(name, help=help_line, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
            module.add_arguments(p)
            if name in library_log.QUIET_COMMANDS and "--verbose" not in p._option_string_actions:
                p.add_argument("--verbose", "-v", action="store_true",
                               help="show the libraries' warnings and log lines (else kept in "
                                    f"{library_log.log_path(name)})")
            p.set_defaults(_module=module)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 0 if not argv else EXIT_INVALID
    try:
        with library_log.quiet(args.command, getattr(args, "verbose", False)):
            return int(args._module.run(args) or 0)
    except SpecError as err:
        print(err.render(fmt=getattr(args, "format", "text")), file=sys.stderr)
        return EXIT_INVALID
    except RunFailure as err:
        print(f"jobspec: run failed: {err.reason}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`jobspec plan JOB | head`): end quietly, as `cat` does. Python would
        # otherwise complain again when it flushes stdout at exit, so point stdout at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141   # 128 + SIGPIPE, what a shell reports for a command killed by the closed pipe


if __name__ == "__main__":
    raise SystemExit(main())
