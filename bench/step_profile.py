"""Steady-state cost of the worker's training step against the hand-written loop, in CPU time.

    python -m bench.step_profile                             # quickstart model, 1 rank, 3 repeats
    python -m bench.step_profile --repeats 5 --steps 400 --profile /tmp/prof   # + cProfile of each side
    python -m bench.step_profile --before /tmp/main-copy      # + the workers of another checkout

Each side runs in its own process on one rank (the environment the deepspeed runner would set, but
no runner: start-up is `bench.launch_overhead`'s business), on the same compiled job:

  hand       bench/hand_loop.py: forward / backward / step, nothing else
  worker-N   jobspec.train.worker with logging.every_n_steps = N (MLflow on, a local sqlite store,
             the run created as the launcher creates it); N = 1, 10 (the default) and "off"
             (every_n_steps = the step count: one window at the end, nothing logged in between)

Both are timed the same way: `DeepSpeedEngine.step` is wrapped to record, after every optimizer step,
wall time, the process's CPU time (every thread: the MLflow sender and gloo's threads included) and
the main thread's CPU time. The steady state is the slope from step --warmup to the last step. Sides
run interleaved (hand, worker-1, worker-10, worker-off, hand, ...) so that a shared machine's drift
hits all alike; medians over repeats; ratios are against the hand loop (and "telemetry" is worker-N
against worker-off). With `--pairs` each side runs at the same time as a hand loop of its own (two
processes, one thread each) and the ratio is the median of those pairs' ratios: the load of that
moment hits both, which on a shared machine is steadier than runs minutes apart.
`--profile DIR` writes a cProfile of each side's steady steps (main thread) and, for the worker, of
its MLflow sender thread's sends (`*.sender.prof`). Every side also reports the CPU time its garbage
collections took per steady step (gc callbacks, any thread).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JOB = REPO / "jobs" / "quickstart.yaml"
SIDES = ("hand", "worker-1", "worker-10", "worker-off")
BEFORE_SIDES = ("before-1", "before-10", "before-off")  # the worker of --before TREE (another checkout)
TRAINER_SIDES = ("trainer-1", "trainer-5", "trainer-10")  # bench.trainer_baseline, logging_steps = N
KINDS = {"hand": "hand", "worker": "worker", "before": "worker", "trainer": "trainer"}


def job_sets(work: Path, tag: str, steps: int, log_every: int, global_batch: int) -> list[str]:
    samples = (steps + 1) * global_batch  # one epoch covers the run: no epoch boundary in the timed steps
    return [f"output_dir={work / tag}", f"logging.mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}",
            "logging.mlflow.experiment=step-profile", f"logging.mlflow.run_name={tag}",
            f"training.max_steps={steps}", "training.eval_every=null",
            f"logging.every_n_steps={log_every}", f"data.synthetic.num_samples={samples}",
            "data.synthetic.eval_samples=0", "resources.gpus_per_node=1", "logging.progress=lines",
            "checkpoint.resume=never", "checkpoint.save_final=false", "checkpoint.every_n_steps=null"]


# --- the child: one side, one rank, timed ---------------------------------------------------------

def instrument(records: list, profile_from: int | None, profiler: cProfile.Profile | None) -> None:
    """Wrap DeepSpeedEngine.step: a (wall, process CPU, main-thread CPU) record after each optimizer step."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine.step

    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        out = original(self, *args, **kwargs)
        if boundary:
            records.append((time.perf_counter(), time.process_time(), time.thread_time(), time.time()))
            if profiler is not None and len(records) == profile_from:
                profiler.enable()
        return out
    DeepSpeedEngine.step = step


def child(side: str, run_dir: Path, out: Path, warmup: int, profile: Path | None) -> int:
    started = time.time()  # before torch/deepspeed/transformers are imported: start-up counts from here
    records = RECORDS
    profiler = cProfile.Profile(time.thread_time) if profile else None  # CPU time: robust to a loaded machine
    time_gc()
    if side != "trainer":  # the Trainer's records come from its callback (it may not use DeepSpeed at all)
        instrument(records, warmup, profiler)
    if side == "hand":
        sys.path.insert(0, str(REPO))
        from bench import hand_loop
        code = hand_loop.main(["--run-dir", str(run_dir)])
    elif side == "trainer":
        sys.path.insert(0, str(REPO))
        code = run_trainer(run_dir, records, warmup, profiler)
    else:
        from jobspec.train import worker
        sender_profiler = cProfile.Profile(time.thread_time) if profile else None
        instrument_worker(sender_profiler, warmup)
        code = worker.main(["--run-dir", str(run_dir)])
        if sender_profiler is not None:
            sender_profiler.dump_stats(str(profile.with_suffix(".sender.prof")))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    out.write_text(json.dumps({"code": code, "records": records, "costs": COSTS,
                               "first_step_s": records[0][3] - started if records else None}) + "\n")
    return code


def run_trainer(run_dir: Path, records: list, profile_from: int, profiler) -> int:
    """bench.trainer_baseline on the run dir, with a record at every optimizer step's end (its callback)."""
    from bench import trainer_baseline
    make_callback = trainer_baseline.make_callback

    def recording_callback(window, device):
        callback = make_callback(window, device)
        on_step_end = callback.on_step_end

        def step_end(*args, **kwargs):
            records.append((time.perf_counter(), time.process_time(), time.thread_time(), time.time()))
            if profiler is not None and len(records) == profile_from:
                profiler.enable()
            return on_step_end(*args, **kwargs)
        callback.on_step_end = step_end
        return callback
    trainer_baseline.make_callback = recording_callback
    trainer_baseline.run(run_dir, run_dir / "trainer-result.json")
    return 0


COSTS: dict = {}  # name -> [(optimizer steps done at the call, CPU seconds of the calling thread)]
RECORDS: list = []


def time_calls(owner, name: str, label: str) -> None:
    """Wrap owner.name to record the CPU time of the thread calling it (thread_time: own thread only)."""
    original = getattr(owner, name)
    COSTS[label] = []

    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            COSTS[label].append((len(RECORDS), time.thread_time() - t))
    setattr(owner, name, timed)


def time_gc() -> None:
    """Record the CPU time of every garbage collection (any thread, any generation) as cost "gc"."""
    import gc
    COSTS["gc"] = []
    began = []

    def callback(phase, info):
        if phase == "start":
            began.append(time.thread_time())  # collections do not nest; the thread holds the GIL throughout
        elif began:
            COSTS["gc"].append((len(RECORDS), time.thread_time() - began.pop()))
    gc.callbacks.append(callback)


def instrument_worker(sender_profiler: cProfile.Profile | None = None, profile_from: int = 0) -> None:
    """The worker's telemetry, timed in its own threads: the log step in the training thread and the
    MLflow sender's log_batch calls in the sender thread (profiled there from step `profile_from` on,
    with a `sender_profiler`)."""
    from jobspec.train.progress import StepReporter
    from jobspec.tracking.mlflow_sender import MlflowSender
    from jobspec.tracking.sink import MetricSink
    time_calls(StepReporter, "log_window", "log_window")
    if sender_profiler is not None:
        send = MlflowSender._send

        def profiled_send(*args, **kwargs):
            if len(RECORDS) < profile_from:
                return send(*args, **kwargs)
            sender_profiler.enable()  # in the calling (sender) thread only
            try:
                return send(*args, **kwargs)
            finally:
                sender_profiler.disable()
        MlflowSender._send = profiled_send
    time_calls(MlflowSender, "_send", "sender_log_batch")
    if os.environ.get("STEP_PROFILE_DETAIL"):  # the log step's parts
        from jobspec.train import metrics, progress
        time_calls(MetricSink, "log", "sink_log")
        time_calls(progress.Progress, "log", "progress_log")
        time_calls(metrics, "memory_snapshot", "memory_snapshot")
        time_calls(metrics, "gather_rows", "gather_rows")


def steady(records: list, warmup: int) -> dict:
    """Seconds per step (wall, process CPU, main-thread CPU) from step `warmup` to the last."""
    first, last = records[warmup - 1], records[-1]
    n = len(records) - warmup
    return {"wall": (last[0] - first[0]) / n, "cpu": (last[1] - first[1]) / n, "main": (last[2] - first[2]) / n}


# --- the parent: compile, interleave, report ------------------------------------------------------

def run_side(side: str, job: Path, work: Path, tag: str, args, log) -> dict:
    return finish_side(start_side(side, job, work, tag, args, log))


def side_name(text: str) -> str:
    """hand, or worker-N / before-N / trainer-N with N a log interval (worker/before also -off)."""
    import re
    if text == "hand" or re.fullmatch(r"(worker|before)-(\d+|off)|trainer-\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: use hand, worker-N, worker-off, before-N, before-off or trainer-N")


def global_batch(job: Path) -> int:
    from jobspec.spec.derived import derive
    from jobspec.spec.validation import load_and_validate
    spec = load_and_validate(str(job), ["resources.gpus_per_node=1"]).spec
    return derive(spec).global_batch_size


def start_side(side: str, job: Path, work: Path, tag: str, args, log) -> dict:
    """Compile the side's run dir (and its MLflow run) and start its child; `finish_side` waits."""
    from jobspec.launch.runner import free_port
    every = side.split("-")[1] if "-" in side else "off"
    log_every = args.steps if every == "off" else int(every)
    run_dir = work / tag / "run"
    sets = job_sets(work, tag, args.steps, log_every, global_batch(job))
    kind = KINDS[side.split("-")[0]]
    tree = args.before if side.startswith("before") else REPO  # whose jobspec compiles and trains
    python_path = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", "jobspec", "compile", str(job), "--out", str(run_dir),
                    *[x for s in sets for x in ("--set", s)]], cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                   check=True, env=python_path)
    tracked = None
    if kind == "worker":  # the worker's MLflow run, created as the launcher does
        from jobspec import rundir
        from jobspec.tracking import run as tracking_run
        launch = rundir.read_launch(run_dir)
        tracked = tracking_run.start_run(rundir.read_resolved(run_dir), launch, launch["derived"],
                                      rundir.read_spec_text(run_dir), run_dir)
    env = {**python_path, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "JOBSPEC_PROGRESS": "lines"}
    out = work / tag / "result.json"
    profile = args.profile / f"{tag}.prof" if args.profile else None
    # the child runs as a script: with --before, `jobspec` must come from the other tree
    cmd = [sys.executable, str(REPO / "bench" / "step_profile.py"), "--child", kind, "--run-dir", str(run_dir),
           "--child-out", str(out), "--warmup", str(args.warmup)] + (["--child-profile", str(profile)] if profile else [])
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    return {"side": side, "proc": proc, "tracked": tracked, "run_dir": run_dir, "out": out, "log": log, "args": args}


def finish_side(started: dict) -> dict:
    side, run_dir, out, log, args = (started[k] for k in ("side", "run_dir", "out", "log", "args"))
    tracked = started["tracked"]
    code = started["proc"].wait()
    if tracked is not None:
        from jobspec.tracking import run as tracking_run
        tracking_run.end_run(tracked, run_dir, status="FINISHED" if code == 0 else "FAILED", exit_code=code)
    if code != 0:
        raise SystemExit(f"{side} failed (exit {code}); see {log.name}")
    records = json.loads(out.read_text())["records"]
    if len(records) != args.steps:
        raise SystemExit(f"{side}: {len(records)} optimizer steps recorded, expected {args.steps}")
    result = json.loads(out.read_text())
    # steady state only: calls made after the warm-up steps (the first log_batch also sets up the store)
    per_step = {f"{k}_ms_per_step": 1e3 * sum(dt for step, dt in calls if step > args.warmup)
                / (args.steps - args.warmup) for k, calls in result["costs"].items()}
    return {**steady(records, args.warmup), **per_step, "first_step_s": result["first_step_s"],
            "load": os.getloadavg()[0]}


def render(results: dict, base: str = "hand") -> str:
    def med(side, key):
        return statistics.median(r[key] for r in results[side])

    lines = [f"| side | wall ms/step | CPU ms/step (process) | CPU ms/step (main thread) | CPU vs {base} | "
             f"main-thread CPU vs {base} | CPU vs *-off (telemetry) | log_window / MLflow sender, CPU ms per step | "
             "garbage collection, CPU ms per step | process start to step 1, s | load avg (min-max) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for side, runs in results.items():
        if not runs:
            continue

        def ratio(key):
            if f"base_{key}" in runs[0]:  # --pairs: the median of the concurrent pairs' ratios
                return f"x{statistics.median(r[key] / r[f'base_{key}'] for r in runs):.3f}"
            return f"x{med(side, key) / med(base, key):.3f}" if results.get(base) else "-"
        pairs = ""
        if "base_cpu" in runs[0]:
            pairs = " (" + ", ".join(f"{r['cpu'] / r['base_cpu']:.2f}" for r in runs) + ")"
        elif side != base and results.get(base):  # per-repeat ratios: the spread the median hides
            pairs = " (" + ", ".join(f"{a['cpu'] / b['cpu']:.2f}" for a, b in zip(runs, results[base])) + ")"
        off = side.split("-")[0] + "-off"
        telemetry = ("-" if side == off or off not in results or side.startswith(("hand", "trainer"))
                     else f"{100 * (med(side, 'cpu') / med(off, 'cpu') - 1):+.1f}%")
        loads = [r["load"] for r in runs]
        costs = " / ".join(f"{med(side, k):.3f}" if k in runs[0] else "-"
                           for k in ("log_window_ms_per_step", "sender_log_batch_ms_per_step"))
        if "sink_log_ms_per_step" in runs[0]:
            costs += " (" + ", ".join(f"{k[:-12]} {med(side, k):.3f}" for k in runs[0] if k.endswith("_ms_per_step")
                                      and k[:-12] not in ("log_window", "sender_log_batch", "gc")) + ")"
        gc_cost = f"{med(side, 'gc_ms_per_step'):.3f}" if "gc_ms_per_step" in runs[0] else "-"
        lines.append(f"| {side} | {1e3 * med(side, 'wall'):.2f} | {1e3 * med(side, 'cpu'):.2f} | "
                     f"{1e3 * med(side, 'main'):.2f} | {ratio('cpu')}{pairs} | {ratio('main')} | "
                     f"{telemetry} | {costs} | {gc_cost} | {med(side, 'first_step_s'):.2f} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def top_functions(path: Path, n: int = 25) -> str:
    import io
    stream = io.StringIO()
    pstats.Stats(str(path), stream=stream).sort_stats("tottime").print_stats(n)
    return stream.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="a sequence-classification job with data.synthetic")
    parser.add_argument("--sides", nargs="+", default=None, type=side_name, metavar="SIDE",
                        help=f"default: {' '.join(SIDES)}, and {' '.join(BEFORE_SIDES)} with --before; "
                             "also trainer-N (bench.trainer_baseline logging every N)")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout of jobspec (e.g. `git archive` of main) whose worker runs as before-N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="steps left out (default 100: past the MLflow import in the sink's thread)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the rank (default 1)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write cProfile stats of each run here (main thread; *.sender.prof: the MLflow sender)")
    parser.add_argument("--pairs", action="store_true",
                        help="run each side at the same time as its own --base run (2 processes): ratios per pair")
    parser.add_argument("--base", default="hand", type=side_name,
                        help="what the ratios are against (default hand; e.g. trainer-5 for the HF Trainer)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--child", choices=("hand", "worker", "trainer"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.run_dir, args.child_out, args.warmup, args.child_profile)
    if args.steps < args.warmup + 10:
        parser.error("--steps must be at least --warmup + 10")
    args.sides = args.sides or list(SIDES) + (list(BEFORE_SIDES) if args.before else [])
    if any(s.startswith("before") for s in args.sides) and not args.before:
        parser.error("before-* sides need --before TREE")
    if args.before:
        args.before = args.before.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="jobspec-step-profile-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    base = args.base
    results: dict = {side: [] for side in args.sides}
    if base not in results:
        results = {base: [], **results}
    with open(work / "bench.log", "a", encoding="utf-8") as log:
        for i in range(args.repeats):
            for side in args.sides:
                if args.pairs and side == base:
                    continue
                print(f"step_profile: repeat {i + 1}/{args.repeats} {side}{f' || {base}' if args.pairs else ''} "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                if args.pairs:  # both at once: the machine's load at that moment hits both alike
                    a = start_side(side, args.job.resolve(), work, f"{side}-r{i + 1}", args, log)
                    b = start_side(base, args.job.resolve(), work, f"{base}-{side}-r{i + 1}", args, log)
                    result, partner = finish_side(a), finish_side(b)
                    results[base].append(partner)
                    result.update({f"base_{k}": partner[k] for k in ("wall", "cpu", "main")})
                else:
                    result = run_side(side, args.job.resolve(), work, f"{side}-r{i + 1}", args, log)
                results[side].append(result)
                (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")  # partial runs survive
    import platform
    from importlib import metadata
    text = (f"{render(results, base)}\n\n{args.repeats} repeats, {args.steps} steps (first {args.warmup} left out), "
            f"1 rank, OMP_NUM_THREADS={args.threads}, job {args.job.name}; {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{os.cpu_count()}-core CPU, CPython {platform.python_version()}, torch {metadata.version('torch')}, "
            f"deepspeed {metadata.version('deepspeed')}")
    print(text)
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.profile:
        for side in args.sides:
            print(f"\n### cProfile, {side} (repeat 1, steady steps, main thread)\n")
            print(top_functions(args.profile / f"{side}-r1.prof"))
    print(f"work dir {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
