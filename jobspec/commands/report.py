"""Tabulate and plot the runs of an MLflow experiment: settings, throughput, memory, prediction.

One row per run: name, status, precision, ZeRO stage, micro/global batch, accumulation,
checkpointing, optimizer, world size; steady-state samples/s, tokens/s, TFLOP/s and MFU (median of
the logged series after its first point, which pays for warm-up); peak allocated / NVML / host RSS
memory (max of the series); and the memory planner's predicted peak allocated memory ('-' when it
cannot be computed). GPU-only values are '-' on CPU runs.

Plots (unless --no-plots): `plots/memory.png` and `plots/throughput.png` logged to each run that
lacks them, and `comparison.png` (samples/s and peak memory per run) in --out.

examples:
  jobspec report quickstart
  jobspec report bench --format markdown --out reports/bench
  jobspec report xlmr-large --tracking-uri http://mlflow:5000 --format csv > runs.csv
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jobspec.errors import spec_error

HELP = "Tabulate and plot an MLflow experiment's runs: settings, throughput, memory vs prediction."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jobspec.report.table import DEFAULT_TRACKING_URI
    parser.add_argument("experiment", metavar="EXPERIMENT",
                        help="MLflow experiment name (logging.mlflow.experiment, by default the job's name), "
                             "or a job name: that job's runs in any experiment")
    parser.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URI",
                        help=f"MLflow tracking URI (default: {DEFAULT_TRACKING_URI}, the launch default)")
    parser.add_argument("--format", choices=("table", "markdown", "csv"), default="table",
                        help="table: aligned text; markdown; csv (raw numbers, empty = missing)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="also write report.<md|csv|txt> here, and the comparison plot "
                             "(default for the plot: reports/<experiment>/)")
    parser.add_argument("--no-plots", action="store_true", help="tables only: draw and log no plots")


def safe_dir_name(name: str) -> str:
    """An experiment name as one path component (names may hold '/', spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"


def run(args: argparse.Namespace) -> int:
    from jobspec.report import table as report

    client, reports = report.collect(args.tracking_uri, args.experiment)
    rows = [r.row for r in reports]
    if not rows:
        raise spec_error(f"experiment {args.experiment!r} has no runs", path=("EXPERIMENT",),
                         hint="launch a job with logging.mlflow.experiment set to it")
    text = report.RENDERERS[args.format](rows)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")

    out_dir = args.out or Path("reports") / safe_dir_name(args.experiment)
    if args.out is not None:
        _write(out_dir / f"report.{report.SUFFIXES[args.format]}", text)
    if args.no_plots:
        return 0
    from jobspec.report import plots
    logged = 0
    for item in reports:
        try:
            logged += len(plots.log_run_plots(client, item.run_id, item.series, title=item.row["run"]))
        except Exception as err:  # a read-only artifact store must not cost the user the table
            print(f"jobspec: could not log plots to run {item.run_id}: {str(err).splitlines()[0][:200]}",
                  file=sys.stderr)
    comparison = plots.plot_comparison(rows, out_dir / plots.COMPARISON_FILE, title=args.experiment)
    print(f"jobspec: {logged} plot(s) logged to runs; comparison plot {comparison}", file=sys.stderr)
    return 0


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as err:
        raise spec_error(f"cannot write {path} ({err.strerror or err})", path=("--out",),
                         hint="choose a directory you can write") from None
