"""The long-sequence techniques (issue 33) measured on this machine's CPU, beside the planner's prediction.

    python bench/long_sequence.py            # RSS and step time, tiled loss and tiled MLP (~3 min, ~6 GiB RAM)
    python bench/long_sequence.py --trace    # the planner's trace vs torch's MemTracker, each technique (~1 min)

Each measured row runs in a fresh Python process: a tiny-depth Llama built from its config, the ranks'
patches applied as `jobspec compile` writes them (train/patches.apply_patches), three forward + backward
steps of one micro-batch as the ranks run them (`loss_of(model(**batch))`, then backward), fp32 on CPU.
The process's peak RSS (ru_maxrss) less its RSS before the first step is the step's memory; the step
time is the median of the last two steps. The planner's prediction of the saving is the difference of
its traced activations (`plan_memory`: layers + embeddings + logits-and-loss terms) between the two
settings. `--trace` compares the trace (model/planner_trace.ModelTracer.full) with MemTracker over the same step
on fake tensors (bench/planner_accuracy.memtracker_peak), for each technique.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOSS_CONFIG = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 512, "vocab_size": 128256, "max_position_embeddings": 8192,
               "tie_word_embeddings": False}
MLP_CONFIG = {**LOSS_CONFIG, "vocab_size": 1000, "intermediate_size": 8192, "max_position_embeddings": 16384}
ROWS = [  # (label, config, seq, memory section)
    ("128K vocab x 2K tokens", LOSS_CONFIG, 2048, {}),
    ("128K vocab x 2K tokens, tiled loss", LOSS_CONFIG, 2048, {"tiled_loss": {"tiles": 8}}),
    ("MLP 8192 wide x 16K tokens", MLP_CONFIG, 16384, {}),
    ("MLP 8192 wide x 16K tokens, tiled MLP", MLP_CONFIG, 16384, {"tiled_mlp": True}),
]


def spec_of(config: dict, seq: int, memory: dict) -> dict:
    from jobspec.spec.schema import fill_defaults

    return fill_defaults({"name": "bench", "model": {"architecture": "llama", "task": "causal-lm", "config": config,
                                                     "attention": "sdpa"},
                          "data": {"synthetic": {"num_samples": 8, "seq_len": seq,
                                                 "vocab_range": [3, min(30000, config["vocab_size"])]}},
                          "training": {"micro_batch_size": 1, "max_steps": 1},
                          "memory": {"precision": "fp32", "activation_checkpointing": False, **memory}})


def one_row(payload: str) -> None:
    """In the child process: build, patch, step, print {rss_step_bytes, step_s, loss}."""
    import resource
    import statistics
    import time

    import torch

    from jobspec.compile.compiler import compile_patches
    from jobspec.model.build import build_model
    from jobspec.model.step import forward_loss, step_inputs
    from jobspec.train.patches import apply_patches

    spec = json.loads(payload)
    torch.manual_seed(0)
    model = build_model(spec)
    model, _ = apply_patches(model, compile_patches(spec))
    model.train()
    seq = spec["data"]["synthetic"]["seq_len"]
    batch = step_inputs(spec, model.config, 1, seq)
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
    times, loss = [], None
    for _ in range(3):
        start = time.perf_counter()
        loss = forward_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss_step_bytes": peak - before, "step_s": statistics.median(times[1:]),
                      "loss": float(loss)}))


def predicted_activations(spec: dict) -> int:
    from jobspec.memory.planner import plan_memory
    from jobspec.model.planner_trace import job_profiler
    from jobspec.spec.derived import derive

    plan = plan_memory(spec, derive(spec, profiler=job_profiler()))
    return sum(plan.breakdown[k] for k in ("activations", "embeddings_activations", "logits_and_loss"))


def run_measured() -> None:
    rows = []
    for label, config, seq, memory in ROWS:
        spec = spec_of(config, seq, memory)
        out = subprocess.run([sys.executable, __file__, "--row", json.dumps(spec)], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        measured = json.loads(out)
        rows.append((label, measured, predicted_activations(spec)))
    print("| setting (fp32, one micro-batch, CPU) | step RSS GiB | step s | loss | planner activations GiB |")
    print("|---|---|---|---|---|")
    for label, m, predicted in rows:
        print(f"| {label} | {m['rss_step_bytes'] / 2**30:.2f} | {m['step_s']:.2f} | {m['loss']:.5f} | "
              f"{predicted / 2**30:.2f} |")
    print()
    for (label, plain, p_plain), (tiled_label, tiled, p_tiled) in (rows[0:2], rows[2:4]):
        saved = plain["rss_step_bytes"] - tiled["rss_step_bytes"]
        print(f"{tiled_label}: measured saving {saved / 2**30:.2f} GiB, planner's "
              f"{(p_plain - p_tiled) / 2**30:.2f} GiB; step time x{tiled['step_s'] / plain['step_s']:.2f}; "
              f"loss difference {abs(tiled['loss'] - plain['loss']):.1e}")


def run_trace() -> None:
    from bench.planner_accuracy import memtracker_peak
    from jobspec.model.planner_trace import ModelTracer, tiling_setting

    print("| setting (bf16, checkpointing off) | trace MiB | MemTracker MiB | error |")
    print("|---|---|---|---|")
    for label, config, seq, memory in ROWS:
        spec = spec_of(config, seq // 4, memory)
        spec["memory"]["precision"] = "bf16"
        tiling = tiling_setting(spec["memory"])
        traced = ModelTracer(spec).full("bf16", 1, seq // 4, False, tiling).peak
        reference = memtracker_peak(spec, "bf16", 1, seq // 4, False, tiling=tiling)["without_gradients"]
        print(f"| {label.split(' x ')[0]} x {seq // 4} tokens{label.split('tokens')[1]} | {traced / 2**20:.1f} | "
              f"{reference / 2**20:.1f} | {100 * (traced / reference - 1):+.1f}% |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="store_true", help="the trace against MemTracker")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        one_row(args.row)
    elif args.trace:
        run_trace()
    else:
        run_measured()
    return 0


if __name__ == "__main__":
    sys.exit(main())
