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
import csv
import json
import shlex
import sys
from pathlib import Path

from jobspec import rundir
from jobspec.errors import spec_error

_EXTENSION_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


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
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(args.job, overrides=args.overrides)
    run_dir = str(args.out.resolve()) if args.out else "RUN_DIR"
    compiled = compile_resolved(resolved, run_dir=run_dir)

    if args.out:
        rundir.write_compiled(args.out, resolved, compiled)
        if args.format == "json":
            print(json.dumps({"out": run_dir, "files": list(rundir.COMPILE_FILES), "notes": compiled.notes}, indent=2))
        else:
            print(f"wrote {', '.join(rundir.COMPILE_FILES)} to {run_dir}")
            print(f"command: {shlex.join(compiled.launch['argv'])}")
            for note in compiled.notes:
                print(f"note: {note}")
        return 0
    if args.format == "json":
        print(json.dumps({"ds_config": compiled.ds_config, "patches": compiled.patches, "launch": compiled.launch,
                          "derived": compiled.derived, "notes": compiled.notes}, indent=2))
    else:
        print(json.dumps(compiled.ds_config, indent=2))
        # Notes go to stderr so stdout stays a valid ds_config.json.
        for note in compiled.notes:
            print(f"note: {note}", file=sys.stderr)
    return 0


def compile_resolved(resolved, *, run_dir: str = "RUN_DIR", master_port: int | None = None):
    """`compile_spec` with the inputs read at this edge: a local checkpoint's config.json (model
    dimensions) and, for `training.epochs` with file data, the row count. `jobspec launch` compiles
    through here too, so it runs exactly what `jobspec compile` shows."""
    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.model_dims import model_dims, read_local_config

    spec = resolved.spec
    dims = model_dims(spec, read_local_config(spec["model"]["name_or_path"]))
    num_train_samples = None
    if spec["training"]["epochs"] is not None and spec["data"]["train"]:
        num_train_samples = count_rows(spec["data"]["train"], spec["data"]["format"])
    return compile_spec(spec, model_dims=dims, num_train_samples=num_train_samples, run_dir=run_dir,
                        master_port=master_port)


def count_rows(path: str | Path, fmt: str = "auto") -> int:
    """Training samples in a jsonl/csv/parquet file (rows; blank jsonl lines and the csv header excluded)."""
    path = Path(path)
    if fmt == "auto":
        fmt = _EXTENSION_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise spec_error(f"cannot tell the format of {path.name} from its extension", path=("data", "format"),
                             hint="set data.format to jsonl, csv or parquet")
    try:
        if fmt == "jsonl":
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if fmt == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                return max(0, sum(1 for _ in csv.reader(f)) - 1)  # csv.reader: quoted newlines stay one row
        import pyarrow.parquet as pq  # only for parquet data; metadata holds the row count
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, ImportError) as err:
        raise spec_error(f"cannot count the rows of {path}: {err}", path=("data", "train"),
                         hint="check the file and data.format") from None
