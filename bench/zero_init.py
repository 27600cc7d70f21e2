"""Peak host RSS per rank while the ranks construct the model, with and without `deepspeed.zero.Init`
(issue 26): `python -m bench.zero_init [--layers 18 --hidden 2048 ...] [--ranks 2]`; the
Llama-3.2-1B shape on one rank: `python -m bench.zero_init --shape llama-3.2-1b --ranks 1
--modes bf16-full`; QLoRA's 4-bit base: `--modes qlora-4bit`.

A Llama-architecture model built from a config (default: hidden 2048, 18 layers, MLP 5632, vocab
32000: 1.03B parameters) by jobspec's own `build_model`, exactly as the worker calls it, on N CPU
ranks (gloo), once per construction:

  fp32 full   every rank builds the whole model in fp32 (what every job did before issue 26, and
              what an fp32 ZeRO 0-2 job still does)
  bf16 full   ZeRO 0/1/2 in bf16: a full copy per rank, built straight in bf16
  bf16 zero3  ZeRO-3 in bf16: built under zero.Init, each rank keeps its partition
  qlora 4bit  ZeRO-0 in bf16 with `model.quantization` 4-bit (NF4, double quantisation): the
              linear layers of the stack in 4 bits, the rest in bf16

Each construction runs in fresh processes (a process's peak RSS never goes down). A rank prints its
RSS after the imports and the process group (the floor), its peak RSS after the build
(`ru_maxrss`), the parameter elements it holds (from the partitions) and the build time; this
prints the per-rank peak, the peak over the floor, what the built model keeps (its tensors' bytes as
stored), and Ψ × 2 and Ψ × 4 bytes (the model whole in 16 and in 32 bits) for comparison, Ψ
counted on the model's meta-device skeleton. The peak includes what glibc's heap retains of freed
temporaries (bitsandbytes' CPU quantisation makes fp32 ones per weight); `MALLOC_MMAP_THRESHOLD_=1048576`
in the environment (the ranks inherit it) returns them to the system and separates the two.
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
MODES = {"fp32-full": ("fp32", 0), "bf16-full": ("bf16", 0), "bf16-zero3": ("bf16", 3),
         "qlora-4bit": ("bf16", 0)}
# --shape: the architectures' published configs (the 1B: 1,235,814,400 parameters, tied embeddings)
SHAPES = {"llama-3.2-1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192,
                           "vocab": 128256, "tied": True}}


def llama_spec(args, mode: str) -> dict:
    from jobspec.spec.schema import fill_defaults

    heads = args.heads or args.hidden // 128
    quantization = {"bits": 4} if mode == "qlora-4bit" else None
    lora = {"r": 8} if quantization else None
    return fill_defaults({
        "name": "zero-init-bench",
        "model": {"architecture": "llama", "task": "causal-lm", "quantization": quantization, "lora": lora,
                  "config": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                             "num_attention_heads": heads, "num_key_value_heads": args.kv_heads or heads,
                             "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                             "max_position_embeddings": 2048, "tie_word_embeddings": args.tied}},
        "memory": {"precision": MODES[mode][0]},   # QLoRA's compute dtype (`auto`) follows it
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

    from jobspec.model.build import build_model, build_skeleton
    from jobspec.model.construct import count_partitions

    deepspeed.init_distributed(dist_backend="gloo")
    precision, stage = MODES[args.child]
    spec = llama_spec(args, args.child)
    psi = sum(p.numel() for p in build_skeleton(spec).parameters())   # meta: no memory
    # a 1-layer, 128-wide build first: the modelling code imported and zero.Init's paths warm, so the
    # floor below holds them and the measured build is the model's own memory and time
    tiny = argparse.Namespace(**{**vars(args), "layers": 1, "hidden": 128, "heads": 0, "kv_heads": 0,
                                 "intermediate": 128, "vocab": 1024})
    build_model(llama_spec(tiny, args.child), ds_config=ds_config(precision, stage, args.ranks))   # discarded
    floor = rss_mib()
    started = time.perf_counter()
    model = build_model(spec, ds_config=ds_config(precision, stage, args.ranks))
    seconds = time.perf_counter() - started
    parts = count_partitions(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # what the built model keeps: its parameters and buffers as stored (a 4-bit weight packed; a
    # ZeRO-3 parameter its partition), each tensor once
    kept = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    kept_mib = sum((getattr(t, "ds_tensor", None) if hasattr(t, "ds_id") else t).nbytes
                   for t in kept.values()) / 2**20
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "floor_mib": floor, "peak_mib": peak,
                                  "held": parts.held, "total": parts.total, "psi": psi, "kept_mib": kept_mib,
                                  "seconds": seconds}), flush=True)
    deepspeed.comm.barrier()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode: str, args) -> list[dict]:
    port = str(free_port())
    argv = [sys.executable, "-m", "bench.zero_init", "--child", mode, "--ranks", str(args.ranks),
            "--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
            "--vocab", str(args.vocab), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            *(["--tied"] if args.tied else [])]
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
    parser.add_argument("--heads", type=int, default=0, help="attention heads (default: hidden / 128)")
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: the heads)")
    parser.add_argument("--tied", action="store_true", help="the head shares the embedding's weight")
    parser.add_argument("--shape", choices=list(SHAPES), help="a published shape (overrides the sizes; "
                        "--layers given explicitly still counts)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.shape:
        layers_given = "--layers" in (argv if argv is not None else sys.argv)
        vars(args).update({k: v for k, v in SHAPES[args.shape].items() if not (k == "layers" and layers_given)})
    if args.child:
        child(args)
        return 0
    print(f"{'construction':<12} {'rank':>4} {'peak RSS MiB':>13} {'over floor MiB':>15} {'kept MiB':>9} "
          f"{'psi x 2 MiB':>12} {'psi x 4 MiB':>12} {'held/total':>11} {'build s':>8}")
    for mode in args.modes.split(","):
        for row in run_mode(mode, args):
            print(f"{mode:<12} {row['rank']:>4} {row['peak_mib']:>13.0f} {row['peak_mib'] - row['floor_mib']:>15.0f} "
                  f"{row['kept_mib']:>9.0f} {row['psi'] * 2 / 2**20:>12.0f} {row['psi'] * 4 / 2**20:>12.0f} "
                  f"{row['held'] / row['total']:>11.3f} {row['seconds']:>8.1f}", flush=True)
    print(f"(Ψ = {row['psi']:,} parameters; {args.ranks} CPU ranks, gloo; peak RSS = ru_maxrss; held/total "
          "counts a 4-bit weight by its stored elements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
