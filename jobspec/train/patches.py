"""Model patches: the changes the compiler asks the worker to make to the model before DeepSpeed sees it.

`PATCHES` maps each patch name the compiler emits (`Compiled.patches`: `[{"name", "args"}]`) to a
function `fn(model, **args)` that changes the model in place and returns a note (or None). A patch
that may replace the module (torch.compile of a model without a layer stack) returns
`(model, note)` instead.
`parameter_groups` shapes the optimizer rather than the model: `apply_patches` skips it and the
worker passes `optimizer_parameters(model, patches)` (the decayed matrices and the undecayed biases and
norms) to a client optimizer or to `deepspeed.initialize`. The optimizer DeepSpeed cannot build from
its config is no patch: the worker builds it from the resolved spec (`client_optimizer`).

Patch arguments, as the compiler writes them:
    attention_implementation {implementation}
    gradient_checkpointing  {every_n_layers, use_reentrant}
    tf32                    {enabled}
    freeze                  {patterns}
    parameter_groups        {weight_decay, no_decay}  (`training.optimizer.weight_decay_on: matrices`)
    lora                    {r, alpha, dropout, target_modules, modules_to_save, bias, use_rslora, use_dora,
                             enable_input_require_grads}  (PEFT's adapters: train/lora_adapters.lora)
    torch_compile           {}  (regional: each layer of the layer stack, train/regional_compile.py;
                                 any keyword is passed to torch.compile)
    tiled_loss              {tiles}  (null: as many as keep one tile's logits within model/tiling.TILE_BYTES)
    tiled_mlp               {}
    activation_offload      {every_n_layers}
    fused_kernels           {kernels, fused_loss}  (`model.kernels`: model/fused_kernels)
"""
from __future__ import annotations

import inspect
from typing import Callable

from jobspec import optimizers
from jobspec.errors import spec_error
from jobspec.model.activation_offload import offload_checkpoints
from jobspec.model.fused_kernels import fused_kernels
from jobspec.model.structure import attention_implementation, freeze, gradient_checkpointing
from jobspec.model.tiling import tiled_loss, tiled_mlp
from jobspec.spec.types import JobSpecTrainingOptimizer
from jobspec.train.lora_adapters import lora
from jobspec.train.regional_compile import regional_compile


def tf32(model, enabled: bool = True) -> str:
    """Allow TF32 tensor cores for fp32 matmuls and convolutions (a no-op on CPU)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return f"tf32: {'on' if enabled else 'off'}"


def parameter_groups_note(model, weight_decay: float = 0.0, no_decay: str = "") -> str:
    """Registry entry only: the groups are built by `optimizer_parameters`."""
    return f"weight decay {weight_decay} on matrices only (none on {no_decay})"


PATCHES: dict[str, Callable] = {
    "attention_implementation": attention_implementation,
    "gradient_checkpointing": gradient_checkpointing,
    "tf32": tf32,
    "freeze": freeze,
    "parameter_groups": parameter_groups_note,
    "lora": lora,
    "torch_compile": regional_compile,
    "tiled_loss": tiled_loss,
    "tiled_mlp": tiled_mlp,
    "activation_offload": offload_checkpoints,
    "fused_kernels": fused_kernels,
}


def apply_patches(model, patches: list[dict]):
    """Apply the compiled patches in order; returns (model, notes). `parameter_groups` is skipped (the
    worker's `optimizer_parameters` reads it). The order is the compiler's: `lora` wraps the model after
    every patch of the base and before `torch_compile`, which must see the final module.
    """
    import torch.nn as nn

    notes: list[str] = []
    for index, patch in enumerate(patches):
        name, args = patch.get("name"), dict(patch.get("args") or {})
        if name not in PATCHES:
            raise spec_error(f"unknown patch {name!r} in patches.json (entry {index})",
                             hint=f"known patches: {', '.join(PATCHES)}")
        if name == "parameter_groups":   # the optimizer's groups, built by the worker
            continue
        patch_fn = PATCHES[name]
        try:   # the arguments checked apart from the call: a TypeError from inside a patch is its own
            inspect.signature(patch_fn).bind(model, **args)
        except TypeError as err:
            raise spec_error(f"patch {name!r} got bad arguments {args}: {err}",
                             hint="recompile the job: patches.json is written by `jobspec compile`") from None
        result = patch_fn(model, **args)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
            model, result = result
        if result:
            notes.append(str(result))
    return model, notes


def optimizer_parameters(model, patches: list[dict], weight_decay: float = 0.0) -> list:
    """What the optimizer gets (`deepspeed.initialize`'s `model_parameters`, a client optimizer's
    groups): with a `parameter_groups` patch, the trainable matrices decayed by its `weight_decay` and
    the biases and normalisation weights not at all; without one (`weight_decay` 0, or
    `weight_decay_on: all`), one group of every trainable parameter at `weight_decay` (DeepSpeed's
    optimizers take their config's)."""
    for patch in patches:
        if patch.get("name") == "parameter_groups":
            return parameter_groups(model, float((patch.get("args") or {}).get("weight_decay", 0.0)))
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]


def client_optimizer(model, optimizer: JobSpecTrainingOptimizer, patches: list[dict]):
    """The optimizer of the spec's `training.optimizer` that DeepSpeed cannot build from its config
    (bitsandbytes AdamW8bit, Adafactor), None for DeepSpeed's own: `build_client_optimizer` with its
    module's `client_args` (what `jobspec compile` prints on its `optimizer:` line), over
    `optimizer_parameters` of the compiled patches."""
    chosen = optimizers.get(optimizer["name"])
    if chosen.client_args is None:
        return None
    args = chosen.client_args(optimizer)
    return build_client_optimizer(model, args, optimizer_parameters(model, patches, float(args["weight_decay"])))


def build_client_optimizer(model, args: dict, groups: list | None = None):
    """The optimizer DeepSpeed cannot build from its config (bitsandbytes AdamW8bit, Adafactor): its
    module's `build` (jobspec/optimizers) with `args` as its `client_args` writes them.

    Returns None for optimizers DeepSpeed builds itself (adamw, sgd). `groups`: `optimizer_parameters`'
    (None: the Hugging Face Trainer grouping, weight decay on every trainable parameter except biases
    and normalisation weights).
    """
    name = args.get("name", "adamw")
    if name not in optimizers.OPTIMIZERS:
        raise spec_error(f"unknown optimizer {name!r}", path=("training", "optimizer", "name"),
                         hint=f"use one of {', '.join(optimizers.OPTIMIZERS)}")
    optimizer = optimizers.get(name)
    if optimizer.built_by_deepspeed:
        return None
    if optimizer.build is None:
        raise TypeError(f"optimizer {name}: a client optimizer without `build`")
    if groups is None:
        groups = parameter_groups(model, float(args.get("weight_decay", 0.0)))
    return optimizer.build(model, groups, args)


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters split into a decayed group and a no-decay group (biases, norms)."""
    import torch.nn as nn
    from transformers.trainer_pt_utils import get_parameter_names

    # the name patterns of transformers' Trainer.get_decay_parameter_names
    no_decay_patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay_names = set(get_parameter_names(model, [nn.LayerNorm], no_decay_patterns))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if n in decay_names], "weight_decay": weight_decay},
        {"params": [p for n, p in trainable if n not in decay_names], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
