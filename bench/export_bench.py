"""Model export: time, size and peak host memory, for the quickstart job and an XLM-R-large ZeRO-3 checkpoint.

    python -m bench.export_bench                   # both parts (the XLM-R part needs ~12 GB RAM, ~10 GB disk)
    python -m bench.export_bench --skip-large --repeats 5

1. quickstart: `jobspec launch jobs/quickstart.yaml` (2 CPU ranks, fp32, MLflow off) exports
   `model/final` on rank 0 (its time and size from summary.json); then `jobspec export RUN_DIR`
   converts the final checkpoint offline, --repeats times (wall time of the whole command, and
   the conversion's own time from the export record).
2. XLM-R large's shape (hidden 1024, 24 layers, 16 heads, ffn 4096, vocab 250002; random weights):
   a ZeRO-3 fp32 checkpoint written by 2 CPU ranks (1 optimizer step on 4 synthetic samples of 16
   tokens, no export on the ranks), converted by `jobspec export` to fp32 and to bf16.

Peak host memory of each `jobspec export` process two ways: the kernel's ru_maxrss (os.wait4) and
the largest RSS seen by psutil sampling every 50 ms (an independent reading; it can miss a short
peak, never invent one). Sizes are checked against parameters x bytes per parameter, the parameter
count from jobspec's memory planner (jobspec/spec/model_dims.py), not from the export code.
Work files go to --work (default: a temp directory, removed at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
XLMR_LARGE = REPO / "jobs" / "xlmr-large.yaml"
XLMR_CHECKPOINT_SETS = ("memory.zero_stage=3", "memory.precision=fp32", "memory.activation_checkpointing=false",
                        "resources.gpus_per_node=2", "training.max_steps=1", "training.micro_batch_size=1",
                        "data.synthetic.num_samples=4", "data.synthetic.seq_len=16", "data.num_workers=0",
                        "data.pin_memory=false", "model.config.max_position_embeddings=514",
                        "training.scheduler.warmup_ratio=0", "export.final=false",
                        "logging.mlflow.enabled=false", "logging.progress=lines")


def jobspec_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "jobspec", *args]


def sets(items) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def measured(argv: list[str], log: Path) -> dict:
    """Run `argv` (stdout to `log`, stderr to `log`.err); wall seconds, ru_maxrss (MiB) from wait4,
    the psutil-sampled peak RSS (MiB)."""
    with open(log, "w") as out, open(f"{log}.err", "w") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        peak = {"rss": 0}
        done = threading.Event()

        def sample():
            try:
                watched = psutil.Process(proc.pid)
                while not done.is_set():
                    peak["rss"] = max(peak["rss"], watched.memory_info().rss)
                    time.sleep(0.05)
            except psutil.Error:
                pass
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {code}); see {log}(.err):\n"
                         + Path(f"{log}.err").read_text()[-3000:])
    return {"wall_s": wall, "maxrss_mib": usage.ru_maxrss / 1024, "sampled_peak_mib": peak["rss"] / 2**20}


def launch(job: Path, work: Path, name: str, extra_sets=()) -> Path:
    out = work / name
    argv = jobspec_argv("launch", str(job), *sets((f"output_dir={out}", "logging.mlflow.enabled=false",
                                                   *extra_sets)))
    log = work / f"{name}-launch.log"
    measured(argv, log)
    (run_dir,) = sorted(out.glob("run-*"))
    return run_dir


def export(source: Path, out: Path, log: Path, *options: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    numbers = measured(jobspec_argv("export", str(source), "--out", str(out), "--format", "json", *options), log)
    record = json.loads(log.read_text())
    numbers.update(convert_s=record["seconds"], bytes=record["bytes"], dtype=record["dtype"])
    return numbers


def parameters(job: Path, overrides=()) -> int:
    from jobspec.model.planner_trace import ModelTracer
    from jobspec.spec.validation import load_and_validate
    spec = load_and_validate(job, list(overrides)).spec
    return ModelTracer(spec).inventory().total


def size_check(numbers: dict, params: int) -> str:
    expected = params * {"fp32": 4, "bf16": 2, "fp16": 2}[numbers["dtype"]]
    return f"{numbers['bytes'] / 1e6:.2f} MB (params x bytes: {expected / 1e6:.2f} MB, {numbers['bytes'] / expected:.4f}x)"


def quickstart(work: Path, repeats: int) -> None:
    from jobspec import rundir

    run_dir = launch(QUICKSTART, work, "quickstart")
    summary = rundir.read_summary(run_dir)
    assert summary is not None, f"{run_dir} has no summary.json"
    final = summary.exports["final"]
    params = parameters(QUICKSTART)
    print("## quickstart (jobs/quickstart.yaml: XLM-R 2x64, 2 CPU ranks, fp32, ZeRO-0)")
    print(f"parameters (planner): {params:,}")
    print(f"rank-side export at the end of training: {final['seconds']:.2f} s, {final['bytes'] / 1e6:.3f} MB "
          f"({final['dtype']})")
    runs = [export(run_dir, work / "quickstart-export", work / f"quickstart-export-{i}.log") for i in range(repeats)]
    print(f"`jobspec export RUN_DIR`, {repeats} runs (median [min, max]):")
    for key, unit in (("wall_s", "s"), ("convert_s", "s"), ("maxrss_mib", "MiB"), ("sampled_peak_mib", "MiB")):
        values = [r[key] for r in runs]
        print(f"  {key}: {statistics.median(values):.2f} {unit} [{min(values):.2f}, {max(values):.2f}]")
    print(f"  size: {size_check(runs[0], params)}")


def xlmr_large(work: Path) -> None:
    started = time.perf_counter()
    run_dir = launch(XLMR_LARGE, work, "xlmr-large", XLMR_CHECKPOINT_SETS)
    written = time.perf_counter() - started
    import yaml
    ckpt = Path(yaml.safe_load((run_dir / "resolved.yaml").read_text())["checkpoint"]["dir"])
    tag = (ckpt / "latest").read_text().strip()
    on_disk = sum(f.stat().st_size for f in (ckpt / tag).rglob("*") if f.is_file())
    params = parameters(XLMR_LARGE, XLMR_CHECKPOINT_SETS)
    print("## XLM-R large shape, ZeRO-3 fp32 checkpoint of 2 CPU ranks")
    print(f"parameters (planner): {params:,}; checkpoint {ckpt / tag}: {on_disk / 1e9:.2f} GB on disk, written "
          f"(launch incl. model init and 1 step) in {written:.0f} s")
    for dtype in ("fp32", "bf16"):
        numbers = export(ckpt / tag, work / f"xlmr-large-{dtype}", work / f"xlmr-export-{dtype}.log", "--dtype", dtype)
        print(f"`jobspec export` to {dtype}: wall {numbers['wall_s']:.1f} s (conversion {numbers['convert_s']:.1f} s), "
              f"peak RSS {numbers['maxrss_mib']:.0f} MiB (ru_maxrss) / {numbers['sampled_peak_mib']:.0f} MiB "
              f"(psutil sampled), size {size_check(numbers, params)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="offline exports of the quickstart run")
    parser.add_argument("--skip-large", action="store_true", help="only the quickstart part")
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: a temp dir, removed)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="jobspec-export-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM; python {platform.python_version()}")
    try:
        quickstart(work, args.repeats)
        if not args.skip_large:
            xlmr_large(work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
