"""Adam kernels on CPU ranks: DeepSpeed's JIT-built FusedAdam against torch's AdamW (fused, foreach),
and what DeepSpeed's shm_comm op does to a training step. Prints numbers; asserts nothing.

    python bench/optimizer_kernels.py [--rounds 7] [--steps 5] [--hidden 512] [--layers 4]

One process, one DeepSpeed engine per variant on the same model and batch, steps interleaved:
each round runs `--steps` steps of every variant in turn (the order rotating), so a slow patch of
the machine hits all of them alike. The statistic is the median over rounds of each variant's mean
step time, and its ratio to FusedAdam's (issue 22's goal: torch's kernel within 2 %).

`--comm` instead times the same job on 2 ranks with and without DeepSpeed's shm_comm op loaded
(it re-launches itself under torch.distributed with gloo): DeepSpeed 0.19 uses that op only for
`inference_all_reduce` (tensor-parallel inference), so training's all-reduces go through the
process group either way; this measures that rather than assuming it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

VARIANTS = {   # DeepSpeed optimizer params per variant (the `torch_adam` switch and torch's kernel choice)
    "deepspeed FusedAdam (JIT op)": {"torch_adam": False, "bias_correction": True},
    "torch AdamW fused": {"torch_adam": True, "fused": True},
    "torch AdamW foreach": {"torch_adam": True, "foreach": True},
}


def build(hidden: int, layers: int, seq: int, batch: int, precision: str, params: dict, zero: int):
    import deepspeed
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                        intermediate_size=4 * hidden, vocab_size=8000, max_position_embeddings=seq, num_labels=2)
    model = BertForSequenceClassification(config)
    ds_config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "adam_w_mode": True,
                                                           **params}},
                 "zero_optimization": {"stage": zero}, "bf16": {"enabled": precision == "bf16"},
                 "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    inputs = {"input_ids": torch.randint(5, 8000, (batch, seq)), "labels": torch.randint(0, 2, (batch,))}
    return engine, inputs


def step(engine, inputs) -> None:
    loss = engine(**inputs).loss
    engine.backward(loss)
    engine.step()


def kernels(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    engines = {name: build(args.hidden, args.layers, args.seq, args.batch, args.precision, params, args.zero)
               for name, params in VARIANTS.items()}
    params = sum(p.numel() for p in next(iter(engines.values()))[0].module.parameters())
    for engine, inputs in engines.values():   # warm-up: first steps allocate optimizer state
        for _ in range(2):
            step(engine, inputs)
    means: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            engine, inputs = engines[name]
            started = time.perf_counter()
            for _ in range(args.steps):
                step(engine, inputs)
            means[name].append((time.perf_counter() - started) / args.steps)
    base = statistics.median(means[names[0]])
    print(f"model {params / 1e6:.1f}M params, batch {args.batch} x seq {args.seq}, {args.precision}, ZeRO-{args.zero}, "
          f"{args.threads} threads; {args.rounds} rounds x {args.steps} steps, interleaved")
    print(f"{'variant':32s} {'median step':>12s} {'min':>9s} {'max':>9s} {'vs FusedAdam':>13s}")
    for name in names:
        med = statistics.median(means[name])
        print(f"{name:32s} {med * 1e3:10.1f} ms {min(means[name]) * 1e3:7.1f} ms {max(means[name]) * 1e3:7.1f} ms "
              f"{(med / base - 1) * 100:+12.1f}%")


def comm_rank(args) -> None:
    """One rank of the --comm measurement (started by `comm`)."""
    import deepspeed
    import deepspeed.ops
    import torch
    torch.set_num_threads(1)
    if os.environ["BENCH_SHM"] == "0":   # what jobspec's worker does: the op is never built or loaded
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    engine, inputs = build(args.hidden, args.layers, args.seq, args.batch, args.precision,
                           {"torch_adam": True, "fused": True}, args.zero)
    for _ in range(2):
        step(engine, inputs)
    times = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.steps):
            step(engine, inputs)
        times.append((time.perf_counter() - started) / args.steps)
    loaded = getattr(deepspeed.comm.comm.cdb, "shm_comm_op", None) is not None
    if int(os.environ["RANK"]) == 0:
        print(f"shm_comm {'loaded' if loaded else 'not loaded'}: median step {statistics.median(times) * 1e3:.1f} ms "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})", flush=True)
    torch.distributed.destroy_process_group()


def comm(args) -> None:
    import subprocess

    for round_ in range(2):   # twice each, alternating: the machine's drift shows as a spread
        for shm in ("1", "0"):
            env = {**os.environ, "BENCH_SHM": shm}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(29600 + round_ * 2 + int(shm)), __file__, "--comm-rank",
                            *sys.argv[1:]], env=env, check=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--comm", action="store_true", help="time 2 gloo ranks with and without shm_comm")
    parser.add_argument("--comm-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.comm_rank:
        comm_rank(args)
    elif args.comm:
        comm(args)
    else:
        os.environ.setdefault("MASTER_PORT", "29599")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        kernels(args)


if __name__ == "__main__":
    main()
