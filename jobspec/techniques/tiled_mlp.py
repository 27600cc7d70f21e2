"""`memory.tiled_mlp`: every layer's MLP through DeepSpeed's TiledMLP, one tile per hidden_size
tokens (model/tiling.tiled_mlp, on the ranks and in the planner's trace). Refused beside
`model.compile` (techniques/regional_compile.py)."""
from __future__ import annotations

from jobspec.spec.types import JobSpec, JobSpecMemory
from jobspec.techniques.base import FitStep, Technique


def _args(spec: JobSpec) -> dict | None:
    return {} if spec["memory"]["tiled_mlp"] else None


def _trace_args(value, checkpointed: list[int]) -> dict | None:
    return {} if value else None


def _trace_value(memory: JobSpecMemory) -> bool:
    return bool(memory["tiled_mlp"])


def _offerable(spec: JobSpec, zero_stage: int) -> bool:
    return spec["model"]["task"] == "causal-lm" and not spec["memory"]["tiled_mlp"] \
        and not spec["model"]["compile"]


TECHNIQUE = Technique(
    name="tiled_mlp",
    summary="each layer's MLP one tile of tokens at a time (DeepSpeed's TiledMLP)",
    args=_args, text=lambda args: "tiled MLP", apply="jobspec.model.tiling:tiled_mlp",
    trace_args=_trace_args, trace_value=_trace_value,
    trace_imports=("deepspeed.runtime.sequence_parallel.ulysses_sp",),
    fit=FitStep(key="memory.tiled_mlp", changes={"memory.tiled_mlp": True}, cost=2,
                words="tiled MLP", is_on=lambda spec: bool(spec["memory"]["tiled_mlp"]),
                refused=lambda spec, wanted: bool(spec["model"]["compile"])),
    remedy={"activations": "--set memory.tiled_mlp=true (the MLP one tile at a time)"},
    offerable=_offerable)
