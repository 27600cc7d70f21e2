"""How long `jobspec validate` takes: wall time of the command (a fresh process each run) and of
the in-process validation (and `compile_spec`, when the compiler is there).

    python bench/spec_speed.py [JOB] [--runs 20]

The command is the `jobspec` console script next to this Python (what a virtualenv user runs);
shims such as pyenv's add their own start-up time on top.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = ROOT / "jobs" / "xlmr-large.yaml"
FALLBACK_JOB = ROOT / "tests" / "assets" / "valid" / "tiny-bert.yaml"


def command() -> list[str]:
    script = Path(sys.executable).parent / "jobspec"
    if script.is_file():
        return [str(script)]
    found = shutil.which("jobspec")
    return [found] if found else [sys.executable, "-m", "jobspec"]


# An installed package has compiled bytecode; with PYTHONDONTWRITEBYTECODE set (some sandboxes
# do) every run would recompile jobspec's modules, which no user pays. A warm-up run writes it.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def time_command(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds per run; CPU time shows the cost on a busy machine."""
    wall, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=CHILD_ENV)
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return wall, cpu


def time_call(fn, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def report(label: str, times: list[float]) -> None:
    print(f"{label:<34} median {statistics.median(times) * 1000:7.1f} ms   min {min(times) * 1000:7.1f} ms"
          f"   (n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", type=Path, default=DEFAULT_JOB if DEFAULT_JOB.exists() else FALLBACK_JOB)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    argv = [*command(), "validate", str(args.job)]
    print(f"job: {args.job}\ncommand: {' '.join(argv)}")
    time_command(argv, 1)   # warm-up: bytecode, file cache
    wall, cpu = time_command(argv, args.runs)
    report("jobspec validate (wall, process)", wall)
    report("jobspec validate (CPU, process)", cpu)
    print(f"{'load average (1 min)':<34} {os.getloadavg()[0]:7.2f} on {os.cpu_count()} cores")

    start = time.perf_counter()
    from jobspec.spec.validation import load_and_validate
    resolved = load_and_validate(args.job)
    print(f"{'first in-process validate':<34} {(time.perf_counter() - start) * 1000:7.1f} ms (imports included)")
    report("load_and_validate (warm)", time_call(lambda: load_and_validate(args.job), args.runs))
    try:
        from jobspec.compile.compiler import compile_spec
        from jobspec.spec.derived import derive
    except ImportError:
        print("jobspec.compile.compiler not available: compile_spec not timed")
        return
    report("compile_spec (warm)", time_call(lambda: compile_spec(resolved.spec, derive(resolved.spec)), args.runs))


if __name__ == "__main__":
    main()
