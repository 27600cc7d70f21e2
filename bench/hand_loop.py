"""A minimal hand-written DeepSpeed training loop: the baseline `bench/launch_overhead.py` times jobspec against.

    jobspec compile JOB --out DIR
    deepspeed --num_gpus N --master_port P bench/hand_loop.py --run-dir DIR

What someone would write by hand for the same job: the model built from its config with transformers
(random init, same seed and attention implementation as the worker), the job's synthetic samples
(`jobspec.data.loaders.synthetic_dataset`: the same token ids), a plain DataLoader with a DistributedSampler,
`deepspeed.initialize` with the SAME compiled `ds_config.json`, and forward / backward / step for
`derived.total_steps` optimizer steps. No telemetry, no checkpoints, no stop votes.

Rank 0 prints one line per optimizer step, `hand_loop step N t=UNIX_SECONDS`, after `engine.step()`
returned (the timestamps the benchmark reads), and `hand_loop start t=...` when the process started.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # before the heavy imports: they are part of launch-to-first-step


def build_model(spec: dict):
    """The spec's `model.architecture` + `model.config` with random weights, as the worker builds it."""
    import torch
    import transformers

    model_spec = spec["model"]
    if model_spec.get("name_or_path") or model_spec.get("task", "sequence-classification") != "sequence-classification":
        raise SystemExit("hand_loop handles sequence-classification models built from model.architecture only")
    config = transformers.AutoConfig.for_model(model_spec["architecture"], num_labels=model_spec["num_labels"],
                                               **(model_spec.get("config") or {}))
    torch.manual_seed(spec["training"]["seed"])
    return transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation=model_spec.get("attention", "sdpa"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/hand_loop.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="a `jobspec compile --out` directory")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed runner")
    args = parser.parse_args(argv)

    import deepspeed
    import torch
    import torch.distributed as dist
    import yaml
    from torch.utils.data import DataLoader, DistributedSampler

    from jobspec.data.loaders import synthetic_dataset

    spec = yaml.safe_load((args.run_dir / "resolved.yaml").read_text(encoding="utf-8"))
    ds_config = json.loads((args.run_dir / "ds_config.json").read_text(encoding="utf-8"))
    total_steps = json.loads((args.run_dir / "launch.json").read_text(encoding="utf-8"))["derived"]["total_steps"]
    if spec["data"].get("synthetic") is None:
        raise SystemExit("hand_loop needs a job with data.synthetic")

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if "OMP_NUM_THREADS" not in os.environ:  # as the worker does: CPU ranks share the node's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", world))))
    if rank == 0:
        print(f"hand_loop start t={STARTED:.6f}", flush=True)

    model = build_model(spec)
    seed = spec["training"]["seed"]
    dataset = synthetic_dataset(spec, spec["data"]["synthetic"]["num_samples"], seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    micro_batch = ds_config["train_micro_batch_size_per_gpu"]
    accumulation = ds_config["gradient_accumulation_steps"]

    engine.train()
    step, epoch = 0, 0
    while step < total_steps:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        for i, batch in enumerate(DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)):
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if (i + 1) % accumulation:
                continue
            step += 1
            if rank == 0:
                print(f"hand_loop step {step} t={time.time():.6f}", flush=True)
            if step >= total_steps:
                break
        epoch += 1
    dist.destroy_process_group()  # without it the ranks abort at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
