"""Planner accuracy on a CUDA GPU: predicted vs measured `torch.cuda.max_memory_allocated`.

    python bench/planner_accuracy.py            # on a CUDA machine: runs every row (1 GPU)
    python bench/planner_accuracy.py --dry-run  # predictions only (any machine)
    python bench/planner_accuracy.py --guide    # planner next to the HF single-GPU guide's 7 bert-large rows
    python bench/planner_accuracy.py --json OUT # also the rows as JSON (`python -m bench gpu` reads it)

Each row builds the model from its config (no downloads), wraps it with `deepspeed.initialize` using the
config `jobspec.compile.compiler` writes, runs a few steps on random tokens and reads the allocator's peak
(`torch.cuda.max_memory_allocated`, less what was still allocated when the row began) and NVML's used
memory of the whole GPU after the last step, while the caching allocator still holds the row's blocks
(what nvidia-smi would show). All rows run in one process, one after another: a process per row would
pay the torch/DeepSpeed imports 17 times. Prints a markdown table with the error of each row and the
median absolute error. The two SEED_ROWS are seed 000's XLM-R large setting (fp16, eager attention).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobspec.compile.compiler import compile_spec  # noqa: E402
from jobspec.spec.derived import derive  # noqa: E402
from jobspec.memory.planner import CUDA_CONTEXT_BYTES, plan_memory  # noqa: E402
from jobspec.units import MiB  # noqa: E402
from jobspec.spec.schema import fill_defaults  # noqa: E402

MODELS = {
    "bert-large": {"architecture": "bert", "config": {"hidden_size": 1024, "num_hidden_layers": 24,
                                                      "num_attention_heads": 16, "intermediate_size": 4096}},
    "xlmr-large": {"architecture": "xlm-roberta", "config": {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
        "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1}},
}
# (model, seq, micro, precision, checkpointing, optimizer, zero stage, optimizer offload)
ROWS = [
    ("bert-large", 128, 8, "fp32", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp32", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp16", True, "adamw", 0, "none"),
    ("bert-large", 512, 8, "bf16", {"every_n_layers": 2}, "adamw", 0, "none"),
    ("bert-large", 512, 1, "fp32", True, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp32", False, "adamw_8bit", 0, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 1, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 2, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 3, "none"),
    ("bert-large", 512, 4, "bf16", True, "adamw", 2, "cpu"),
    ("xlmr-large", 512, 8, "bf16", True, "adamw", 0, "none"),
    ("xlmr-large", 128, 8, "bf16", False, "adamw_8bit", 0, "none"),
    ("xlmr-large", 512, 2, "fp32", {"every_n_layers": 2}, "adamw", 0, "none"),
    ("xlmr-large", 512, 4, "bf16", True, "adamw", 3, "cpu"),
]
# Seed 000's XLM-R large rows, as close as a DeepSpeed job gets: micro-batch 8, seq 512, fp16, the
# eager attention of its time, without and with checkpointing (its nvidia-smi totals: OOM-free 23.5 GB
# and 11.8 GB on a 24 GB card, HF Trainer with AMP). Keyword `attention` goes to row_spec.
SEED_ROWS = [
    (("xlmr-large", 512, 8, "fp16", False, "adamw", 0, "none"), {"attention": "eager"}),
    (("xlmr-large", 512, 8, "fp16", True, "adamw", 0, "none"), {"attention": "eager"}),
]


def all_rows() -> list[tuple[str, tuple, dict]]:
    """(label, row_spec args, row_spec kwargs) of every measured row: ROWS, then SEED_ROWS; rows with
    an optimizer offload last, so the DeepSpeedCPUAdam build can finish in the background meanwhile."""
    rows = [(row, {}) for row in ROWS] + SEED_ROWS
    rows.sort(key=lambda r: r[0][7] != "none")  # stable: the listed order otherwise
    return [(row_label(row, kwargs), row, kwargs) for row, kwargs in rows]


def row_label(row: tuple, kwargs: dict) -> str:
    label = " ".join(str(c if not isinstance(c, dict) else f"every{c['every_n_layers']}") for c in row)
    return label + "".join(f" {v}" for v in kwargs.values())
# HF "Efficient training on a single GPU" (V100 16 GB, HF Trainer, no DeepSpeed, eager attention):
# bert-large-uncased, seq 512; the measured MB include ~1.3 GB of CUDA context.
GUIDE_CONTEXT = 1300 * 10**6
GUIDE = [
    ("vanilla, batch 4", 4, 1, "fp32", False, "adamw", 14949),
    ("batch 1 x accumulation 4", 1, 4, "fp32", False, "adamw", 8681),
    ("+ gradient checkpointing", 1, 4, "fp32", True, "adamw", 6775),
    ("fp16, batch 4", 4, 1, "fp16", False, "adamw", 13939),
    ("batch 1 x 4 + ckpt + fp16", 1, 4, "fp16", True, "adamw", 7275),
    ("8-bit AdamW, batch 4", 4, 1, "fp32", False, "adamw_8bit", 13085),
    ("everything", 1, 4, "fp16", True, "adamw_8bit", 5363),
]


def row_spec(model, seq, micro, precision, ckpt, optimizer, stage, offload, accumulation=1, attention="sdpa"):
    return fill_defaults({
        "name": "bench", "model": {**MODELS[model], "task": "sequence-classification", "attention": attention},
        "data": {"synthetic": {"seq_len": seq, "num_samples": 64}},
        "training": {"max_steps": 4, "micro_batch_size": micro, "global_batch_size": micro * accumulation,
                     "optimizer": {"name": optimizer}},
        "memory": {"precision": precision, "activation_checkpointing": ckpt, "zero_stage": stage,
                   "offload": {"optimizer": offload}},
        "logging": {"mlflow": {"enabled": False}},
    })


def measure(spec: dict, steps: int = 3) -> tuple[int, int | None]:
    """(peak allocated bytes, NVML used bytes) of a few real steps on cuda:0 (single rank, DeepSpeed engine)."""
    import deepspeed
    import torch
    from jobspec.hardware import nvml_used_bytes
    from jobspec.model.build import build_model
    from jobspec.train.patches import apply_patches, build_client_optimizer
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    compiled = compile_spec(spec, derive(spec))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated()  # anything an earlier row left behind is not this row's
    model = build_model(spec)
    client = next((p for p in compiled.patches if p["name"] == "client_optimizer"), None)
    apply_patches(model, [p for p in compiled.patches if p["name"] != "client_optimizer"])
    optimizer = build_client_optimizer(model, client["args"]) if client else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                      config=compiled.ds_config)
    micro, seq = spec["training"]["micro_batch_size"], spec["data"]["synthetic"]["seq_len"]
    vocab = model.config.vocab_size
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids = torch.randint(5, vocab - 1, (micro, seq), device=engine.device)
        labels = torch.randint(0, 2, (micro,), device=engine.device)
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - leftover
    nvml = nvml_used_bytes(torch.device("cuda", 0))
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model, optimizer, ids, labels
    gc.collect()
    torch.cuda.empty_cache()
    return peak, nvml


def table(rows, header):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="predictions only, no GPU needed")
    parser.add_argument("--guide", action="store_true", help="compare with the HF guide's bert-large rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows (bytes) as JSON here")
    args = parser.parse_args(argv)
    if args.guide:
        out, errors = [], []
        for label, micro, accumulation, precision, ckpt, optimizer, measured_mb in GUIDE:
            spec = row_spec("bert-large", 512, micro, precision, ckpt, optimizer, 0, "none", accumulation,
                            attention="eager")   # the guide predates SDPA in BERT
            plan = plan_memory(spec, derive(spec))
            predicted_mb = (plan.peak_reserved + GUIDE_CONTEXT) / 10**6
            errors.append(abs(predicted_mb / measured_mb - 1))
            out.append((label, f"{predicted_mb:.0f}", measured_mb, f"{100 * (predicted_mb / measured_mb - 1):+.1f}%"))
        table(out, ["guide row", "planner MB (reserved + 1.3 GB ctx)", "guide MB", "error"])
        print(f"\nmedian |error|: {100 * statistics.median(errors):.1f}%  (guide: HF Trainer with "
              "torch AdamW in fp32/amp, not DeepSpeed: its fp16 rows keep fp32 weights and no master copy)")
        return 0
    if not args.dry_run and not _has_cuda():
        print("no CUDA device: use --dry-run for predictions only", file=sys.stderr)
        return 2
    out, errors, records = [], [], []
    for label, row, kwargs in all_rows():
        spec = row_spec(*row, **kwargs)
        plan = plan_memory(spec, derive(spec))
        record = {"label": label, "predicted_allocated": plan.peak_allocated, "predicted_nvml": plan.nvml_total,
                  "measured_allocated": None, "nvml_used": None}
        if not args.dry_run:
            record["measured_allocated"], record["nvml_used"] = measure(spec)
            errors.append(abs(plan.peak_allocated / record["measured_allocated"] - 1))
            print(f"planner_accuracy: {label}: measured {record['measured_allocated'] / MiB:.0f} MiB",
                  file=sys.stderr, flush=True)
        records.append(record)
        out.append(table_row(record))
    table(out, HEADER)
    if errors:
        print(f"\nmedian |error|: {100 * statistics.median(errors):.1f}% over {len(errors)} rows "
              f"(CUDA context not in the allocated column: +{CUDA_CONTEXT_BYTES / MiB:.0f} MiB in the NVML total)")
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
    return 0


def _has_cuda() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()


HEADER = ["model seq micro precision ckpt optimizer zero offload", "predicted MiB", "measured MiB", "error",
          "predicted NVML MiB", "NVML used MiB"]


def table_row(record: dict) -> tuple:
    def mib(value):
        return "-" if value is None else f"{value / MiB:.0f}"
    predicted, measured = record["predicted_allocated"], record["measured_allocated"]
    error = "-" if measured is None else f"{100 * (predicted / measured - 1):+.1f}%"
    return (record["label"], mib(predicted), mib(measured), error, mib(record["predicted_nvml"]),
            mib(record["nvml_used"]))


if __name__ == "__main__":
    raise SystemExit(main())
