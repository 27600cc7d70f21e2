"""`model.lora` and `model.quantization` on the torch side: PEFT's LoraConfig, the adapters put on a
model, the target patterns checked against the model's real module names, bitsandbytes' quantisation
config.

One code path for everyone who needs the adapted model, `adapt(model, settings)` with the settings
of patches.json's `lora` patch (techniques/lora.lora_patch_args): the ranks (train/lora_adapters,
the patch in the compiler's order), the planner's trace (model/planner_trace.py wraps its meta model
through `apply_lora`, so the plan counts exactly the adapters PEFT makes), the export, and the
job-preparation check (`check_targets` on the meta model job/checks builds: compile, plan, launch
and `--dry-run` refuse a pattern that matches nothing before any rank starts, positioned at
`model.lora.target_modules[i]`).

Matching is PEFT's (peft.tuners.tuners_utils.check_target_module_exists): a list entry matches a
module whose dotted name equals it or ends with `.<entry>`; `all-linear` is every linear layer but
the output head. Modules in `modules_to_save` are trained in full and never get adapters.
Imports torch, peft and transformers inside the functions only: `jobspec validate` never loads them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobspec import tasks
from jobspec.errors import SpecError, SpecIssue, did_you_mean, spec_error
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.model.planner_trace import TraceSetting

ALL_LINEAR = "all-linear"
# PEFT's LoRA layer kinds by torch / transformers class name (peft.tuners.lora.model dispatchers):
# a pattern naming only other modules (an attention block, a layer norm) is refused here rather
# than by PEFT's ValueError from inside get_peft_model
ADAPTABLE = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention",
             "Linear4bit", "Linear8bitLt")
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def settings(spec: JobSpec) -> dict:
    """`model.lora` as patches.json's `lora` patch carries it (techniques/lora.lora_patch_args)."""
    from jobspec.techniques.lora import lora_patch_args

    return lora_patch_args(spec)


def modules_to_save(spec: JobSpec, model) -> list[str]:
    """`model.lora.modules_to_save`, or (null) the task's head modules the model has (tasks/: the
    classification heads are new, randomly initialised, and must be trained)."""
    if spec["model"]["lora"] is None:
        return []
    return saved_modules(settings(spec), model)


def saved_modules(lora: dict, model) -> list[str]:
    """The `modules_to_save` of the patch's settings that `model` has (PEFT passes over the
    others)."""
    names = [name for name, _ in model.named_modules()]
    return [entry for entry in lora["modules_to_save"]
            if any(_matches(name, entry) for name in names)]


def resolve_targets(spec: JobSpec, model) -> list[str]:
    """The dotted names of the modules that get adapters, as PEFT will pick them; SpecError (every
    bad pattern at once) when a pattern matches no adaptable module, with the nearest module
    names."""
    return targets_of(settings(spec), model)


def targets_of(lora: dict, model) -> list[str]:
    """`resolve_targets` of the patch's settings."""
    saved = saved_modules(lora, model)
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if name}
    adaptable = [name for name, kind in kinds.items() if kind in ADAPTABLE
                 and not _saved(name, saved)]
    if lora["target_modules"] == ALL_LINEAR:
        output = _output_module_name(model)
        chosen = [n for n in adaptable
                  if kinds[n] in ("Linear", "Conv1D", "Linear4bit", "Linear8bitLt")
                  and n != output]
        if not chosen:
            raise spec_error(f"`all-linear` finds no linear layer in {type(model).__name__} "
                             "outside the head",
                             path=("model", "lora", "target_modules"),
                             hint="list the modules to adapt by name", code="lora-targets")
        return chosen
    issues, chosen = [], []
    for i, pattern in enumerate(lora["target_modules"]):
        hits = [name for name in adaptable if _matches(name, pattern)]
        if hits:
            chosen += [h for h in hits if h not in chosen]
            continue
        others = [name for name in kinds if _matches(name, pattern)]
        if any(_saved(name, saved) for name in others):
            message = (f"target module pattern {pattern!r} matches only modules in modules_to_save "
                       f"({others[0]}), which are trained in full and never get adapters")
            hint = "drop it from target_modules, or from model.lora.modules_to_save"
        elif others:
            message = (f"target module pattern {pattern!r} matches only {kinds[others[0]]} modules "
                       f"({others[0]}{', ...' if len(others) > 1 else ''}); LoRA adapts linear, "
                       "embedding and convolution layers")
            inside = sorted({n.rsplit(".", 1)[-1] for n in adaptable
                             if n.startswith(f"{others[0]}.")})
            hint = f"name the layers inside it: {', '.join(inside[:6])}" if inside \
                else "name a linear layer"
        else:
            message = (f"target module pattern {pattern!r} matches no module of "
                       f"{type(model).__name__}")
            leaves = sorted({n.rsplit(".", 1)[-1] for n in adaptable})
            hint = did_you_mean(pattern.rsplit(".", 1)[-1], leaves,
                                "the model's adaptable modules", n=3,
                                quote="'", shown=8, otherwise=None if leaves else
                                "the model has no linear, embedding or convolution layer")
        issues.append(SpecIssue(path=("model", "lora", "target_modules", i), message=message,
                                hint=hint, code="lora-targets"))
    if issues:
        raise SpecError(issues)
    return chosen


def check_targets(spec: JobSpec, model) -> None:
    """The job-preparation check (job/checks.lora_target_check builds `model` on the meta device: no
    weights, no memory): `model.lora`'s patterns and `modules_to_save` entries against its module
    names; SpecError without file positions (the caller locates it)."""
    if spec["model"]["lora"] is None:
        return
    written = spec["model"]["lora"]["modules_to_save"]
    if written:
        names = [name for name, _ in model.named_modules() if name]
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        issues = [SpecIssue(path=("model", "lora", "modules_to_save", i),
                            message=f"modules_to_save entry {entry!r} matches no module of "
                                    f"{type(model).__name__}",
                            hint=did_you_mean(entry.rsplit(".", 1)[-1], leaves,
                                              "the model's modules", n=3, quote="'", shown=8),
                            code="lora-modules-to-save")
                  for i, entry in enumerate(written) if not any(_matches(n, entry) for n in names)]
        if issues:
            raise SpecError(issues)
    resolve_targets(spec, model)


def lora_config(spec: JobSpec, model) -> Any:
    """`peft.LoraConfig` of `model.lora` for `model` (its head modules resolved against the
    model)."""
    return config_of(settings(spec), model)


def config_of(lora: dict, model) -> Any:
    """`peft.LoraConfig` of the patch's settings for `model`."""
    from peft import LoraConfig

    target = lora["target_modules"]
    targets_of(lora, model)   # refuse here what PEFT would refuse with a traceback
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=target if target == ALL_LINEAR else list(target),
                      modules_to_save=saved_modules(lora, model) or None, bias=lora["bias"],
                      use_rslora=lora["use_rslora"], use_dora=lora["use_dora"])


def adapt(model, lora: dict):
    """`model` wrapped by `peft.get_peft_model` with the `lora` patch's settings: the base frozen,
    the adapters and `modules_to_save` trainable."""
    from peft import get_peft_model

    return get_peft_model(model, config_of(lora, model))


def apply_lora(model, spec: JobSpec):
    """`adapt` with `model.lora` (the model itself when it is null)."""
    if spec["model"]["lora"] is None:
        return model
    return adapt(model, settings(spec))


def trace_lora(model, setting: TraceSetting):
    """The planner's trace's `lora`: `apply_lora`, the ranks' own call, as a step of the model's
    build (`setting.guard`: PEFT's failure is the spec's model's); the model as it is without
    `model.lora`."""
    if setting.spec["model"]["lora"] is None:
        return model
    return setting.guard(lambda: apply_lora(model, setting.spec))


def compute_dtype(spec: JobSpec) -> str:
    """The torch dtype name 4-bit weights are dequantised to: `compute_dtype`, `auto` = the training
    precision."""
    quant = spec["model"]["quantization"]
    chosen = quant["compute_dtype"] if quant else "auto"
    return COMPUTE_DTYPES[spec["memory"]["precision"] if chosen == "auto" else chosen]


def quantization_config(spec: JobSpec, model=None) -> Any:
    """`transformers.BitsAndBytesConfig` of `model.quantization` (None when null).

    The trained head (`modules_to_save`) stays unquantised: bitsandbytes' layers cannot be trained.
    Naming skip modules replaces transformers' default skips (the output embeddings, the last
    module, tied weights), so those are added back from `model` (a meta skeleton is enough) when
    given. 4-bit weights are stored in the compute dtype's width (`bnb_4bit_quant_storage`), as
    transformers and PEFT document for sharding them with ZeRO-3 / FSDP; the packing itself is
    unchanged.
    """
    quant = spec["model"]["quantization"]
    if quant is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    skip: list[str] | None = None
    saved = modules_to_save(spec, model) if model is not None else list(
        spec["model"]["lora"]["modules_to_save"] if spec["model"]["lora"] and
        spec["model"]["lora"]["modules_to_save"] is not None
        else tasks.get(spec["model"]["task"]).head_modules)
    if saved:
        from transformers.quantizers.base import get_keys_to_not_convert

        defaults = get_keys_to_not_convert(model) if model is not None else []
        skip = sorted(set(saved) | set(defaults))
    dtype = getattr(torch, compute_dtype(spec))
    if quant["bits"] == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant["quant_type"],
                              bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_use_double_quant=quant["double_quant"],
                              bnb_4bit_quant_storage=dtype, llm_int8_skip_modules=skip)


def quantized_linear_names(spec: JobSpec, model) -> list[str]:
    """The base's linear layers bitsandbytes replaces when the model loads with
    `quantization_config` (transformers' rule: nn.Linear outside the skip modules and the model's
    `_keep_in_fp32_modules`), for the planner's byte count and the ranks' quantisation alike."""
    if spec["model"]["quantization"] is None:
        return []
    import torch.nn as nn
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = quantization_config(spec, model)
    skip = config.llm_int8_skip_modules
    if skip is None:
        skip = get_keys_to_not_convert(model) if hasattr(model, "all_tied_weights_keys") else []
    skip = [*skip, *(getattr(model, "_keep_in_fp32_modules", None) or [])]
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and should_convert_module(name, skip)]


def parameter_counts(model) -> dict[str, int]:
    """{"trainable", "total"}: the elements of a (PEFT-wrapped) model's parameters, each tensor
    once, a 4-bit weight counted by its logical shape (bitsandbytes packs two values per byte in a
    flat uint8 tensor) and a ZeRO-3 partition by its full shape."""
    trainable = total = 0
    for param in model.parameters():
        n = _logical_numel(param)
        total += n
        if param.requires_grad:
            trainable += n
    return {"trainable": trainable, "total": total}


def _logical_numel(param) -> int:
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        numel = 1
        for dim in quant_state.shape:
            numel *= int(dim)
        return numel
    return int(getattr(param, "ds_numel", 0) or param.numel())


def _matches(name: str, pattern: str) -> bool:
    """PEFT's match of a `target_modules` list entry: the whole dotted name, or its dotted
    suffix."""
    return name == pattern or name.endswith(f".{pattern}")


def _saved(name: str, saved: list[str]) -> bool:
    """Whether a module is (inside) a `modules_to_save` entry, by PEFT's rule: the entry is one or
    more whole components of the dotted name."""
    dotted = f".{name}."
    return any(f".{entry}." in dotted for entry in saved)


def _output_module_name(model) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    output = get() if callable(get) else None
    if output is None:
        return None
    return next((name for name, module in model.named_modules() if module is output), None)


