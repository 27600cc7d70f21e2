"""`model.quantization`: the base's linear weights in 4 or 8 bits by bitsandbytes (model/quantize.py
at the build; the plan's weight bytes: memory/planner.weight_bytes). Its rules: quantisation needs
LoRA (techniques/lora.py, with LoRA's), and here what DeepSpeed can do with a quantised base
(QLoRA): ZeRO stages 0-2 and optimizer offload, not ZeRO-3 and not parameter offload. Pure.

ZeRO-3 partitions every parameter by flattening it into its ranks' shards and re-gathering it
around each use, and builds the model under `zero.Init`; bitsandbytes' 4-bit and 8-bit weights are
packed tensors whose quantisation state (absmax per 64-block, the double-quantisation constants)
lives beside them, quantised once after the whole weight exists: neither survives partitioning, and
parameter offload moves the same flat buffers. transformers and PEFT document ZeRO-3 + QLoRA only
through `bnb_4bit_quant_storage` for FSDP's sharding, which DeepSpeed's partitioner does not use;
bitsandbytes' CPU backend, the one this project can test on, also repacks a weight in place for
inference, under the partitioner's feet. ZeRO 0-2 keep the frozen, quantised base whole on every
rank and shard only the adapters' gradients and optimizer states: nothing of the base to shard.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def quantized_zero_issues(r: ResolvedSpec) -> list[SpecIssue]:
    quant = r.spec["model"].get("quantization")
    if not quant:
        return []
    memory = r.spec["memory"]
    issues = []
    if memory["zero_stage"] == 3:
        issues.append(r.issue(
            ("model", "quantization"),
            f"a {quant['bits']}-bit base cannot be trained under ZeRO stage 3: ZeRO-3 flattens and "
            "partitions every parameter, which breaks bitsandbytes' packed weights and their "
            "quantisation constants",
            "set `memory.zero_stage: 2` (the quantised base is frozen: ZeRO 0-2 shard only the "
            "adapters' gradients and optimizer states), or drop model.quantization for plain LoRA "
            "under ZeRO-3",
            code="quantization-zero3"))
    # parameter offload needs ZeRO-3 (the offload rule): refused with it above
    return issues


TECHNIQUE = Technique(
    name="quantization", summary="a 4- or 8-bit base (bitsandbytes) under LoRA adapters (QLoRA)",
    rules=(quantized_zero_issues,))
