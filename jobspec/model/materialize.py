"""A transformers model made real one module at a time on its device, from a meta-device skeleton.

QLoRA's base from `model.architecture` (random weights) is built this way, so that no moment holds
the whole model in 16 bits, on the host or on the GPU: `skeleton` builds the model with its
parameters on the meta device (its buffers real, on the CPU: the rotary `inv_freq`, BERT's
`position_ids`), and `materialize` walks the modules in the order transformers' own
`initialize_weights` does (children first, then the module; a nested `PreTrainedModel` with its own
`_initialize_weights`), and for each module:

1. allocates its own parameters on the device in their dtype (a parameter tied to one made earlier
   is that same tensor) and moves its buffers there;
2. initialises it with the owning model's `_initialize_weights` (the model's `_init_weights`: the
   same distributions `from_config` draws, under transformers' guarded `torch.nn.init`);
3. hands it to `replace`, which may return a module to put in its place (QLoRA: a bitsandbytes
   layer quantised from the weight just drawn, model/quantize.quantized_linear); the 16-bit weight
   is then freed before the next module is made.

The values are those of transformers' `initialize_weights` on the same skeleton (the same draws in
the same order); they differ from `from_config`'s, whose constructors draw torch's default
initialisation first, in value but not in distribution.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

# name, module -> the module to put in its place, or None to keep it
Replace = Callable[[str, Any], Any]


def skeleton(auto_class, config, **kwargs):
    """`auto_class.from_config(config, **kwargs)` with every parameter on the meta device (no
    memory, no initialisation) and the buffers real on the CPU (accelerate's
    `init_empty_weights`)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, **kwargs)
    # inside, every parameter assigned was wrapped anew, so the constructor's ties (an output
    # embedding on the input one, XLM-R's decoder bias on its head's) are not ties: made again here,
    # so that `materialize` makes a tied tensor once
    model.tie_weights()
    # the constructor's `init_weights` ran over meta tensors and marked every module initialised
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    return model


def materialize(model, device, replace: Replace | None = None):
    """Make every parameter of a `skeleton` real on `device`, module by module, initialised by the
    model's own `_init_weights` (see the module docstring); ties kept. Returns the model."""
    import torch
    from transformers import initialization as init

    # id(meta parameter) -> (it, a weak reference to its real one)
    made: dict[int, tuple[Any, Any]] = {}
    custom = bool(model.is_custom_code())
    with torch.no_grad(), init.guard_torch_init_functions():
        walk = _Walk(torch.device(device), made, replace, custom)
        _walk(model, "", model._initialize_weights, walk)
    model.tie_weights()
    tensors = [*model.named_parameters(), *model.named_buffers()]
    left = [name for name, tensor in tensors if tensor.is_meta]
    if left:
        raise RuntimeError(f"left on the meta device after materialising: {', '.join(left[:5])}")
    return model


class _Walk:
    def __init__(self, device, made: dict, replace: Replace | None, custom: bool):
        self.device, self.made, self.replace, self.custom = device, made, replace, custom


def _walk(module, name: str, initialize, walk: _Walk):
    """`module` made real (children first), initialised, and maybe replaced: returns what stands in
    its place."""
    from transformers import PreTrainedModel

    seen: set[int] = set()   # a child registered twice is walked once, as `children()` yields it
    for child_name in list(module._modules):   # names only: a replaced child is not kept alive here
        child = module._modules[child_name]
        if child is None or id(child) in seen:
            continue
        seen.add(id(child))
        own = child._initialize_weights if isinstance(child, PreTrainedModel) else initialize
        new = _walk(child, f"{name}.{child_name}" if name else child_name, own, walk)
        if new is not child:
            setattr(module, child_name, new)
    _make_own_tensors(module, walk)
    initialize(module, walk.custom)
    replaced = walk.replace(name, module) if walk.replace is not None else None
    return module if replaced is None else replaced


def _make_own_tensors(module, walk: _Walk) -> None:
    import torch

    for key, param in list(module._parameters.items()):
        if param is None or not param.is_meta:
            continue
        _, earlier = walk.made.get(id(param), (None, None))
        real = earlier() if earlier is not None else None
        if real is None:
            real = torch.nn.Parameter(torch.empty_like(param, device=walk.device),
                                      requires_grad=param.requires_grad)
            # the meta parameter kept alive (its id stays unique), the real one only weakly: a
            # weight `replace` quantised away must be freed, not kept here
            walk.made[id(param)] = (param, weakref.ref(real))
        module._parameters[key] = real
    for key, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.device != walk.device:
            module._buffers[key] = buffer.to(walk.device)
