"""How far per-step losses drift when a CPU run continues with another intra-op thread count.

A resumed CPU run is bit-identical to an uninterrupted one when it keeps the thread count (the
checkpoint records it and the worker keeps it where the host allows: jobspec/train/engine.py);
this measures what happens when it cannot. The quickstart model (tiny XLM-R, sequence
classification, seq 64, micro-batch 16, AdamW lr 1e-3) trains in-process for --steps steps at
--threads; a second run switches to --resume-threads after --switch-at steps; a third switches to
the SAME count (the control, which must not differ). Prints the steps whose loss differs and the
largest relative difference.

    python -m bench.resume_threads --steps 200 --switch-at 100 --threads 1 --resume-threads 2
"""
from __future__ import annotations

import argparse
import os
import time


def train(steps: int, threads: int, switch_at: int | None, resume_threads: int | None, seed: int = 7) -> list[float]:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    config = XLMRobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              vocab_size=1000, max_position_embeddings=130, num_labels=2)
    model = XLMRobertaForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(steps):
        if switch_at is not None and step == switch_at:
            torch.set_num_threads(resume_threads)
        ids = torch.randint(5, 1000, (16, 64), generator=data)
        labels = ((ids[:, :8] >= 500).sum(dim=1) > 4).long()  # learnable, as the quickstart's labels
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def compare(reference: list[float], other: list[float], start: int) -> tuple[int, float]:
    diffs = [abs(a - b) / abs(a) for a, b in zip(reference[start:], other[start:])]
    return sum(1 for d in diffs if d), max(diffs, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--switch-at", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--resume-threads", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    reference = train(args.steps, args.threads, None, None)
    switched = train(args.steps, args.threads, args.switch_at, args.resume_threads)
    control = train(args.steps, args.threads, args.switch_at, args.threads)
    later = args.steps - args.switch_at
    for name, run in ((f"{args.threads} -> {args.resume_threads} threads", switched),
                      (f"{args.threads} -> {args.threads} threads (control)", control)):
        differ, worst = compare(reference, run, args.switch_at)
        print(f"{name:<34} {differ:4d} of {later} later steps differ, max relative difference {worst:.1e}")
    print(f"final loss {reference[-1]:.6f}; {time.perf_counter() - started:.0f} s on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
