"""Training throughput on one GPU, with and without each speed setting.

    python -m bench gpu-throughput --out bench/work/gpu-throughput.md   # one GPU, one call <= 6 min
    python -m bench gpu-throughput --dry-run                     # any machine: what it measures

Jobs (JOBS: the calibration file's `throughput` specs, bench/calibration/h200-2026-11-28.json): the
TinyLlama shape at micro-batch 4 x 2048 (causal LM) and XLM-R large at 32 x 512 (sequence
classification), each on one rank, ZeRO-0, bf16, sdpa, synthetic tokens, MLflow off, STEPS steps.
Variants (VARIANTS, data: a name and the spec fields it sets): the job as it is,
`model.kernels: liger`, `model.compile`, and both. A variant whose field this checkout's schema
does not have is skipped with a note (the run goes on with the others).

On a GPU it first times a bf16 8192^3 matmul (the ceiling memory/gpu_throughput.py scales), then for
each job and variant, in VARIANTS order (the baselines first): plans and compiles the run directory
as `jobspec launch` does (bench/gpu_calibrate.plan_job, compile_run; the next run is planned while
one runs) and runs the launch's worker on one rank in a process of its own. It reads the worker's
summary.json (tokens/s and MFU: the launch's steady-state figures, the first step left out; peak
allocated), metrics.jsonl (each step's loss: the first LOSS_STEPS against the baseline's, within
LOSS_TOLERANCE) and its output (the first step's seconds from the start-up phases, the compile
seconds from the `torch.compile` note: torch compiles inside the first step).

Writes the markdown table (--out) and a JSON file beside it (same name, .json): `matmul` and
`throughput` entries in the calibration file's shape, each with its variant, so the readings can
join a calibration file. Time: no run starts unless its estimate (START_S, BUILD_S_PER_BILLION, the
job's measured step time, COMPILE_S) ends it within --budget-s.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "bench" / "calibration" / "h200-2026-11-28.json"
WORK = REPO / "bench" / "work" / "gpu-throughput"
BUDGET_S = 330   # the last run ends by then: one call of a lent GPU's 6 minutes, set-up included
STEPS, LOSS_STEPS = 30, 20
# The losses of two variants computing the same steps in bf16 differ by rounding: each step's within
# two bf16 units of roundoff (2 * 2^-8) of the baseline's, relative
LOSS_TOLERANCE = 2 * 2.0 ** -8
JOBS = ("tinyllama-bf16-sdpa-b4-s2048", "xlmr-large-bf16-sdpa-b32-s512")
TARGET_MFU = {"tinyllama-bf16-sdpa-b4-s2048": 0.45, "xlmr-large-bf16-sdpa-b32-s512": 0.35}
# What every run gets: a short run that writes nothing big, every step's loss, no evaluation (its
# first pass would compile the layers' evaluation graph), no MLflow (the GPU image has none)
RUN_SETTINGS = {"training": {"max_steps": STEPS, "eval_every": None},
                "data": {"synthetic": {"eval_samples": 0}},
                "checkpoint": {"save_final": False, "every_n_steps": None, "resume": "never"},
                "export": {"final": False},
                "logging": {"every_n_steps": 1, "progress": "lines", "system_metrics": False,
                            "mlflow": {"enabled": False}}}
# The time estimate: process start and imports, the model built on the host and moved, the steps
# at the job's measured step time, one layer's compilation (forward, backward, Triton kernels)
START_S, BUILD_S_PER_BILLION, COMPILE_S = 15.0, 6.0, 60.0
MATMUL_N = 8192
PHASE = re.compile(r"jobspec-log: phase rank0 (\S+) ([0-9.]+) ")
COMPILE_NOTE = re.compile(r"jobspec-log: torch\.compile: ([0-9.]+) s for ")


@dataclass(frozen=True)
class Variant:
    name: str
    sets: dict            # the spec fields it sets, merged over the job's


# refusals that say only that this host cannot run Liger's kernels (no CUDA GPU, no Triton): a dry run
# on a CPU box reports them as such; on the GPU host they are real
HOST_CODES = frozenset({"kernels-gpu", "kernels-package"})


def _has_gpu() -> bool:
    from jobspec import hardware

    return hardware.gpu_count() > 0


VARIANTS = (
    Variant("baseline", {}),
    Variant("liger", {"model": {"kernels": "liger"}}),
    Variant("compile", {"model": {"compile": True}}),
    Variant("liger-compile", {"model": {"kernels": "liger", "compile": True}}),
)


@dataclass
class Run:
    """One job and variant: its spec, whether this checkout accepts it, what it measured."""

    job: str
    variant: Variant
    spec: dict
    measured_step_s: float       # the job's reading in the calibration file (the estimate's steps)
    skipped: str | None = None   # why it does not run (a field the schema lacks, the time budget)
    host_note: str | None = None  # valid but for this host (a dry run without a GPU)
    readings: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.job}-{self.variant.name}"


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if nested else copy.deepcopy(value)
    return out


def runs() -> list[Run]:
    """Every job and variant, baselines first, from the calibration file's `throughput` entries."""
    entries = {e["name"]: e for e in json.loads(CALIBRATION.read_text())["throughput"]}
    out = []
    for variant in VARIANTS:
        for job in JOBS:
            entry = entries[job]
            spec = deep_merge(deep_merge(entry["spec"], variant.sets), RUN_SETTINGS)
            spec["name"] = f"{job}-{variant.name}"
            run = Run(job, variant, spec, entry["readings"]["step_s"])
            run.skipped = unsupported_kernels(spec)
            out.append(run)
    return out


def unsupported_kernels(spec: dict) -> str | None:
    """Why a `model.kernels: liger` variant of this job cannot exist (its model type has no fused
    modules in Liger: XLM-R's encoder, say); None for the other variants."""
    from jobspec.techniques.fused_kernels import model_problem

    model = spec.get("model", {})
    if model.get("kernels") != "liger":
        return None
    problem = model_problem(model.get("architecture"))
    return None if problem is None else f"skipped: {problem[0]}"


def validate(run: Run, work: Path) -> None:
    """`jobspec validate` of the run's spec: a field the schema lacks skips the run with a note; any
    other problem is raised (a variant that should run and cannot)."""
    import yaml

    from jobspec.errors import SpecError
    from jobspec.spec.validation import load_and_validate
    if run.skipped:
        return
    path = work / run.name / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    written = yaml.safe_dump({**run.spec, "output_dir": "out"}, sort_keys=False)
    path.write_text(written, encoding="utf-8")
    try:
        load_and_validate(path)
    except SpecError as err:
        unknown = [i for i in err.issues if i.code == "schema-unknown-key"]
        if unknown and len(unknown) == len(err.issues):
            fields = ", ".join(".".join(map(str, i.path)) for i in unknown)
            run.skipped = f"skipped: {fields} is not in this checkout's schema"
            return
        if not all(i.code in HOST_CODES for i in err.issues) or _has_gpu():
            raise
        run.host_note = "valid on a GPU host with `jobspec[gpu]` (this one lacks the GPU or Triton)"


def estimate_s(run: Run, parameters: float) -> float:
    """Seconds the run takes on the GPU, start to exit (START_S, BUILD_S_PER_BILLION, COMPILE_S)."""
    compiles = bool(run.spec["model"].get("compile"))
    return (START_S + BUILD_S_PER_BILLION * parameters / 1e9 + STEPS * run.measured_step_s
            + COMPILE_S * compiles)


# --- the GPU run ----------------------------------------------------------------------------------

MATMUL_CODE = """import sys, time, torch
n = int(sys.argv[1])
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
for _ in range(5):
    a @ b
torch.cuda.synchronize()
best = float("inf")
for _ in range(50):
    started = time.perf_counter()
    a @ b
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - started)
print(2 * n ** 3 / best / 1e12)
"""


def matmul_tflops(rank_gpus: dict[str, str]) -> float:
    """TFLOP/s of a bf16 MATMUL_N^3 torch.matmul (its best of 50, after a warm-up), in a process of
    its own (`rank_gpus`: its CUDA_VISIBLE_DEVICES) so that this one never holds a CUDA context."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([sys.executable, "-c", MATMUL_CODE, str(MATMUL_N)],
                          env={**env, **rank_gpus}, capture_output=True, text=True, timeout=120,
                          check=True)
    return round(float(done.stdout.split()[-1]), 1)


def plan(run: Run, work: Path):
    """The run planned as `jobspec plan` plans it (bench/gpu_calibrate.plan_job: the job file, the
    trace)."""
    from bench import gpu_calibrate
    return gpu_calibrate.plan_job(gpu_calibrate.Job(run.name, run.spec), work)


def start(run: Run, planned, work: Path, rank_gpus: dict[str, str]):
    """The run directory compiled as `jobspec launch` writes it, and its one rank started: (the
    process, the run directory, the rank's output)."""
    from bench import gpu_calibrate
    run_dir = work / run.name / "run"
    env = gpu_calibrate.compile_run(planned, run_dir, rank_gpus)
    log = work / run.name / "worker.log"
    command = [sys.executable, "-m", "jobspec.train.worker", "--run-dir", str(run_dir)]
    with open(log, "w", encoding="utf-8") as out:   # its own process group: a hung run ends whole
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, run_dir, log


def finish(run: Run, proc: subprocess.Popen, run_dir: Path, log: Path, limit_s: float) -> None:
    """Wait for the rank (at most `limit_s`), then read what it measured into `run.readings`."""
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    run.readings = read_run(run_dir, log.read_text(errors="replace"), code)


def read_run(run_dir: Path, output: str, code: int) -> dict:
    """tokens/s, MFU, peak allocated, the first step's and the compile's seconds, each step's
    loss."""
    from jobspec import rundir
    summary = rundir.read_summary(run_dir)
    points = rundir.read_metric_points(run_dir) if (run_dir / rundir.METRICS).is_file() else []
    losses = {step: value for key, value, _, step in points if key == "train/loss"}
    phases = {name: float(at) for name, at in PHASE.findall(output)}
    compiled = COMPILE_NOTE.search(output)
    derived = rundir.read_launch(run_dir)["derived"]
    tokens_per_s = summary.tokens_per_s if summary else None
    peak = (summary.peak_memory if summary else {}).get("mem/peak_allocated_mib_max")
    timed = {"first-step", "sink"} <= set(phases)   # the worker's phases around its first step
    first_step = phases["first-step"] - phases["sink"] if timed else None
    return {"exit_code": code, "status": summary.status if summary else None,
            "tokens_per_s": tokens_per_s, "mfu": summary.mfu if summary else None,
            "step_s": (derived["global_batch_size"] * derived["seq_len"] / tokens_per_s
                       if tokens_per_s else None),
            "peak_allocated_gib": None if peak is None else round(peak / 1024, 2),
            "first_step_s": first_step,
            "compile_s": float(compiled.group(1)) if compiled else None,
            "losses": [losses[s] for s in sorted(losses)][:LOSS_STEPS],
            "error": summary.error if summary else output.splitlines()[-20:]}


def measure(todo: list[Run], work: Path, deadline: float, rank_gpus: dict[str, str]) -> None:
    """Each run that is not skipped, planned while the one before runs, started only when its
    estimate ends it by `deadline`."""
    running = None
    try:
        for run in todo:
            planned = plan(run, work)
            if running is not None:
                finish(*running)
                running = None
            estimate = estimate_s(run, planned.prepared.derived.num_parameters or 0)
            if time.monotonic() + estimate > deadline:
                run.skipped = f"not started: est. {estimate:.0f} s would end past --budget-s"
                continue
            _say(f"{run.name}: about {estimate:.0f} s")
            proc, run_dir, log = start(run, planned, work, rank_gpus)
            running = (run, proc, run_dir, log, max(120.0, 3 * estimate))
        if running is not None:
            finish(*running)
            running = None
    finally:   # stopped (Ctrl-C, the session's limit): the rank must not hold the GPU on
        if running is not None and running[1].poll() is None:
            os.killpg(running[1].pid, signal.SIGKILL)


# --- the results ----------------------------------------------------------------------------------

def loss_check(run: Run, baseline: Run | None) -> tuple[float | None, bool | None]:
    """The largest relative difference of the run's first LOSS_STEPS losses from the baseline's,
    and whether it is within LOSS_TOLERANCE (None: no baseline losses to compare)."""
    ours = run.readings.get("losses") or []
    theirs = (baseline.readings.get("losses") or []) if baseline is not None else []
    if run is baseline or not ours or len(ours) != len(theirs):
        return None, None
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    return worst, worst <= LOSS_TOLERANCE


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_row(run: Run, baseline: Run | None) -> str:
    """The run's row of the markdown table."""
    r, target = run.readings, TARGET_MFU[run.job]
    if run.skipped:
        return f"| {run.job} | {run.variant.name} | {run.skipped} | | | | | |"
    worst, within = loss_check(run, baseline)
    if run is baseline:
        verdict = "baseline"
    else:
        verdict = "-" if worst is None else \
            f"max {worst:.2%} ({'within' if within else 'OVER'} bf16 tolerance)"
    mfu = r.get("mfu")
    met = "" if mfu is None else (" met" if mfu >= target else " missed")
    cells = [run.job, run.variant.name, _f(r.get("tokens_per_s"), ",.0f"),
             f"{_f(mfu, '.1%')} ({target:.0%}{met})", _f(r.get("peak_allocated_gib"), ".2f"),
             _f(r.get("first_step_s"), ".1f"), _f(r.get("compile_s"), ".1f"), verdict]
    return "| " + " | ".join(cells) + " |"


def render(done: list[Run], matmul: float | None, device: str) -> str:
    baselines = {r.job: r for r in done if r.variant.name == "baseline"}
    lines = [f"bf16 {MATMUL_N}^3 matmul: {_f(matmul, '.0f')} TFLOP/s on {device}", "",
             "| job | variant | tokens/s | MFU (target) | peak alloc GiB | first step s "
             f"| compile s | loss vs baseline, first {LOSS_STEPS} steps |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [table_row(run, baselines.get(run.job)) for run in done]
    return "\n".join(lines)


def record(done: list[Run], matmul: float | None, device: str) -> dict:
    """The JSON file: the calibration file's `matmul` and `throughput` shapes, each run with its
    variant."""
    from importlib import metadata

    import torch
    how = (f"python -m bench gpu-throughput: the worker on one rank, {STEPS} steps; tokens/s and "
           "MFU from its summary.json (the first step left out)")
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
                "transformers": metadata.version("transformers"),
                "deepspeed": metadata.version("deepspeed")}
    what = f"torch.matmul of two {MATMUL_N} x {MATMUL_N} bf16 matrices, best of 50"
    return {"gpu": device, "date": datetime.date.today().isoformat(), "versions": versions,
            "matmul": None if matmul is None else {"what": what, "tflops": matmul},
            "throughput": [{"name": r.name, "job": r.job, "variant": r.variant.name,
                            "spec": r.spec, "how": how, "skipped": r.skipped,
                            "readings": r.readings} for r in done]}


def _say(what: str) -> None:
    print(f"gpu-throughput: {what}", file=sys.stderr, flush=True)


# --- the command ----------------------------------------------------------------------------------

def dry_run(todo: list[Run], work: Path, budget_s: float) -> int:
    """Validate every variant's spec here; print what a GPU run measures and the time it takes."""
    from jobspec.errors import SpecError
    before = {e["name"]: e["readings"] for e in json.loads(CALIBRATION.read_text())["throughput"]}
    print(f"python -m bench gpu-throughput --dry-run: {len(todo)} runs (nothing runs here)\n")
    print(f"On a GPU: a bf16 {MATMUL_N}^3 matmul's TFLOP/s, then each run below as `jobspec "
          f"launch` runs it (one rank, {STEPS} steps, the worker's own process); it reads "
          "tokens/s, MFU, peak allocated memory, the first step's and the compile's seconds, "
          f"and the first {LOSS_STEPS} steps' losses (within {LOSS_TOLERANCE:.2%} of the "
          "baseline's: two bf16 units of roundoff).\n")
    failed, total = 0, 0.0
    for run in todo:
        try:
            validate(run, work)
        except SpecError as err:
            failed += 1
            print(f"- {run.name}: REFUSED\n{err.render()}")
            continue
        if run.skipped:
            print(f"- {run.name}: {run.skipped}")
            continue
        sets = ", ".join(f"{k}.{kk}={vv}" for k, v in run.variant.sets.items()
                         for kk, vv in v.items()) or "as is"
        seconds, reading = estimate_s(run, 0), before[run.job]
        total += seconds
        print(f"- {run.name}: valid ({sets}); before, {CALIBRATION.stem}: "
              f"{reading['tokens_per_s']:,} tokens/s, {reading['mfu']:.1%} MFU; target "
              f"{TARGET_MFU[run.job]:.0%} MFU; est. {seconds:.0f} s plus building the model"
              + (f"; {run.host_note}" if run.host_note else ""))
    print(f"\nestimated: {total:.0f} s plus the model builds; no run starts unless it ends within "
          f"--budget-s {budget_s:.0f} s")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu-throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="validate every variant and print what a GPU run does")
    parser.add_argument("--out", type=Path, default=WORK / "gpu-throughput.md",
                        help="the markdown table; the JSON beside it "
                             "(default bench/work/gpu-throughput/)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"start no run that would end past this many seconds "
                             f"(default {BUDGET_S})")
    parser.add_argument("--work", type=Path, default=WORK, help="job files, run dirs, logs")
    args = parser.parse_args(argv)
    started, todo, work = time.monotonic(), runs(), args.work.resolve()
    if args.dry_run:
        return dry_run(todo, work, args.budget_s)
    from bench import gpu_calibrate
    device = gpu_calibrate.gpu_info()["name"]
    if device is None:
        _say("no NVIDIA GPU here (NVML); --dry-run validates the runs")
        return 2
    rank_gpus = gpu_calibrate.hide_gpus()   # this process plans on fake tensors: no CUDA context
    for run in todo:
        validate(run, work)
    matmul = matmul_tflops(rank_gpus)
    _say(f"bf16 matmul: {matmul} TFLOP/s")
    measure([r for r in todo if not r.skipped], work, started + args.budget_s, rank_gpus)
    text = render(todo, matmul, device) + f"\n\n{time.monotonic() - started:.0f} s in all\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    document = json.dumps(record(todo, matmul, device), indent=1)
    args.out.with_suffix(".json").write_text(document + "\n", encoding="utf-8")
    ran = [r for r in todo if r.readings]
    return 0 if ran and all(r.readings.get("status") == "finished" for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
