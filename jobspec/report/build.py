"""`jobspec report`: the table of an experiment's runs on stdout (and in --out), plots logged to each
run that lacks them, and the comparison plot."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from jobspec.errors import first_line, spec_error
from jobspec.report import table


def safe_dir_name(name: str) -> str:
    """An experiment name as one path component (names may hold '/', spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"


def report(experiment: str, tracking_uri: str, fmt: str, out: Path | None, *, plots: bool = True) -> None:
    from jobspec.launch import orphans
    client, experiment_ids, _ = table.open_experiment(tracking_uri, experiment)
    for experiment_id in experiment_ids:   # RUNNING runs whose launcher is gone
        orphans.close_orphans_of_experiment(client, experiment_id)
    client, reports = table.collect(tracking_uri, experiment)
    rows = [r.row for r in reports]
    if not rows:
        raise spec_error(f"experiment {experiment!r} has no runs", path=("EXPERIMENT",),
                         hint="launch a job with logging.mlflow.experiment set to it")
    text = table.RENDERERS[fmt](rows)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")

    out_dir = out or Path("reports") / safe_dir_name(experiment)
    if out is not None:
        write_text(out_dir / f"report.{table.SUFFIXES[fmt]}", text)
    if not plots:
        return
    from jobspec.report import plots as plotting
    logged = 0
    for item in reports:
        try:
            logged += len(plotting.log_run_plots(client, item.run_id, item.series, title=item.row["run"]))
        except Exception as err:  # a read-only artifact store must not cost the user the table
            print(f"jobspec: could not log plots to run {item.run_id}: {first_line(err, limit=200)}",
                  file=sys.stderr)
    comparison = plotting.plot_comparison(rows, out_dir / plotting.COMPARISON_FILE, title=experiment)
    print(f"jobspec: {logged} plot(s) logged to runs; comparison plot {comparison}", file=sys.stderr)


def write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as err:
        raise spec_error(f"cannot write {path} ({err.strerror or err})", path=("--out",),
                         hint="choose a directory you can write") from None
