"""What DeepSpeed's CPU optimizer offload keeps on the host, per parameter, against the planner's host terms.

    python -m bench.offload_host [--stage 3 --hidden 1024 --layers 8 --vocab 32000 --steps 3]

One CPU rank (gloo), a Llama-shaped model built from its config in bf16, DeepSpeed's CPU Adam,
`offload_optimizer: {device: cpu, pin_memory: true}` (jobspec's default). Prints:
- the census of the host tensors DeepSpeed's ZeRO optimizer holds after a few steps, read from the
  optimizer object itself (stage 3: `fp32_partitioned_groups_flat` and their `.grad`,
  `grad_partitions_flat_buffer`; stage 1/2: `single_partition_of_fp32_groups` and their `.grad`,
  `param_buffer_of_bit16_for_cpu_offload_groups`, `temp_grad_buffer_for_cpu_offload`; both: the
  optimizer's `exp_avg`/`exp_avg_sq`), in bytes per trainable parameter;
- the planner's offload terms for the same sizes (jobspec.memory.host_ram.offload_terms);
- RSS after construction and the process's peak (ru_maxrss). On CPU ranks the "device" side (the
  16-bit partition, the reduce buckets, activations) lives in the same RSS, and pin_memory is a no-op
  (DeepSpeed's CPU accelerator), so the census, not the RSS, is what compares with the host terms.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def census(opt, stage: int) -> dict[str, int]:
    """Bytes of each host buffer family DeepSpeed's ZeRO optimizer holds (storage-deduplicated)."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or t.device.type != "cpu":
                continue
            key = t.untyped_storage().data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return total

    if stage == 3:
        masters = opt.fp32_partitioned_groups_flat
        out = {"fp32_master": nbytes(masters), "fp32_gradients": nbytes(m.grad for m in masters),
               "gradient_accumulation": nbytes([opt.grad_partitions_flat_buffer])}
    else:
        masters = opt.single_partition_of_fp32_groups
        out = {"fp32_master": nbytes(masters), "fp32_gradients": nbytes(m.grad for m in masters),
               "bit16_transfer": nbytes(opt.param_buffer_of_bit16_for_cpu_offload_groups),
               "temp_grad_buffer": nbytes([opt.temp_grad_buffer_for_cpu_offload])}
    out["adam_states"] = nbytes(v for s in opt.optimizer.state.values() for v in s.values()
                                if hasattr(v, "untyped_storage") and v.numel() > 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=int, default=int(1e9))
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    import psutil
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from transformers import LlamaConfig, LlamaForCausalLM

    from jobspec.memory.host_ram import offload_terms

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, vocab_size=args.vocab)
    deepspeed.init_distributed(dist_backend="gloo")
    zero = {"stage": args.stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "sub_group_size": args.sub_group_size}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True}, "zero_optimization": zero}
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.bfloat16):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    largest = max(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    rss_built = psutil.Process().memory_info().rss
    ids = torch.randint(0, args.vocab, (1, 128))
    for _ in range(args.steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    found = census(engine.optimizer, args.stage)
    planned = offload_terms(stage=args.stage, world=1, lp=2, trainable=psi, opt_states=8 * psi,
                            largest_param=largest, sub_group_size=args.sub_group_size, pinned=False)
    out = {"stage": args.stage, "parameters": psi, "largest_parameter": largest, "measured": found,
           "measured_bytes_per_param": round(sum(found.values()) / psi, 3),
           "planned": planned, "planned_bytes_per_param": round(sum(planned.values()) / psi, 3),
           "rss_after_initialize_mib": rss_built >> 20,
           "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
           "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
