"""The planner's measurements of a model, from the model's own code: parameters, activations, FLOPs.

The spec's model is built on the meta device exactly as the ranks build it (`model/build.py`, the
`model.freeze` and checkpointing code of `model/structure.py`), moved to fake CPU tensors
(`FakeTensorMode`: shapes and dtypes, no memory, no compute) and cast to the training precision. One
forward + backward then runs with the job's micro-batch, sequence length, task head and loss, under:

- `_LiveStorages`, a dispatch mode that sees every tensor an op creates and, by a weak reference, when its
  storage dies: the peak of live bytes (rounded to the CUDA allocator's 512-byte blocks) over the step,
  parameters and their gradients left out (the planner counts those as model states), itemised by
  the module that was running (torch's `ModTracker`): a layer of the stack, the embeddings (the rest of
  the base model, the inputs), or the head, logits and loss;
- the formulas of torch's FLOP counter (`torch.utils.flop_counter.flop_registry`, what `FlopCounterMode`
  applies) on the same ops. (`FlopCounterMode` itself is not used: its module tracking keeps a
  checkpointed layer's recomputed tensors alive, which would inflate the memory being measured.)

Attention: eager runs as written. SDPA cannot reach the GPU kernels in a CPU torch, so it runs through
`_sdpa_stand_in`, which calls the real kernels' meta functions (`_scaled_dot_product_flash_attention`
with no mask and 16-bit inputs, else `_scaled_dot_product_efficient_attention`): what they keep for
backward (q, k, v, output, fp32 log-sum-exp) and their FLOPs are the kernels' own; the backward adds the
fp32 scratch the kernels allocate (flash: dq accumulator and softmax_d; efficient: delta).

Speed: a trace costs ~90 µs per op. Layers are traced in short units and composed (`spec.model_profile.compose`,
exact: tests/model/test_trace.py), unit traces are cached in-process and on disk (`JOBSPEC_CACHE_DIR`,
else `$XDG_CACHE_HOME/jobspec`, else `~/.cache/jobspec`), keyed by everything that changes them.
Data-dependent routing (mixture-of-experts) cannot be traced without data and is refused by name.
"""
from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import os
import tempfile
import weakref
from pathlib import Path

from jobspec.errors import SpecError, first_line, spec_error
from jobspec.spec.model_profile import REGIONS, Inventory, ModelProfile, UnitTrace, compose, layer_types

TRACE_VERSION = 3   # bump when what a trace measures changes: old cache entries are not read
ALLOCATOR_ROUND = 512          # the CUDA caching allocator's smallest block
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# config attributes that mean tokens are routed to experts by their values
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ModelTracer:
    """Builds, traces and caches one spec model (its `model` section); settings vary per call."""

    def __init__(self, spec: dict, cache_dir: Path | None = None):
        self.spec = spec
        self.model_key = model_key(spec)
        self.cache_dir = cache_dir
        self._units: dict = {}
        self._inventory: Inventory | None = None
        self._config = None

    # ------------------------------------------------------------------ public
    def inventory(self) -> Inventory:
        if self._inventory is None:
            cached = self._load("inventory")
            if cached is not None:
                self._inventory = Inventory.from_dict(cached)
            else:
                model = self._build(layers=None)
                if self.spec["model"].get("freeze"):
                    from jobspec.model.structure import freeze

                    freeze(model, self.spec["model"]["freeze"])
                self._inventory = _inventory_of(model, getattr(model, "config", None))
                self._store("inventory", self._inventory.as_dict())
        return self._inventory

    def profile(self, precision: str, micro_batch: int, seq_len: int, checkpointing) -> ModelProfile:
        """The job setting's activations and FLOPs: composed from unit traces, or every layer traced when
        the layers differ in more than their `config.layer_types` kind (or there is no layer stack)."""
        inv = self.inventory()
        every, reentrant = checkpoint_setting(checkpointing)
        if inv.num_layers == 0 or not inv.uniform:
            trace = self.full(precision, micro_batch, seq_len, checkpointing)
            model_trace = self.full(precision, micro_batch, seq_len, False) if every else trace
            method = "full"
        else:
            flags = tuple(bool(every) and i % every == 0 for i in range(inv.num_layers))
            unit = functools.partial(self.unit, precision, micro_batch, seq_len, reentrant=reentrant)
            trace = compose(layer_types(inv.layer_kinds, flags), unit)
            plain = tuple(False for _ in flags)
            model_trace = compose(layer_types(inv.layer_kinds, plain), unit) if every else trace
            method = "composed"
        tokens = micro_batch * seq_len
        return ModelProfile(inventory=inv, activations=trace, model_flops_per_token=model_trace.flops / tokens,
                            hardware_flops_per_token=trace.flops / tokens, method=method)

    def unit(self, precision: str, micro_batch: int, seq_len: int, types: tuple, *, reentrant: bool = False
             ) -> UnitTrace:
        """A trace of the model cut to `types` ((attention kind, checkpointed) per layer).

        Micro-batches above 2 are not traced: every tensor's size is affine in the batch (b·x + y) and
        the ops do not change with it, so the timelines at 1 and 2 give every event's size at any b
        exactly (`_extrapolate`); where the two timelines differ in their ops, b is traced."""
        types = tuple(types)

        def timeline(batch: int) -> dict:
            key = ("timeline", precision, batch, seq_len, types, reentrant)
            return self._cached(key, lambda: self._trace(precision, batch, seq_len, types=types,
                                                         reentrant=reentrant), trace=False)

        def make() -> UnitTrace:
            if micro_batch > 2:
                synthetic = _extrapolate(timeline(1), timeline(2), micro_batch)
                if synthetic is not None:
                    return _summarize(synthetic)
            return _summarize(timeline(micro_batch))

        return self._cached(("unit", precision, micro_batch, seq_len, types, reentrant), make)

    def full(self, precision: str, micro_batch: int, seq_len: int, checkpointing) -> UnitTrace:
        """A trace of every layer at the micro-batch itself, checkpointed by the training patch (the
        reference the shortcuts are tested against)."""
        key = ("full", precision, micro_batch, seq_len, json.dumps(checkpointing, sort_keys=True))
        return self._cached(key, lambda: _summarize(self._trace(precision, micro_batch, seq_len,
                                                                checkpointing=checkpointing)))

    # ------------------------------------------------------------------ building
    def _config_for(self, kinds: tuple | None):
        """The spec's config, cut to the given layer kinds (None: as the spec says)."""
        from jobspec.model.build import build_config

        if self._config is None:
            self._config = self._build_step(lambda: build_config(self.spec)[1])
            _refuse_experts(self._config, self.spec)
        config = copy.deepcopy(self._config)
        if kinds is not None:
            _set_layer_count(config, len(kinds))
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = list(kinds)
        return config

    def _build(self, layers: tuple | None):
        import torch

        from jobspec.model.build import build_config, build_skeleton

        if self.spec["model"].get("architecture") == "mlp" and not self.spec["model"].get("name_or_path"):
            spec = copy.deepcopy(self.spec)
            if layers is not None:
                spec["model"].setdefault("config", {})["num_layers"] = len(layers)
            return self._build_step(lambda: build_skeleton(spec))
        config = self._config_for(layers)
        auto_class = self._build_step(lambda: build_config(self.spec)[0])
        attention = self.spec["model"].get("attention", "sdpa")
        trust = bool(self.spec["model"].get("trust_remote_code"))
        with torch.device("meta"):
            return self._build_step(lambda: auto_class.from_config(config, attn_implementation=attention,
                                                                  trust_remote_code=trust))

    def _build_step(self, make):
        from jobspec.model.build import loading_error

        try:
            return make()
        except SpecError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of transformers' code is the spec's model's
            model = self.spec["model"]
            raise loading_error(model, model.get("task", "sequence-classification"),
                                model.get("attention", "sdpa"), err) from None

    # ------------------------------------------------------------------ tracing
    def _trace(self, precision: str, micro_batch: int, seq_len: int, *, types: tuple | None = None,
               reentrant: bool = False, checkpointing=None) -> dict:
        """One traced step: its timeline (`_LiveStorages.timeline`)."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from jobspec.model.structure import checkpoint_layers, find_layer_stack, freeze, gradient_checkpointing

        kinds = tuple(kind for kind, _ in types) if types is not None else None
        model = self._build(layers=kinds)
        model.train()
        patterns = self.spec["model"].get("freeze") or []
        setting = f"{precision}, micro-batch {micro_batch}, seq {seq_len}"
        try:
            if patterns:
                freeze(model, patterns)
            if types is not None:
                chosen = [i for i, (_, ckpt) in enumerate(types) if ckpt]
                if chosen:
                    checkpoint_layers(model, chosen, use_reentrant=reentrant)
            else:
                every, reentrant = checkpoint_setting(checkpointing)
                if every:
                    gradient_checkpointing(model, every, reentrant)
            model = model.to(getattr(torch, PRECISION_DTYPES[precision]))   # on meta: no memory
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = model.to_empty(device="cpu")
                return _run_step(model, self.spec, micro_batch, seq_len, find_layer_stack(model))
        except SpecError:
            raise
        except Exception as err:  # noqa: BLE001 - report which setting could not be traced, in one line
            kind = type(err).__name__
            if "DataDependent" in kind or "DynamicOutputShape" in kind:
                raise spec_error(f"model type {self._model_type()!r} computes shapes from the data ({kind}); "
                                 "the planner traces without data and cannot plan it",
                                 path=("model",), hint="plan it with memory.fit: off and measure a few steps") from None
            raise spec_error(f"the planner's trace failed at {setting}: {kind}: {first_line(err)}",
                             path=("model",), hint="check model.config and model.attention; "
                             "`jobspec launch` still runs the job unplanned") from None

    def _model_type(self) -> str:
        return str(self.spec["model"].get("architecture") or getattr(self._config, "model_type", "?"))

    # ------------------------------------------------------------------ cache
    def _cached(self, key: tuple, make, *, trace: bool = True):
        """`make()` once per key: in this process, then on disk (a UnitTrace, or with trace=False a
        timeline dict)."""
        if key in self._units:
            return self._units[key]
        name = hashlib.sha256(json.dumps([str(k) for k in key]).encode()).hexdigest()[:24]
        stored = self._load(name)
        if stored is not None:
            result = UnitTrace.from_dict(stored) if trace else stored
        else:
            result = make()
            self._store(name, result.as_dict() if trace else result)
        self._units[key] = result
        return result

    def _path(self, name: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / "traces" / self.model_key / f"{name}.json"

    def _load(self, name: str) -> dict | None:
        path = self._path(name)
        if path is None or not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None   # a damaged entry is traced again and rewritten

    def _store(self, name: str, value: dict) -> None:
        """Atomic: a temporary file renamed into place, so concurrent launches never read half a file."""
        path = self._path(name)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        except OSError:
            pass   # a read-only or full cache only costs speed


def default_cache_dir() -> Path:
    if os.environ.get("JOBSPEC_CACHE_DIR"):
        return Path(os.environ["JOBSPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jobspec"


def model_key(spec: dict) -> str:
    """A hash of everything that changes a trace besides the job setting: the model section, a local
    checkpoint's config.json, and the versions of torch, transformers and this tracer."""
    model = spec["model"]
    fields = {k: model.get(k) for k in ("name_or_path", "architecture", "config", "revision", "task", "num_labels",
                                        "attention", "trust_remote_code", "freeze")}
    config_file = Path(model["name_or_path"]) / "config.json" if model.get("name_or_path") else None
    if config_file is not None and config_file.is_file():
        fields["config.json"] = hashlib.sha256(config_file.read_bytes()).hexdigest()
    text = json.dumps({"model": fields, "versions": _versions(), "tracer": TRACE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    """torch's and transformers' versions (read once: a metadata read costs ~5 ms)."""
    from importlib import metadata

    versions = {}
    for dist in ("torch", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def checkpoint_setting(checkpointing) -> tuple[int, bool]:
    """(every_n_layers, 0 when off; use_reentrant) of `memory.activation_checkpointing`."""
    if checkpointing is None or checkpointing is False:
        return 0, False
    if isinstance(checkpointing, dict):
        return int(checkpointing.get("every_n_layers", 1)), bool(checkpointing.get("use_reentrant", False))
    return 1, False


def _set_layer_count(config, n: int) -> None:
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if hasattr(config, name):
            setattr(config, name, n)
            return


def _refuse_experts(config, spec: dict) -> None:
    for key in _EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            raise spec_error(f"model type {config.model_type!r} routes each token to {value} experts by its "
                             "values (mixture of experts): the planner traces without data and does not guess "
                             "the routing", path=("model",),
                             hint="plan a dense model, or launch with memory.fit: off and measure a few steps")


def _inventory_of(model, config) -> Inventory:
    from jobspec.model.structure import find_layer_stack

    tensors = tuple((name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters())
    stack = find_layer_stack(model)
    num_layers = len(stack) if stack is not None else 0
    layer_params = max((sum(p.numel() for p in layer.parameters()) for layer in stack), default=0) if stack else 0
    kinds = getattr(config, "layer_types", None)
    if not (isinstance(kinds, list) and len(kinds) == num_layers):
        kinds = ["layer"] * num_layers
    # the layers differ only in their layer_types kind: same module classes, same parameter shapes
    shapes = [tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()) + (type(layer).__name__,)
              for layer in (stack or [])]
    return Inventory(model_type=str(getattr(config, "model_type", "mlp")), tensors=tensors,
                     num_layers=num_layers,
                     layer_params=layer_params, layer_kinds=tuple(str(k) for k in kinds),
                     hidden_size=getattr(config, "hidden_size", None),
                     uniform=all(shape == shapes[0] for shape in shapes),
                     buffer_float_elements=sum(b.numel() for b in model.buffers() if b.is_floating_point()),
                     buffer_other_bytes=sum(b.numel() * b.element_size() for b in model.buffers()
                                            if not b.is_floating_point()))


def _inputs(spec: dict, config, micro_batch: int, seq_len: int) -> dict:
    """What the data loader gives a micro-batch (train/data.py): ids, attention mask, labels."""
    import torch

    vocab = int(getattr(config, "vocab_size", 0) or 1000)
    ids = torch.randint(0, vocab, (micro_batch, seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones(micro_batch, seq_len, dtype=torch.long)}
    task = spec["model"].get("task", "sequence-classification")
    labels_count = int(spec["model"].get("num_labels", 2))
    if task == "sequence-classification":
        batch["labels"] = torch.randint(0, labels_count, (micro_batch,))
    elif task == "token-classification":
        batch["labels"] = torch.randint(0, labels_count, (micro_batch, seq_len))
    else:
        batch["labels"] = ids.clone()
    return batch


def _run_step(model, spec: dict, micro_batch: int, seq_len: int, stack) -> dict:
    """One forward + backward under the counters (inside the caller's FakeTensorMode)."""
    import torch
    from torch.distributed._tools.mod_tracker import ModTracker

    params = list(model.parameters())
    tracker = ModTracker()
    root = type(model).__name__
    base = getattr(model, "base_model_prefix", "")
    layer_prefix = _layer_prefix(model, stack, root)
    counter = _LiveStorages(lambda: _region(tracker.parents, root, base, layer_prefix))
    counter.ignore(params + list(model.buffers()))
    # No garbage collection while tracing: a collection frees tensors held in reference cycles at
    # whatever moment it happens to run, which would make the peak depend on the interpreter's timing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _traced_step(model, spec, micro_batch, seq_len, tracker, counter, params)
    finally:
        if collecting:
            gc.enable()


def _traced_step(model, spec, micro_batch, seq_len, tracker, counter, params) -> dict:
    # A parameter's gradient is a temporary until it lands in `.grad` (then it is a model state, which
    # the planner counts as "gradients"): the hook takes it out of the activations at that moment.
    # Until then it counts: the head's gradient in flight is part of the peak of an accumulation step,
    # and of every ZeRO-1/2/3 step (the hooks copy it to a bucket).
    hooks = [p.register_post_accumulate_grad_hook(lambda p: counter.settle(p.grad)) for p in params
             if p.requires_grad]
    try:
        with _sdpa_stand_in(), tracker, counter:
            counter.fixed_region = "embeddings"
            batch = _inputs(spec, getattr(model, "config", None), micro_batch, seq_len)
            counter.fixed_region = None
            output = model(**batch)
            loss = output.loss if hasattr(output, "loss") else output["loss"]
            counter.backward_at = len(counter.events)
            loss.backward()
            del output, loss, batch
    finally:
        for hook in hooks:
            hook.remove()
    return counter.timeline()


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
                self.events: list = []      # (serial, +bytes | -bytes, region)
                self.sizes: dict = {}       # serial -> (bytes, region)
                self.backward_at = 0        # index of the first event of the backward pass
                self.flops = 0
                self.seen: dict = {}        # storage id -> weakref

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                kwargs = kwargs or {}
                out = _dispatch(func, args, kwargs)
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
                self.events.append((serial, size, region))
                self.sizes[serial] = (size, region)
                self.seen[id(storage)] = (serial, weakref.ref(
                    storage, functools.partial(self._freed, id(storage), serial, size, region)))

            def ignore(self, tensors) -> None:
                """Storages that exist before the step (parameters, buffers): a view of one (a weight's
                transpose) is not a new allocation."""
                for t in tensors:
                    storage = t.untyped_storage()
                    self.seen[id(storage)] = (-1, storage)

            def _freed(self, key, serial, size, region, _ref) -> None:
                self.seen.pop(key, None)
                self.events.append((serial, -size, region))

            def settle(self, grad) -> None:
                """A gradient stored in `.grad`: from now on a model state, not a live temporary."""
                if grad is None:
                    return
                storage = grad.untyped_storage()
                entry = self.seen.get(id(storage))
                if entry is None or entry[0] < 0:
                    return   # already settled (a shared weight's later contributions add in place)
                serial, _ = entry
                size, region = self.sizes[serial]
                self.events.append((serial, -size, region))
                self.seen[id(storage)] = (-1, storage)   # its real free, later, is not an event

            def timeline(self) -> dict:
                """The step as allocations (+bytes) and frees (-bytes) in order, with their regions."""
                kept = [(size, region) for _, size, region in self.events]
                return {"sizes": [size for size, _ in kept], "regions": "".join(REGION_CODES[r] for _, r in kept),
                        "backward": self.backward_at, "flops": float(self.flops)}

        return Mode()


REGION_CODES = {"layers": "l", "embeddings": "e", "logits_and_loss": "o"}
_REGION_OF_CODE = {code: region for region, code in REGION_CODES.items()}


def _summarize(timeline: dict) -> UnitTrace:
    """The peak of live bytes over a timeline (each storage rounded to the allocator's 512-byte
    blocks), phase by phase (`UnitTrace`), with each region's live bytes at each phase's peak."""
    from jobspec.spec.model_profile import Phase

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

    live = dict.fromkeys(REGIONS, 0)
    total = 0
    peaks = {name: Phase(0, dict(live)) for name in ("outside", "stack", "turn")}
    for i, (size, code) in enumerate(zip(timeline["sizes"], codes)):
        rounded = -(-abs(size) // ALLOCATOR_ROUND) * ALLOCATOR_ROUND
        rounded = rounded if size >= 0 else -rounded
        live[_REGION_OF_CODE[code]] += rounded
        total += rounded
        name = phase_of(i)
        if total > peaks[name].peak:
            peaks[name] = Phase(total, dict(live))
    return UnitTrace.of_phases(peaks, timeline["flops"])


def _extrapolate(one: dict, two: dict, batch: int) -> dict | None:
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


def _dispatch(func, args, kwargs):
    """Run an op; ops whose output size depends on the values (nonzero) get their worst case: every
    element selected (DeBERTa's classification loss picks its labelled rows this way)."""
    import torch

    if func is torch.ops.aten.nonzero.default:
        (x,) = args
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    return func(*args, **kwargs)


class _sdpa_stand_in:
    """Replaces torch.nn.functional.scaled_dot_product_attention while tracing (see the module docstring)."""

    def __enter__(self):
        import torch.nn.functional as F

        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _attention
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._original
        return False


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    import torch

    use_flash = attn_mask is None and query.dtype in (torch.float16, torch.bfloat16)
    if enable_gqa and not use_flash and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]   # the efficient kernel has no GQA: torch expands k and v
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # torch turns a boolean mask into an additive bias of the query's dtype for the kernel
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype)
        attn_mask = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return _KernelAttention.apply(query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, use_flash)


def _kernel_class():
    import torch

    aten = torch.ops.aten

    class KernelAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, use_flash):
            if use_flash:
                out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                    q, k, v, dropout_p, is_causal, False, scale=scale)
            else:
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                    q, k, v, bias, True, dropout_p, is_causal, scale=scale)
            ctx.save_for_backward(q, k, v, bias if bias is not None else torch.empty(0), out, lse, seed, offset)
            ctx.settings = (dropout_p, is_causal, scale, use_flash, bias is not None)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
            dropout_p, is_causal, scale, use_flash, has_bias = ctx.settings
            b, h, s, d = q.shape
            rounded = -(-s // 128) * 128
            if use_flash:   # FlashAttention-2's backward scratch: fp32 dq accumulator and softmax_d
                scratch = (torch.empty(b, rounded, h, d, dtype=torch.float32),
                           torch.empty(b, h, rounded, dtype=torch.float32))
                dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                    grad_out, q, k, v, out, lse, None, None, s, k.shape[2], dropout_p, is_causal, seed, offset,
                    scale=scale)
            else:           # the memory-efficient kernel's backward: fp32 delta
                scratch = (torch.empty(b, h, -(-s // 32) * 32, dtype=torch.float32),)
                dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                    grad_out, q, k, v, bias if has_bias else None, out, lse, seed, offset, dropout_p,
                    [True, True, True, False], is_causal, scale=scale)
            del scratch
            return dq, dk, dv, None, None, None, None, None

    return KernelAttention


class _LazyKernel:
    """`_KernelAttention.apply` without importing torch at module import."""

    @functools.cached_property
    def cls(self):
        return _kernel_class()

    def apply(self, *args):
        return self.cls.apply(*args)


_KernelAttention = _LazyKernel()


def job_profiler(cache_dir: Path | None = None, *, use_cache: bool = True):
    """`profiler(spec, seq_len) -> ModelProfile` for `derive`: one tracer per model, unit traces cached
    in this process and (`use_cache`) on disk under `cache_dir` (default: `default_cache_dir()`)."""
    directory = (cache_dir or default_cache_dir()) if use_cache else None
    tracers: dict[str, ModelTracer] = {}

    def profile(spec: dict, seq_len: int) -> ModelProfile:
        key = model_key(spec)
        if key not in tracers:
            tracers[key] = ModelTracer(spec, directory)
        return tracers[key].profile(spec["memory"]["precision"], spec["training"]["micro_batch_size"], seq_len,
                                    spec["memory"]["activation_checkpointing"])

    return profile
