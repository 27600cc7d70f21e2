"""`Technique`: what one technique module declares, so that the compiler, the ranks, the planner's
trace, `--fit`, the remedies and the console read it from one place (jobspec/techniques).

Pure: no torch. `apply` names the function the ranks call (`"module:function"`, imported by
`apply_function` where it runs: train/patches on the ranks, model/planner_trace in the trace), and
`trace` the planner's trace's own call where it differs.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from jobspec.spec.types import JobSpec, JobSpecMemory

if TYPE_CHECKING:
    from jobspec.spec.derived import DerivedJob


@dataclass(frozen=True)
class FitStep:
    """A long-sequence technique `--fit` may switch on (memory/fit.py), tried in the order of `cost`
    (cheapest first) on top of checkpointing every layer."""

    key: str                             # its name among fit's technique levels
    changes: dict[str, Any]              # the spec fields it sets ({dotted path: value})
    cost: int                            # its place in the search: the expected slowdown's order
    words: str                           # how `describe` names it
    is_on: Callable[[JobSpec], bool]     # whether the spec has it already (then it stays on)
    # whether fit may try it for this spec
    available: Callable[[JobSpec], bool] = lambda spec: True
    # whether validation refuses it beside these changes ({dotted path: value}, the candidate's)
    refused: Callable[[JobSpec, dict], bool] = lambda spec, wanted: False


@dataclass(frozen=True)
class Technique:
    """One technique: a patch of the model in the registry's order, or a setting applied
    elsewhere."""

    name: str                            # its patch name in patches.json (or its key: no patch)
    summary: str                         # one line: what it does (docs, the registry's table)
    # its patches.json args for a spec, None: not applied; a technique that is no model patch
    # (the data's packing, Ulysses' groups, the quantised build) leaves args, text and apply out
    args: Callable[[JobSpec], dict | None] = lambda spec: None
    text: Callable[[dict], str] = lambda args: ""   # the patch in a few words (console, compile)
    apply: str | None = None             # "module:function" the ranks call as fn(model, **args)
    # the planner's trace applies it too, in the registry's order (its loop:
    # model/planner_trace.apply_techniques), either by its own call, "module:function" called as
    # fn(model, setting) -> the model (`setting`: a model/planner_trace.TraceSetting; Liger's
    # kernels stood in, a unit trace's checkpointed layers, PEFT's wrap) ...
    trace: str | None = None
    # ... or `apply` with args from the trace's setting (`trace_value`) and the checkpointed
    # layers' indices; None where the setting leaves it off
    trace_args: Callable[[Any, list[int]], dict | None] | None = None
    trace_value: Callable[[JobSpecMemory], Any] | None = None   # its part of the trace's setting
    # modules the trace loads before applying it (the first call would: the trace marks their loops)
    trace_imports: tuple[str, ...] = ()
    # applied to the finished base (the optimizer's groups, PEFT's adapters, torch.compile): the
    # console says a client optimizer where the first of them comes
    after_base: bool = False
    rules: tuple[Callable, ...] = ()     # its cross-field rules (spec/validation.CROSS_FIELD_RULES)
    # its top-level ds_config.json fields for a spec and its derived job ({}: none), merged by
    # compile/compiler.compile_spec after the ZeRO block
    ds_config: Callable[[JobSpec, DerivedJob], dict] = lambda spec, job: {}
    fit: FitStep | None = None
    # a remedy of a plan's GPU term ({term: "--set ... (why)"}); offered where `offerable`
    remedy: dict[str, str] = field(default_factory=dict)
    offerable: Callable[[JobSpec, int], bool] = lambda spec, zero_stage: False


def apply_function(technique: Technique) -> Callable:
    """The function `technique.apply` names, imported now (torch, on the ranks and in the trace)."""
    if technique.apply is None:
        raise TypeError(f"technique {technique.name} is no model patch")
    return named_function(technique.apply)


def named_function(name: str) -> Callable:
    """The function a `"module:function"` name (`apply`, `trace`) names, imported now."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)
