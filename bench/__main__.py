"""jobspec vs the HF Trainer: the same jobs, interleaved, steady-state throughput and peak memory.

    python -m bench                                   # CPU-size jobs (bench/jobs/*.yaml), 2 repeats
    python -m bench --repeats 3 --out bench/results/cpu.md
    python -m bench --full --out bench/results/gpu.md # bert-large guide + XLM-R rows (CUDA GPU)
    python -m bench gpu [--dry-run]                   # the GPU acceptance suite (bench/gpu.py)
    python -m bench gpu-calibrate [--dry-run]         # the memory planner against one GPU (bench/gpu_calibrate.py)
    python -m bench gpu-throughput [--dry-run]        # tokens/s, MFU: model.compile on, off, liger
                                                      # (bench/gpu_throughput.py)
    python -m bench packing [--gpu]                   # tokens/s with and without data.packing (bench/packing.py)
    python -m bench lora                              # full vs LoRA vs QLoRA: step time, memory (bench/lora.py)
    python -m bench qlora-gpu                         # the 8B QLoRA job on one GPU vs its plan (bench/qlora_gpu.py)
    python -m bench gpu-startup [--dry-run]           # time to the first step on one GPU (bench/gpu_startup.py)

For each job and repeat, in the order A, B, A, B ... (so drift of a shared machine hits both sides):
A = `jobspec launch JOB` (numbers from its MLflow run: median of `perf/samples_per_s` windows after
the first, max of the `mem/*` series); B = `bench.trainer_baseline` on the same compiled job
(transformers.Trainer, same model, data, batch, precision, checkpointing, optimizer, and the
compiled DeepSpeed config when ZeRO >= 1). Writes a markdown table: medians over repeats, and the
ratios jobspec / Trainer for throughput and memory (GPU peak allocated, else host RSS).
Work files (run dirs, mlflow.db) go to --work (default bench/work/, git-ignored or delete it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_JOBS = "bench/jobs/*.yaml"
# GPU-size rows: the HF single-GPU guide's 7 bert-large rows and the seed's XLM-R rows
FULL_JOBS = ("jobs/bert-large-[1-9]-*.yaml", "jobs/xlmr-base-[1-9]*.yaml", "jobs/xlmr-large-[1-9]*.yaml")
EXPERIMENT = "bench"
METRICS = ("perf/samples_per_s", "perf/tokens_per_s", "perf/tflops_per_device", "perf/mfu",
           "mem/peak_allocated_mib_max", "mem/nvml_used_mib_max", "mem/host_rss_mib_max")


def job_files(patterns) -> list[Path]:
    """Job specs matching the globs (relative to the repo), without `_`-prefixed bases."""
    found = []
    for pattern in patterns:
        matches = sorted(REPO.glob(pattern)) if not Path(pattern).is_absolute() else [Path(pattern)]
        found += [p for p in matches if p.is_file() and not p.name.startswith("_")]
    return list(dict.fromkeys(found))


def overrides(work: Path, job: Path, tag: str) -> list[str]:
    """`--set`s that keep every run apart: own output dir (no resume of the previous repeat), own run name."""
    return [f"output_dir={work / job.stem / tag}", f"logging.mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}",
            f"logging.mlflow.experiment={EXPERIMENT}", f"logging.mlflow.run_name={job.stem}-{tag}",
            "checkpoint.resume=never", "logging.progress=lines"]


def _sets(values: list[str]) -> list[str]:
    return [x for v in values for x in ("--set", v)]


def run_jobspec(job: Path, work: Path, tag: str, log) -> dict:
    cmd = [sys.executable, "-m", "jobspec", "launch", str(job), *_sets(overrides(work, job, tag))]
    subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    run_dir = max((work / job.stem / tag).glob("run-*"), key=lambda p: p.stat().st_mtime)
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    from jobspec.report import table as report
    from jobspec.tracking import run as tracking
    client = tracking.client_for(info["tracking_uri"])
    series = report.metric_series(client, info["run_id"], METRICS)
    reduce = {name: (report.series_max if name.startswith("mem/") else report.steady_state) for name in METRICS}
    result = {name: reduce[name](points) for name, points in series.items()}
    import yaml
    result["predicted_mib"] = report.predicted_peak_mib(yaml.safe_load((run_dir / "resolved.yaml").read_text()))
    return result


def run_baseline(job: Path, work: Path, tag: str, log) -> dict:
    run_dir = work / job.stem / tag
    subprocess.run([sys.executable, "-m", "jobspec", "compile", str(job), "--out", str(run_dir),
                    *_sets(overrides(work, job, tag))], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    out = run_dir / "result.json"
    cmd = baseline_command(run_dir, out)
    try:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    finally:  # the Trainer's DeepSpeed ranks leave their /dev/shm all-reduce buffers (jobspec/shm.py)
        if "--master_port" in cmd:
            from jobspec.shm import remove_shared_memory_buffers
            remove_shared_memory_buffers(cmd[cmd.index("--master_port") + 1])
    return json.loads(out.read_text())


def baseline_command(run_dir: Path, out: Path) -> list[str]:
    """The command running bench.trainer_baseline on a compiled run dir (through the runner for ZeRO or > 1 rank)."""
    import yaml

    from bench.trainer_baseline import uses_deepspeed
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    module = ["--module", "bench.trainer_baseline", "--run-dir", str(run_dir), "--out", str(out)]
    world = spec["resources"]["gpus_per_node"]
    if uses_deepspeed(spec) or world > 1:  # the runner sets up the ranks' distributed environment
        from jobspec.launch.runner import free_port, runner_prefix
        return runner_prefix() + ["--num_gpus", str(world), "--master_port", str(free_port()), *module]
    return [sys.executable, "-m", *module[1:]]


def median_of(results: list[dict], key: str):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def memory_key(results: list[dict]) -> str:
    gpu = any(r.get("mem/peak_allocated_mib_max") is not None for r in results)
    return "mem/peak_allocated_mib_max" if gpu else "mem/host_rss_mib_max"


def render(rows: dict, repeats: int) -> str:
    """Markdown: per job, jobspec and Trainer medians over repeats, then the ratios."""
    head = ("| job | side | samples/s (min-max) | tokens/s | TFLOP/s | MFU | peak alloc MiB | NVML MiB | "
            "host RSS MiB | predicted MiB | jobspec/Trainer samples/s | jobspec/Trainer memory |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 10]
    for job, sides in rows.items():
        mem = memory_key(sides["jobspec"] + sides["trainer"])
        for side in ("jobspec", "trainer"):
            results = sides[side]
            speeds = [r["perf/samples_per_s"] for r in results if r.get("perf/samples_per_s")]
            spread = f" ({min(speeds):.1f}-{max(speeds):.1f})" if len(speeds) > 1 else ""
            ratio_speed = ratio_mem = ""
            if side == "jobspec":
                a, b = median_of(results, "perf/samples_per_s"), median_of(sides["trainer"], "perf/samples_per_s")
                ratio_speed = _fmt(a / b if a and b else None, ".2f")
                pairs = [x["perf/samples_per_s"] / y["perf/samples_per_s"] for x, y in zip(results, sides["trainer"])
                         if x.get("perf/samples_per_s") and y.get("perf/samples_per_s")]
                if len(pairs) > 1:  # per repeat: the spread the ratio of medians hides
                    ratio_speed += " (" + ", ".join(f"{r:.2f}" for r in pairs) + ")"
                a, b = median_of(results, mem), median_of(sides["trainer"], mem)
                ratio_mem = _fmt(a / b if a and b else None, ".2f") + (" (RSS)" if "rss" in mem and a and b else "")
            lines.append("| " + " | ".join([
                job, "jobspec" if side == "jobspec" else "HF Trainer",
                _fmt(median_of(results, "perf/samples_per_s"), ".1f") + spread,
                _fmt(median_of(results, "perf/tokens_per_s"), ".0f"),
                _fmt(median_of(results, "perf/tflops_per_device"), ".2f"),
                _fmt(median_of(results, "perf/mfu"), ".1%"),
                _fmt(median_of(results, "mem/peak_allocated_mib_max"), ".0f"),
                _fmt(median_of(results, "mem/nvml_used_mib_max"), ".0f"),
                _fmt(median_of(results, "mem/host_rss_mib_max"), ".0f"),
                _fmt(median_of(results, "predicted_mib"), ".0f") if side == "jobspec" else "",
                ratio_speed, ratio_mem]) + " |")
    return "\n".join(lines)


def environment() -> str:
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in
                         ("torch", "deepspeed", "transformers", "accelerate", "mlflow"))
    try:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU only ({os.cpu_count()} cores)"
    except Exception:
        device = "unknown"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.date.today().isoformat()}, {device}, {platform.python_implementation()} "
            f"{platform.python_version()}, {versions}; load average at the end {load:.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        from bench import gpu
        return gpu.main(argv[1:])
    if argv[:1] == ["gpu-calibrate"]:
        from bench import gpu_calibrate
        return gpu_calibrate.main(argv[1:])
    if argv[:1] == ["gpu-throughput"]:
        from bench import gpu_throughput
        return gpu_throughput.main(argv[1:])
    if argv[:1] == ["packing"]:
        from bench import packing
        return packing.main(argv[1:])
    if argv[:1] == ["lora"]:
        from bench import lora
        return lora.main(argv[1:])
    if argv[:1] == ["qlora-gpu"]:
        from bench import qlora_gpu
        return qlora_gpu.main(argv[1:])
    if argv[:1] == ["gpu-startup"]:
        from bench import gpu_startup
        return gpu_startup.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=None, metavar="GLOB",
                        help=f"job specs (globs relative to the repo; default {CPU_JOBS})")
    parser.add_argument("--full", action="store_true", help=f"the GPU-size list: {' '.join(FULL_JOBS)}")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side and job (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / "work", help="run dirs and mlflow.db")
    parser.add_argument("--concurrent", action="store_true",
                        help="run the two sides of a repeat at the same time (one process each): on a shared "
                             "machine both meet the same load; use with --threads 1 on a 2-core machine")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both sides (default: unset; on a small shared CPU machine 1 "
                             "keeps an oversubscribed thread pool from swinging step times)")
    args = parser.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by both sides' processes
    patterns = args.jobs or (FULL_JOBS if args.full else (CPU_JOBS,))
    jobs = job_files(patterns)
    if not jobs or args.repeats < 1:
        parser.error(f"no job specs match {' '.join(patterns)}" if not jobs else "--repeats must be >= 1")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    with open(work / "bench.log", "a", encoding="utf-8") as log:
        for job in jobs:
            rows[job.stem] = {"jobspec": [], "trainer": []}
            for i in range(args.repeats):  # interleaved: A, B, A, B (or A and B at once: --concurrent)
                sides = (("jobspec", run_jobspec), ("trainer", run_baseline))
                print(f"bench: {job.stem} repeat {i + 1}/{args.repeats}"
                      f"{' (both sides at once)' if args.concurrent else ''}, load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)
                log.flush()
                if args.concurrent:
                    from concurrent.futures import ThreadPoolExecutor
                    with ThreadPoolExecutor(2) as pool:
                        futures = {side: pool.submit(runner, job, work, f"{side}-r{i + 1}", log) for side, runner in sides}
                    for side, future in futures.items():
                        rows[job.stem][side].append(future.result())
                else:
                    for side, runner in sides:
                        rows[job.stem][side].append(runner(job, work, f"{side}-r{i + 1}", log))
    table = render(rows, args.repeats)
    threads = f", OMP_NUM_THREADS={args.threads}" if args.threads else ""
    mode = ", both sides at once" if args.concurrent else ", interleaved"
    text = f"{table}\n\n{args.repeats} repeat(s) per side{mode}{threads}, medians; {environment()}\n"
    print(text)
    (work / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
