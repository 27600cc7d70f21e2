"""Peak host RSS per rank while the ranks construct the model, with and without `deepspeed.zero.Init`
(issue 26): `python -m bench.zero_init [--layers 18 --hidden 2048 ...] [--ranks 2]`.

A Llama-architecture model built from a config (default: hidden 2048, 18 layers, MLP 5632, vocab
32000: 1.03B parameters) by jobspec's own `build_model`, exactly as the worker calls it, on N CPU
ranks (gloo), once per construction:

  fp32 full   every rank builds the whole model in fp32 (what every job did before issue 26, and
              what an fp32 ZeRO 0-2 job still does)
  bf16 full   ZeRO 0/1/2 in bf16: a full copy per rank, built straight in bf16
  bf16 zero3  ZeRO-3 in bf16: built under zero.Init, each rank keeps its partition

Each construction runs in fresh processes (a process's peak RSS never goes down). A rank prints its
RSS after the imports and the process group (the floor), its peak RSS after the build
(`ru_maxrss`), the parameter elements it holds (from the partitions) and the build time; this
prints the per-rank peak, the peak over the floor, and Ψ × bytes for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = {"fp32-full": ("fp32", 0), "bf16-full": ("bf16", 0), "bf16-zero3": ("bf16", 3)}


def llama_spec(args) -> dict:
    from jobspec.spec.schema import fill_defaults

    return fill_defaults({
        "name": "zero-init-bench",
        "model": {"architecture": "llama", "task": "causal-lm",
                  "config": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                             "num_attention_heads": args.hidden // 128, "num_key_value_heads": args.hidden // 128,
                             "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                             "max_position_embeddings": 2048, "tie_word_embeddings": False}},
        "data": {"synthetic": {"num_samples": 8, "seq_len": 16, "vocab_range": [5, 1000]}},
        "training": {"max_steps": 1, "micro_batch_size": 1},
        "resources": {"gpus_per_node": args.ranks},
    })


def ds_config(precision: str, stage: int, ranks: int) -> dict:
    return {"train_batch_size": ranks, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": stage}}


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args) -> None:
    """One rank: the process group, then `build_model` under the mode's compiled-like config."""
    import torch
    torch.set_num_threads(1)
    import deepspeed

    from jobspec.model.build import build_model
    from jobspec.model.construct import count_partitions

    deepspeed.init_distributed(dist_backend="gloo")
    precision, stage = MODES[args.child]
    spec = llama_spec(args)
    # a 1-layer, 64-wide build first: the modelling code imported and zero.Init's paths warm, so the
    # floor below holds them and the measured build is the model's own memory and time
    tiny = argparse.Namespace(**{**vars(args), "layers": 1, "hidden": 128, "intermediate": 128, "vocab": 1024})
    tiny_model_of(tiny, precision, stage)   # discarded at once
    floor = rss_mib()
    started = time.perf_counter()
    model = build_model(spec, ds_config=ds_config(precision, stage, args.ranks))
    seconds = time.perf_counter() - started
    parts = count_partitions(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "floor_mib": floor, "peak_mib": peak,
                                  "held": parts.held, "total": parts.total, "seconds": seconds}), flush=True)
    deepspeed.comm.barrier()


def tiny_model_of(args, precision: str, stage: int):
    from jobspec.model.build import build_model
    return build_model(llama_spec(args), ds_config=ds_config(precision, stage, args.ranks))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode: str, args) -> list[dict]:
    port = str(free_port())
    argv = [sys.executable, "-m", "bench.zero_init", "--child", mode, "--ranks", str(args.ranks),
            "--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
            "--vocab", str(args.vocab)]
    procs = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.ranks),
               "LOCAL_WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    rows = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: a rank failed (exit {proc.returncode}):\n{err[-3000:]}")
        rows += [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    print(f"{'construction':<12} {'rank':>4} {'peak RSS MiB':>13} {'over floor MiB':>15} {'psi x bytes MiB':>16} "
          f"{'held/total':>11} {'build s':>8}")
    for mode in args.modes.split(","):
        precision, _ = MODES[mode]
        for row in run_mode(mode, args):
            psi_bytes = row["total"] * (4 if precision == "fp32" else 2) / 2**20
            print(f"{mode:<12} {row['rank']:>4} {row['peak_mib']:>13.0f} {row['peak_mib'] - row['floor_mib']:>15.0f} "
                  f"{psi_bytes:>16.0f} {row['held'] / row['total']:>11.3f} {row['seconds']:>8.1f}", flush=True)
    print(f"(Ψ = {row['total']:,} parameters; {args.ranks} CPU ranks, gloo; peak RSS = ru_maxrss)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
