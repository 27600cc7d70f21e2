"""`model.quantization`: the base's linear weights in 4 or 8 bits by bitsandbytes (model/quantize.py
at the build; the plan's weight bytes: memory/planner.weight_bytes). Its rules: spec/rules/lora.py
(quantisation needs LoRA) and spec/rules/quantized_base.py (ZeRO 0-2)."""
from __future__ import annotations

from jobspec.spec.rules import quantized_base
from jobspec.techniques.base import Technique

TECHNIQUE = Technique(
    name="quantization", summary="a 4- or 8-bit base (bitsandbytes) under LoRA adapters (QLoRA)",
    rules=(quantized_base.quantized_zero_issues,))
