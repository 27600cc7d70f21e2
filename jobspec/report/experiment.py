"""`jobspec report`: the table of an experiment's runs on stdout; with --out, the table and the
comparison plot in that directory; with --log-to-runs, per-run plots logged to each run that lacks
them. Nothing else is written (no default directory, no MLflow artifact unless asked)."""
from __future__ import annotations

import sys
from pathlib import Path

from jobspec.errors import first_line, spec_error
from jobspec.report import table


def report(experiment: str, tracking_uri: str, fmt: str, out: Path | None, *, plots: bool = True,
           log_to_runs: bool = False, generations: bool = False) -> None:
    """Print the table. Files only under `out` (the table and the comparison plot); per-run plots
    logged to the MLflow runs only with `log_to_runs`: a report reads, it writes where it is
    told."""
    from jobspec.tracking import orphans
    client, experiment_ids, _ = table.open_experiment(tracking_uri, experiment)
    for experiment_id in experiment_ids:   # RUNNING runs whose launcher is gone
        orphans.close_orphans_of_experiment(client, experiment_id)
    client, reports = table.collect(tracking_uri, experiment)
    rows = [r.row for r in reports]
    if not rows:
        raise spec_error(f"experiment {experiment!r} has no runs", path=("EXPERIMENT",),
                         hint="launch a job with logging.mlflow.experiment set to it")
    # training.eval_generate: the runs' latest answers side by side (report/generation_table.py)
    if generations:
        report_generations(client, reports, experiment, fmt, out)
        return
    text = table.RENDERERS[fmt](rows)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")

    if out is not None:
        write_text(out / f"report.{table.SUFFIXES[fmt]}", text)
    if not plots or (out is None and not log_to_runs):
        return
    from jobspec.report import plots as plotting
    said = []
    if log_to_runs:
        logged = 0
        for item in reports:
            try:
                logged += len(plotting.log_run_plots(client, item.run_id, item.series,
                                                     title=item.row["run"]))
            except Exception as err:  # a read-only artifact store must not cost the user the table
                print(f"jobspec: could not log plots to run {item.run_id}: "
                      f"{first_line(err, limit=200)}",
                      file=sys.stderr)
        said.append(f"{logged} plot(s) logged to runs")
    if out is not None:
        comparison = plotting.plot_comparison(rows, out / plotting.COMPARISON_FILE,
                                              title=experiment)
        said.append(f"comparison plot {comparison}")
    print(f"jobspec: {'; '.join(said)}", file=sys.stderr)


def report_generations(client, reports, experiment: str, fmt: str, out: Path | None) -> None:
    """Print each prompt with every run's latest answer (markdown with `--format markdown`); with
    `out`, generations.md and generations.html there. No run that generated: exit 2, saying how to
    get some."""
    from jobspec.report import generation_table as generations
    comparison = generations.collect(client, reports)
    if not comparison.runs:
        raise spec_error(f"no run of experiment {experiment!r} generated answers at evaluation",
                         path=("EXPERIMENT",),
                         hint="launch a causal-lm job with training.eval_generate set")
    text = generations.render_markdown(comparison) if fmt == "markdown" \
        else generations.render_text(comparison)
    sys.stdout.write(text + "\n")
    if out is not None:
        write_text(out / "generations.md", generations.render_markdown(comparison))
        write_text(out / "generations.html", generations.render_html(comparison, experiment))
        print(f"jobspec: generations.md and generations.html in {out}", file=sys.stderr)


def write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as err:
        raise spec_error(f"cannot write {path} ({err.strerror or err})", path=("--out",),
                         hint="choose a directory you can write") from None
