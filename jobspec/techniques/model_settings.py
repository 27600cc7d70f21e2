"""The patches that set the model up rather than save memory: the attention kernel, TF32, frozen
parameters and the optimizer's parameter groups. Each is one `Technique` of the registry (its place
in the patch order is jobspec/techniques/__init__.py's)."""
from __future__ import annotations

from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique


def _attention_args(spec: JobSpec) -> dict:
    return {"implementation": spec["model"]["attention"]}


ATTENTION = Technique(
    name="attention_implementation", summary="the attention kernel (`model.attention`)",
    args=_attention_args, text=lambda args: f"attention {args.get('implementation')}",
    apply="jobspec.model.structure:attention_implementation")


def _tf32_args(spec: JobSpec) -> dict | None:
    return {"enabled": True} if spec["memory"]["tf32"] else None


TF32 = Technique(
    name="tf32", summary="TF32 tensor cores for fp32 matmuls (`memory.tf32`)",
    args=_tf32_args, text=lambda args: f"tf32 {'on' if args.get('enabled', True) else 'off'}",
    apply="jobspec.train.patches:tf32")


def _freeze_args(spec: JobSpec) -> dict | None:
    patterns = spec["model"]["freeze"]
    return {"patterns": list(patterns)} if patterns else None


FREEZE = Technique(
    name="freeze", summary="parameters whose names match `model.freeze` trained not at all",
    args=_freeze_args, text=lambda args: f"frozen: {', '.join(args.get('patterns') or [])}",
    apply="jobspec.model.structure:freeze")


def _parameter_groups_args(spec: JobSpec) -> dict | None:
    optimizer = spec["training"]["optimizer"]
    if not (optimizer["weight_decay"] and optimizer["weight_decay_on"] == "matrices"):
        return None
    # the optimizer's parameter groups (DeepSpeed's config has no field for them): the decay on
    # matrices only, as transformers' Trainer groups them (train/patches.parameter_groups)
    return {"weight_decay": optimizer["weight_decay"],
            "no_decay": "biases and normalisation weights"}


PARAMETER_GROUPS = Technique(
    name="parameter_groups",
    summary="weight decay on matrices only (`training.optimizer.weight_decay_on: matrices`)",
    args=_parameter_groups_args,
    text=lambda args: f"weight decay {args.get('weight_decay')} on matrices, none on "
                      f"{args.get('no_decay')}",
    apply="jobspec.train.patches:parameter_groups_note", after_base=True)
