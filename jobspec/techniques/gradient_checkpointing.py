"""`memory.activation_checkpointing`: Hugging Face's gradient checkpointing, every layer or one in
`every_n_layers` (model/structure.gradient_checkpointing). Its rule: `every_n_layers` against the
model's layer count (the derived job's; unknown without a hidden size, or when the batch split is
refused: then nothing to say). `--fit` searches its every_n_layers itself (memory/fit.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.rules.batch import derived_job
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def every_n_layers_issues(r: ResolvedSpec) -> list[SpecIssue]:
    checkpointing = r.spec["memory"]["activation_checkpointing"]
    if not isinstance(checkpointing, dict):
        return []
    # derived again, as its own rule: cheap (no profile, one config.json read)
    derived, _ = derived_job(r)
    layers = derived.num_layers if derived is not None else None
    if layers is not None and checkpointing["every_n_layers"] > layers:
        return [r.issue(("memory", "activation_checkpointing", "every_n_layers"),
                        f"every_n_layers = {checkpointing['every_n_layers']} but the model has "
                        f"{layers} layers",
                        f"use a value between 1 and {layers}", code="checkpointing-layers")]
    return []


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
    trace="jobspec.model.structure:trace_checkpointing",
    rules=(every_n_layers_issues,))
