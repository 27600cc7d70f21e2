"""Launch and telemetry overhead: `jobspec launch` against a minimal hand-written DeepSpeed loop.

    python -m bench.launch_overhead                        # quickstart model, 1 CPU rank, 3 repeats
    python -m bench.launch_overhead --repeats 5 --steps 80 --ranks 2 --out /tmp/overhead.md

Both sides run the same job (default `jobs/quickstart.yaml` with the `--set`s below): A is
`jobspec launch JOB`, B is `jobspec compile JOB --out DIR` then `deepspeed bench/hand_loop.py
--run-dir DIR` (the same model, synthetic samples and compiled ds_config.json, a plain loop). They
run interleaved A, B, A, B ... after one untimed warm-up launch (import caches, DeepSpeed op
builds, the MLflow database), so drift of a shared machine hits both sides. Measured:

1. launch to first step: from starting the command to the end of optimizer step 1, read from the
   timestamps both sides write (the worker's metrics.jsonl, logging every step; hand_loop's lines).
   The hand loop's `jobspec compile` is not counted (someone writing the loop writes the config).
2. steady-state step time: the median of step-to-step timestamp gaps after --warmup steps, both
   truncated to milliseconds as metrics.jsonl is; ratio = median over repeats, jobspec / hand loop.
   By default jobspec logs every step (its per-step stamps), so its steps carry the full telemetry
   cost, the worst case; `--log-every 10` measures it at the schema's default interval instead.
   Also the CPU seconds rank 0 spends per step (psutil, all threads): a shared machine's load
   disturbs them far less than wall time.
3. telemetry per step: an in-process probe (`--probe RUN_DIR`, started by this script) runs the
   worker's own engine, StepReporter and MetricSink (MLflow on) on a synthetic loop, times
   `StepReporter.log_window` (collectives, memory readings, metrics.jsonl, the MLflow queue) and the
   per-step accounting (token count, loss) with time.perf_counter, and also compares blocks of steps
   logging every step with blocks logging none (which also catches the MLflow sender thread).

Threads: every rank gets --threads OpenMP threads (OMP_NUM_THREADS, default 1), on both sides:
on a small shared machine an oversubscribed OpenMP pool makes step times swing by 10x.
Work files go to --work (default: a temp directory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JOB = REPO / "jobs" / "quickstart.yaml"
EXPERIMENT = "launch-overhead"
HAND_STEP = re.compile(r"^hand_loop step (\d+) t=([0-9.]+)", re.MULTILINE)
# DeepSpeed's own log lines (local time, ms) mark the phases of a start on both sides alike
DS_LOG_TIME = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[INFO\] \[%s"
# (jobspec runs launch.py itself on one node, the hand loop through the `deepspeed` runner: launch.py's
# first line is the common mark)
PHASES = {"runner_s": DS_LOG_TIME % r"launch\.py:\d+:main\] WORLD INFO DICT",
          "rank_s": DS_LOG_TIME % r"launch\.py:\d+:main\] process \d+ spawned"}
FIRST_STEP = re.compile(r"^jobspec-log: phase rank0 first-step ([0-9.]+) ", re.MULTILINE)
DEFAULT_LOG_EVERY = 10  # logging.every_n_steps's schema default: the telemetry share of a usual job
STEADY_GOAL, LAUNCH_GOAL_S = 1.03, 1.5  # issue 14: steady step vs the hand loop; launch to first step


def job_overrides(work: Path, tag: str, args) -> list[str]:
    """`--set`s making both sides the same short job: own output dir and run name, no eval or checkpoint."""
    samples = max(960, (args.steps + 1) * 16 * args.ranks)  # no epoch boundary inside the timed steps
    return [f"output_dir={work / tag}", f"logging.mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}",
            f"logging.mlflow.experiment={EXPERIMENT}", f"logging.mlflow.run_name={tag}",
            f"training.max_steps={args.steps}", "training.micro_batch_size=16", "training.eval_every=null", f"logging.every_n_steps={args.log_every}",
            f"data.synthetic.num_samples={samples}", "data.synthetic.eval_samples=0",
            f"resources.gpus_per_node={args.ranks}", "logging.progress=lines",
            "checkpoint.resume=never", "checkpoint.save_final=false", "checkpoint.every_n_steps=null"]


def _sets(values: list[str]) -> list[str]:
    return [x for v in values for x in ("--set", v)]


def child_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def steady_step_s(stamps_ms: list[tuple[int, int]], warmup: int) -> float:
    """Median seconds per optimizer step between consecutive (step, ms) stamps after step `warmup`
    (per-step gaps, or per-window means when only every Nth step has a stamp)."""
    stamps = sorted(stamps_ms)
    gaps = [(b[1] - a[1]) / 1000 / (b[0] - a[0]) for a, b in zip(stamps, stamps[1:]) if a[0] > warmup]
    if not gaps:
        raise SystemExit(f"no step gaps after warm-up step {warmup}: raise --steps")
    return statistics.median(gaps)


def phase_times(output: str, started: float) -> dict:
    """Seconds from `started` to the runner's first command line and to the rank's spawn (first rank)."""
    out = {}
    for name, pattern in PHASES.items():
        found = re.search(pattern, output, re.MULTILINE)
        if found:
            stamp = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")  # local time
            out[name] = stamp.timestamp() - started
    return out


class RankCpuSampler:
    """Polls the CPU time (user + system, all threads) of the rank-0 process below a command.

    Wall time on a shared machine swings with other people's load; the CPU seconds a rank spends
    per step swing far less, so the steady state is also reported as CPU time per step."""

    def __init__(self, root_pid: int, period_s: float = 0.1):
        import threading
        self.root_pid, self.period_s = root_pid, period_s
        self.samples: list[tuple[float, float]] = []  # (unix time, CPU seconds of rank 0)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil
        rank = None
        while not self._done.is_set():
            try:
                if rank is None:
                    rank = next((p for p in psutil.Process(self.root_pid).children(recursive=True)
                                 if "--local_rank=0" in p.cmdline()), None)
                if rank is not None:
                    cpu = rank.cpu_times()
                    self.samples.append((time.time(), cpu.user + cpu.system))
            except psutil.Error:
                if rank is not None:
                    return  # rank 0 has exited
            self._done.wait(self.period_s)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def cpu_per_step_s(self, stamps_ms: list[tuple[int, int]], warmup: int) -> float | None:
        """CPU seconds per optimizer step between the first stamp after `warmup` and the last stamp."""
        stamps = sorted(s for s in stamps_ms if s[0] > warmup)
        if len(stamps) < 2 or len(self.samples) < 2:
            return None
        (step_a, t_a), (step_b, t_b) = stamps[0], stamps[-1]
        return (self._cpu_at(t_b / 1000) - self._cpu_at(t_a / 1000)) / (step_b - step_a)

    def _cpu_at(self, t: float) -> float:
        """Linear interpolation of the sampled CPU time at unix time t."""
        before = max((s for s in self.samples if s[0] <= t), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t), default=self.samples[-1])
        if after[0] == before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])


def run_jobspec(job: Path, work: Path, tag: str, args, log) -> dict:
    cmd = [sys.executable, "-m", "jobspec", "launch", str(job), *_sets(job_overrides(work, tag, args))]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    sampler = RankCpuSampler(proc.pid)
    returncode = proc.wait()
    sampler.stop()
    if returncode != 0:
        raise SystemExit(f"jobspec launch failed (exit {returncode}); see {log.name}")
    run_dir = max((work / tag).glob("run-*"), key=lambda p: p.stat().st_mtime)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stamps = [(r["step"], r["timestamp"]) for r in lines if "train/loss" in r]
    launcher_log = (run_dir / "launcher.log").read_text(errors="replace")
    # rank 0's end of its first optimizer step (jobspec/launcher_log.py), logged or not: the point where the
    # hand loop prints its first step line
    first = FIRST_STEP.search(launcher_log)
    return {"first_step_s": float(first.group(1)) - started if first else None,
            "step_s": steady_step_s(stamps, args.warmup),
            "cpu_step_s": sampler.cpu_per_step_s(stamps, args.warmup),
            **phase_times(launcher_log, started),
            "ds_config": json.loads((run_dir / "ds_config.json").read_text())}


def compile_run_dir(job: Path, work: Path, tag: str, args, log) -> tuple[Path, float]:
    run_dir = work / tag / "compiled"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jobspec", "compile", str(job), "--out", str(run_dir),
                    *_sets(job_overrides(work, tag, args))], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                   check=True)
    return run_dir, time.perf_counter() - started


def run_hand_loop(job: Path, work: Path, tag: str, args, log) -> dict:
    from jobspec.launch.runner import free_port, runner_prefix
    run_dir, compile_s = compile_run_dir(job, work, tag, args, log)
    from jobspec.shm import remove_shared_memory_buffers
    port = free_port()
    cmd = runner_prefix() + ["--num_gpus", str(args.ranks), "--master_port", str(port),
                             str(REPO / "bench" / "hand_loop.py"), "--run-dir", str(run_dir)]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(args.threads), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sampler = RankCpuSampler(proc.pid)
    try:
        output, _ = proc.communicate()
    finally:  # DeepSpeed never unlinks its /dev/shm all-reduce buffers (jobspec/shm.py)
        remove_shared_memory_buffers(port)
    sampler.stop()
    log.write(output)
    if proc.returncode != 0:
        raise SystemExit(f"hand loop failed (exit {proc.returncode}); see {log.name}")
    # truncated to ms like MetricSink's timestamps, so both sides are measured at the same resolution
    stamps = [(int(step), int(float(t) * 1000)) for step, t in HAND_STEP.findall(output)]
    return {"first_step_s": min(stamps)[1] / 1000 - started, "step_s": steady_step_s(stamps, args.warmup),
            "compile_s": compile_s, "cpu_step_s": sampler.cpu_per_step_s(stamps, args.warmup),
            **phase_times(output, started), "ds_config": json.loads((run_dir / "ds_config.json").read_text())}


# --- the telemetry probe (a child process: one rank, the worker's own pieces) ------------------

def probe(run_dir: Path, steps: int, block: int, warmup: int) -> dict:
    """Steps of the worker's engine with StepReporter logging in alternating blocks (on, off, on, ...)."""
    import itertools

    import deepspeed

    from jobspec import rundir
    from jobspec.data.loaders import make_loader
    from jobspec.spec.derived import DerivedJob
    from jobspec.tracking.mlflow_sender import MlflowSender
    from jobspec.tracking.sink import MetricSink
    from jobspec.train import engine as rank_engine
    from jobspec.train.progress import Progress, RunState, StepReporter, Window

    files = rundir.read_run_files(run_dir)
    deepspeed.init_distributed()
    engine, train_ds, _, _ = rank_engine.build_engine(files)
    sink = MetricSink.open(run_dir)  # MLflow on: mlflow_run.json names a live run
    sender = next(w for w in sink.writers if isinstance(w, MlflowSender))   # MLflow's writer in the sink
    devnull = open(os.devnull, "w")  # the console line rank 0 prints per log step: formatted, not shown
    progress = Progress(steps, mode="lines", stream=devnull)
    job = DerivedJob.from_dict(files.derived)
    reporter = StepReporter(engine, files.spec, job, files.patches, sink, progress, 0, RunState())
    mb = job.micro_batch_size
    batches = itertools.chain.from_iterable(
        make_loader(train_ds, micro_batch_size=mb, rank=0, world_size=1, seed=0, epoch=e, shuffle=True,
                    num_workers=0, pin_memory=False) for e in itertools.count())
    deadline = time.monotonic() + 120
    while sender.client is None and time.monotonic() < deadline:  # the sender makes its MLflow client
        time.sleep(0.05)                                         # (imports mlflow) before its first send
    time.sleep(0.5)
    sender_cpu_before_s = _thread_cpu_s(sender._thread)  # that one-off cost is start-up, not telemetry
    records = []
    window = Window()
    engine.train()
    previous_end, previous_cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        logging_on = (i // block) % 2 == 0
        batch = next(batches)
        t0 = time.perf_counter()
        window.tokens += reporter.count_tokens(batch)
        window.samples += int(batch["input_ids"].shape[0])
        t1 = time.perf_counter()
        loss = rank_engine.loss_of(engine(**{k: v.to(engine.device) for k, v in batch.items()}))
        engine.backward(loss)
        engine.step()
        t2 = time.perf_counter()
        window.add_loss(loss)
        window.steps += 1
        t3 = time.perf_counter()
        if logging_on:
            window = reporter.log_window(i + 1, window)
        t4, cpu = time.perf_counter(), time.process_time()  # process CPU: includes the MLflow sender thread
        if i >= warmup:
            records.append({"on": logging_on, "cycle": t4 - previous_end, "cpu": cpu - previous_cpu,
                            "accounting": (t1 - t0) + (t3 - t2), "log": t4 - t3})
        previous_end, previous_cpu = t4, cpu
    deadline = time.monotonic() + 60
    while not sender._queue.empty() and time.monotonic() < deadline:  # let the sender drain the queue
        time.sleep(0.05)
    time.sleep(0.5)  # the last batch in flight
    # while it still lives: a finished thread's time is gone
    sender_cpu_s = _thread_cpu_s(sender._thread) - sender_cpu_before_s
    sink.close(timeout=60)
    on = [r for r in records if r["on"]]
    off = [r for r in records if not r["on"]]
    step_s = statistics.median(r["cycle"] for r in off)  # a step without any logging
    return {"step_s": step_s,
            "log_s_median": statistics.median(r["log"] for r in on),
            "log_s_mean": statistics.fmean(r["log"] for r in on),
            "accounting_s": statistics.median(r["accounting"] for r in records),
            "cycle_on_s": statistics.median(r["cycle"] for r in on),
            "cycle_off_s": step_s, "cpu_on_s": statistics.fmean(r["cpu"] for r in on),
            "cpu_off_s": statistics.fmean(r["cpu"] for r in off), "steps_on": len(on), "steps_off": len(off), "dropped": sender.dropped,
            "sender_cpu_per_log_s": sender_cpu_s / max(1, sum(1 for i in range(steps) if (i // block) % 2 == 0))}


def _thread_cpu_s(thread) -> float:
    """CPU seconds a (finished or running) thread used, from the OS's per-thread accounting."""
    import psutil
    if thread is None:
        return 0.0
    ids = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    return ids.get(thread.native_id, float("nan"))


def run_probe(job: Path, work: Path, args, log) -> dict:
    from jobspec.launch.runner import free_port
    from jobspec.tracking import run as tracking
    # the schedule spans the probe's steps (the learning rate does not change the work, but stay valid)
    run_dir, _ = compile_run_dir(job, work, "probe", argparse.Namespace(**{**vars(args), "steps": args.probe_steps}),
                                 log)
    import yaml
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    launch = json.loads((run_dir / "launch.json").read_text())
    tracked = tracking.start_run(spec, launch, launch["derived"], (run_dir / "spec.yaml").read_text(), run_dir)
    env = {**child_env(args.threads), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out_file = run_dir / "probe.json"
    cmd = [sys.executable, "-m", "bench.launch_overhead", "--probe", str(run_dir), "--probe-out", str(out_file),
           "--probe-steps", str(args.probe_steps), "--warmup", str(args.warmup)]
    result = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    tracking.end_run(tracked, run_dir, status="FINISHED" if result.returncode == 0 else "FAILED",
                      exit_code=result.returncode)
    if result.returncode != 0:
        raise SystemExit(f"telemetry probe failed (exit {result.returncode}); see {log.name}")
    return json.loads(out_file.read_text())


# --- report -----------------------------------------------------------------------------------

def _spread(values: list[float], scale: float, fmt: str) -> str:
    text = format(statistics.median(values) * scale, fmt)
    if len(values) > 1:
        text += f" ({format(min(values) * scale, fmt)}-{format(max(values) * scale, fmt)})"
    return text


PHASE_LABELS = (("runner_s", "start to DeepSpeed launch.py up, s"),
                ("rank_s", "start to rank process spawned, s"))


def _phase(results: list[dict], key: str) -> str:
    values = [r[key] for r in results if key in r]
    return _spread(values, 1, ".1f") if values else "?"


def _cpu_row(a: list[dict], b: list[dict]) -> str:
    cpu_a = [r["cpu_step_s"] for r in a if r.get("cpu_step_s")]
    cpu_b = [r["cpu_step_s"] for r in b if r.get("cpu_step_s")]
    if not (cpu_a and cpu_b):
        return "| steady CPU time per step, ms (rank 0) | ? | ? | | | |"
    ratio = statistics.median(cpu_a) / statistics.median(cpu_b)
    return (f"| steady CPU time per step, ms (rank 0, all threads) | {_spread(cpu_a, 1000, '.1f')} | "
            f"{_spread(cpu_b, 1000, '.1f')} | x{ratio:.3f} | <= {STEADY_GOAL} | {'yes' if ratio <= STEADY_GOAL else 'no'} |")


def render(a: list[dict], b: list[dict], p: dict) -> str:
    """Markdown: launch and steady state (medians over repeats, min-max), then the telemetry probe."""
    first_a, first_b = [r["first_step_s"] for r in a if r["first_step_s"] is not None], [r["first_step_s"] for r in b]
    first_a_text = _spread(first_a, 1, ".1f") if first_a else "- (step 1 not logged)"
    diff = statistics.median(first_a) - statistics.median(first_b) if first_a else None
    first_diff = f"{diff:+.1f} s" if first_a else "-"
    pair_diffs = [x["first_step_s"] - y["first_step_s"] for x, y in zip(a, b) if x["first_step_s"] is not None]
    if len(pair_diffs) > 1:
        first_diff += " (pairs " + ", ".join(f"{d:+.1f}" for d in pair_diffs) + ")"
    first_met = "-" if diff is None else ("yes" if diff <= LAUNCH_GOAL_S else "no")
    step_a, step_b = [r["step_s"] for r in a], [r["step_s"] for r in b]
    ratio = statistics.median(step_a) / statistics.median(step_b)
    pair_ratios = [x / y for x, y in zip(step_a, step_b)]
    rows = [
        "| measure | jobspec launch | hand loop | jobspec - / hand loop | goal | met |",
        "|---|---:|---:|---:|---:|---|",
        f"| launch to first step, s | {first_a_text} | {_spread(first_b, 1, '.1f')} | {first_diff} | "
        f"<= +{LAUNCH_GOAL_S} s | {first_met} |",
        *(f"| - of which: {label} | {_phase(a, key)} | {_phase(b, key)} | | | |" for key, label in PHASE_LABELS),
        f"| steady step time, ms (median) | {_spread(step_a, 1000, '.1f')} | {_spread(step_b, 1000, '.1f')} | "
        f"x{ratio:.3f} (pairs {min(pair_ratios):.3f}-{max(pair_ratios):.3f}) | <= {STEADY_GOAL} | "
        f"{'yes' if ratio <= STEADY_GOAL else 'no'} |",
        _cpu_row(a, b),
    ]
    if p is not None:
        rows += probe_rows(p)
    compile_s = [r["compile_s"] for r in b]
    rows.append(f"\n(the hand loop's `jobspec compile --out`, not counted above: {_spread(compile_s, 1, '.1f')} s)")
    return "\n".join(rows)


def probe_rows(p: dict) -> list[str]:
    log_share = p["log_s_mean"] / p["step_s"]
    acc_share = p["accounting_s"] / p["step_s"]
    ab_share = p["cycle_on_s"] / p["cycle_off_s"] - 1
    return [
        f"| telemetry per step, logging every step | {log_share + acc_share:.2%} of a step | - | - | <= 3% | "
        f"{'yes' if log_share + acc_share <= 0.03 else 'no'} |",
        "",
        "| telemetry probe (in-process, worker's StepReporter + MetricSink, MLflow on) | value |",
        "|---|---:|",
        f"| step without logging, ms (median) | {p['step_s'] * 1000:.1f} |",
        f"| `log_window` per call, ms (mean / median) | {p['log_s_mean'] * 1000:.2f} / {p['log_s_median'] * 1000:.2f} |",
        f"| per-step accounting (token count, loss), ms (median) | {p['accounting_s'] * 1000:.3f} |",
        f"| telemetry share, logging every step | {log_share + acc_share:.2%} |",
        f"| telemetry share, logging every {DEFAULT_LOG_EVERY} steps (schema default) | "
        f"{log_share / DEFAULT_LOG_EVERY + acc_share:.2%} |",
        f"| blocks logging every step vs none: median step time change | {ab_share:+.2%} |",
        f"| blocks logging every step vs none: process CPU time per step change (incl. MLflow sender) | "
        f"{p['cpu_on_s'] / p['cpu_off_s'] - 1:+.2%} |",
        f"| MLflow sender thread (sqlite store) CPU per logged step, ms | {p['sender_cpu_per_log_s'] * 1000:.2f} |",
        f"| steps on / off (after warm-up); MLflow points dropped | {p['steps_on']} / {p['steps_off']}; {p['dropped']} |",
    ]


def environment(args) -> str:
    versions = ", ".join(f"{n} {metadata.version(n)}" for n in ("torch", "deepspeed", "transformers", "mlflow"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.date.today().isoformat()}, CPU only ({os.cpu_count()} cores), {args.ranks} rank(s) x "
            f"{args.threads} thread(s), jobspec logging every {args.log_every} step(s), {args.repeats} repeat(s) of {args.steps} steps (first {args.warmup} "
            f"left out), Python {platform.python_version()}, {versions}; load average at the end {load:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.launch_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="a sequence-classification job with data.synthetic (default jobs/quickstart.yaml)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state (default 5)")
    parser.add_argument("--ranks", type=int, default=1, help="CPU ranks (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank (default 1)")
    parser.add_argument("--log-every", type=int, default=1,
                        help="jobspec's logging.every_n_steps (default 1: per-step stamps, launch-to-first-step "
                             "and the full telemetry cost; N > 1: the steady state at that interval)")
    parser.add_argument("--probe-steps", type=int, default=200, help="telemetry probe steps (default 200)")
    parser.add_argument("--concurrent", action="store_true",
                        help="start the two sides of a repeat at the same time: both meet the same load")
    parser.add_argument("--no-probe", action="store_true", help="skip the in-process telemetry probe")
    parser.add_argument("--work", type=Path, default=None, help="run dirs, mlflow.db, bench.log (default: temp)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    parser.add_argument("--probe", type=Path, default=None, help=argparse.SUPPRESS)  # the probe child
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        result = probe(args.probe, args.probe_steps, block=10, warmup=args.warmup)
        args.probe_out.write_text(json.dumps(result, indent=2) + "\n")
        import torch.distributed as dist
        dist.destroy_process_group()
        return 0
    if min(args.repeats, args.ranks, args.threads) < 1 or args.steps < args.warmup + 3:
        parser.error("--repeats, --ranks, --threads must be >= 1 and --steps >= --warmup + 3")
    work = (args.work or Path(tempfile.mkdtemp(prefix="jobspec-launch-overhead-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    job = args.job.resolve()
    a, b = [], []
    with open(work / "bench.log", "a", encoding="utf-8") as log:
        print(f"launch_overhead: work dir {work}; warm-up launch (untimed)", file=sys.stderr, flush=True)
        run_jobspec(job, work, "warmup", argparse.Namespace(**{**vars(args), "steps": args.warmup + 3, "log_every": 1}), log)
        for i in range(args.repeats):  # interleaved: A, B, A, B (--concurrent: A and B at once)
            print(f"launch_overhead: repeat {i + 1}/{args.repeats} (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
            log.flush()
            if args.concurrent:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(2) as pool:
                    future_a = pool.submit(run_jobspec, job, work, f"jobspec-r{i + 1}", args, log)
                    future_b = pool.submit(run_hand_loop, job, work, f"hand-r{i + 1}", args, log)
                a.append(future_a.result())
                b.append(future_b.result())
            else:
                a.append(run_jobspec(job, work, f"jobspec-r{i + 1}", args, log))
                log.flush()
                b.append(run_hand_loop(job, work, f"hand-r{i + 1}", args, log))
            if a[-1]["ds_config"] != b[-1]["ds_config"]:
                raise SystemExit("the two sides got different DeepSpeed configs: not a fair comparison")
        probe_result = None
        if not args.no_probe:
            print("launch_overhead: telemetry probe", file=sys.stderr, flush=True)
            probe_result = run_probe(job, work, args, log)
    text = f"{render(a, b, probe_result)}\n\n{environment(args)}\n"
    print(text)
    (work / "results.json").write_text(json.dumps({"jobspec": a, "hand_loop": b, "probe": probe_result},
                                                  indent=2, default=str) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    shutil.rmtree(work / "warmup", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
