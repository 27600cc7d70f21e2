"""One row per MLflow run of an experiment: the settings that explain it, every spec field whose
value differs between the experiment's runs (`model.lora.r` for two LoRA variants), trainable and
total parameters, how the run ended, the final train and eval loss and the task metrics of the last
evaluation, the run's throughput (its perf/run_* average: the number summary.json and the closing
summary show, docs/architecture.md, "Throughput"), measured peak memory beside the planner's
prediction; rendered as an aligned table, markdown or CSV.

Reads what the launcher and worker log (see jobspec.tracking.run and jobspec.tracking.sink): params
are the flattened resolved spec plus `derived.*`, metrics use the shared names
(`perf/samples_per_s`, `mem/...`), artifacts include `resolved.yaml`. Missing values (a GPU metric
on a CPU run, a failed run) are None here and '-' in the text formats: absent, never zero.
"""
from __future__ import annotations

import csv
import io
import json
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jobspec import rundir
from jobspec.errors import first_line, spec_error
from jobspec.memory import plan_figures
from jobspec.tasks import metrics as eval_metrics
from jobspec.train import startup

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # the schema's logging.mlflow.tracking_uri default

THROUGHPUT_METRICS = ("perf/samples_per_s", "perf/tokens_per_s", "perf/tflops_per_device",
                      "perf/mfu")
# the launch's averages over its training time (train/progress.StepReporter.finish), logged at its
# end
RUN_THROUGHPUT_METRICS = tuple(name.replace("perf/", "perf/run_") for name in THROUGHPUT_METRICS)
MEMORY_METRICS = ("mem/peak_allocated_mib_max", "mem/peak_allocated_mib_rank0",
                  "mem/peak_reserved_mib_max",
                  "mem/peak_reserved_mib_rank0", "mem/nvml_used_mib_max", "mem/host_rss_mib_max")
LOSS_METRICS = ("train/loss", "eval/loss")
# the start-up's phases and its total to the first step (train/startup.py), logged at the first step
STARTUP_METRICS = tuple(startup.metric_names())
# each phase's seconds: CSV columns after the total (`startup_s`), for the runs that logged them
STARTUP_PHASE_COLUMNS = {name.replace("/", "_"): name for name in STARTUP_METRICS
                         if name != f"startup/{startup.TOTAL}_s"}
# eval/accuracy, ...
TASK_METRICS = tuple(eval_metrics.key(name) for name in eval_metrics.TASK_ONLY)

# (key, header, how the text formats show it)
COLUMNS = (
    ("run", "run", str),
    ("status", "status", str),
    ("precision", "precision", str),
    ("zero", "zero", str),
    ("micro", "micro", str),
    ("global", "global", str),
    ("accum", "accum", str),
    ("checkpointing", "ckpt", str),
    ("optimizer", "optimizer", str),
    ("world", "world", str),
    ("trainable", "trainable", "{:,.0f}".format),
    ("parameters", "params", "{:,.0f}".format),
    ("train_loss", "train loss", "{:.4f}".format),
    ("eval_loss", "eval loss", "{:.4f}".format),
    ("accuracy", "accuracy", "{:.4f}".format),
    ("f1", "F1", "{:.4f}".format),
    ("perplexity", "perplexity", "{:.4g}".format),
    ("samples_per_s", "samples/s", "{:.2f}".format),
    ("tokens_per_s", "tokens/s", "{:.0f}".format),
    ("tflops", "TFLOP/s", "{:.2f}".format),
    ("mfu", "MFU", "{:.1%}".format),
    ("startup_s", "start-up s", "{:.1f}".format),   # from the command to the end of the first step
    # each measured peak beside its plan (memory/plan_figures: the figures the launch showed)
    ("peak_allocated_mib", "peak alloc MiB", "{:.0f}".format),
    ("predicted_mib", "plan alloc MiB", "{:.0f}".format),
    ("nvml_used_mib", "GPU total MiB", "{:.0f}".format),
    ("gpu_total_plan_mib", "plan GPU total MiB", "{:.0f}".format),
    ("host_rss_mib", "host RSS MiB", "{:.0f}".format),
    ("host_plan_mib", "plan host RAM MiB", "{:.0f}".format),
)
# a row's plan key for each figure (memory/plan_figures' metric names)
PLAN_COLUMNS = {"predicted_mib": plan_figures.PEAK_ALLOCATED.metric,
                "gpu_total_plan_mib": plan_figures.GPU_TOTAL.metric,
                "host_plan_mib": plan_figures.HOST_RAM.metric}
# a spec field that differs between the experiment's runs gets a column "spec.<field>" after
# `status`; these do not: what the fixed columns show already, and what names, places or logs a run
SHOWN_FIELDS = {"memory.precision", "memory.zero_stage", "training.micro_batch_size",
                "training.global_batch_size",
                "training.optimizer.name", "memory.activation_checkpointing",
                "memory.activation_checkpointing.every_n_layers"}
UNTRAINED_PREFIXES = ("name", "description", "output_dir", "checkpoint.", "logging.", "export.",
                      "derived.", "plan.",
                      "fit.", "params.", "lora.summary", "quantization.summary",
                      "resources.master_port")
SPEC_COLUMN = "spec."
# task metric columns: shown only when some run of the report has the metric (a classification
# experiment has no perplexity column)
OPTIONAL_COLUMNS = set(eval_metrics.TASK_ONLY)
NUMERIC_ALIGN = {"zero", "micro", "global", "accum", "world", "trainable", "parameters",
                 "train_loss", "eval_loss", *OPTIONAL_COLUMNS,
                 "samples_per_s", "tokens_per_s", "tflops", "mfu", "startup_s",
                 "peak_allocated_mib", "nvml_used_mib", "host_rss_mib", *PLAN_COLUMNS}


@dataclass
class RunReport:
    """One run: its table row and the metric series the plots draw."""

    run_id: str
    row: dict
    # metric name -> [(step, value), ...] sorted by step
    series: dict = field(default_factory=dict)


# --- reducing metric series -----------------------------------------------------------------------

def steady_state(points: list) -> float | None:
    """Median of a logged series after its first point (which pays for warm-up: allocation, JIT)."""
    values = [v for _, v in sorted(points)]
    if not values:
        return None
    return statistics.median(values[1:] or values)


def run_rate(series: dict, name: str) -> float | None:
    """The run's `perf/<name>`: its perf/run_<name> average (the last launch's, for a resumed run);
    for a run logged before that metric existed, the steady state of the per-window series."""
    average = series.get(f"perf/run_{name}")
    return series_last(average) if average else steady_state(series.get(f"perf/{name}", []))


def series_max(points: list) -> float | None:
    return max((v for _, v in points), default=None)


def series_last(points: list) -> float | None:
    """The value at the last step logged (a final loss, the last evaluation's metric)."""
    return max(points)[1] if points else None


def settings_from_params(params: dict) -> dict:
    """The key settings of a run from its params (JSON text for non-strings, see
    jobspec.tracking.run.flatten)."""
    def get(*keys):
        for key in keys:
            if key in params:
                return params[key]
        return None
    return {
        "precision": get("memory.precision"),
        "zero": get("memory.zero_stage"),
        "micro": get("derived.micro_batch_size", "training.micro_batch_size"),
        "global": get("derived.global_batch_size", "training.global_batch_size"),
        "accum": get("derived.gradient_accumulation_steps"),
        "checkpointing": _checkpointing(params),
        "optimizer": get("training.optimizer.name"),
        "world": get("derived.world_size"),
    }


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def differing_fields(params_of_runs: list[dict]) -> list[str]:
    """The spec fields (flattened param names) whose values differ between the runs, in name order:
    what sets the runs apart beyond the fixed columns. A field a run lacks counts as differing."""
    if len(params_of_runs) < 2:
        return []
    names = set().union(*params_of_runs)
    return sorted(name for name in names
                  if name not in SHOWN_FIELDS and not name.startswith(UNTRAINED_PREFIXES)
                  and len({params.get(name) for params in params_of_runs}) > 1)


def add_differing_fields(rows: list[dict], params_of_runs: list[dict]) -> list[str]:
    """Each row gets `spec.<field>` for every field differing between the runs; returns the
    fields."""
    fields = differing_fields(params_of_runs)
    for row, params in zip(rows, params_of_runs):
        row.update({SPEC_COLUMN + name: params.get(name) for name in fields})
    return fields


def status_text(run) -> str:
    """MLflow's status, with jobspec's word where it says more (KILLED: preempted with a checkpoint,
    or killed before one)."""
    label = run.data.tags.get("jobspec.status")
    status = run.info.status
    return f"{status} ({label})" if label and label.upper() != status and status != "FINISHED" \
        else status


def _checkpointing(params: dict) -> str | None:
    every = params.get("memory.activation_checkpointing.every_n_layers")
    if every is not None:
        return "all" if every == "1" else f"1/{every}"
    value = params.get("memory.activation_checkpointing")
    if value is None:
        return None
    return {"true": "all", "false": "off", "{}": "all"}.get(value, value)


def build_row(run_name: str, status: str, params: dict, series: dict,
              planned: Mapping[str, float] | None) -> dict:
    """A table row from a run's params, metric series and planned memory figures ({metric: MiB},
    memory/plan_figures.planned) (pure: the unit the tests pin down)."""
    row = {"run": run_name, "status": status, **settings_from_params(params)}
    row.update({
        "train_loss": series_last(series.get("train/loss", [])),
        "eval_loss": series_last(series.get("eval/loss", [])),
        **{name: series_last(series.get(eval_metrics.key(name), []))
           for name in eval_metrics.TASK_ONLY},
        "samples_per_s": run_rate(series, "samples_per_s"),
        "tokens_per_s": run_rate(series, "tokens_per_s"),
        "tflops": run_rate(series, "tflops_per_device"),
        "mfu": run_rate(series, "mfu"),
        # the last launch's (a resumed run logs one start-up per launch)
        "startup_s": series_last(series.get(f"startup/{startup.TOTAL}_s", [])),
        **{key: series_last(series.get(name, [])) for key, name in STARTUP_PHASE_COLUMNS.items()},
        "trainable": _number(params.get("params.trainable")),
        "parameters": _number(params.get("params.total")),
        "peak_allocated_mib": series_max(series.get("mem/peak_allocated_mib_max", [])),
        "nvml_used_mib": series_max(series.get("mem/nvml_used_mib_max", [])),
        "host_rss_mib": series_max(series.get("mem/host_rss_mib_max", [])),
        **{key: (planned or {}).get(metric) for key, metric in PLAN_COLUMNS.items()},
    })
    return row


# --- the planner's prediction --------------------------------------------------------------------

def _launch_memory(spec: Mapping[str, Any], cpu_ranks: bool):
    """The LaunchMemory of a run's resolved spec (the spec that ran: `memory.fit` is not applied
    again), prepared as a launch prepares it; None when the planner cannot tell. `spec` is
    resolved.yaml as read back (an MLflow artifact), maybe of an older jobspec: its defaults are
    filled."""
    from jobspec.hardware import Host
    from jobspec.job.prepare import AS_WRITTEN, prepare_job
    from jobspec.spec.schema import filled_spec
    from jobspec.spec.validation import ResolvedSpec
    try:
        resolved = ResolvedSpec(filled_spec(spec), Path(rundir.RESOLVED), "")
        memory = prepare_job(resolved, host=Host(cpu_ranks=cpu_ranks), how=AS_WRITTEN).memory
    # an unknown architecture, an old resolved.yaml: a '-' in the table, not a crash
    except Exception:
        return None
    return memory if memory is not None and memory.plan is not None else None


def planned_of_spec(spec: Mapping[str, Any], cpu_ranks: bool = False) -> dict[str, float]:
    """The planned memory figures ({metric: MiB}, memory/plan_figures) of a run's resolved spec on
    CPU ranks or GPUs, as its launch would have logged them; {} when the planner cannot tell."""
    from jobspec.memory.at_launch import plan_record
    memory = _launch_memory(spec, cpu_ranks)
    return plan_figures.planned(plan_record(memory)["plan"]) if memory is not None else {}


def predicted_peak_mib(spec: Mapping[str, Any]) -> float | None:
    """The planned peak allocated MiB per GPU of a run's resolved spec (unrounded); None when the
    planner cannot tell."""
    from jobspec.units import MiB
    memory = _launch_memory(spec, cpu_ranks=False)
    return memory.plan.peak_allocated / MiB if memory is not None else None


def _planned_of_run(client, run, series: dict) -> dict[str, float]:
    """The run's planned figures: the `plan.*` params its launcher logged, else (a launcher that
    logged none) recomputed from its resolved.yaml, on CPU ranks when it measured no GPU."""
    params = run.data.params
    if any(key.startswith("plan.") for key in params):
        return plan_figures.from_params(params)
    try:
        import yaml
        with tempfile.TemporaryDirectory(prefix="jobspec-report-") as tmp:
            local = client.download_artifacts(run.info.run_id, rundir.RESOLVED, tmp)
            spec = yaml.safe_load(Path(local).read_text(encoding="utf-8"))
    except Exception:  # no such artifact, unreadable store: the prediction is optional
        return {}
    gpu = any(f.metric in series for f in plan_figures.GPU_FIGURES)
    return planned_of_spec(spec, cpu_ranks=not gpu and plan_figures.HOST_RAM.metric in series)


# --- reading MLflow ------------------------------------------------------------------------------

def open_experiment(tracking_uri: str, experiment: str):
    """(client, experiment ids, run filter) or a SpecError saying why not: unreachable store,
    unknown experiment. A name that is no experiment's but a job's (the `jobspec.job` tag, for runs
    logged to another experiment) selects that job's runs in every experiment."""
    from jobspec.secrets import mask_secrets, split_credentials
    from jobspec.tracking import run as tracking
    uri, user, password = split_credentials(tracking_uri)
    shown = mask_secrets(tracking_uri)
    parts = urlsplit(uri)
    if parts.scheme == "sqlite":
        # MLflow would silently create an empty database at a mistyped path
        db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
        if db is not None and str(db) not in ("", ":memory:") and not db.is_file():
            raise spec_error(f"no MLflow database at {db.resolve()} (tracking URI {shown})",
                             path=("--tracking-uri",),
                             hint="run from the directory you launched in, or pass --tracking-uri "
                                  "sqlite:///PATH")
    try:
        tracking.probe(uri)
        if user:
            import os
            os.environ["MLFLOW_TRACKING_USERNAME"] = user
            os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
        client = tracking.client_for(uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return client, [found.experiment_id], ""
        everything = client.search_experiments()
        ids, names = [e.experiment_id for e in everything], sorted(e.name for e in everything)
        job_filter = f"tags.`jobspec.job` = '{experiment}'"
        if ids and "'" not in experiment and client.search_runs(ids, job_filter, max_results=1):
            return client, ids, job_filter
    except Exception as err:  # TrackingUnavailable, MlflowException, requests/sqlite errors
        raise spec_error(f"MLflow tracking at {shown} is unavailable: {first_line(err, limit=300)}",
                         path=("--tracking-uri",), hint="start the server or fix the URI") from None
    raise spec_error(f"no experiment or job named {experiment!r} at {shown}", path=("EXPERIMENT",),
                     hint=f"known experiments: {', '.join(names)}" if names
                     else "launch a job first")


def metric_series(client, run_id: str,
                  names=THROUGHPUT_METRICS + RUN_THROUGHPUT_METRICS + MEMORY_METRICS + LOSS_METRICS
                  + TASK_METRICS
                  + STARTUP_METRICS) -> dict:
    series = {}
    for name in names:
        history = client.get_metric_history(run_id, name)
        if history:
            series[name] = sorted((m.step, m.value) for m in history)
    return series


def collect(tracking_uri: str, experiment: str) -> tuple[object, list[RunReport]]:
    """(client, one RunReport per run of the experiment, oldest first)."""
    client, experiment_ids, run_filter = open_experiment(tracking_uri, experiment)
    from jobspec.tracking import run as tracking
    runs = tracking.search_active_runs(client, experiment_ids, run_filter,
                                       order_by=["attributes.start_time ASC"], max_results=10_000)
    reports = []
    for run in runs:
        series = metric_series(client, run.info.run_id)
        row = build_row(run.info.run_name or run.info.run_id[:8], status_text(run),
                        run.data.params, series, _planned_of_run(client, run, series))
        reports.append(RunReport(run.info.run_id, row, series))
    add_differing_fields([r.row for r in reports], [run.data.params for run in runs])
    _disambiguate([r.row for r in reports], [r.run_id for r in reports])
    return client, reports


def _disambiguate(rows: list[dict], run_ids: list[str]) -> None:
    """Repeated runs of one job share a name; add the run id's head so rows and bars stay apart."""
    counts: dict = {}
    for row in rows:
        counts[row["run"]] = counts.get(row["run"], 0) + 1
    for row, run_id in zip(rows, run_ids):
        if counts[row["run"]] > 1:
            row["run"] = f"{row['run']} ({run_id[:6]})"


# --- rendering -----------------------------------------------------------------------------------

def _cell(key: str, value, fmt) -> str:
    if value is None or value == "":
        return "-"
    return fmt(value) if not isinstance(value, str) else value


def columns(rows: list[dict]) -> list[tuple]:
    """COLUMNS less the task metric and parameter-count columns no row has, with a column for each
    spec field that differs between the rows (add_differing_fields) after `status`."""
    fields = sorted({key for row in rows for key in row if key.startswith(SPEC_COLUMN)})
    spec_columns = [(key, key[len(SPEC_COLUMN):], str) for key in fields]
    shown = [c for c in COLUMNS if c[0] not in OPTIONAL_COLUMNS | {"trainable", "parameters"}
             or any(row.get(c[0]) is not None for row in rows)]
    at = [key for key, _, _ in shown].index("status") + 1
    return shown[:at] + spec_columns + shown[at:]


def _text_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    shown = columns(rows)
    headers = [header for _, header, _ in shown]
    body = [[_cell(key, row.get(key), fmt) for key, _, fmt in shown] for row in rows]
    return headers, body


def render_table(rows: list[dict]) -> str:
    """Aligned plain-text table (numbers right-aligned)."""
    headers, body = _text_cells(rows)
    widths = [max(len(x) for x in column) for column in zip(headers, *body)]
    keys = [key for key, _, _ in columns(rows)]

    def line(cells):
        return "  ".join(c.rjust(w) if k in NUMERIC_ALIGN else c.ljust(w)
                         for c, w, k in zip(cells, widths, keys)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, body)])


def render_markdown(rows: list[dict]) -> str:
    headers, body = _text_cells(rows)
    align = ["---:" if key in NUMERIC_ALIGN else "---" for key, _, _ in columns(rows)]
    lines = ["| " + " | ".join(cells) + " |" for cells in (headers, align, *body)]
    return "\n".join(lines)


def render_csv(rows: list[dict]) -> str:
    """Machine-readable: column keys as headers, raw numbers, empty cells for missing values."""
    out = io.StringIO()
    keys = [key for key, _, _ in columns(rows)]
    phases = [key for key in STARTUP_PHASE_COLUMNS if any(row.get(key) is not None for row in rows)]
    at = keys.index("startup_s") + 1
    keys[at:at] = phases
    writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in keys})
    return out.getvalue()


RENDERERS = {"table": render_table, "markdown": render_markdown, "csv": render_csv}
SUFFIXES = {"table": "txt", "markdown": "md", "csv": "csv"}


def as_json(reports: list[RunReport]) -> str:
    return json.dumps([{"run_id": r.run_id, **r.row} for r in reports], indent=2)
