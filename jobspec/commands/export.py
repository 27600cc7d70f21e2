"""Convert a saved checkpoint into a Hugging Face model directory, offline, on the CPU.

SOURCE is a run directory (its job's newest checkpoint), a checkpoint directory (the checkpoint
its `latest` file names) or one step<N> checkpoint. Any ZeRO stage and world size: the weights
are merged by DeepSpeed's own zero_to_fp32 code. DIR gets config.json, safetensors weights in
--dtype (default: the spec's `export.dtype`), the tokenizer when the job has one and a README.md
model card, as the job's own export writes it (spec section `export`); it loads with
`AutoModelFor<task>.from_pretrained(DIR)`. A LoRA job's PEFT adapter, with the tokenizer, goes to
DIR/adapter (`export.adapter: adapter`: to DIR): nothing is written outside DIR. Every file gets
the mode the umask gives.

The model is rebuilt from the job's resolved spec: the copy in the checkpoint, else a run
directory of the job, else --spec. Exit status: 0 written, 1 the directory could not be written
(disk full, permissions), 2 bad input (paths, a non-empty DIR without --force, a damaged
checkpoint).

examples:
  jobspec export runs/quickstart/run-20250101-120000-ab12 --out models/quickstart
  jobspec export runs/xlmr-large/checkpoints/step2000 --out /data/xlmr-2000 --dtype bf16
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from jobspec.commands import add_format_argument
from jobspec.errors import spec_error
from jobspec.units import MiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR",
                        help="run directory, checkpoint directory (with `latest`) or one step<N> "
                             "checkpoint")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="model directory to write")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="dtype of the saved weights (default: the spec's export.dtype; auto "
                             "follows memory.precision)")
    parser.add_argument("--force", action="store_true", help="replace DIR when it is not empty")
    parser.add_argument("--spec", type=Path, default=None, metavar="RESOLVED_YAML",
                        help="the job's resolved.yaml, when the checkpoint carries no copy of it")
    add_format_argument(parser,
                        {"text": "one line per result", "json": "the export record (errors too)"})


def run(args: argparse.Namespace) -> int:
    from jobspec.export.from_checkpoint import export_checkpoint, hub_offline, locate
    from jobspec.export.hf_dir import ExportFailed

    out = args.out.expanduser().resolve()
    # DeepSpeed and transformers log to stdout as they are imported and convert: stdout stays the
    # result
    # offline: the cache or local files only
    with contextlib.redirect_stdout(sys.stderr), hub_offline():
        source = locate(args.source, args.spec)
        check_out(out, source.path, args.force)
        try:
            record = export_checkpoint(source, out, args.dtype, show_progress=True)
        except ExportFailed as err:
            print(f"jobspec: error: {err}", file=sys.stderr)
            return 1
    if args.format == "json":
        print(json.dumps(record, indent=2))
    else:
        print(f"wrote {record['path']} ({record['bytes'] / MiB:.1f} MiB, {record['dtype']}, step "
              f"{record['step']}) from {source.path} in {record['seconds']:.1f} s")
        adapter = record.get("adapter")
        if adapter:   # model.lora: the PEFT adapter inside DIR, beside the merged model (both)
            print(f"wrote {adapter['path']} (PEFT adapter, {adapter['bytes'] / MiB:.1f} MiB)")
    return 0


def check_out(out: Path, checkpoint: Path, force: bool) -> None:
    """DIR may be new or empty; a non-empty one only with --force, and never one holding the
    checkpoint."""
    if out.exists() and not out.is_dir():
        raise spec_error(f"--out {out} exists and is not a directory",
                         hint="choose a directory path")
    if out == checkpoint or out in checkpoint.parents:
        raise spec_error(f"--out {out} contains the checkpoint {checkpoint}",
                         hint="write the model to a directory outside the checkpoint's")
    from jobspec.spec.validation import SYSTEM_DIRS, SYSTEM_TREES
    text = str(out)
    if text in SYSTEM_DIRS or any(text == t or text.startswith(t + "/") for t in SYSTEM_TREES):
        raise spec_error(f"--out {out} is a system location; jobspec will not write there",
                         hint="use a directory of your own")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise spec_error(f"--out {out} is not empty",
                         hint="choose a new or empty directory, or pass --force "
                                                           "to replace it")
