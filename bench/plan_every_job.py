"""How long planning takes for every shipped job: `jobspec plan JOB` cold (an empty
JOBSPEC_CACHE_DIR) and warm (the same command again), and the planning phase of `jobspec launch
JOB --dry-run` (job/prepare.prepare_job: the checks, the model's profile, the memory plan and fit),
cold and warm.

    python bench/plan_every_job.py [--jobs jobs/a.yaml ...] [--launch-jobs jobs/a.yaml ...]

Each run is a fresh process of the jobspec of the tree this script sits in (PYTHONPATH and the
working directory are that tree's, so a copy of an older commit measures that commit). Wall and CPU
(user + system) seconds, median of --runs; on a busy machine the CPU seconds are the steadier
figure. A row also says whether the warm plan printed what the cold one did, and which of torch,
transformers and deepspeed the warm plan imported (the warm path should import none). Goals
(docs/memory-planner.md, "Planning speed"): cold <= 5 s, warm <= 0.5 s, a warm launch's planning
<= 1 s.
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
HEAVY = ("torch", "transformers", "deepspeed")
# a plan in the child's own process, the heavy modules it imported on stderr
PLAN = f"""import sys
from jobspec.cli import main
try:
    code = main(['plan', sys.argv[1]])
finally:
    print('HEAVY', *(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""
# a dry-run launch whose prepare_job is timed (wall, CPU) in the launcher's process
LAUNCH = """import sys, time
import jobspec.job.prepare as prepare
real, spent = prepare.prepare_job, []
def timed(*args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        return real(*args, **kwargs)
    finally:
        spent.append((time.perf_counter() - wall, time.process_time() - cpu))
prepare.prepare_job = timed
from jobspec.cli import main
try:
    code = main(['launch', sys.argv[1], '--dry-run'])
finally:
    print('PLANNING', sum(w for w, _ in spent), sum(c for _, c in spent), file=sys.stderr)
sys.exit(code)
"""


def child_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(ROOT), "JOBSPEC_CACHE_DIR": str(cache),
            "JOBSPEC_LOG_DIR": str(cache / "logs")}


def run(code: str, job: str, cache: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall, CPU, the finished process) of one child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True,
                          cwd=ROOT, env=child_env(cache))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, done


def marked(done: subprocess.CompletedProcess, mark: str) -> list[str]:
    line = next((x for x in done.stderr.splitlines() if x.startswith(mark)), None)
    if line is None:
        raise SystemExit(f"no {mark} line:\n{done.stderr[-2000:]}")
    return line.split()[1:]


def plan_row(job: str, runs: int) -> str:
    """| job | cold wall | cold CPU | warm wall | warm CPU | same output | warm imported |"""
    cold, warm, same, heavy = [], [], True, set()
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="jobspec-plan-every-job-") as tmp:
            wall, cpu, first = run(PLAN, job, Path(tmp))
            cold.append((wall, cpu))
            wall, cpu, second = run(PLAN, job, Path(tmp))
            warm.append((wall, cpu))
            same = same and (first.stdout, first.returncode) == (second.stdout, second.returncode)
            heavy.update(marked(second, "HEAVY"))
    cells = [f"{statistics.median(x[i] for x in series):.2f}" for series in (cold, warm)
             for i in (0, 1)]
    return (f"| {Path(job).stem} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} | "
            f"{', '.join(sorted(heavy)) or 'none'} |")


def launch_row(job: str) -> str:
    """| job | planning cold wall | CPU | planning warm wall | CPU | warm dry run, whole |"""
    cells, wall = [], 0.0
    with tempfile.TemporaryDirectory(prefix="jobspec-plan-every-job-") as tmp:
        for _ in ("cold", "warm"):
            wall, _, done = run(LAUNCH, job, Path(tmp))
            cells += [f"{float(x):.2f}" for x in marked(done, "PLANNING")]
    return f"| {Path(job).stem} | " + " | ".join(cells) + f" | {wall:.2f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    jobs = sorted(str(p) for p in (ROOT / "jobs").glob("*.yaml"))
    parser.add_argument("--jobs", nargs="*", default=jobs)
    parser.add_argument("--launch-jobs", nargs="*",
                        default=[str(ROOT / "jobs" / f"{name}.yaml")
                                 for name in ("quickstart", "xlmr-large", "gemma2-lora-chat")])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    print("| job | cold wall s | cold CPU s | warm wall s | warm CPU s | warm = cold | "
          "warm imported |")
    print("|---|---:|---:|---:|---:|---|---|")
    for job in args.jobs:
        print(plan_row(job, args.runs), flush=True)
    print("\n| `launch --dry-run` | planning cold wall s | CPU s | planning warm wall s | CPU s | "
          "warm dry run, whole, wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for job in args.launch_jobs:
        print(launch_row(job), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
