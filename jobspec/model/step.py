"""One training step of a model traced under fake tensors: what the planner measures
(jobspec/model/planner_trace.py).

`run_step` runs forward + backward on a micro-batch shaped as the data loader gives it
(`step_inputs`), inside the caller's FakeTensorMode, under `_LiveStorages`: a dispatch mode that
sees every storage an op creates and, by a weak reference, when it dies; parameters and buffers are
not allocations, and a parameter's gradient counts until it lands in `.grad` (then it is a model
state). Each storage is tagged with the region that was running (torch's ModTracker): a layer of the
stack, the embeddings (the rest of the base model, the inputs), or the head, logits and loss. The
FLOPs of the same ops come from torch's counter formulas (`flop_registry`; `FlopCounterMode` itself
keeps a checkpointed layer's recomputed tensors alive through its module tracking, which would
inflate the memory measured).

The result is a timeline (allocations +bytes, frees -bytes, regions, where backward starts);
`summarize` turns it into a `UnitTrace` (the peak of each phase of the step, by region), and
`extrapolate` gives the timeline at any micro-batch from those at 1 and 2 (every size is affine in
the batch); model/lengths.py the timeline at a long sequence from three short ones, from the
shapes and tile loops the timeline also records. `dispatch_worst_case` gives data-dependent shapes
their worst case.
"""
from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

from jobspec import tasks
from jobspec.memory.model_profile import REGIONS, UnitTrace
from jobspec.model.activation_offload import OFFLOAD_ATTRIBUTE
from jobspec.model.kernels import dropout_stand_in, mask_skip_stand_in, sdpa_stand_in
from jobspec.model.lengths import ALLOCATOR_ROUND, storage_shape, tile_loops
from jobspec.model.padding_mask import PACKED, PADDING, trace_mask
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import CLASS, TOKEN_CLASS


def step_inputs(spec: JobSpec, config, micro_batch: int, seq_len: int) -> dict:
    """What a micro-batch hands the model on the ranks (data/loaders.py, then
    model/padding_mask.model_inputs): ids, labels and, where the ranks keep one, the attention
    mask."""
    import torch

    vocab = int(getattr(config, "vocab_size", 0) or 1000)
    ids = torch.randint(0, vocab, (micro_batch, seq_len))
    batch = {"input_ids": ids}
    task = tasks.of(spec)
    mask = mask_of(spec)
    if mask == PADDING:
        batch["attention_mask"] = torch.ones(micro_batch, seq_len, dtype=torch.long)
    elif mask == PACKED:
        batch["position_ids"] = torch.arange(seq_len).expand(micro_batch, seq_len)
    labels = task.labels   # the task's label shape (jobspec/tasks)
    labels_count = int(spec["model"]["num_labels"])
    if labels == CLASS:
        batch["labels"] = torch.randint(0, labels_count, (micro_batch,))
    elif labels == TOKEN_CLASS:
        batch["labels"] = torch.randint(0, labels_count, (micro_batch, seq_len))
    else:
        batch["labels"] = ids.clone()
    return batch


def mask_of(spec: JobSpec) -> str:
    """The attention mask the ranks hand the model (model/padding_mask.trace_mask) for this spec."""
    data = spec["data"]
    return trace_mask(causal=tasks.of(spec).shift > 0, fixed_length=bool(data.get("synthetic")),
                      packed=bool(data.get("packing")))


def run_step(model, spec: JobSpec, micro_batch: int, seq_len: int, stack) -> dict:
    """One forward + backward under the counters (inside the caller's FakeTensorMode)."""
    from torch.distributed._tools.mod_tracker import ModTracker

    params = list(model.parameters())
    tracker = ModTracker()
    root = type(model).__name__
    base = getattr(model, "base_model_prefix", "")
    layer_prefix = _layer_prefix(model, stack, root)
    counter: Any = _LiveStorages(lambda: _region(tracker.parents, root, base, layer_prefix))
    counter.ignore(params + list(model.buffers()))
    offload = getattr(model, OFFLOAD_ATTRIBUTE, None)
    # memory.activation_checkpointing.offload: an input on the host leaves the GPU count
    if offload is not None:
        offload.settle = functools.partial(counter.settle, gradient=False)
    # No garbage collection while tracing: a collection frees tensors held in reference cycles at
    # whatever moment it happens to run, which would make the peak depend on the interpreter's
    # timing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _traced_step(model, spec, micro_batch, seq_len, tracker, counter, params)
    finally:
        if collecting:
            gc.enable()


def _traced_step(model, spec, micro_batch, seq_len, tracker, counter, params) -> dict:
    # A parameter's gradient is a temporary until it lands in `.grad` (then it is a model state,
    # which the planner counts as "gradients"): the hook takes it out of the activations at that
    # moment. Until then it counts: the head's gradient in flight is part of the peak of an
    # accumulation step, and of every ZeRO-1/2/3 step (the hooks copy it to a bucket).
    hooks = [p.register_post_accumulate_grad_hook(lambda p: counter.settle(p.grad)) for p in params
             if p.requires_grad]
    try:
        packed = mask_of(spec) == PACKED
        with sdpa_stand_in(), dropout_stand_in(), mask_skip_stand_in(packed=packed), \
                tile_loops(counter), tracker, counter:
            counter.fixed_region = "embeddings"
            batch = step_inputs(spec, getattr(model, "config", None), micro_batch, seq_len)
            counter.fixed_region = None
            loss = forward_loss(model, batch)   # the output dropped at once, as the ranks drop it
            counter.backward_at = len(counter.events)
            loss.backward()
            del loss, batch
    finally:
        for hook in hooks:
            hook.remove()
    return counter.timeline()


def forward_loss(model, batch: dict):
    """The loss of one micro-batch, the model's output dropped before the backward: what the ranks
    run (train/oom.OomGuard.forward: `loss_of(engine(**batch))`), so the trace holds the logits no
    longer than they do (tests/model/test_tiling.py holds the two to the same peak)."""
    return loss_of(model(**batch))


def loss_of(outputs):
    """The loss of a model's outputs: a ModelOutput (a dict), an object with `.loss`, or a tuple."""
    return outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", outputs[0])


def _layer_prefix(model, stack, root: str) -> str | None:
    if stack is None:
        return None
    for name, module in model.named_modules():
        if module is stack:
            return f"{root}.{name}." if name else f"{root}."
    return None


def _region(parents: set, root: str, base: str, layer_prefix: str | None) -> str:
    if layer_prefix and any(p.startswith(layer_prefix) for p in parents):
        return "layers"
    if base and any(p == f"{root}.{base}" or p.startswith(f"{root}.{base}.") for p in parents):
        return "embeddings"
    return "logits_and_loss"


class _LiveStorages:
    """A dispatch mode counting live tensor storages created inside it, with the region of each."""

    def __new__(cls, region_of):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry as FLOP_FORMULAS

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.region_of = region_of
                self.fixed_region = None
                self.events: list = []      # (serial, +bytes | -bytes, region, a gradient landing)
                self.sizes: dict = {}       # serial -> (bytes, region)
                self.backward_at = 0        # index of the first event of the backward pass
                self.flops = 0
                self.seen: dict = {}        # storage id -> weakref
                self.shapes: dict = {}      # serial -> storage_shape (model/lengths.py)
                self.loops: list = []       # tile loops (model/lengths.tile_loops)
                self.open_loop = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                kwargs = kwargs or {}
                out = dispatch_worst_case(func, args, kwargs)
                formula = FLOP_FORMULAS.get(func._overloadpacket)
                if formula is not None:
                    self.flops += formula(*args, **kwargs, out_val=out)
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self._note(t)
                return out

            def _note(self, t) -> None:
                storage = t.untyped_storage()
                if id(storage) in self.seen:
                    return
                # a serial, not id(): a freed storage's id is reused by later ones
                serial = len(self.events)
                size = storage.nbytes()
                region = self.fixed_region or self.region_of()
                self.events.append((serial, size, region, False))
                self.sizes[serial] = (size, region)
                self.shapes[serial] = storage_shape(t, size)
                self.seen[id(storage)] = (serial, weakref.ref(
                    storage, functools.partial(self._freed, id(storage), serial, size, region)))

            def ignore(self, tensors) -> None:
                """Storages that exist before the step (parameters, buffers): a view of one (a
                weight's transpose) is not a new allocation."""
                for t in tensors:
                    storage = t.untyped_storage()
                    self.seen[id(storage)] = (-1, storage)

            def _freed(self, key, serial, size, region, _ref) -> None:
                self.seen.pop(key, None)
                self.events.append((serial, -size, region, False))

            def settle(self, grad, *, gradient: bool = True) -> None:
                """A gradient stored in `.grad`: from now on a model state (`_settle`)."""
                _settle(self, grad, gradient=gradient)

            def timeline(self) -> dict:
                return _timeline(self)

        return Mode()


def _settle(mode, grad, *, gradient: bool = True) -> None:
    """A gradient stored in `.grad`: from now on a model state, not a live temporary
    (`gradient=False`: a tensor that leaves the GPU, an offloaded checkpoint input)."""
    if grad is None:
        return
    storage = grad.untyped_storage()
    entry = mode.seen.get(id(storage))
    if entry is None or entry[0] < 0:
        return   # already settled (a shared weight's later contributions add in place)
    serial, _ = entry
    size, region = mode.sizes[serial]
    mode.events.append((serial, -size, region, gradient))
    mode.seen[id(storage)] = (-1, storage)   # its real free, later, is not an event


def _timeline(mode) -> dict:
    """The step as allocations (+bytes) and frees (-bytes) in order, with their regions (a
    gradient landing in `.grad`: its region's code in upper case)."""
    codes = "".join(REGION_CODES[r].upper() if landed else REGION_CODES[r]
                    for _, _, r, landed in mode.events)
    # for model/lengths.py: each event's storage (its allocation's serial), the shape of
    # each allocation, the tile loops
    serials = [serial for serial, _, _, _ in mode.events]
    return {"sizes": [size for _, size, _, _ in mode.events], "regions": codes,
            "backward": mode.backward_at, "flops": float(mode.flops),
            "serials": serials, "loops": mode.loops,
            "shapes": [mode.shapes[s] if i == s else [] for i, s in enumerate(serials)]}


REGION_CODES = {"layers": "l", "embeddings": "e", "logits_and_loss": "o"}
_REGION_OF_CODE = {code: region for region, code in REGION_CODES.items()}


def summarize(timeline: dict) -> UnitTrace:
    """The peak of live bytes over a timeline (each storage rounded to the allocator's 512-byte
    blocks), phase by phase (`UnitTrace`), with each region's live bytes at each phase's peak;
    twice: each gradient leaving the count as it lands in `.grad` (PHASES), and every gradient kept,
    in the "gradients" region from then on (GRADIENT_PHASES)."""
    from jobspec.memory.model_profile import GRADIENT_PHASES, PHASES, Phase

    codes = timeline["regions"]
    backward = timeline["backward"]
    layer_events = [i for i, code in enumerate(codes) if code == "l"]
    forward_end = max((i for i in layer_events if i < backward), default=-1)
    backward_start = min((i for i in layer_events if i >= backward), default=len(codes))
    first, last = (layer_events[0], layer_events[-1]) if layer_events else (len(codes), -1)

    def phase_of(i: int) -> str:
        if i < first or i > last:
            return "outside"
        return "turn" if forward_end < i < backward_start else "stack"

    peaks = {}
    for names, keep in ((PHASES, False), (GRADIENT_PHASES, True)):
        live = dict.fromkeys(REGIONS, 0)
        total = 0
        found = {name: Phase(0, dict(live)) for name in PHASES}
        for i, (size, code) in enumerate(zip(timeline["sizes"], codes)):
            rounded = -(-abs(size) // ALLOCATOR_ROUND) * ALLOCATOR_ROUND
            region = _REGION_OF_CODE[code.lower()]
            if size >= 0:
                live[region] += rounded
            elif keep and code.isupper():   # a gradient landing: kept, as a gradient
                live[region] -= rounded
                live["gradients"] += rounded
                continue
            else:
                live[region] -= rounded
            total += rounded if size >= 0 else -rounded
            name = phase_of(i)
            if total > found[name].peak:
                found[name] = Phase(total, dict(live))
        peaks.update({kept_name: found[name] for name, kept_name in zip(PHASES, names)})
    return UnitTrace.of_phases(peaks, timeline["flops"])


def extrapolate(one: dict, two: dict, batch: int) -> dict | None:
    """The timeline at micro-batch `batch` from those at 1 and 2, or None when they differ in their
    events (then the batch is traced)."""
    if len(one["sizes"]) != len(two["sizes"]) or one["regions"] != two["regions"] \
            or one["backward"] != two["backward"]:
        return None
    sizes = []
    for a, b in zip(one["sizes"], two["sizes"]):
        if (a >= 0) != (b >= 0):
            return None
        sizes.append(a + (batch - 1) * (b - a))
    return {"sizes": sizes, "regions": one["regions"], "backward": one["backward"],
            "flops": one["flops"] + (batch - 1) * (two["flops"] - one["flops"])}


def dispatch_worst_case(func, args, kwargs):
    """Run an op; ops whose output size depends on the values (nonzero) get their worst case: every
    element selected (DeBERTa's classification loss picks its labelled rows this way)."""
    import torch

    if func is torch.ops.aten.nonzero.default:
        (x,) = args
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    return func(*args, **kwargs)
