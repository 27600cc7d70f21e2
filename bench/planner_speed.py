"""How long the traced planner takes: `jobspec plan` cold and warm, `plan --fit`, and `jobspec validate`.

    python bench/planner_speed.py [--runs 3] [--job jobs/xlmr-large.yaml] [--fit-job jobs/xlmr-large.yaml]

Each measurement is a fresh `jobspec` process (what a user runs), wall and CPU seconds, median of
--runs. "cold": an empty trace cache (a new JOBSPEC_CACHE_DIR each run), so the process imports torch
and transformers, builds the model on the meta device and traces it. "warm": the cache holds the
traces, so the process imports neither. `validate` must import neither torch nor transformers: the
script checks that in-process too and prints the modules it found.
Goals (issue 20): plan cold <= 3 s, warm <= 0.5 s; plan --fit <= 5 s; validate < 0.3 s.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.spec_speed import CHILD_ENV, command  # noqa: E402


def timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of the jobspec command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command() + argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):   # 1: --fit found nothing that fits, still a finished search
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def series(argv: list[str], runs: int, *, cold: bool) -> tuple[float, float]:
    walls, cpus = [], []
    with tempfile.TemporaryDirectory(prefix="jobspec-planner-speed-") as tmp:
        env = {**CHILD_ENV, "JOBSPEC_CACHE_DIR": str(Path(tmp) / "warm")}
        if not cold:
            timed(argv, env)   # fills the cache
        for run in range(runs):
            if cold:
                env = {**env, "JOBSPEC_CACHE_DIR": str(Path(tmp) / f"cold-{run}")}
            wall, cpu = timed(argv, env)
            walls.append(wall)
            cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def validate_imports(job: str) -> list[str]:
    """Heavy modules `jobspec validate` imports, checked in a fresh interpreter."""
    code = ("import sys\nfrom jobspec.cli import main\nmain(['validate', sys.argv[1]])\n"
            "print('HEAVY:', *(m for m in ('torch', 'transformers', 'deepspeed', 'mlflow') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, env=CHILD_ENV)
    line = next((x for x in done.stdout.splitlines() if x.startswith("HEAVY:")), "HEAVY: ?")
    return line.split()[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--job", default=str(ROOT / "jobs" / "xlmr-large.yaml"))
    parser.add_argument("--fit-job", default=str(ROOT / "jobs" / "xlmr-large.yaml"))
    parser.add_argument("--fit-budget", default="12GiB")
    args = parser.parse_args(argv)
    import platform
    from importlib import metadata

    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {metadata.version('torch')}, transformers {metadata.version('transformers')}; "
          f"median of {args.runs} fresh processes\n")
    rows = [
        ("validate", ["validate", args.job], False),
        ("plan, cold cache", ["plan", args.job], True),
        ("plan, warm cache", ["plan", args.job], False),
        (f"plan --fit --gpu-mem {args.fit_budget}, cold", ["plan", args.fit_job, "--fit", "--gpu-mem", args.fit_budget],
         True),
        (f"plan --fit --gpu-mem {args.fit_budget}, warm", ["plan", args.fit_job, "--fit", "--gpu-mem", args.fit_budget],
         False),
    ]
    print("| command | wall s | CPU s |")
    print("|---|---:|---:|")
    for label, command_args, cold in rows:
        wall, cpu = series(command_args, args.runs, cold=cold)
        print(f"| `jobspec {' '.join(command_args[:1])} ...` {label} | {wall:.2f} | {cpu:.2f} |", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.auto.modeling_auto"], env=CHILD_ENV,
                   capture_output=True)
    print(f"\nimporting torch + transformers' auto models alone: {time.perf_counter() - start:.2f} s wall")
    heavy = validate_imports(args.job)
    print(f"`jobspec validate` imported: {', '.join(heavy) if heavy else 'none of torch, transformers, deepspeed, mlflow'}")
    return 1 if heavy else 0


if __name__ == "__main__":
    raise SystemExit(main())
