"""`memory.activation_checkpointing.offload: cpu`: the checkpointed layers' inputs kept in pinned
host memory, copied on a side stream (model/activation_offload.offload_checkpoints, on the ranks
and, as its stand-in, in the planner's trace). Refused beside `model.compile`
(techniques/regional_compile.py)."""
from __future__ import annotations

from jobspec.spec.types import JobSpec, JobSpecMemory
from jobspec.techniques.base import FitStep, Technique


def offloads_inputs(memory: JobSpecMemory) -> bool:
    checkpointing = memory["activation_checkpointing"]
    return isinstance(checkpointing, dict) and checkpointing["offload"] == "cpu"


def _args(spec: JobSpec) -> dict | None:
    checkpointing = spec["memory"]["activation_checkpointing"]
    if not isinstance(checkpointing, dict) or checkpointing["offload"] != "cpu":
        return None
    return {"every_n_layers": checkpointing["every_n_layers"]}


def _trace_args(value, checkpointed: list[int]) -> dict | None:
    return {"indices": checkpointed, "traced": True} if value and checkpointed else None


TECHNIQUE = Technique(
    name="activation_offload",
    summary="the checkpointed layers' inputs in pinned host memory, copied on a side stream",
    args=_args, text=lambda args: "checkpointed inputs offloaded to pinned host memory",
    apply="jobspec.model.activation_offload:offload_checkpoints",
    trace_args=_trace_args, trace_value=offloads_inputs,
    fit=FitStep(key="offload",
                changes={"memory.activation_checkpointing": {"every_n_layers": 1,
                                                             "offload": "cpu"}},
                cost=3, words="checkpoint every layer, inputs offloaded to the host",
                is_on=lambda spec: offloads_inputs(spec["memory"]),
                refused=lambda spec, wanted: bool(spec["model"]["compile"])))
