"""The run directory: every file a job's run directory holds, and the one place each is written and
read.

`jobspec compile --out DIR` writes the compile files; `jobspec launch` creates
`<output_dir>/run-<UTC %Y%m%d-%H%M%S>-<4 hex>/` and writes them there, then the other files appear:

  file             what it holds                                   written by -> read by
  spec.yaml        the spec as written (secrets masked)            compile -> MLflow artifact, sync
  resolved.yaml    every default filled, what runs (masked)        compile -> worker, sync, report
  ds_config.json   the complete DeepSpeed config                   compile -> worker (DeepSpeed)
  patches.json     model changes the worker applies                compile -> worker
  command.txt      the runner command line                         compile -> the user
  launch.json      world size, batch arithmetic (`derived`), notes,compile -> worker, sync
                   `plan`/`fit` (launch), `source`
  hostfile         one `host slots=N` line per node (multi-node    launch/slurm -> DeepSpeed runner
                   Slurm)
  mlflow_run.json  tracking URI, experiment and run id             tracking -> rank 0's sink, sync
  mlflow_off       the job runs without an MLflow run              launch -> rank 0 stops waiting
                   (off/unreachable)
  cpu_info.json    py-cpuinfo's reading of the launching host      launch -> ranks (jobspec/ops.py)
  launcher.log     everything the runner and ranks printed         supervise -> MLflow artifact
  launcher.json    the launcher's host, pid, start time; `ended`   launch -> launch/sync/report:
                   once it has closed the run                      a run left RUNNING
  metrics.jsonl    every metric point, a JSON object per log step  ank 0 -> sync, bench, export
  summary.json     status, steps, loss, throughput, peak memory    rank 0 (else the fallback below)
                   (`RunSummary`)
  .oom-recovery/   the state an OOM retry reloads (removed after)  rank side
  model/           exported HF directories (`export.dir` null)     rank 0 -> the user, MLflow

No heavy imports: `jobspec compile` writes through here.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

import yaml

from jobspec.errors import spec_error
from jobspec.secrets import mask_secrets, mask_tree
from jobspec.spec.types import JobSpec

SPEC = "spec.yaml"
RESOLVED = "resolved.yaml"
DS_CONFIG = "ds_config.json"
PATCHES = "patches.json"
COMMAND = "command.txt"
LAUNCH = "launch.json"
HOSTFILE = "hostfile"
MLFLOW_RUN = "mlflow_run.json"
TRACKING_OFF = "mlflow_off"
CPU_INFO = "cpu_info.json"
LAUNCHER_LOG = "launcher.log"
LAUNCHER = "launcher.json"
METRICS = "metrics.jsonl"
GENERATIONS = "generations.jsonl"   # training.eval_generate: one line per prompt per evaluation
SUMMARY = "summary.json"
OOM_RECOVERY = ".oom-recovery"
MODEL_DIR = "model"

COMPILE_FILES = (SPEC, RESOLVED, DS_CONFIG, PATCHES, COMMAND, LAUNCH)
WORKER_INPUTS = (RESOLVED, DS_CONFIG, PATCHES, LAUNCH)
START_ARTIFACTS = (SPEC, RESOLVED, DS_CONFIG, COMMAND)   # logged to MLflow when the run starts
END_ARTIFACTS = (SUMMARY, LAUNCHER_LOG)                  # logged when it ends
# summary.json statuses of a job that ended well
DONE_STATUSES = ("finished", "preempted")


def export_dir(spec: JobSpec, run_dir: Path) -> Path:
    """Where the job's exported models go: `export.dir`, else `<run dir>/model`."""
    return Path(spec["export"]["dir"] or Path(run_dir) / MODEL_DIR)


# --- the directory itself ---------------------------------------------------------------------

RUN_PREFIX = "run-"
RUN_GLOB = f"{RUN_PREFIX}*"        # the run directories of an output_dir


def new_run_dir_path(output_dir: str | Path, now: datetime | None = None) -> Path:
    """`<output_dir>/run-<UTC %Y%m%d-%H%M%S>-<4 hex>` (not created)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return Path(output_dir) / f"{RUN_PREFIX}{stamp}-{secrets.token_hex(2)}"


def run_dirs(output_dir: str | Path, newest_first: bool = False) -> list[Path]:
    """The run directories under `output_dir`, oldest first by name (their names start with the UTC
    time); empty when `output_dir` is not a directory."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted((d for d in root.glob(RUN_GLOB) if d.is_dir()), reverse=newest_first)


def create_run_dir(output_dir: str | Path) -> Path:
    """A new, empty run directory; never an existing one (exclusive mkdir, new name on
    collision)."""
    ensure_writable(output_dir, ("output_dir",))
    for _ in range(100):
        path = new_run_dir_path(output_dir)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise spec_error(f"could not create a new run directory under {output_dir}",
                     path=("output_dir",))


def ensure_writable(directory: str | Path, field: tuple) -> None:
    """Create `directory` if needed and prove we can write there, before anything starts."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".jobspec-write-test-{os.getpid()}"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as err:
        raise spec_error(f"{directory} is not a writable directory ({err.strerror or err})",
                         path=field,
                         hint=f"set {'.'.join(field)} to a directory you can write, or fix its "
                              "permissions")


# --- compile outputs --------------------------------------------------------------------------

def launch_record(resolved, compiled, argv: Sequence[str] | None = None,
                  launched: Mapping | None = None) -> dict:
    """What launch.json holds: the launch plan's record with the command that runs (`argv`; default
    the plan's `deepspeed` command), what the launcher adds (`launched`: plan, fit, mlflow_run,
    overrides, segment), the derived numbers, notes and the source."""
    return {**compiled.plan.record(argv), **(launched or {}), "derived": compiled.derived.as_dict(),
            "notes": compiled.notes, "source": str(resolved.source.resolve())}


def write_compiled(out: Path, resolved, compiled, argv: Sequence[str] | None = None,
                   launched: Mapping | None = None) -> None:
    """Write the compile files into `out`; refuse a non-empty directory holding anything else.
    command.txt and launch.json's `argv` are `argv` (what a launch runs), else the plan's
    `deepspeed` command."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise spec_error(f"--out {out} exists and is not a directory",
                         hint="choose a directory path")
    if out.is_dir():
        # a multi-node launch writes its hostfile into the run directory before these files
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (*COMPILE_FILES, HOSTFILE))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise spec_error(f"--out {out} is not empty and is not a previous compile output (has "
                             f"{shown})",
                             hint="choose a new or empty directory; compile only overwrites its "
                                  "own files")
    out.mkdir(parents=True, exist_ok=True)
    # one argv for command.txt and launch.json
    record = launch_record(resolved, compiled, argv, launched)
    contents = {
        # a password in a tracking URI or a planted token must not reach files that become artifacts
        SPEC: mask_secrets(resolved.text),
        RESOLVED: yaml.safe_dump(mask_tree(resolved.spec), sort_keys=False),
        DS_CONFIG: _json_text(compiled.ds_config),
        PATCHES: _json_text(compiled.patches),
        COMMAND: shlex.join(record["argv"]) + "\n",
    }
    for name, text in contents.items():
        (out / name).write_text(text, encoding="utf-8")
    write_launch(out, record)


def write_launch(run_dir: Path, launch: dict) -> None:
    (Path(run_dir) / LAUNCH).write_text(_json_text(launch), encoding="utf-8")


def read_launch(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / LAUNCH).read_text(encoding="utf-8"))


def read_resolved(run_dir: Path) -> JobSpec:
    return read_resolved_file(Path(run_dir) / RESOLVED)


def read_resolved_file(path: Path) -> JobSpec:
    """A resolved.yaml: the run directory's, or the copy a checkpoint keeps. The compiler wrote it
    from a validated spec with every field filled, so it is read as the JobSpec it was: the one
    place outside the loader (spec/validation.validate_spec) where a plain dict becomes a
    JobSpec."""
    return cast(JobSpec, yaml.safe_load(Path(path).read_text(encoding="utf-8")))


def read_spec_text(run_dir: Path) -> str:
    return (Path(run_dir) / SPEC).read_text(encoding="utf-8")


@dataclass
class RunFiles:
    """What a rank reads from the run directory."""

    spec: JobSpec     # resolved.yaml
    ds_config: dict
    patches: list
    launch: dict

    @property
    def derived(self) -> dict:
        """launch.json's derived job as written; the ranks read it typed
        (spec/derived.DerivedJob.from_dict)."""
        return self.launch["derived"]


def read_run_files(run_dir: Path) -> RunFiles:
    """The worker's inputs; a SpecError naming what is missing or stale."""
    run_dir = Path(run_dir)
    missing = [name for name in WORKER_INPUTS if not (run_dir / name).is_file()]
    if missing:
        raise spec_error(f"run directory {run_dir} lacks {', '.join(missing)}",
                         hint="create it with `jobspec compile --out DIR` or `jobspec launch`")
    spec = read_resolved(run_dir)
    ds_config, patches = (json.loads((run_dir / name).read_text(encoding="utf-8"))
                          for name in (DS_CONFIG, PATCHES))
    files = RunFiles(spec, ds_config, patches, read_launch(run_dir))
    if files.launch.get("derived", {}).get("total_steps") is None:   # the compiler always writes it
        raise spec_error(f"{run_dir / LAUNCH} has no derived.total_steps",
                         hint="recompile the job with this version of jobspec")
    return files


# --- files of the running job -----------------------------------------------------------------

def write_hostfile(run_dir: Path, text: str) -> Path:
    path = Path(run_dir) / HOSTFILE
    path.write_text(text, encoding="utf-8")
    return path


def write_mlflow_run(run_dir: Path, info: dict) -> None:
    """Atomically: rank 0 may be polling for it (wait_for_tracking)."""
    tmp = Path(run_dir) / f".{MLFLOW_RUN}.tmp"
    tmp.write_text(_json_text(info), encoding="utf-8")
    os.replace(tmp, Path(run_dir) / MLFLOW_RUN)


def read_mlflow_run(run_dir: Path) -> dict | None:
    """tracking_uri, experiment_id, run_id of the job's MLflow run; None when it has none."""
    path = Path(run_dir) / MLFLOW_RUN
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_launcher(run_dir: Path, record: dict) -> None:
    """launcher.json: who runs this job (jobspec/lifeline.py identity), replaced atomically."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{LAUNCHER}.tmp"
    tmp.write_text(_json_text(record), encoding="utf-8")
    os.replace(tmp, run_dir / LAUNCHER)


def read_launcher(run_dir: Path) -> dict | None:
    try:
        record = json.loads((Path(run_dir) / LAUNCHER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def mark_launcher_ended(run_dir: Path, status: str, exit_code: int, by: str = "launcher") -> None:
    """The run was closed (by its launcher, or by whoever found the launcher gone): nothing left to
    check."""
    record = read_launcher(run_dir) or {}
    record["ended"] = {"status": status, "exit_code": exit_code, "by": by,
                      "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_launcher(run_dir, record)


def write_tracking_off(run_dir: Path) -> None:
    (Path(run_dir) / TRACKING_OFF).write_text("", encoding="utf-8")


def wait_for_tracking(run_dir: Path, timeout_s: float, poll_s: float = 0.1) -> dict | None:
    """mlflow_run.json once the launcher has written it; None once it says there is no run
    (`mlflow_off`), or after `timeout_s` (then the job keeps its metrics in metrics.jsonl)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        info = read_mlflow_run(run_dir)
        if info is not None or (Path(run_dir) / TRACKING_OFF).exists() \
                or time.monotonic() >= deadline:
            return info
        time.sleep(poll_s)


def open_launcher_log(run_dir: Path):
    """launcher.log for appending raw bytes (the runner's output as it comes)."""
    return open(Path(run_dir) / LAUNCHER_LOG, "ab")


def open_metrics(run_dir: Path):
    """metrics.jsonl for appending one JSON line per logged step."""
    return open(Path(run_dir) / METRICS, "a", encoding="utf-8")


def metric_line(metrics: dict, step: int, timestamp: int) -> str:
    return json.dumps({"step": int(step), "timestamp": timestamp, **metrics}) + "\n"


def read_metric_points(run_dir: Path) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp, step) of every point in metrics.jsonl; a torn last line is
    skipped."""
    points = []
    for line in (Path(run_dir) / METRICS).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short when the job died
        if not isinstance(row, dict) or "step" not in row:
            continue
        for key, value in row.items():
            if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                points.append((key, float(value), int(row.get("timestamp", 0)), int(row["step"])))
    return points


def append_generations(run_dir: Path, rows: list[dict]) -> None:
    """generations.jsonl: rank 0's answers of one evaluation (train/generation.py), one line per
    prompt."""
    with open(Path(run_dir) / GENERATIONS, "a", encoding="utf-8") as out:
        out.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_generations(run_dir: Path) -> list[dict]:
    """Every row of generations.jsonl ([] without one); a torn last line is skipped."""
    try:
        lines = (Path(run_dir) / GENERATIONS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short when the job died
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


LAUNCHER_WRITER = "launcher"   # summary.json `written_by` of the launcher's fallback


@dataclass
class RunSummary:
    """summary.json: how the run ended and what it measured.

    Rank 0 writes the whole record (train/progress.summarize; a value not measured is null); the
    launcher writes `status`, `exit_code` and `written_by: launcher` for a job whose rank 0 wrote
    none (`write_fallback_summary`), then adds `report`, the closing block it printed. Readers (the
    launcher's watchdog and closing block, status.ending, tracking's sync and orphans, the exported
    models' artifacts) go through `from_dict`, which keeps keys it does not know in `extra` (a newer
    or older jobspec's), so `to_dict` writes them back unchanged.
    """

    # finished | preempted | failed | oom | ... (lower case)
    status: str | None = None
    steps: int | None = None                  # optimizer steps done
    total_steps: int | None = None
    # global samples trained in this run (not before a resume)
    samples: int | None = None
    final_loss: float | None = None           # the last logged train/loss
    eval_loss: float | None = None
    # eval/<name>: the last evaluation's
    eval_metrics: dict[str, float] = field(default_factory=dict)
    samples_per_s: float | None = None        # steady-state rates: the warm-up window left out
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None    # GPU ranks only (a CPU's peak FLOP/s is unknown)
    mfu: float | None = None
    peak_memory: dict[str, float] = field(default_factory=dict)    # mem/<reading>_max, _rank0 (MiB)
    elapsed_s: float | None = None
    resumed_from: str | None = None
    checkpoint: str | None = None             # the last checkpoint's tag, under checkpoint.dir
    # export/exporter.py's records by name
    exports: dict[str, dict] = field(default_factory=dict)
    # trainable and total parameter counts
    parameters: dict[str, int] = field(default_factory=dict)
    error: str | None = None                  # why a failed run failed (rank 0)
    # training.eval_generate: the last evaluation's first answer
    generation: dict | None = None
    # the tokenised data's counts (data.<split>.records, tokens, ...)
    data: dict | None = None
    exit_code: int | None = None              # the launcher's fallback
    written_by: str | None = None             # LAUNCHER_WRITER for the fallback
    # the plan of each peak_memory reading, by its name (the launcher's: memory/plan_figures)
    planned_memory: dict[str, float] | None = None
    report: str | None = None                 # the closing block the launcher printed (plain text)
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    # what rank 0 always writes (null when not measured); the fallback has none of them
    RANK_KEYS = ("steps", "total_steps", "samples", "final_loss", "eval_loss", "eval_metrics",
                 "samples_per_s",
                 "tokens_per_s", "tflops_per_device", "mfu", "peak_memory", "elapsed_s",
                 "resumed_from", "checkpoint", "exports", "parameters")
    # written only when set
    OPTIONAL_KEYS = ("error", "generation", "data", "exit_code", "written_by", "planned_memory",
                     "report")

    @property
    def done(self) -> bool:
        """The job ended well: finished, or stopped with a checkpoint to go on from."""
        return self.status in DONE_STATUSES

    @classmethod
    def fallback(cls, status: str, exit_code: int) -> RunSummary:
        return cls(status=status.lower(), exit_code=exit_code, written_by=LAUNCHER_WRITER)

    @classmethod
    def from_dict(cls, d: dict) -> RunSummary:
        known = {"status", *cls.RANK_KEYS, *cls.OPTIONAL_KEYS}
        values = {key: d[key] for key in known if key in d}
        # null in a hand-written file
        for key in ("eval_metrics", "peak_memory", "exports", "parameters"):
            values[key] = values.get(key) or {}
        return cls(**values, extra={key: value for key, value in d.items() if key not in known})

    def to_dict(self) -> dict:
        """The JSON summary.json holds, keys in the order they have always been written."""
        out: dict = {"status": self.status}
        if self.written_by != LAUNCHER_WRITER:
            out.update({key: getattr(self, key) for key in self.RANK_KEYS})
        out.update({key: getattr(self, key) for key in self.OPTIONAL_KEYS
                    if getattr(self, key) is not None})
        return {**out, **self.extra}


def write_summary(run_dir: Path, summary: RunSummary) -> None:
    """summary.json, replaced atomically (the launcher's watchdog may read it at any moment)."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{SUMMARY}.tmp"
    tmp.write_text(_json_text(summary.to_dict()), encoding="utf-8")
    os.replace(tmp, run_dir / SUMMARY)


def write_fallback_summary(run_dir: Path, status: str, exit_code: int) -> None:
    """The launcher's minimal summary.json, for a job whose rank 0 wrote none (it died first)."""
    if not (Path(run_dir) / SUMMARY).is_file():
        write_summary(run_dir, RunSummary.fallback(status, exit_code))


def read_summary(run_dir: Path) -> RunSummary | None:
    """summary.json, or None when it is missing or unreadable (a job that died before writing
    it)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return RunSummary.from_dict(summary) if isinstance(summary, dict) else None


def summary_says_done(run_dir: Path) -> bool:
    summary = read_summary(run_dir)
    return summary is not None and summary.done


def _json_text(value) -> str:
    return json.dumps(value, indent=2) + "\n"
