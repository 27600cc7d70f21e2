"""What the planner knows of a model, measured from the model itself
(`jobspec/model/planner_trace.py`): pure data.

- `Inventory`: every parameter tensor of the model as training builds it (names, shapes, trainable
  or frozen by `model.freeze`; tied weights once), its buffers, the layer stack's size and its
  largest layer.
- `UnitTrace`: one forward + backward of the model cut to a short sequence of layers, under fake
  tensors: the peak of live activations and temporaries, itemised by region, and the FLOPs torch's
  counter saw.
- `compose`: the trace of the full layer stack from unit traces (docs/memory-planner.md, "The
  trace"):

      trace(t_0 .. t_{L-1}) = U(t_0, K, t_{L-2}, t_{L-1}) + sum over the other middle layers i of
                              [U(t_0, K, t_i, t_{L-2}, t_{L-1}) - U(t_0, K, t_{L-2}, t_{L-1})]

  where t_i is layer i's type (its attention kind from `config.layer_types`, and whether it is
  checkpointed), K one middle layer of each kind that t_0 and the last two do not have, and U(...) a
  unit trace of a model with exactly those layers. Each middle layer adds what it keeps for backward
  to every point of the peak region; the first layer's type decides what is kept of the embeddings'
  output, the last two what happens at the turn from forward to backward (DeBERTa-v2's shared
  relative-position tensors need both), and K makes every per-kind mask exist once in every unit, as
  in the whole model. tests/model/test_trace.py holds this equal to the full trace, for uniform,
  alternating (local/global) and checkpointed-one-in-k stacks.
- `ModelProfile`: an inventory and the composed trace of one setting (what `DerivedJob.profile`
  holds).

No torch here: the planner (pure) reads these, and the trace cache stores them as JSON.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

REGIONS = ("layers", "embeddings", "logits_and_loss", "gradients")


@dataclass(frozen=True)
class Inventory:
    """The model's parameters (tied weights once) and buffers, as training builds it."""

    model_type: str
    # ((name, shape tuple, trainable bool), ...) in the model's parameter order
    tensors: tuple
    num_layers: int           # length of the transformer layer stack (0: none found)
    layer_params: int         # parameters of the largest layer (ZeRO-3 gathers a layer at a time)
    layer_kinds: tuple = ()   # per layer: its attention kind (`config.layer_types`), or "layer"
    hidden_size: int | None = None
    uniform: bool = True      # the layers differ at most in their kind (else every layer is traced)
    buffer_float_elements: int = 0   # floating buffers: cast to the training dtype with the model
    buffer_other_bytes: int = 0      # integer/bool buffers (position ids, masks)
    # names of the frozen base weights bitsandbytes quantises (`model.quantization`; model/lora.py)
    quantized: tuple = ()

    @functools.cached_property
    def total(self) -> int:
        return sum(_numel(shape) for _, shape, _ in self.tensors)

    @functools.cached_property
    def trainable(self) -> int:
        return sum(_numel(shape) for _, shape, trainable in self.tensors if trainable)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def buffer_bytes(self, precision_bytes: int) -> int:
        return self.buffer_float_elements * precision_bytes + self.buffer_other_bytes

    def quantized_shapes(self) -> list[tuple]:
        names = set(self.quantized)
        return [tuple(shape) for name, shape, _ in self.tensors if name in names]

    def trainable_shapes(self) -> list[tuple]:
        return [tuple(shape) for _, shape, trainable in self.tensors if trainable]

    def as_dict(self) -> dict:
        return {**asdict(self), "tensors": [[n, list(s), t] for n, s, t in self.tensors],
                "layer_kinds": list(self.layer_kinds), "quantized": list(self.quantized)}

    @classmethod
    def from_dict(cls, d: dict) -> "Inventory":
        return cls(model_type=d["model_type"],
                   tensors=tuple((n, tuple(s), bool(t)) for n, s, t in d["tensors"]),
                   num_layers=d["num_layers"], layer_params=d["layer_params"],
                   layer_kinds=tuple(d.get("layer_kinds", ())), hidden_size=d.get("hidden_size"),
                   uniform=bool(d.get("uniform", True)),
                   buffer_float_elements=d.get("buffer_float_elements", 0),
                   buffer_other_bytes=d.get("buffer_other_bytes", 0),
                   quantized=tuple(d.get("quantized", ())))


PHASES = ("outside", "stack", "turn")
# The same phases with every parameter gradient kept from the moment it is made: a step that starts
# without gradients (ZeRO-0 with one micro-batch per step: the engine sets them to None after each
# step) holds at its peak the activations and the gradients made so far ("gradients" region).
GRADIENT_PHASES = tuple(f"{name}_with_gradients" for name in PHASES)


@dataclass(frozen=True)
class Phase:
    """The peak of one phase of a step and each region's live bytes at that moment."""

    peak: int
    regions: dict             # region -> bytes (sums to peak)

    def __add__(self, other: "Phase") -> "Phase":
        return Phase(self.peak + other.peak,
                     {r: self.regions[r] + other.regions[r] for r in REGIONS})

    def __sub__(self, other: "Phase") -> "Phase":
        return Phase(self.peak - other.peak,
                     {r: self.regions[r] - other.regions[r] for r in REGIONS})


@dataclass(frozen=True)
class UnitTrace:
    """One traced forward + backward: the peak of live activations and temporaries, the live bytes
    of each region at that peak, the FLOPs counted, and the peak of each phase of the step:

    - "outside": before the layer stack's forward starts and after its backward ends (embeddings,
      the inputs, the embeddings' backward): no layer keeps anything then;
    - "stack": while a layer of the stack runs, forward or backward (recompute included);
    - "turn": between the stack's forward and its backward (final norm, head, logits, loss).
    """

    peak: int
    regions: dict             # region -> bytes live at the peak (sums to peak)
    flops: float
    phases: dict = field(default_factory=dict)   # phase -> Phase

    def as_dict(self) -> dict:
        return {"peak": self.peak, "regions": self.regions, "flops": self.flops,
                "phases": {name: asdict(phase) for name, phase in self.phases.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "UnitTrace":
        phases = {name: Phase(int(v["peak"]), {r: int(v["regions"][r]) for r in REGIONS})
                  for name, v in d.get("phases", {}).items()}
        return cls(peak=int(d["peak"]), regions={r: int(d["regions"][r]) for r in REGIONS},
                   flops=float(d["flops"]), phases=phases)

    @classmethod
    def of_phases(cls, phases: dict, flops: float) -> "UnitTrace":
        """The step's peak is its highest phase's (of PHASES: each gradient leaves the activations
        as it lands in `.grad`)."""
        top = max((phases[name] for name in PHASES if name in phases), key=lambda phase: phase.peak)
        return cls(peak=top.peak, regions=dict(top.regions), flops=flops, phases=phases)

    def with_gradients(self) -> "UnitTrace":
        """The trace of a step that keeps every gradient it makes (GRADIENT_PHASES): its peak and
        each region's bytes then, the "gradients" made by that moment included."""
        if not all(name in self.phases for name in GRADIENT_PHASES):
            raise ValueError("this trace has no gradient phases (traced before they were recorded)")
        top = max((self.phases[name] for name in GRADIENT_PHASES), key=lambda phase: phase.peak)
        return UnitTrace(peak=top.peak, regions=dict(top.regions), flops=self.flops,
                         phases=self.phases)


def layer_types(kinds: tuple, checkpointed: tuple) -> tuple:
    """Each layer's type for the composition: (attention kind, checkpointed)."""
    return tuple(zip(kinds, checkpointed))


TAIL = 2   # layers every unit ends with (tests/model/test_trace.py: 1 is not exact for DeBERTa-v2)


def compose(types: tuple, unit: Callable[[tuple], UnitTrace]) -> UnitTrace:
    """The trace of a stack of layers of these types from `unit(types_tuple) -> UnitTrace` (see
    above).

    Every unit keeps the first layer (what it does with the embeddings' output), the last two (the
    turn from forward to backward, and what the layer before the last keeps across it) and one layer
    of each attention kind those do not have (a model builds one mask per kind present, once,
    whatever the number of layers using it); each other layer adds its own increment over that base,
    phase by phase: to the peak while the stack runs and to the peak of the turn, not to the peak
    outside the stack (the embeddings' backward, say, when every layer's tensors are gone).
    """
    types = tuple(types)
    if len(types) <= TAIL + 2:
        return unit(types)
    first, middle, last = types[:1], types[1:-TAIL], types[-TAIL:]
    kinds = {layer_type[0] for layer_type in first + last}
    representatives = []
    for index, layer_type in enumerate(middle):
        if layer_type[0] not in kinds:
            kinds.add(layer_type[0])
            representatives.append(index)
    context = tuple(middle[i] for i in representatives)
    base = unit(first + context + last)
    phases = dict(base.phases)
    flops = base.flops
    for index, layer_type in enumerate(middle):
        if index in representatives:
            continue
        grown = unit(first + context + (layer_type,) + last)
        flops += grown.flops - base.flops
        # "outside" does not grow: no layer keeps anything then (but its gradients, which are kept)
        growing = ("stack", "turn", *GRADIENT_PHASES)
        for name in (name for name in growing if name in phases):
            phases[name] = phases[name] + (grown.phases[name] - base.phases[name])
    return UnitTrace.of_phases(phases, flops)


@dataclass(frozen=True)
class ModelProfile:
    """The planner's measured facts of one job setting: parameters, activations, FLOPs per token."""

    inventory: Inventory
    activations: UnitTrace            # the composed (or full) trace at the job's setting
    model_flops_per_token: float      # no recompute (checkpointing off), PaLM's MFU numerator
    hardware_flops_per_token: float   # with the checkpointed layers' recompute
    method: str = "composed"          # "composed" from unit traces, or "full" (every layer traced)
    notes: tuple = field(default=())

    def as_dict(self) -> dict:
        """The summary launch.json carries (no tensor list)."""
        inv = self.inventory
        return {"parameters": inv.total, "trainable_parameters": inv.trainable,
                "num_layers": inv.num_layers,
                "activations": self.activations.as_dict(),
                "model_flops_per_token": self.model_flops_per_token,
                "hardware_flops_per_token": self.hardware_flops_per_token, "method": self.method,
                "notes": list(self.notes)}


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
