"""Tabulate and plot the runs of an MLflow experiment: settings, losses, task metrics, throughput,
memory, prediction.

One row per run: name, status, precision, ZeRO stage, micro/global batch, accumulation,
checkpointing, optimizer, world size; the final train and eval loss, and the last evaluation's task
metrics (accuracy, F1, perplexity: a column only when some run has it); steady-state samples/s,
tokens/s, TFLOP/s and MFU (median of the logged series after its first point, which pays for
warm-up); peak allocated, GPU total (NVML) and host RSS memory (max of the series), each beside
the plan the launch logged for it (its `plan.*` params; recomputed from resolved.yaml for a run
without them; '-' when it cannot be computed). GPU values are '-' on CPU ranks, whose plan is
their host RAM (the process and the tensors).

A report only reads unless told where to write: with --out DIR, report.<md|csv|txt> and
`comparison.png` (samples/s and peak memory per run) go to DIR; with --log-to-runs,
`plots/memory.png` and `plots/throughput.png` are logged to each run that lacks them. Without
either, nothing is written (no directory in the current one, no MLflow artifact). One thing a
report does change: a RUNNING run whose launcher is gone is closed (docs/reliability.md).

examples:
  jobspec report quickstart
  jobspec report bench --format markdown --out reports/bench
  jobspec report bench --log-to-runs         # memory/throughput plots into each run's artifacts
  jobspec report chat --generations --out reports/chat   # each run's answers (eval_generate)
  jobspec report xlmr-large --tracking-uri http://mlflow:5000 --format csv > runs.csv
"""
from __future__ import annotations

import argparse
from pathlib import Path

from jobspec.commands import add_format_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jobspec.report.table import DEFAULT_TRACKING_URI
    parser.add_argument("experiment", metavar="EXPERIMENT",
                        help="MLflow experiment name (logging.mlflow.experiment, by default the "
                             "job's name), or a job name: that job's runs in any experiment")
    parser.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URI",
                        help=f"MLflow tracking URI (default: {DEFAULT_TRACKING_URI}, the launch "
                             "default)")
    add_format_argument(parser, {"table": "aligned text", "markdown": "a Markdown table",
                                 "csv": "raw numbers, empty = missing"})
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="also write report.<md|csv|txt> and the comparison plot here "
                             "(default: write nothing, only print the table)")
    parser.add_argument("--log-to-runs", action="store_true",
                        help="log plots/memory.png and plots/throughput.png to each run that lacks "
                             "them")
    parser.add_argument("--no-plots", action="store_true",
                        help="tables only: draw and log no plots")
    parser.add_argument("--generations", action="store_true",
                        help="instead of the table: each prompt of training.eval_generate with "
                             "every run's latest answer side by side (with --out: generations.md "
                             "and generations.html)")


def run(args: argparse.Namespace) -> int:
    from jobspec.report.experiment import report

    report(args.experiment, args.tracking_uri, args.format, args.out, plots=not args.no_plots,
           log_to_runs=args.log_to_runs, generations=args.generations)
    return 0
