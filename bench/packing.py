"""Non-padding tokens/s with and without `data.packing` (issue 24, items 3 and 9).

    python -m bench packing                     # CPU: the Llama instruction job shrunk to a tiny model
    python -m bench packing --repeats 3 --steps 16
    python -m bench packing --gpu               # a CUDA GPU: jobs/llama-instruct-packing.yaml as written,
                                                # 40 steps per variant (about 2 minutes on an H100)

Both variants are real `jobspec launch`es of the same job (default jobs/llama-instruct-packing.yaml:
a Llama-architecture model, 300 prompt/completion records of mixed lengths, loss on the completions),
with `data.packing: true` and without it (VARIANTS: each batch padded to its longest record, or every
record to `max_length`), run interleaved (packed, longest, max_length, packed, ...) so that the drift
of a shared machine hits all of them. The numbers
are the ranks' own: summary.json's `tokens_per_s` (non-padding tokens, the attention mask's sum, per
second of training, the first timing window left out) and its peak memory (GPU: torch.cuda
.max_memory_allocated, the largest over ranks; CPU: the ranks' peak RSS), and the packing note the
ranks log (how full the rows are).

On CPU the model is shrunk with `--set`s (CPU_MODEL; fp32: CPU ranks have no fast bf16) and rows
are 512 tokens; --gpu runs the job as written and refuses cleanly without a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "llama-instruct-packing.yaml"
GPU_STEPS = 40
# a Llama with the job's shape ratios, small enough for CPU ranks (about 2.6M parameters)
CPU_MODEL = ("model.config={hidden_size: 128, intermediate_size: 344, num_hidden_layers: 4, num_attention_heads: 4, "
             "num_key_value_heads: 2, max_position_embeddings: 512, vocab_size: 2048, tie_word_embeddings: true}")
CPU_SETS = (CPU_MODEL, "memory.precision=fp32", "data.max_length=512", "training.micro_batch_size=4",
            "training.global_batch_size=4")
# data.packing / data.padding of each variant: packed rows; each batch padded to its longest record (the
# cheapest unpacked batches); every record padded to max_length (the schema's default: fixed shapes)
VARIANTS = {"packed": ("true", "max_length"), "longest": ("false", "longest"), "max_length": ("false", "max_length")}
GPU_VARIANTS = ("packed", "longest")   # 2 launches of the ~1B job fit in 3 minutes on an H100


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench packing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=JOB, help=f"the job (default {JOB.relative_to(REPO)})")
    parser.add_argument("--gpu", action="store_true",
                        help=f"run the job as written on this host's CUDA GPU, {GPU_STEPS} steps per variant")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per launch (default {GPU_STEPS} with --gpu, else 16)")
    parser.add_argument("--repeats", type=int, default=None, help="launches per variant (default 1 with --gpu, "
                                                                  "else 2)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the CPU rank (default 2)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all on CPU, "
                             f"{','.join(GPU_VARIANTS)} with --gpu)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides for both variants")
    parser.add_argument("--work", type=Path, default=None, help="run directories (default: a temp directory)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (GPU_STEPS if args.gpu else 16)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.gpu else 2)
    args.variants = args.variants.split(",") if args.variants else list(GPU_VARIANTS if args.gpu else VARIANTS)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or len(args.variants) < 2:
        parser.error(f"--variants: two or more of {', '.join(VARIANTS)}" + (f" (not {', '.join(unknown)})"
                                                                             if unknown else ""))
    if args.steps < 4:
        parser.error("--steps must be at least 4: the first timing window is left out of tokens/s")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not args.job.is_file():
        parser.error(f"no job file {args.job}")
    return args


def cuda_device() -> str | None:
    """The CUDA device's name, or None where there is none (NVML through jobspec.hardware: no torch import)."""
    from jobspec import hardware

    names = [name for name in hardware.gpu_names() if name != "cpu"]   # ["cpu"] without NVIDIA GPUs
    return names[0] if names else None


def overrides(args: argparse.Namespace, variant: str, out: Path) -> list[str]:
    """The `--set`s of one launch: the variant, the steps, its own output dir, no MLflow, no checkpoints."""
    base = [] if args.gpu else list(CPU_SETS)
    every = max(1, args.steps // 8)   # 8 timing windows; summary.json leaves the first out
    packing, padding = VARIANTS[variant]
    return [*base, f"data.packing={packing}", f"data.padding={padding}", f"training.max_steps={args.steps}",
            f"output_dir={out}", "logging.mlflow.enabled=false", f"logging.every_n_steps={every}",
            "logging.progress=lines", "checkpoint.save_final=false", "checkpoint.every_n_steps=null",
            "checkpoint.resume=never", "export.final=false", "resources.gpus_per_node=1", *args.sets]


def launch(args: argparse.Namespace, variant: str, out: Path) -> dict:
    """One launch; its summary.json numbers and the ranks' packing note."""
    sets = [x for s in overrides(args, variant, out) for x in ("--set", s)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not args.gpu:
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.time()
    # the launch's output streams to a file beside its run directory: a run cut off by a time limit
    # still shows how far it got (a lent GPU's session ends at its limit, output captured in memory is lost)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "launch-output.txt"
    with open(log_path, "w") as log_file:
        proc = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(args.job), *sets], cwd=REPO, env=env,
                              stdout=log_file, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench packing: the {variant} launch failed (exit {proc.returncode}):\n"
                         f"{log_path.read_text(errors='replace')[-4000:]}")
    run_dir = max(out.glob("run-*"), key=lambda p: p.stat().st_mtime)
    summary = json.loads((run_dir / "summary.json").read_text())
    log = (run_dir / "launcher.log").read_text(errors="replace")
    note = re.search(r"packing: \d+ samples in \d+ rows of at most \d+ tokens \([\d.]+% full\)", log)
    peak = summary.get("peak_memory") or {}
    return {"tokens_per_s": summary["tokens_per_s"], "samples_per_s": summary["samples_per_s"],
            "final_loss": summary["final_loss"], "steps": summary["steps"],
            "gpu_peak_mib": peak.get("mem/peak_allocated_mib_max"), "host_rss_mib": peak.get("mem/host_rss_mib_max"),
            "note": note.group(0) if note else None, "wall_s": round(time.time() - started, 1)}


def render(results: dict[str, list[dict]], args: argparse.Namespace, device: str) -> str:
    def median(variant: str, key: str):
        values = [r[key] for r in results[variant] if r[key] is not None]
        return statistics.median(values) if values else None

    lines = [f"{'variant':8} {'tokens/s':>10} {'samples/s':>10} {'peak GPU MiB':>13} {'peak RSS MiB':>13} "
             f"{'final loss':>10}"]
    for variant in args.variants:
        gpu, rss = median(variant, "gpu_peak_mib"), median(variant, "host_rss_mib")
        lines.append(f"{variant:8} {median(variant, 'tokens_per_s'):10.1f} {median(variant, 'samples_per_s'):10.2f} "
                     f"{'-' if gpu is None else f'{gpu:.0f}':>13} {'-' if rss is None else f'{rss:.0f}':>13} "
                     f"{median(variant, 'final_loss'):10.4f}")
    if "packed" in args.variants:
        for other in args.variants[1:] if args.variants[0] == "packed" else [v for v in args.variants if v != "packed"]:
            ratio = median("packed", "tokens_per_s") / median(other, "tokens_per_s")
            lines.append(f"packed / {other} non-padding tokens/s: {ratio:.2f}x")
    notes = {r["note"] for r in results.get("packed", []) if r["note"]}
    lines += [f"ranks' note: {n}" for n in sorted(notes)]
    mode = "job as written" if args.gpu else "shrunk for CPU: " + " ".join(CPU_SETS)
    lines.append(f"{args.job.relative_to(REPO) if args.job.is_relative_to(REPO) else args.job}, {mode}; "
                 f"{args.steps} steps per launch, {args.repeats} launch(es) per variant, medians; {device}; "
                 f"Python {platform.python_version()}; load average at the end {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.gpu:
        device = cuda_device()
        if device is None:
            print("bench packing: --gpu needs a CUDA GPU and this host has none; without --gpu it measures "
                  "the shrunk job on CPU ranks", file=sys.stderr)
            return 2
    else:
        device = f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), 1 rank, " \
                 f"OMP_NUM_THREADS={args.threads}"
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-packing-"))
    results: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants:   # interleaved: a shared machine's drift hits both variants
            print(f"bench packing: {variant} {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
            result = launch(args, variant, work / f"{variant}-{repeat + 1}")
            results[variant].append(result)
            # each launch's numbers at once, and the results so far on disk: a cut-off run keeps them
            print(f"bench packing: {variant} {repeat + 1}: {json.dumps(result)}", file=sys.stderr, flush=True)
            (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(render(results, args, device))
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
