"""An 8B Llama-architecture job under ZeRO-3 with CPU offload on one GPU, measured against its plan
(issue 26 item 6): `python -m bench.zero3_offload_gpu [--layers 32] [--steps 10] [--out FILE]`.

The job (weights from a config, random; Llama-3-8B's shape: hidden 4096, 32 layers, GQA 32/8 heads,
MLP 14336, vocabulary 128256, untied head: 8.03B parameters) trains on synthetic tokens for 10 steps
in bf16 with every layer checkpointed, ZeRO-3, the optimizer (DeepSpeed's CPU Adam) offloaded to
the CPU, and with --offload-params the bf16 parameters too. The plan of the default: 138.8 GiB of host
RAM per rank (fp32 master, Adam moments and fp32 gradients: 16 bytes x 8.03B, the 16-bit gradient
partition and the pinned buffers' rounding: memory/host_ram.offload_terms), 154.8 GiB with the
parameters offloaded as well, which no 128 GiB host holds. It runs through `jobspec launch`, so the model is built under
`deepspeed.zero.Init` (model/construct.py) exactly as any job's.

Printed (and written to --out as markdown): the plan's per-GPU peak allocated and NVML total and its
host RAM per rank and per node, next to the run's `mem/peak_allocated_mib_max`,
`mem/nvml_used_mib_max`, `mem/host_rss_mib_max` and the ranks' RSS right after construction (their
`jobspec-log: construction` line). On a machine without a CUDA GPU it says so and exits 2 before
anything starts; when the plan says this host's RAM cannot hold the job it stops there too (exit 2,
with the numbers), rather than let the kernel's OOM killer end it (`--layers` makes a smaller model).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
CONSTRUCTION = re.compile(r"construction rank(\d+) \S+ \S+ held=(\d+) total=(\d+) \S+ peak_rss_mib=([\d.]+)")


def job(layers: int, steps: int, work: Path, offload_params: bool = False) -> dict:
    return {
        "name": "llama-8b-zero3-offload",
        "model": {"architecture": "llama", "task": "causal-lm", "attention": "sdpa",
                  "config": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": layers,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1.0e-5,
                             "tie_word_embeddings": False}},
        "data": {"synthetic": {"num_samples": 64, "eval_samples": 0, "seq_len": 2048, "vocab_range": [100, 128000]}},
        "training": {"max_steps": steps, "micro_batch_size": 1, "eval_every": None,
                     "optimizer": {"name": "adamw", "lr": 1.0e-5}},
        "memory": {"precision": "bf16", "zero_stage": 3, "activation_checkpointing": True,
                   "offload": {"optimizer": "cpu", "params": "cpu" if offload_params else "none"}},
        "resources": {"gpus_per_node": 1},
        "checkpoint": {"every_n_steps": None, "save_final": False, "resume": "never"},
        "export": {"final": False},
        "logging": {"every_n_steps": 1, "perf_window_s": 0, "progress": "lines", "mlflow": {"enabled": False}},
        "output_dir": str(work / "out"),
    }


def planned(job_path: Path) -> dict:
    """The plan `jobspec launch` prints in its header, from the same functions."""
    from jobspec.hardware import gpu_free_bytes
    from jobspec.memory.planner import plan_memory
    from jobspec.model.planner_trace import job_profiler
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    spec = load_and_validate(str(job_path)).spec
    derived = derive_job(spec, profiler=job_profiler())
    plan = plan_memory(spec, derived)
    per_node = getattr(plan, "host_per_node", plan.host_total)
    offload = spec["memory"]["offload"]
    return {"parameters": derived.num_parameters, "peak_allocated_mib": plan.peak_allocated / MiB,
            "nvml_mib": plan.nvml_total / MiB, "host_per_rank_mib": plan.host_total / MiB,
            "host_per_node_mib": per_node / MiB, "gpu_free_mib": (gpu_free_bytes(1) or 0) / MiB,
            "host": {k: v / MiB for k, v in plan.host.items()},
            "offload": "optimizer and parameters" if offload["params"] == "cpu" else "optimizer"}


def host_ram_mib() -> float:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MiB


def measured(work: Path) -> dict:
    from jobspec import rundir
    (run_dir,) = sorted((work / "out").glob("run-*"))[-1:]
    maxima: dict = {}
    for key, value, _, _ in rundir.read_metric_points(run_dir):
        if key.startswith("mem/") and value is not None:
            maxima[key] = max(value, maxima.get(key, value))
    log = (run_dir / "launcher.log").read_text(errors="replace")
    ranks = [{"rank": int(m[1]), "held": int(m[2]), "total": int(m[3]), "rss_mib": float(m[4])}
             for m in CONSTRUCTION.finditer(log)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": str(run_dir), "status": summary.get("status"), "steps": summary.get("steps"),
            "peak_allocated_mib": maxima.get("mem/peak_allocated_mib_max"),
            "nvml_mib": maxima.get("mem/nvml_used_mib_max"), "host_rss_mib": maxima.get("mem/host_rss_mib_max"),
            "construction": ranks}


def render(device: str, plan: dict, run: dict | None) -> str:
    def gib(mib):
        return "-" if mib is None else f"{mib / 1024:.2f} GiB"
    got = run or {}
    construction = got.get("construction") or [{}]
    lines = [f"ZeRO-3 + CPU offload ({plan['offload']}), bf16, checkpointing, {plan['parameters'] / 1e9:.2f}B "
             f"parameters, one GPU: {device}",
             "| reading | plan | measured |", "| --- | --- | --- |",
             f"| GPU peak allocated | {gib(plan['peak_allocated_mib'])} | {gib(got.get('peak_allocated_mib'))} |",
             f"| GPU used (NVML) | {gib(plan['nvml_mib'])} | {gib(got.get('nvml_mib'))} |",
             f"| host RSS per rank (peak) | {gib(plan['host_per_rank_mib'])} | {gib(got.get('host_rss_mib'))} |",
             f"| host RSS after construction | {gib(plan['host'].get('construction'))} (construction) | "
             f"{gib(construction[0].get('rss_mib'))} |",
             f"| host per node (1 rank) | {gib(plan['host_per_node_mib'])} | - |",
             f"plan's host components: {', '.join(f'{k} {v / 1024:.2f} GiB' for k, v in plan['host'].items())}"]
    if run:
        lines.append(f"run: {run['status']}, {run['steps']} steps, {run['run_dir']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-3-8B)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--offload-params", action="store_true", help="offload the bf16 parameters to the CPU too")
    parser.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench.zero3_offload_gpu needs a CUDA GPU (it measures GPU memory against the plan); none here. "
              "Run it on a GPU machine: python -m bench.zero3_offload_gpu", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    work = args.work or Path(tempfile.mkdtemp(prefix="zero3-offload-"))
    work.mkdir(parents=True, exist_ok=True)
    job_path = work / "llama-8b-zero3-offload.yaml"
    job_path.write_text(yaml.safe_dump(job(args.layers, args.steps, work, args.offload_params), sort_keys=False))
    plan = planned(job_path)
    ram = host_ram_mib()
    if plan["host_per_node_mib"] > ram:
        print(render(device, plan, None))
        print(f"the plan needs {plan['host_per_node_mib'] / 1024:.1f} GiB of host RAM, this host has "
              f"{ram / 1024:.1f} GiB: not started (use a host with more RAM, or --layers to shrink the model)",
              file=sys.stderr)
        return 2
    proc = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(job_path)], cwd=REPO)
    run = measured(work)
    text = render(device, plan, run)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
