"""`memory.activation_checkpointing.offload: cpu`: the checkpointed layers' inputs in pinned host
memory.

A checkpointed layer keeps only its input (the hidden states, micro-batch x sequence x hidden) from
its forward to its backward; at long sequences those inputs are the bulk of the layer activations
(32 layers x 32K tokens x 4096 x 2 bytes = 8 GiB for Llama-3-8B). DeepSpeed's
`CheckpointHiddenStatesOffload` (runtime/activation_checkpointing/offload_activations.py) copies
each one to a pinned host buffer on a side stream when the checkpoint saves it and back when the
backward recomputes the layer, keeping the newest one on the GPU (its backward comes first).

DeepSpeed marks the inputs of transformers' `GradientCheckpointingLayer`s that checkpoint
themselves; jobspec's one-layer-in-k checkpointing wraps a layer's forward instead
(model/structure.py), so the checkpointed layers are marked here by a forward pre-hook (and a
leftover mark dropped after the layer). The context is entered for the model's forward and left open
until the next forward: the backward restores the inputs after the forward has returned, and
DeepSpeed's own exit would drop them.

Shared by the ranks (train/patches.py) and the planner's trace, where `TracedOffload` moves each
offloaded input out of the GPU count at the moment DeepSpeed would start its copy and counts the
restored copy as a new allocation, so the plan's layer activations are what the GPU holds
(model/step.py).
"""
from __future__ import annotations

from jobspec.errors import spec_error

OFFLOAD_ATTRIBUTE = "jobspec_activation_offload"   # the model's manager (the trace finds it there)


def offload_checkpoints(model, every_n_layers: int = 1, *, indices=None,
                        traced: bool = False) -> str:
    """Offload the inputs of the checkpointed layers (i % every_n_layers == 0, or `indices`) to
    pinned host memory; `traced`: the planner's stand-in (`TracedOffload`)."""
    import functools

    from jobspec.model.structure import find_layer_stack

    layers = find_layer_stack(model)
    if layers is None:
        raise spec_error(f"{type(model).__name__}: no transformer layer stack whose inputs to "
                         "offload",
                         path=("memory", "activation_checkpointing", "offload"),
                         hint="set offload: none")
    manager = (TracedOffload if traced else _offload_class())()
    chosen = set(range(0, len(layers), every_n_layers) if indices is None else indices)
    for index, layer in enumerate(layers):
        if index in chosen:
            layer.register_forward_pre_hook(_mark(manager), with_kwargs=True)
            layer.register_forward_hook(_unmark(manager), with_kwargs=True)
    untiled = model.forward

    @functools.wraps(untiled)
    def forward(*args, **kwargs):
        import torch

        if not (model.training and torch.is_grad_enabled()):
            return untiled(*args, **kwargs)
        manager.begin()
        with manager:
            return untiled(*args, **kwargs)

    model.forward = forward
    setattr(model, OFFLOAD_ATTRIBUTE, manager)
    return (f"activation offload: the inputs of {len(chosen)} checkpointed "
            "layers in pinned host memory between forward and backward (DeepSpeed "
            "CheckpointHiddenStatesOffload)")


def _hidden_states(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states")


def _mark(manager):
    def hook(layer, args, kwargs):
        import torch

        hidden = _hidden_states(args, kwargs)
        if manager.active and layer.training and torch.is_grad_enabled() \
                and torch.is_tensor(hidden):
            manager.mark(hidden)
        return None

    return hook


def _unmark(manager):
    def hook(layer, args, kwargs, output):
        hidden = _hidden_states(args, kwargs)
        if manager.active and hidden is not None:
            manager._consume_mark(hidden)   # a mark no checkpoint consumed (id() is recycled)
        return None

    return hook


_CLASS = None


def _offload_class():
    """DeepSpeed's manager, kept open across the backward: its exit only waits for the copies; the
    inputs of the previous step are dropped when the next forward begins (`begin`)."""
    global _CLASS
    if _CLASS is None:
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            CheckpointHiddenStatesOffload,
        )

        class HeldOffload(CheckpointHiddenStatesOffload):
            active = False

            def begin(self) -> None:
                self.reset()

            def __enter__(self):
                self.active = True
                return super().__enter__()

            def __exit__(self, *args, **kwargs):
                self.active = False
                return super().__exit__(*args, **kwargs)

            def reset(self) -> None:
                super().reset()
                self._allowed.clear()

            def _sync_and_clear(self) -> None:
                self._sync_copy_streams()   # the backward still restores what the forward offloaded

        _CLASS = HeldOffload
    return _CLASS


class TracedOffload:
    """The planner's stand-in for DeepSpeed's manager under fake tensors: the same marks, the same
    newest-one-kept rule, no copies; `settle(tensor)` (the trace's counter) takes an offloaded input
    out of the GPU's live bytes, and its restore is a new GPU tensor freed after the layer's
    backward."""

    KEEP_LAST = 1   # DeepSpeed's keep_last_count default

    def __init__(self):
        self.active = False
        self.settle = None          # set by the traced step: counter.settle
        self._allowed: dict = {}
        self._kept: dict = {}
        self._host: dict = {}
        self._next = 0
        self._hooks = None

    def begin(self) -> None:
        self._allowed.clear()
        self._kept.clear()
        self._host.clear()

    def mark(self, tensor) -> None:
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1

    def _consume_mark(self, tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count <= 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    def _pack(self, tensor):
        if not self._consume_mark(tensor):
            return tensor
        self._next += 1
        self._kept[self._next] = tensor
        while len(self._kept) > self.KEEP_LAST:
            oldest = next(iter(self._kept))
            moved = self._kept.pop(oldest)
            if self.settle is not None:
                self.settle(moved)      # on the host from now on
            self._host[oldest] = moved
        return ("offloaded", self._next)

    def _unpack(self, ref):
        if not (isinstance(ref, tuple) and len(ref) == 2 and ref[0] == "offloaded"):
            return ref
        kept = self._kept.pop(ref[1], None)
        if kept is not None:
            return kept
        import torch

        host = self._host.pop(ref[1])
        restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                       device=host.device)
        return restored.copy_(host)

    def __enter__(self):
        from torch.autograd.graph import saved_tensors_hooks

        self.active = True
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *args):
        self.active = False
        assert self._hooks is not None
        self._hooks.__exit__(*args)
        self._hooks = None
        return False
