"""Full fine-tuning vs LoRA vs QLoRA on this machine: step time, peak memory, trainable parameters.

    python -m bench lora [--steps 8] [--hidden 512] [--layers 4] [--seq 256] [--batch 4]

Each variant runs in its own process (so each peak RSS is its own): a Llama-shape causal LM built
from a config by jobspec's own `model/build.build_model` (random weights, the spec's seed), the
adapters put on by the ranks' `lora` patch (train/lora_adapters.lora, model/lora.adapt), the base quantised by
model/quantize (bitsandbytes' CPU backend) for QLoRA; then forward, backward and a torch AdamW step
over the trainable parameters only (what DeepSpeed's engine is given). Step time: the median over the
steps after the first two; peak memory: the process's peak RSS (`ru_maxrss`), and on a GPU
torch.cuda.max_memory_allocated. Prints one markdown table.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "full fine-tuning": {"lora": None, "quantization": None},
    "LoRA r=8 all-linear": {"lora": {"r": 8}, "quantization": None},
    "QLoRA r=8, 4-bit NF4 base": {"lora": {"r": 8}, "quantization": {"bits": 4}},
}


def spec_for(variant: dict, args) -> dict:
    from jobspec.spec.schema import fill_defaults
    config = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3 // 64 * 64,
              "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
              "num_key_value_heads": max(1, args.hidden // 256), "vocab_size": 8192,
              "max_position_embeddings": max(args.seq, 128)}
    return fill_defaults({"name": "bench-lora", "model": {"architecture": "llama", "task": "causal-lm",
                                                          "config": config, **variant},
                          "data": {"synthetic": {"vocab_range": [5, 8192], "seq_len": args.seq}},
                          "memory": {"precision": "bf16"}, "training": {"max_steps": args.steps, "seed": 0}})


def run_one(name: str, args) -> dict:
    """One variant in this process: the numbers as a dict."""
    import torch

    from jobspec.techniques.lora import lora_patch_args
    from jobspec.model.build import build_model
    from jobspec.train import lora_adapters

    spec = spec_for(VARIANTS[name], args)
    model = build_model(spec).to(torch.bfloat16)
    if spec["model"]["lora"]:   # the ranks' `lora` patch with the compiler's settings (no checkpointing here)
        model, _ = lora_adapters.lora(model, **lora_patch_args(spec))
    counts = lora_adapters.parameter_counts(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(5, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"name": name, **counts, "step_s": statistics.median(times[2:] or times),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mib": peak_gpu / 2**20 if peak_gpu is not None else None,
            "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)   # a child process: run this variant, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print("BENCH-LORA " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    rows = []
    shape = [f"--{k}={getattr(args, k)}" for k in ("steps", "hidden", "layers", "seq", "batch")]
    for name in VARIANTS:
        done = subprocess.run([sys.executable, "-m", "bench", "lora", *shape, "--one", name],
                              capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH-LORA ")), None)
        if done.returncode or line is None:
            print(f"{name}: failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(line[len("BENCH-LORA "):]))
    print(f"Llama shape hidden {args.hidden}, {args.layers} layers, vocab 8192; micro-batch {args.batch} x "
          f"{args.seq} tokens, bf16, torch AdamW over the trainable parameters; {args.steps} steps, median after 2")
    print()
    print("| variant | trainable | total | step time | peak RSS | peak GPU | loss first → last |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        gpu = f"{r['peak_gpu_mib']:.0f} MiB" if r["peak_gpu_mib"] is not None else "-"
        print(f"| {r['name']} | {r['trainable']:,} | {r['total']:,} | {r['step_s'] * 1000:.0f} ms | "
              f"{r['peak_rss_mib']:.0f} MiB | {gpu} | {r['first_loss']:.3f} → {r['last_loss']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
