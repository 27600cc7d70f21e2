"""The model's structure as training changes it: the layer stack, activation checkpointing (every
layer, one in k, or any chosen layers), freezing by name pattern and the attention implementation.

Shared by the ranks (train/patches.py registers these as patches) and the planner's trace
(model/planner_trace.py), so the plan measures the model exactly as training will run it.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jobspec.errors import spec_error

if TYPE_CHECKING:
    from jobspec.model.planner_trace import TraceSetting

# Attribute paths where transformers models keep their stack of transformer layers.
LAYER_STACK_PATHS = ("encoder.layer", "h", "layers", "decoder.layers", "encoder.layers", "block",
                     "blocks")


def attention_implementation(model, implementation: str = "sdpa") -> str:
    """Check (and if needed switch) the attention kernel; build_model normally already asked for
    it."""
    if getattr(model, "has_attention", True) is False:   # jobspec's mlp: nothing to check or switch
        return f"attention: none in {type(model).__name__} ({implementation!r} not applicable)"
    current = getattr(model.config, "_attn_implementation", None)
    if current != implementation and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError) as err:
            raise spec_error(f"cannot switch attention to {implementation!r}: {err}",
                             path=("model", "attention"), hint="use sdpa or eager") from None
        current = getattr(model.config, "_attn_implementation", None)
    if current != implementation:
        raise spec_error(f"the model runs attention {current!r}, not the requested "
                         f"{implementation!r}",
                         path=("model", "attention"),
                         hint="use an implementation this model supports")
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
        # a KV cache is useless in training and conflicts with recompute
        model.config.use_cache = False
    return (f"activation checkpointing: one layer in {every_n_layers} "
            f"(use_reentrant={use_reentrant}) via {how}")


def trace_checkpointing(model, setting: TraceSetting):
    """The planner's trace's `gradient_checkpointing`: a unit trace's checkpointed layers
    (`setting.types`), else one layer in `setting.every` as the ranks' patch; the checkpointed
    layers' indices go to `setting.checkpointed` (the tiling and the offload act on them)."""
    if setting.types is not None:
        setting.checkpointed = [i for i, (_, ckpt) in enumerate(setting.types) if ckpt]
        if setting.checkpointed:
            checkpoint_layers(model, setting.checkpointed, use_reentrant=setting.reentrant)
        return model
    every = setting.every
    if every:
        gradient_checkpointing(model, every, setting.reentrant)
    stack = find_layer_stack(model)
    setting.checkpointed = [i for i in range(len(stack) if stack is not None else 0)
                            if every and i % every == 0]
    return model


def checkpoint_every_nth_layer(model, every_n_layers: int, *, use_reentrant: bool = False) -> int:
    """Wrap the forward of every k-th layer (i % k == 0) of the model's layer stack in checkpoint();
    returns the count."""
    layers = find_layer_stack(model)
    count = len(layers) if layers is not None else 0
    return checkpoint_layers(model, [i for i in range(count) if i % every_n_layers == 0],
                             use_reentrant=use_reentrant)


def checkpoint_layers(model, indices, *, use_reentrant: bool = False) -> int:
    """Wrap the forward of the chosen layers of the model's layer stack in checkpoint(); returns the
    count.

    Layers get their inputs as positional tensors plus keyword options (masks, caches, flags) in
    transformers 5; the keywords are bound with functools.partial so the reentrant implementation,
    which only tracks positional tensors, still sees the hidden states.
    """
    import torch.utils.checkpoint

    layers = find_layer_stack(model)
    if layers is None:
        raise spec_error(f"{type(model).__name__}: no transformer layer stack found for activation "
                         "checkpointing",
                         path=("memory", "activation_checkpointing"),
                         hint="use every_n_layers: 1 (the model's own checkpointing) or turn it "
                              "off")
    if hasattr(getattr(model, "config", None), "use_cache"):
        # a KV cache built in training would be appended to again when a layer is recomputed
        model.config.use_cache = False
    if use_reentrant and hasattr(model, "enable_input_require_grads"):
        # reentrant checkpoint only backpropagates when an input requires grad
        model.enable_input_require_grads()
    wrapped = 0
    chosen = set(indices)
    for index, layer in enumerate(layers):
        if index not in chosen:
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

    # a PEFT model (model.lora): the transformers model inside
    unwrap = getattr(model, "get_base_model", None)
    if callable(unwrap):
        model = unwrap()
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


def freeze(model, patterns: Sequence[str] = ()) -> str:
    """Stop gradients for parameters whose name matches a pattern (fnmatch).

    A pattern may leave out leading module names: `embeddings.*` matches
    `bert.embeddings.word_embeddings.weight`. A pattern that matches nothing is an error.
    """
    names = [name for name, _ in model.named_parameters()]
    frozen: set[str] = set()
    for i, pattern in enumerate(patterns):
        matched = [name for name in names if name_matches(name, pattern)]
        if not matched:
            raise spec_error(f"freeze pattern {pattern!r} matches no parameter",
                             path=("model", "freeze", i),
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


def name_matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))
