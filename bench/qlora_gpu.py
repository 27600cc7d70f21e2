"""The 8B QLoRA job on one GPU: measured peak GPU memory beside the plan's (issue 25, item 9).

    python -m bench qlora-gpu [--job jobs/llama-8b-qlora-24gb.yaml] [--steps 20] [--work DIR]

Runs the job as a user would, `jobspec launch JOB` (Llama-3-8B's shape, random weights from the config,
the base quantised to 4-bit NF4 by bitsandbytes as it moves to the GPU, LoRA r 16 on every linear
layer), for `--steps` optimizer steps with MLflow, checkpoints and exports off, then prints the rank's
peak `torch.cuda.max_memory_allocated` and `max_memory_reserved` (summary.json's peak_memory, the
worker's readings over the run) next to `jobspec plan JOB`'s peak allocated and reserved, and the GPU's
name. Without a CUDA GPU it refuses in one line (exit 2): the numbers mean nothing on CPU ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30


def plan_bytes(job: Path) -> dict:
    """`jobspec plan JOB --format json`'s per-GPU peak allocated and reserved (bytes)."""
    done = subprocess.run([sys.executable, "-m", "jobspec", "plan", str(job), "--format", "json"],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"jobspec plan failed (exit {done.returncode}): {done.stdout[-500:]}{done.stderr[-500:]}")
    plan = json.loads(done.stdout)["plan"]
    return {"allocated": plan["peak_allocated"], "reserved": plan["peak_reserved"], "budget": plan["budget"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench qlora-gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(REPO / "jobs" / "llama-8b-qlora-24gb.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", default=None, help="where the run directory goes (default: a temporary one)")
    parser.add_argument("--timeout", type=int, default=540, help="seconds the launch may take")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench qlora-gpu: no CUDA GPU here: this benchmark measures GPU memory (run it on a GPU machine)",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    job = Path(args.job).resolve()
    planned = plan_bytes(job)
    print(f"plan: peak allocated {planned['allocated'] / GiB:.2f} GiB, reserved {planned['reserved'] / GiB:.2f} GiB",
          flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-qlora-"))
    sets = [f"training.max_steps={args.steps}", f"output_dir={work}", "logging.mlflow.enabled=false",
            "logging.progress=lines", "checkpoint.save_final=false", "checkpoint.every_n_steps=null",
            "export.final=false", "checkpoint.resume=never", "training.eval_every=null"]
    argv_launch = [sys.executable, "-m", "jobspec", "launch", str(job), *[x for s in sets for x in ("--set", s)]]
    # the launch's output streams to a file in the work directory: a run cut off by a time limit still
    # shows how far it got (output captured in memory is lost with it)
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "launch-output.txt"
    with open(log_path, "w") as log_file:
        done = subprocess.run(argv_launch, stdout=log_file, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                              timeout=args.timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    output = log_path.read_text(errors="replace")
    print(output[-3000:])
    runs = sorted(work.glob("run-*"))
    summary_path = runs[-1] / "summary.json" if runs else None
    if done.returncode or summary_path is None or not summary_path.is_file():
        print(f"launch failed (exit {done.returncode}); its output: {log_path}", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    peak = summary.get("peak_memory") or {}
    measured_alloc = peak.get("peak_allocated_mib_max", peak.get("peak_allocated_mib"))
    measured_res = peak.get("peak_reserved_mib_max", peak.get("peak_reserved_mib"))
    print(f"device: {device} (torch {torch.__version__}); job {job.name}, {summary.get('steps')} steps, "
          f"loss {summary.get('final_loss')}, {summary.get('samples_per_s')} samples/s")
    print(f"parameters: {summary.get('parameters')}")
    print("| reading | measured | planned |")
    print("| --- | ---: | ---: |")
    for name, value, plan in (("peak allocated", measured_alloc, planned["allocated"]),
                              ("peak reserved", measured_res, planned["reserved"])):
        shown = f"{value / 1024:.2f} GiB" if isinstance(value, (int, float)) else "not recorded"
        print(f"| {name} | {shown} | {plan / GiB:.2f} GiB |")
    print(f"(plan budget {planned['budget'] / 1e9:.0f} GB; summary.json peak_memory: {json.dumps(peak)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
