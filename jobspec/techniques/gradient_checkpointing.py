"""`memory.activation_checkpointing`: Hugging Face's gradient checkpointing, every layer or one in
`every_n_layers` (model/structure.gradient_checkpointing; the rule against the layer count:
spec/rules/activation_checkpointing.py). `--fit` searches its every_n_layers itself
(memory/fit.py)."""
from __future__ import annotations

from jobspec.spec.rules import activation_checkpointing as checkpointing_rules
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique


def _args(spec: JobSpec) -> dict | None:
    checkpointing = spec["memory"]["activation_checkpointing"]
    if not checkpointing:
        return None
    every, reentrant = ((checkpointing["every_n_layers"], checkpointing["use_reentrant"])
                        if isinstance(checkpointing, dict) else (1, False))
    # HF's gradient_checkpointing_enable, not DeepSpeed's activation_checkpointing block,
    # which only affects models that call deepspeed.checkpointing themselves.
    return {"every_n_layers": every, "use_reentrant": reentrant}


def _text(args: dict) -> str:
    every = args.get("every_n_layers", 1)
    return "activation checkpointing " + ("every layer" if every == 1 else f"one layer in {every}")


TECHNIQUE = Technique(
    name="gradient_checkpointing",
    summary="each checkpointed layer keeps only its input and recomputes the rest in the backward",
    args=_args, text=_text, apply="jobspec.model.structure:gradient_checkpointing",
    rules=(checkpointing_rules.every_n_layers_issues,))
