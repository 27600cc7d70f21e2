"""The techniques a spec can switch on: one module each, registered here in the order the ranks
apply their patches and the planner's trace applies them.

Each module declares a `Technique` (jobspec/techniques/base.py): its patches.json args for a spec
and the patch in a few words, the function the ranks call (`apply`, named, imported where it runs)
and the planner's trace's call or args, its cross-field rules, its ds_config.json fields, its step
in `--fit`'s search and the remedy it offers a plan. The compiler (`patches`, `ds_config`,
`patch_text`), the ranks (train/patches.PATCHES), the planner's trace
(model/planner_trace.apply_techniques), validation (`placed`: spec/validation.CROSS_FIELD_RULES),
`--fit` (memory/fit), the remedies and the console loop over `TECHNIQUES`; adding one: the
schema's field, one module here, one line below (docs/architecture.md, "Adding a technique").

Pure: no torch at import (`apply` and `trace` name functions; base.named_function imports them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.spec.types import JobSpec, JobSpecMemory
from jobspec.techniques import (
    activation_offload,
    fused_kernels,
    gradient_checkpointing,
    lora,
    model_settings,
    packing,
    quantization,
    regional_compile,
    sequence_parallel,
    tiled_loss,
    tiled_mlp,
)
from jobspec.techniques.base import FitStep, Technique

if TYPE_CHECKING:
    from jobspec.spec.derived import DerivedJob

# the patch order: the model set up, Liger's kernels before the patches that wrap the layers'
# modules (the tiled MLP), the tiling and offload on the checkpointed layers, then on the finished
# base the optimizer's groups, PEFT's adapters and torch.compile, which must see them; then the
# techniques that are no model patch
TECHNIQUES: tuple[Technique, ...] = (
    model_settings.ATTENTION,
    model_settings.TF32,
    model_settings.FREEZE,
    fused_kernels.TECHNIQUE,
    gradient_checkpointing.TECHNIQUE,
    tiled_mlp.TECHNIQUE,
    tiled_loss.TECHNIQUE,
    activation_offload.TECHNIQUE,
    model_settings.PARAMETER_GROUPS,
    lora.TECHNIQUE,
    regional_compile.TECHNIQUE,
    sequence_parallel.TECHNIQUE,
    packing.TECHNIQUE,
    quantization.TECHNIQUE,
)
BY_NAME: dict[str, Technique] = {t.name: t for t in TECHNIQUES}
PATCHED: tuple[Technique, ...] = tuple(t for t in TECHNIQUES if t.apply is not None)
# the planner's trace runs these as the ranks do; its cache key orders their settings so
TRACED: tuple[Technique, ...] = (tiled_loss.TECHNIQUE, tiled_mlp.TECHNIQUE,
                                 activation_offload.TECHNIQUE)


def get(name: str) -> Technique:
    return BY_NAME[name]


def patches(spec: JobSpec) -> list[dict]:
    """The model patches of a spec, in the registry's order (compile/compiler.compile_patches)."""
    found = []
    for technique in PATCHED:
        args = technique.args(spec)
        if args is not None:
            found.append({"name": technique.name, "args": args})
    return found


def ds_config(spec: JobSpec, job: DerivedJob) -> dict:
    """Every technique's ds_config.json fields for a spec, in the registry's order
    (compile/compiler.compile_spec)."""
    found: dict = {}
    for technique in TECHNIQUES:
        found.update(technique.ds_config(spec, job))
    return found


def patch_text(patch: dict) -> str:
    """A compiled patch in a few words (the launch header's and `jobspec compile`'s patch lines)."""
    name = patch.get("name")
    technique = BY_NAME.get(str(name))
    if technique is None or technique.apply is None:
        return str(name)
    return technique.text(patch.get("args") or {})


def trace_setting(memory: JobSpecMemory) -> tuple:
    """The traced techniques' settings of a `memory` section, in `TRACED`'s order (the trace's
    key)."""
    return tuple(t.trace_value(memory) for t in TRACED if t.trace_value is not None)


def fit_steps() -> list[FitStep]:
    """The techniques `--fit` may switch on, cheapest first."""
    return sorted((t.fit for t in TECHNIQUES if t.fit is not None), key=lambda step: step.cost)


def rules() -> list:
    """Every technique's cross-field rules, in the registry's order."""
    return [rule for t in TECHNIQUES for rule in t.rules]


# in `placed`'s order: every technique not named there, its rules in the registry's order
OTHERS = "the other techniques"


def placed(order: tuple) -> tuple:
    """`order` (spec/validation.CROSS_FIELD_RULES: rules, technique names and `OTHERS`) as rules:
    each name replaced by its technique's rules, `OTHERS` by the rules of the techniques `order`
    does not name (a new technique's run there without a line of its own)."""
    named = {item for item in order if isinstance(item, str) and item != OTHERS}
    unknown = named - set(BY_NAME)
    if unknown:
        raise KeyError(f"no technique {sorted(unknown)}")
    found: list = []
    for item in order:
        if item == OTHERS:
            found += [rule for t in TECHNIQUES if t.name not in named for rule in t.rules]
        elif isinstance(item, str):
            found += BY_NAME[item].rules
        else:
            found.append(item)
    return tuple(found)
