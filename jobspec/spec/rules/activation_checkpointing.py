"""`memory.activation_checkpointing.every_n_layers` against the model's layer count (the derived
job's; unknown without a hidden size, or when the batch split is refused: then nothing to say)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.rules.batch import derived_job

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
