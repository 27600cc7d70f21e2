"""Where the start-up of `jobspec launch` goes: from the command to the end of the first training step.

    python -m bench.startup                      # the quickstart, 3 launches (the first one also
                                                 # creates the MLflow store)
    python -m bench.startup --repeats 5 --job jobs/quickstart.yaml --set training.max_steps=10
    python -m bench.startup --empty-op-cache     # each launch with an empty TORCH_EXTENSIONS_DIR: a
                                                 # newcomer's first launch; prints the ops it built
    python -m bench.startup --empty-plan-cache   # each launch with an empty JOBSPEC_CACHE_DIR: the
                                                 # launcher traces the model (a new clone's first)

Each launch runs in a new output directory with its own SQLite store (a launch that finds a new
store pays for creating its tables: the `cold store` row). The phases are timestamps the launcher
and rank 0 write to launcher.log (`jobspec-log: phase ...`, jobspec/launcher_log.py), the bench's own
clock before the command, and the end of the whole command. Rank 0's phases are the critical path:
rank 1 runs the same steps at the same time. The load average of the machine is printed next to
each launch: on a shared machine, other work slows every phase. A row holds what the launch itself
printed as its time to step 1 (its `startup` lines, summary.json's `startup`:
jobspec/train/startup.py), to set beside the bench's own clock.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASE = re.compile(r"^jobspec-log: phase (\S+) (\S+) ([0-9.]+) ([0-9.]+)$", re.M)
# (label, from, to): consecutive marks of the launch's critical path
STEPS = [
    ("launcher: python, imports, validate, plan", "cmd", "launcher/planned"),
    ("launcher: data preparation or cache check", "launcher/planned", "launcher/data"),
    ("launcher: run dir, compile, header", "launcher/data", "launcher/runner"),
    ("DeepSpeed runner + launch.py start rank 0", "launcher/runner", "rank0/start"),
    ("rank: python + jobspec imports", "rank0/start", "rank0/worker"),
    ("rank: import deepspeed, torch", "rank0/worker", "rank0/imported"),
    ("rank: ops ready (built or cached)", "rank0/imported", "rank0/ops"),
    ("rank: init_distributed (gloo)", "rank0/ops", "rank0/distributed"),
    ("rank: import model code (transformers)", "rank0/distributed", "rank0/imported-model-code"),
    ("rank: build model + patches", "rank0/imported-model-code", "rank0/model"),
    ("rank: data", "rank0/model", "rank0/data"),
    ("rank: deepspeed.initialize", "rank0/data", "rank0/engine"),
    ("rank: resume check", "rank0/engine", "rank0/resumed"),
    ("rank: progress + metric sink (waits for the MLflow run)", "rank0/resumed", "rank0/sink"),
    ("rank: guards, reporter", "rank0/sink", "rank0/loop"),
    ("rank: first optimizer step", "rank0/loop", "rank0/first-step"),
]


def read_phases(log_text: str) -> tuple[dict[str, float], dict[str, float]]:
    """launcher.log's phase lines as ({"who/name": unix time}, {"who/name": CPU seconds so far});
    a name written twice keeps its first time."""
    marks: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for who, name, at, used in PHASE.findall(log_text):
        marks.setdefault(f"{who}/{name}", float(at))
        cpu.setdefault(f"{who}/{name}", float(used))
    return marks, cpu


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def launch(job: str, work: Path, store: Path, sets: list[str], op_cache: Path | None = None,
           plan_cache: Path | None = None) -> dict:
    import psutil

    out = work / "out"
    cmd = [sys.executable, "-m", "jobspec", "launch", job, "--set", f"output_dir={out}",
           "--set", f"logging.mlflow.tracking_uri=sqlite:///{store}", "--set", "logging.progress=lines",
           *[x for s in sets for x in ("--set", s)]]
    load = load_average()
    started = time.time()
    env = {**os.environ, **({"TORCH_EXTENSIONS_DIR": str(op_cache)} if op_cache else {}),
           **({"JOBSPEC_CACHE_DIR": str(plan_cache)} if plan_cache else {})}
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # DeepSpeed's runner and launch.py write no timestamps of their own: their CPU time until the
    # ranks exist is their start-up (afterwards they only wait for the ranks)
    helpers: dict[str, float] = {}
    parent = psutil.Process(proc.pid)
    ranks_seen = False
    while proc.poll() is None and not ranks_seen:
        try:
            for child in parent.children(recursive=True):
                line = " ".join(child.cmdline())
                ranks_seen |= "jobspec.train.worker" in line and "launcher" not in line
                kind = "runner" if ("launcher.runner" in line or "bin/deepspeed" in line) else \
                    "launch.py" if "launcher.launch" in line else None
                if kind:
                    times = child.cpu_times()
                    helpers[kind] = max(helpers.get(kind, 0.0), times.user + times.system)
        except psutil.Error:
            pass
        time.sleep(0.05)
    proc.wait()
    output = proc.stdout.read()
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{output[-5000:]}")
    run_dir = max(out.glob("run-*"))
    marks, cpu = read_phases((run_dir / "launcher.log").read_text(errors="replace"))
    marks.update(cmd=started, end=ended)
    cpu["cmd"] = 0.0
    tracking = run_dir / "mlflow_run.json"
    if tracking.exists():
        marks["mlflow run ready"] = tracking.stat().st_mtime
    built = sorted(p.name for p in op_cache.iterdir()) if op_cache and op_cache.is_dir() else []
    # what the launch printed: its `startup` lines' total (train/startup.py)
    startup = json.loads((run_dir / "summary.json").read_text()).get("startup") or {}
    return {"marks": marks, "cpu": cpu, "helpers": helpers, "load": load, "ops_built": built,
            "shown": startup.get("to_first_step_s")}


def cpu_of(run: dict, start: str, end: str) -> float | None:
    """CPU seconds of the process on the critical path between two marks (one process per step)."""
    if start == "launcher/runner" and end == "rank0/start":
        return sum(run["helpers"].values()) or None
    if start == "cmd":
        start = "launcher/start"
    cpu = run["cpu"]
    if start in cpu and end in cpu and start.split("/")[0] == end.split("/")[0]:
        return cpu[end] - cpu[start]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(REPO / "jobs" / "quickstart.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--empty-op-cache", action="store_true",
                        help="every launch with a new, empty TORCH_EXTENSIONS_DIR (a fresh machine's first launch)")
    parser.add_argument("--empty-plan-cache", action="store_true",
                        help="every launch with a new, empty JOBSPEC_CACHE_DIR: no plan, trace or "
                             "check cached (the launcher traces the model)")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="jobspec-startup-") as tmp:
        store = Path(tmp) / "mlflow.db"   # created by the first launch, found by the others
        for i in range(args.repeats):
            work = Path(tmp) / f"launch-{i + 1}"
            work.mkdir()
            runs.append(launch(args.job, work, store, args.sets,
                               work / "op-cache" if args.empty_op_cache else None,
                               work / "plan-cache" if args.empty_plan_cache else None))
            marks = runs[-1]["marks"]
            built = (f"; ops built: {', '.join(runs[-1]['ops_built']) or 'none'}" if args.empty_op_cache else "")
            print(f"launch {i + 1}/{args.repeats} ({'cold' if i == 0 else 'warm'} store): command to first step "
                  f"{marks['rank0/first-step'] - marks['cmd']:.1f} s, whole command "
                  f"{marks['end'] - marks['cmd']:.1f} s (load average before: {runs[-1]['load']}){built}", flush=True)
    print()
    print(f"| phase | {' | '.join(f'launch {i + 1}' for i in range(len(runs)))} | median | CPU s (median) |")
    print(f"| --- | {' | '.join('---:' for _ in runs)} | ---: | ---: |")
    rows = STEPS + [("MLflow run ready (after the runner started; in parallel)", "launcher/runner", "mlflow run ready"),
                    ("**command to first step**", "cmd", "rank0/first-step"),
                    ("first step to the end (training, eval, checkpoint, summary)", "rank0/first-step", "end"),
                    ("**whole command**", "cmd", "end")]
    critical_cpu = []
    for label, start, end in rows:
        values = [r["marks"][end] - r["marks"][start] if start in r["marks"] and end in r["marks"] else None
                  for r in runs]
        known = [v for v in values if v is not None]
        cpus = [c for c in (cpu_of(r, start, end) for r in runs) if c is not None]
        if (start, end) in [(a, b) for _, a, b in STEPS] and cpus:
            critical_cpu.append(statistics.median(cpus))
        cells = [f"{v:.2f}" if v is not None else "-" for v in values]
        median = f"{statistics.median(known):.2f}" if known else "-"
        cpu_cell = f"{statistics.median(cpus):.2f}" if cpus else ""
        print(f"| {label} | {' | '.join(cells)} | {median} | {cpu_cell} |")
    shown = [r["shown"] for r in runs]
    printed = [v for v in shown if v is not None]
    print(f"| to step 1 as the launch printed it (summary.json `startup`) | "
          f"{' | '.join(f'{v:.2f}' if v is not None else '-' for v in shown)} | "
          f"{f'{statistics.median(printed):.2f}' if printed else '-'} | |")
    print(f"| load average (1, 5, 15 min) before | {' | '.join(r['load'] for r in runs)} | | |")
    print(f"\nCPU seconds on the critical path to the first step (launcher, runner + launch.py, rank 0; "
          f"about the wall time on an idle 2-core machine): {sum(critical_cpu):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
