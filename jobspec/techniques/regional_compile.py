"""`model.compile`: torch.compile of each layer of the layer stack (regional compilation,
train/regional_compile.py), the last patch: it must see the final modules, adapters included. When
it pays: memory/fit.compile_note.

Its rules refuse it, each with its code, where the compiled layer would trace through something
that changes the layer's parameters or its autograd graph behind dynamo's back:

- ZeRO-3 (`compile-zero3`): DeepSpeed gathers and releases each submodule's parameters in hooks
  around its forward and backward, inside the compiled layer; its own `engine.compile()` is the
  route for that, which jobspec does not take. ZeRO 0-2 keep every parameter whole and reduce
  gradients in hooks on the parameters, which run outside the compiled graph.
- a quantized base (`compile-quantized`): bitsandbytes' packed 4-bit and 8-bit weights and their
  quantisation state inside a compiled layer are untested here.
- the tiled MLP (`compile-tiled-mlp`): DeepSpeed's `TiledMLP` runs its own backward per tile inside
  the layer's autograd function.
- checkpointed inputs offloaded to the host (`compile-activation-offload`): DeepSpeed's offload
  copies each layer's input out and back in hooks across the layer's forward and backward.

Sequence parallelism is refused in techniques/sequence_parallel.py, with the other limits of
Ulysses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

OFF = "set `model.compile: false`"


def compile_issues(r: ResolvedSpec) -> list[SpecIssue]:
    spec = r.spec
    if not spec["model"]["compile"]:
        return []
    memory, field = spec["memory"], ("model", "compile")
    issues = []
    if memory["zero_stage"] == 3:
        issues.append(r.issue(
            field, "regional compilation cannot run under ZeRO stage 3: DeepSpeed gathers and "
            "releases each submodule's parameters in hooks inside the compiled layers",
            f"set `memory.zero_stage: 2` (or lower), or {OFF}", code="compile-zero3"))
    if spec["model"]["quantization"]:
        issues.append(r.issue(
            field, "regional compilation of a quantized base is not supported here (bitsandbytes' "
            "packed weights inside a compiled layer are untested)",
            f"{OFF}, or drop model.quantization for plain LoRA", code="compile-quantized"))
    if memory["tiled_mlp"]:
        issues.append(r.issue(
            field, "regional compilation with the tiled MLP is not supported here (DeepSpeed's "
            "TiledMLP runs its own backward per tile inside the compiled layer)",
            f"{OFF}, or remove memory.tiled_mlp", code="compile-tiled-mlp"))
    checkpointing = memory["activation_checkpointing"]
    if isinstance(checkpointing, dict) and checkpointing["offload"] == "cpu":
        issues.append(r.issue(
            field, "regional compilation with checkpointed inputs offloaded to the host is not "
            "supported here (DeepSpeed copies each layer's input out and back in hooks across the "
            "compiled layer)", f"{OFF}, or set memory.activation_checkpointing.offload: none",
            code="compile-activation-offload"))
    return issues


def _args(spec: JobSpec) -> dict | None:
    return {} if spec["model"]["compile"] else None


TECHNIQUE = Technique(
    name="torch_compile", summary="torch.compile of each layer (`model.compile`, regional)",
    args=_args, text=lambda args: "torch.compile of each layer (regional)",
    apply="jobspec.train.regional_compile:regional_compile", after_base=True,
    rules=(compile_issues,))
