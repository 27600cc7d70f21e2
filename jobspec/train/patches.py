"""Model patches: the changes the compiler asks the worker to make to the model before DeepSpeed sees it.

`PATCHES` maps each patch name the compiler emits (`Compiled.patches`: `[{"name", "args"}]`) to a
function `fn(model, **args)` that changes the model in place and returns a note (or None). A patch
that has to replace the module (torch.compile) returns `(new_model, note)` instead.
`client_optimizer` builds an optimizer rather than changing the model: `apply_patches` skips it and
the worker calls `build_client_optimizer(model, args)` to pass the result to `deepspeed.initialize`.

Patch arguments, as the compiler writes them:
    attention_implementation {implementation}
    gradient_checkpointing  {every_n_layers, use_reentrant}
    tf32                    {enabled}
    freeze                  {patterns}
    client_optimizer        {name, lr, betas, eps, weight_decay, ...}
    torch_compile           {}  (any keyword is passed to torch.compile)
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
from typing import Callable

from jobspec.errors import spec_error
from jobspec.spec.optimizers import CLIENT_OPTIMIZERS, DEEPSPEED_OPTIMIZERS

# Attribute paths where transformers models keep their stack of transformer layers.
LAYER_STACK_PATHS = ("encoder.layer", "h", "layers", "decoder.layers", "encoder.layers", "block", "blocks")


def attention_implementation(model, implementation: str = "sdpa") -> str:
    """Check (and if needed switch) the attention kernel; build_model normally already asked for it."""
    if getattr(model, "has_attention", True) is False:   # jobspec's mlp: nothing to check or switch
        return f"attention: none in {type(model).__name__} ({implementation!r} not applicable)"
    current = getattr(model.config, "_attn_implementation", None)
    if current != implementation and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError) as err:
            raise spec_error(f"cannot switch attention to {implementation!r}: {err}", path=("model", "attention"),
                             hint="use sdpa or eager") from None
        current = getattr(model.config, "_attn_implementation", None)
    if current != implementation:
        raise spec_error(f"the model runs attention {current!r}, not the requested {implementation!r}",
                         path=("model", "attention"), hint="use an implementation this model supports")
    return f"attention: {implementation}"


def gradient_checkpointing(model, every_n_layers: int = 1, use_reentrant: bool = False) -> str:
    """Recompute layer activations in backward: every layer, or one layer in `every_n_layers`.

    transformers' own `activation_checkpointing_enable(every_n_layers=...)` is used when the model
    has it; otherwise every layer uses `gradient_checkpointing_enable`, and one-in-k is done here
    by wrapping the forward of layers i % k == 0 in `torch.utils.checkpoint`.
    """
    if every_n_layers < 1:
        raise spec_error("every_n_layers must be >= 1",
                         path=("memory", "activation_checkpointing", "every_n_layers"))
    kwargs = {"use_reentrant": use_reentrant}
    native = getattr(model, "activation_checkpointing_enable", None)
    if native is not None and "every_n_layers" in inspect.signature(native).parameters:
        native(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
        how = "transformers activation_checkpointing_enable"
    elif every_n_layers == 1 and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        how = "transformers gradient_checkpointing_enable"
    else:
        checkpoint_every_nth_layer(model, every_n_layers, use_reentrant=use_reentrant)
        how = "torch.utils.checkpoint on the layer forwards"
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with recompute
    return f"activation checkpointing: one layer in {every_n_layers} (use_reentrant={use_reentrant}) via {how}"


def checkpoint_every_nth_layer(model, every_n_layers: int, *, use_reentrant: bool = False) -> int:
    """Wrap the forward of every k-th layer of the model's layer stack in checkpoint(); returns the count.

    Layers get their inputs as positional tensors plus keyword options (masks, caches, flags) in
    transformers 5; the keywords are bound with functools.partial so the reentrant implementation,
    which only tracks positional tensors, still sees the hidden states.
    """
    import torch.utils.checkpoint

    layers = find_layer_stack(model)
    if layers is None:
        raise spec_error(f"{type(model).__name__}: no transformer layer stack found for activation checkpointing",
                         path=("memory", "activation_checkpointing"),
                         hint="use every_n_layers: 1 (the model's own checkpointing) or turn it off")
    if hasattr(getattr(model, "config", None), "use_cache"):
        # a KV cache built in training would be appended to again when a layer is recomputed
        model.config.use_cache = False
    if use_reentrant and hasattr(model, "enable_input_require_grads"):
        # reentrant checkpoint only backpropagates when an input requires grad
        model.enable_input_require_grads()
    wrapped = 0
    for index, layer in enumerate(layers):
        if index % every_n_layers:
            continue
        original = layer.forward

        @functools.wraps(original)
        def forward(*args, _original=original, _layer=layer, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(functools.partial(_original, **kwargs), *args,
                                                     use_reentrant=use_reentrant)

        layer.forward = forward
        wrapped += 1
    return wrapped


def find_layer_stack(model):
    """The model's ModuleList of transformer layers (encoder.layer, h, layers, ...), or None."""
    import torch.nn as nn

    roots = [model]
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        roots.append(base)
    for root in roots:
        for path in LAYER_STACK_PATHS:
            node = root
            for part in path.split("."):
                node = getattr(node, part, None)
            if isinstance(node, nn.ModuleList) and len(node) > 0:
                return node
    return None


def tf32(model, enabled: bool = True) -> str:
    """Allow TF32 tensor cores for fp32 matmuls and convolutions (a no-op on CPU)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return f"tf32: {'on' if enabled else 'off'}"


def freeze(model, patterns: list[str] = ()) -> str:
    """Stop gradients for parameters whose name matches a pattern (fnmatch).

    A pattern may leave out leading module names: `embeddings.*` matches
    `bert.embeddings.word_embeddings.weight`. A pattern that matches nothing is an error.
    """
    names = [name for name, _ in model.named_parameters()]
    frozen: set[str] = set()
    for i, pattern in enumerate(patterns):
        matched = [name for name in names if _name_matches(name, pattern)]
        if not matched:
            raise spec_error(f"freeze pattern {pattern!r} matches no parameter", path=("model", "freeze", i),
                             hint=f"parameter names look like {', '.join(names[:3])}")
        frozen.update(matched)
    total = frozen_count = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if name in frozen:
            param.requires_grad_(False)
            frozen_count += param.numel()
    share = 100.0 * frozen_count / total if total else 0.0
    return f"freeze: {len(frozen)} tensors, {frozen_count:,} parameters ({share:.1f}%)"


def _name_matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def client_optimizer(model, name: str = "adamw", **_hyper) -> str:
    """Registry entry only: the optimizer itself is built by `build_client_optimizer`."""
    return f"optimizer: {name} (client optimizer built by jobspec)"


def torch_compile(model, **compile_kwargs):
    """Wrap the model in torch.compile; returns the compiled module, which replaces the model."""
    import torch

    return torch.compile(model, **compile_kwargs), "torch.compile: on (compiled at the first step)"


PATCHES: dict[str, Callable] = {
    "attention_implementation": attention_implementation,
    "gradient_checkpointing": gradient_checkpointing,
    "tf32": tf32,
    "freeze": freeze,
    "client_optimizer": client_optimizer,
    "torch_compile": torch_compile,
}


def apply_patches(model, patches: list[dict]):
    """Apply the compiled patches in order; returns (model, notes). `client_optimizer` is skipped."""
    import torch.nn as nn

    notes: list[str] = []
    for index, patch in enumerate(patches):
        name, args = patch.get("name"), dict(patch.get("args") or {})
        if name not in PATCHES:
            raise spec_error(f"unknown patch {name!r} in patches.json (entry {index})",
                             hint=f"known patches: {', '.join(PATCHES)}")
        if name == "client_optimizer":
            continue
        try:
            result = PATCHES[name](model, **args)
        except TypeError as err:
            raise spec_error(f"patch {name!r} got bad arguments {args}: {err}",
                             hint="recompile the job: patches.json is written by `jobspec compile`") from None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
            model, result = result
        if result:
            notes.append(str(result))
    return model, notes


def build_client_optimizer(model, args: dict):
    """The optimizer DeepSpeed cannot build from its config: bitsandbytes AdamW8bit or Adafactor.

    Returns None for optimizers DeepSpeed builds itself (adamw, sgd). Weight decay goes to every
    trainable parameter except biases and normalisation weights (the Hugging Face Trainer grouping).
    """
    name = args.get("name", "adamw")
    if name in DEEPSPEED_OPTIMIZERS:
        return None
    groups = parameter_groups(model, float(args.get("weight_decay", 0.0)))
    lr = float(args.get("lr", 5e-5))
    if name == "adamw_8bit":
        return _adamw_8bit(model, groups, lr, args)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # Fixed lr from the schedule (no relative step / parameter scaling), no first moment:
        # that is what keeps Adafactor's state small. Adam's eps does not apply (Adafactor has its own).
        return Adafactor(groups, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False)
    raise spec_error(f"unknown optimizer {name!r}", path=("training", "optimizer", "name"),
                     hint=f"use one of {', '.join(DEEPSPEED_OPTIMIZERS + CLIENT_OPTIMIZERS)}")


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


def _adamw_8bit(model, groups: list[dict], lr: float, args: dict):
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise spec_error(f"adamw_8bit needs bitsandbytes, which does not import here: {err}",
                         path=("training", "optimizer", "name"),
                         hint="pip install 'jobspec[bnb]' (bitsandbytes), or use adamw") from None
    import torch.nn as nn

    optimizer = bnb.optim.AdamW8bit(groups, lr=lr, betas=tuple(args.get("betas", (0.9, 0.999))),
                                    eps=float(args.get("eps", 1e-8)))
    # Embedding rows are updated sparsely and 8-bit state quantises them badly: keep their
    # state in 32 bits, as the Hugging Face Trainer does.
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer
