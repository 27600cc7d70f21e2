"""Time to the first step on one GPU, one command: `python -m bench gpu-startup`.

    python -m bench gpu-startup --out /tmp/gpu-out/startup.md   # a CUDA GPU; <= 5 minutes in all
    python -m bench gpu-startup --dry-run                        # any machine: the jobs checked
    python -m bench gpu-startup --jobs llama-1b-64k --budget-s 120

Four jobs, each launched as a user launches it (`jobspec launch JOB --set ...`, one rank, random
weights built from the model's config, synthetic tokens, MLflow off):

- llama-1b-64k: Llama-3.2-1B's shape at 64K tokens per sequence, checkpointed, tiled loss, bf16
  (bench/calibration/h200-2026-11-28.json's llama-1b-64k-ckpt-tiled-loss); target <= 20 s;
- llama-1b-64k-forked: the same with JOBSPEC_FORK_RANKS=1, its rank forked from a node launcher
  that imported beside the plan (the CPU ranks' default): whether that works on a GPU, and what
  it saves;
- tinyllama-2x2048: TinyLlama's shape, 2 sequences of 2048 tokens, bf16 (the same file's
  tinyllama-bf16-sdpa-b2-s2048); no target;
- llama-8b-qlora-32k: jobs/llama-8b-qlora-32k-24gb.yaml, Llama-3-8B's shape quantised to 4-bit NF4
  as it moves to the GPU, LoRA r 16; target <= 60 s.

Every job runs with RUN_SETS: 2 optimizer steps of one micro-batch each (the first step is one
forward and backward, not the example's 16 accumulated micro-batches), no evaluation, checkpoint or
export. Measured: the wall time from starting the command to the end of rank 0's first optimizer
step, and where it went, from the `jobspec-log: phase` lines of the run's launcher.log (read by
bench/startup.py's parser): launcher (interpreter, imports, validate, plan, compile), data,
imports on the rank, model build, engine (deepspeed.initialize), the first step, other (runner
start, ops and process group, resume check and metric sink). summary.json's `startup` section, where
the rank writes one, is kept as it is in the JSON.

A job still short of its first step at its limit (or when the session's --budget-s runs out) is
stopped (SIGINT to the launcher, which forwards it and kills the ranks after --kill-grace; then
SIGKILL to whatever is left) and reported as "no first step after N s" with the phase it was in.
A job past its first step gets FINISH_S more seconds to end by itself. Prints a markdown table and
writes it to --out, with the raw phases and versions in a JSON file beside it (after every job: a
session cut short keeps what was measured).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.startup import STEPS, read_phases

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "bench" / "calibration" / "h200-2026-11-28.json"
WORK = REPO / "bench" / "work" / "gpu-startup"
OUT = REPO / "bench" / "work" / "gpu-startup.md"
BUDGET_S = 285        # no job runs past this: the whole script fits a 5-minute call
STOP_S = 15           # what a stop may take (kill grace, the launcher's close), left out of limits
MIN_START_S = 30      # a job is not started with less time than this left
FINISH_S = 20         # a job past its first step may take this much longer to end
KILL_GRACE_S = 5      # the launcher's --kill-grace: SIGINT forwarded, the ranks killed after it
BEFORE_DATE = "2026-11-28"
FIRST_STEP = "rank0/first-step"


@dataclass(frozen=True)
class StartupJob:
    name: str
    source: str                 # a calibration job's name, or a job file relative to the repo
    target_s: float | None      # command to first step, at most
    limit_s: float              # stopped after this many seconds
    before: str                 # the H200 reading of BEFORE_DATE (torch 2.11, transformers 5.17)
    env: tuple[tuple[str, str], ...] = ()   # set for this launch only


JOBS = [
    StartupJob("llama-1b-64k", "llama-1b-64k-ckpt-tiled-loss", 20, 60, "60-75 s"),
    StartupJob("llama-8b-qlora-32k", "jobs/llama-8b-qlora-32k-24gb.yaml", 60, 120,
               "no first step after 280 s"),
    # the same launch with its rank forked from a node launcher started beside the plan (the CPU
    # ranks' default, launch/rank_forks.py): whether a GPU rank works so, and what it saves
    StartupJob("llama-1b-64k-forked", "llama-1b-64k-ckpt-tiled-loss", 20, 45, "-",
               env=(("JOBSPEC_FORK_RANKS", "1"),)),
    StartupJob("tinyllama-2x2048", "tinyllama-bf16-sdpa-b2-s2048", None, 60, "~54 s"),
]

# The table's groups: each a list of (from mark, to mark); together they cover the command to the
# first step once (launcher and data share the launcher's stretch; data, model build the rank's)
PHASE_GROUPS = [
    ("launcher", [("cmd", "launcher/planned"), ("launcher/data", "launcher/runner")]),
    ("data", [("launcher/planned", "launcher/data"), ("rank0/model", "rank0/data")]),
    ("imports", [("rank0/start", "rank0/imported"),
                 ("rank0/distributed", "rank0/imported-model-code")]),
    ("model build", [("rank0/imported-model-code", "rank0/model")]),
    ("engine", [("rank0/data", "rank0/engine")]),
    ("first step", [("rank0/loop", FIRST_STEP)]),
    ("other", [("launcher/runner", "rank0/start"), ("rank0/imported", "rank0/distributed"),
               ("rank0/engine", "rank0/loop")]),
]
# where a job is when this mark is its last: bench/startup.py's steps (their labels first), and the
# launcher's own marks
PHASE_AFTER = {"launcher/start": STEPS[0][0], "launcher/data": "launcher: run dir, compile, header"} \
    | {start: label for label, start, _ in STEPS}
VERSIONED = ("torch", "transformers", "deepspeed", "bitsandbytes", "peft")


# What every job runs with, besides its output directory and a global batch of one micro-batch:
# 2 optimizer steps, nothing evaluated, checkpointed or exported, no MLflow (the GPU image has none)
RUN_SETS = ["training.max_steps=2", "training.eval_every=null", "data.synthetic.eval_samples=0",
            "checkpoint.save_final=false", "checkpoint.every_n_steps=null",
            "checkpoint.resume=never", "export.final=false", "logging.mlflow.enabled=false",
            "logging.progress=lines"]


def spec_of(job: StartupJob) -> dict:
    """The job's spec as written (a calibration job's spec, or the job file's, `extends` merged)."""
    if job.source.endswith(".yaml"):
        from jobspec.spec.loader import load_spec
        return load_spec(REPO / job.source).spec
    calibration = json.loads(CALIBRATION.read_text(encoding="utf-8"))
    jobs = {j["name"]: j["spec"] for j in calibration["jobs"]}
    return jobs[job.source]


def job_file(job: StartupJob, work: Path) -> Path:
    """The file that is launched: the job file itself, or the calibration spec written as YAML."""
    if job.source.endswith(".yaml"):
        return REPO / job.source
    import yaml
    path = work / job.name / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec_of(job), sort_keys=False), encoding="utf-8")
    return path


def job_sets(job: StartupJob, work: Path) -> list[str]:
    """The job's `--set`s: its output under work/NAME/out, one micro-batch per step, RUN_SETS."""
    micro = spec_of(job)["training"].get("micro_batch_size", 1)
    return [f"output_dir={work / job.name / 'out'}", f"training.global_batch_size={micro}",
            *RUN_SETS]


def set_args(job: StartupJob, work: Path) -> list[str]:
    return [x for s in job_sets(job, work) for x in ("--set", s)]


def command(job: StartupJob, work: Path) -> list[str]:
    return [sys.executable, "-m", "jobspec", "launch", str(job_file(job, work)),
            "--kill-grace", str(KILL_GRACE_S), *set_args(job, work)]


def shown_command(job: StartupJob, argv: list[str]) -> str:
    """The launch as a user would type it: the job's environment, then `python ...`."""
    return " ".join([*(f"{k}={v}" for k, v in job.env), "python", *argv[1:]])


def settings(spec: dict) -> str:
    """The spec's key settings in one line (as it runs: 2 steps of one micro-batch)."""
    model, memory, data = spec["model"], spec.get("memory", {}), spec["data"]["synthetic"]
    config, quantization = model["config"], model.get("quantization")
    parts = [f"{model['architecture']} {config['num_hidden_layers']} layers x "
             f"{config['hidden_size']}, vocab {config['vocab_size']}",
             f"{data['seq_len']} tokens x {spec['training'].get('micro_batch_size', 1)}",
             memory.get("precision", "bf16"), f"ZeRO {memory.get('zero_stage', 0)}"]
    if quantization:
        parts.append(f"{quantization['bits']}-bit {quantization.get('quant_type', 'nf4')}")
    if model.get("lora"):
        parts.append(f"LoRA r {model['lora']['r']}")
    parts += [name.replace("_", " ") for name in ("activation_checkpointing", "tiled_loss",
                                                   "tiled_mlp") if memory.get(name)]
    return ", ".join(parts)


# --- one job -------------------------------------------------------------------------------

def descendants(proc: subprocess.Popen) -> list:
    import psutil
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the launcher (it forwards it, kills the ranks after --kill-grace and writes its
    phase lines), then SIGKILL to the launcher and every process under it that is left."""
    import psutil
    left = descendants(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(KILL_GRACE_S + STOP_S - 5)
        except subprocess.TimeoutExpired:
            left += descendants(proc)
            proc.kill()
            proc.wait()
    alive = [p for p in left if p.is_running()]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)   # the GPU's memory is free before the next job starts


def newest_run(out_dir: Path) -> Path | None:
    runs = sorted(out_dir.glob("run-*"))
    return runs[-1] if runs else None


def watch(proc: subprocess.Popen, out_dir: Path, limit_s: float, started: float) -> float | None:
    """Waits for the launch to end, stopping it at its deadline (its limit, or FINISH_S after its
    first step): the seconds from `started` at which it was stopped, None when it ended itself."""
    deadline, seen = started + limit_s, False
    while proc.poll() is None:
        now = time.time()
        run_dir = newest_run(out_dir)
        if not seen and run_dir is not None:
            log = run_dir / "launcher.log"
            seen = log.is_file() and FIRST_STEP in read_phases(log.read_text(errors="replace"))[0]
            if seen:
                deadline = min(deadline, now + FINISH_S)
        if now > deadline:
            stop(proc)
            return now - started
        time.sleep(0.25)
    return None


def run_job(job: StartupJob, work: Path, limit_s: float) -> dict:
    """One launch: its marks relative to the command's start, its phases, how it ended."""
    argv = command(job, work)
    out_dir = work / job.name / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    output = work / job.name / "launch-output.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **dict(job.env)}
    with open(output, "w", encoding="utf-8") as sink:
        started = time.time()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            stopped_at = watch(proc, out_dir, limit_s, started)
        finally:   # this script stopped too (Ctrl-C, a session's limit): no rank keeps the GPU
            stop(proc)
    ended = time.time()
    run_dir = newest_run(out_dir)
    log = run_dir / "launcher.log" if run_dir else None
    marks, cpu = read_phases(log.read_text(errors="replace")) if log and log.is_file() else ({}, {})
    marks["cmd"] = started
    summary = read_json(run_dir / "summary.json") if run_dir else {}
    return {"name": job.name, "command": shown_command(job, argv),
            "exit_code": proc.returncode, "stopped_at_s": stopped_at and round(stopped_at, 1),
            "limit_s": round(limit_s, 1), "seconds": round(ended - started, 2),
            "to_first_step_s": span(marks, "cmd", FIRST_STEP), "phases": phases(marks),
            "steps": {label: span(marks, a, b) for label, a, b in STEPS},
            "marks": {k: round(v - started, 3)
                      for k, v in sorted(marks.items(), key=lambda m: m[1])},
            "cpu_s": cpu, "in_phase": None if FIRST_STEP in marks else phase_at(marks),
            "summary_startup": summary.get("startup"), "run_dir": str(run_dir) if run_dir else None,
            "output_tail": output.read_text(errors="replace").splitlines()[-40:]}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def span(marks: dict, start: str, end: str) -> float | None:
    return round(marks[end] - marks[start], 2) if start in marks and end in marks else None


def phases(marks: dict) -> dict[str, float | None]:
    """Seconds per PHASE_GROUPS group; None where a mark is missing (a job stopped before it)."""
    out: dict[str, float | None] = {}
    for group, pairs in PHASE_GROUPS:
        spans = [span(marks, a, b) for a, b in pairs]
        out[group] = None if None in spans else round(sum(s for s in spans if s is not None), 2)
    return out


def phase_at(marks: dict) -> str:
    """The phase a job that never reached its first step was in: the one after its last mark."""
    last = max((m for m in marks if m != "cmd"), key=lambda m: marks[m], default=None)
    if last is None:
        return "launcher (no phase line written)"
    return PHASE_AFTER.get(last, f"after {last}")


# --- the table -----------------------------------------------------------------------------

def verdict(job: StartupJob, row: dict | None) -> str:
    if row is None:
        return "not run"
    first = row["to_first_step_s"]
    if first is None:
        how = f"no first step after {row['stopped_at_s']:.0f} s" if row["stopped_at_s"] else \
            f"failed: exit {row['exit_code']} after {row['seconds']:.0f} s, no first step"
        return f"{how} (in {row['in_phase']})"
    if job.target_s is None:
        return "no target"
    if first <= job.target_s:
        return f"met (<= {job.target_s:.0f} s)"
    return f"missed by {first - job.target_s:.0f} s (target <= {job.target_s:.0f} s)"


def render(rows: dict[str, dict], jobs: list[StartupJob], gpu: str, versions: dict) -> str:
    """One row per job: the command to its first step, the phases, the target, before, verdict."""
    groups = [g for g, _ in PHASE_GROUPS]
    short = ", ".join(f"{k} {v}" for k, v in versions.items())
    lines = ["| job | GPU | versions | command -> first step, s | "
             + " | ".join(f"{g}, s" for g in groups)
             + f" | target, s | before ({BEFORE_DATE}, H200) | verdict |",
             "|---|---|---|---:|" + "---:|" * len(groups) + "---:|---|---|"]
    for job in jobs:
        row = rows.get(job.name)
        cells = [_s(row["to_first_step_s"]) if row else "-"] + \
            [_s(row["phases"][g]) if row else "-" for g in groups]
        lines.append(f"| {job.name} | {gpu} | {short} | " + " | ".join(cells)
                     + f" | {_s(job.target_s)} | {job.before} | {verdict(job, row)} |")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def installed_versions() -> dict:
    """The versions of VERSIONED, read without importing them (no CUDA context in this process)."""
    from importlib import metadata
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def write(out: Path, text: str, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


# --- the session ---------------------------------------------------------------------------

def measure(jobs: list[StartupJob], args: argparse.Namespace, gpu: str) -> int:
    """Each job in turn, within --budget-s; the table and JSON rewritten after each."""
    started = time.monotonic()
    work = args.work.resolve()
    versions = installed_versions()
    record: dict = {"gpu": gpu, "date": datetime.date.today().isoformat(), "versions": versions,
                    "budget_s": args.budget_s, "run_sets": RUN_SETS, "jobs": []}
    rows: dict[str, dict] = {}
    for job in jobs:
        left = args.budget_s - (time.monotonic() - started)
        if left < MIN_START_S:
            _say(f"{job.name}: not started ({left:.0f} s of --budget-s left)")
            continue
        limit = min(job.limit_s, left - STOP_S)
        _say(f"{job.name}: launching, stopped after {limit:.0f} s without a first step")
        rows[job.name] = row = run_job(job, work, limit)
        # the session's first launch pays the cold file cache and the planner's first trace
        row["first_of_session"] = len(rows) == 1
        record["jobs"].append(row)
        own = (row["summary_startup"] or {}).get("to_first_step_s")   # the rank's own count
        _say(f"{job.name}: {verdict(job, row)}; command -> first step "
             f"{_s(row['to_first_step_s'])} s (summary.json: {_s(own)} s), exit "
             f"{row['exit_code']} after {row['seconds']:.0f} s")
        if row["to_first_step_s"] is None:
            print("\n".join(row["output_tail"][-15:]), flush=True)
        write(args.out, render(rows, jobs, gpu, versions) + "\n", record)
    print(f"\n{render(rows, jobs, gpu, versions)}\n\n{len(rows)} of {len(jobs)} jobs in "
          f"{time.monotonic() - started:.0f} s; {args.out} and {args.out.with_suffix('.json')}")
    return 0 if rows and all(r["to_first_step_s"] is not None for r in rows.values()) else 1


def _say(text: str) -> None:
    print(f"gpu-startup: {text}", file=sys.stderr, flush=True)


def check(job: StartupJob, work: Path) -> dict:
    """`jobspec validate` and `jobspec plan --format json` on the job as it will run; the plan.
    A problem stops the dry run with their output."""
    file, sets = str(job_file(job, work)), set_args(job, work)
    for what in (["validate", file, *sets], ["plan", file, *sets, "--format", "json"]):
        done = subprocess.run([sys.executable, "-m", "jobspec", *what], cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"gpu-startup: {job.name}: jobspec {what[0]} failed (exit "
                             f"{done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout)["plan"]


WHAT = ("On a GPU each job is launched once, in this order, as `jobspec launch JOB --kill-grace "
        "{grace}` with its output directory, a global batch of one micro-batch and: {sets}. "
        "Measured: seconds from starting the command to the end of rank 0's first optimizer step, "
        "and by phase (launcher.log's phase lines): {groups}; summary.json's `startup`, where "
        "written, kept in the JSON. A job without a first step at its limit is stopped and "
        "reported with the phase it was in; one past its first step gets {finish} s more to end.")


def dry_run(jobs: list[StartupJob], args: argparse.Namespace) -> int:
    """Each job checked and described; the table as a GPU run fills it, every measured cell `-`."""
    work = args.work.resolve()
    print(f"python -m bench gpu-startup --dry-run: {len(jobs)} jobs, each checked with `jobspec "
          f"validate` and `jobspec plan` as it will run; nothing is launched.\n")
    print(WHAT.format(grace=KILL_GRACE_S, sets=" ".join(f"--set {s}" for s in RUN_SETS),
                      groups=", ".join(g for g, _ in PHASE_GROUPS), finish=FINISH_S) + "\n")
    planned = {}
    for job in jobs:
        plan = check(job, work)
        shown = planned[job.name] = {
            "parameters": plan["settings"]["parameters"],
            "trainable_parameters": plan["settings"]["trainable_parameters"],
            "peak_allocated_gib": round(plan["peak_allocated"] / 2**30, 2)}
        target = f"target <= {job.target_s:.0f} s" if job.target_s else "no target"
        print(f"- {job.name} ({job.source}): {settings(spec_of(job))}; "
              f"{shown['parameters'] / 1e9:.2f} B parameters "
              f"({shown['trainable_parameters'] / 1e6:.0f} M trained); plan: peak allocated "
              f"{shown['peak_allocated_gib']:.2f} GiB; limit {job.limit_s:.0f} s, {target}; "
              f"before ({BEFORE_DATE}, H200): {job.before}\n"
              f"  {shown_command(job, command(job, work))}")
    print(f"\nlimits {sum(j.limit_s for j in jobs):.0f} s in all (+ up to {STOP_S} s per stop); "
          f"no job runs past --budget-s {args.budget_s:.0f} s\n")
    versions = installed_versions()
    text = render({}, jobs, "none (dry run)", versions)
    print(text + "\n\nDry run: nothing launched; every measured cell is `-`.")
    if args.out:
        write(args.out, text + "\n", {"gpu": None, "dry_run": True, "versions": versions,
                                      "budget_s": args.budget_s, "planned": planned, "jobs": []})
    return 0


def select(names: str | None) -> list[StartupJob]:
    if not names:
        return JOBS
    by_name = {j.name: j for j in JOBS}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"gpu-startup: no job {', '.join(unknown)}; "
                         f"the jobs: {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu-startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="check every job and print what a GPU run measures")
    parser.add_argument("--jobs", default=None, metavar="NAME,...",
                        help="only these jobs (default: all, in order)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the markdown table, the JSON beside it (default "
                             f"{OUT.relative_to(REPO)}; a dry run writes only when given)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"no job runs past this many seconds from the start "
                             f"(default {BUDGET_S})")
    parser.add_argument("--work", type=Path, default=WORK,
                        help="job files, run dirs, launch output")
    args = parser.parse_args(argv)
    jobs = select(args.jobs)
    if args.dry_run:
        return dry_run(jobs, args)
    from jobspec import hardware
    names = [name for name in hardware.gpu_names() if name != "cpu"]   # ["cpu"]: no NVIDIA GPU
    if not names:
        print("gpu-startup: no NVIDIA GPU here (NVML); --dry-run checks the jobs", file=sys.stderr)
        return 2
    args.out = args.out or OUT
    return measure(jobs, args, names[0])


if __name__ == "__main__":
    raise SystemExit(main())
