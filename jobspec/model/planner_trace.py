"""The planner's measurements of a model, from the model's own code: parameters, activations, FLOPs.

`ModelTracer` builds the spec's model on the meta device exactly as the ranks build it
(`model/build.py`; `model.freeze` and the checkpointing code of `model/structure.py`), casts it to
the training precision, moves it to fake CPU tensors (`FakeTensorMode`: shapes and dtypes, no
memory, no compute) and runs one training step with the job's micro-batch, sequence length, task
head and loss (`model/step.py`: live storages by region, FLOPs; `model/kernels.py`: the GPU
attention kernels' stand-in for SDPA). The parameter inventory comes from the same meta model.

Speed: a traced op costs ~0.1-0.3 ms. Layers are traced in short units and composed
(`memory.model_profile.compose`, exact: tests/model/test_trace.py), micro-batches above 2 are
extrapolated from 1 and 2 (`step.extrapolate`, exact), long sequences are interpolated from
three short ones (`model/lengths.py`, exact: tests/model/test_length_interpolation.py; the tiled
loss and MLP run more tiles, so more ops, at longer lengths), and unit traces are cached in-process
and on disk (`JOBSPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/jobspec`, else `~/.cache/jobspec`), keyed
by everything that changes them. Data-dependent routing (mixture-of-experts) cannot be traced
without data and is refused by name.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jobspec import techniques
from jobspec.errors import SpecError, first_line, spec_error
from jobspec.memory.model_profile import Inventory, ModelProfile, UnitTrace, compose, layer_types
from jobspec.model.lengths import LENGTH_QUANTUM, Interpolation, TileRules, basis_lengths
from jobspec.model.step import extrapolate, mask_of, run_step, summarize
from jobspec.spec.types import JobSpec, JobSpecMemory
from jobspec.techniques.base import Technique, apply_function, named_function

TRACE_VERSION = 6   # bump when what a trace measures changes: old cache entries are not read
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# (tiled loss, tiled MLP, offloaded checkpoints): `tiling_setting` of a job with none of them
NO_TILING = tuple(False for _ in techniques.TRACED)


@dataclass
class TraceSetting:
    """What one trace applies the techniques with (`apply_techniques`; each technique's `trace`
    call reads it)."""

    spec: JobSpec
    tiling: tuple = NO_TILING         # `tiling_setting`'s
    # a unit trace's layers, (kind, checkpointed) each; None: the whole model, checkpointed one
    # layer in `every` (0: none)
    types: tuple | None = None
    every: int = 0
    reentrant: bool = False
    # the checkpointed layers' indices (the checkpointing's trace call sets them): the tiling and
    # the offload act on them
    checkpointed: list[int] = field(default_factory=list)
    # runs a step of the model's build: a failure there is the spec's model's (the tracer's)
    guard: Callable[[Callable], Any] = lambda make: make()


# config attributes that mean tokens are routed to experts by their values
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ModelTracer:
    """Builds, traces and caches one spec model (its `model` section); settings vary per call."""

    def __init__(self, spec: JobSpec, cache_dir: Path | None = None, *, interpolate: bool = True):
        self.spec = spec
        self.interpolate = interpolate    # False: every length traced (interpolation's reference)
        self.model_key = model_key(spec)
        self.cache_dir = cache_dir
        self._units: dict = {}
        # by (unit setting, batch): (lengths.TileRules, the three lengths traced), the
        # lengths.Interpolation, the lengths asked past the three
        self._bases: dict = {}
        self._interpolations: dict = {}
        self._asked: dict = {}
        self._searching = False           # several lengths planned: interpolate every unit
        self._inventory: Inventory | None = None
        self._config: Any = None        # the transformers config, built once
        self._auto_class: Any = None    # the transformers auto class of the task

    # ------------------------------------------------------------------ public
    def inventory(self) -> Inventory:
        if self._inventory is None:
            cached = self._load("inventory")
            if cached is not None:
                self._inventory = Inventory.from_dict(cached)
            else:
                model = self._build(layers=None)
                config = getattr(model, "config", None)
                # the weights bitsandbytes would quantise, found on the plain model (PEFT keeps the
                # same tensors inside its wrappers, so they are recognised after the wrap by
                # identity)
                from jobspec.model.lora import quantized_linear_names
                quantized = {id(model.get_submodule(name).weight)
                             for name in quantized_linear_names(self.spec, model)}
                model = self._adapt(model)
                self._inventory = _inventory_of(model, config, quantized)
                self._store("inventory", self._inventory.as_dict())
        return self._inventory

    def profile(self, precision: str, micro_batch: int, seq_len: int, checkpointing,
                tiling: tuple = NO_TILING) -> ModelProfile:
        """The job setting's activations and FLOPs: composed from unit traces, or every layer traced
        when the layers differ in more than their `config.layer_types` kind (or there is no layer
        stack). `tiling`: `tiling_setting(spec["memory"])`, the tiled loss and MLP run as the ranks
        run them."""
        inv = self.inventory()
        every, reentrant = checkpoint_setting(checkpointing)
        # the model's FLOPs (MFU's numerator) are those of the plain step: no recompute of
        # checkpointed layers, tiles or offloaded inputs
        recomputes = bool(every) or tuple(tiling) != NO_TILING
        if inv.num_layers == 0 or not inv.uniform:
            trace = self.full(precision, micro_batch, seq_len, checkpointing, tiling)
            model_trace = self.full(precision, micro_batch, seq_len, False) if recomputes else trace
            method = "full"
        else:
            flags = tuple(bool(every) and i % every == 0 for i in range(inv.num_layers))
            unit = functools.partial(self.unit, precision, micro_batch, seq_len,
                                     reentrant=reentrant, tiling=tiling)
            trace = compose(layer_types(inv.layer_kinds, flags), unit)
            plain = tuple(False for _ in flags)
            plain_unit = functools.partial(self.unit, precision, micro_batch, seq_len,
                                           reentrant=reentrant)
            model_trace = compose(layer_types(inv.layer_kinds, plain), plain_unit) if recomputes \
                else trace
            method = "composed"
        tokens = micro_batch * seq_len
        return ModelProfile(inventory=inv, activations=trace,
                            model_flops_per_token=model_trace.flops / tokens,
                            hardware_flops_per_token=trace.flops / tokens, method=method)

    def unit(self, precision: str, micro_batch: int, seq_len: int, types: tuple, *,
             reentrant: bool = False, tiling: tuple = NO_TILING) -> UnitTrace:
        """A trace of the model cut to `types` ((attention kind, checkpointed) per layer).

        Micro-batches above 2 are not traced: every tensor's size is affine in the batch (b·x + y)
        and the ops do not change with it, so the timelines at 1 and 2 give every event's size at
        any b exactly (`step.extrapolate`); where the two timelines differ in their ops, b is
        traced. Nor are long sequences, once worth it (`_worth_interpolating`): the timeline at a
        length that is a multiple of 64 past three short ones traced comes from those
        (`lengths.Interpolation`, exact); where they do not give it, the length is traced."""
        types = tuple(types)
        setting = (precision, types, reentrant, tuple(tiling))

        def at_length(batch: int, compact: bool = False) -> dict:
            synthetic = self._interpolated(setting, batch, seq_len, compact)
            return synthetic if synthetic is not None else self._timeline(setting, batch, seq_len)

        def make() -> UnitTrace:
            if micro_batch > 2:
                synthetic = extrapolate(at_length(1), at_length(2), micro_batch)
                if synthetic is not None:
                    return summarize(synthetic)
            # compact: the middle tiles of long tile loops as lumps that summarize reads alike
            return summarize(at_length(micro_batch, compact=True))

        return self._cached(("unit", precision, micro_batch, seq_len, types, reentrant)
                            + _tiling_key(tiling), make)

    def _timeline(self, setting: tuple, batch: int, length: int, usable=None) -> dict:
        """The unit's traced timeline (`setting`: precision, layer types, reentrancy, tiling)."""
        precision, types, reentrant, tiling = setting
        return self._cached(_timeline_key(setting, batch, length),
                            lambda: self._trace(precision, batch, length, types=types,
                                                reentrant=reentrant, tiling=tiling),
                            trace=False, usable=usable)

    def _interpolated(self, setting: tuple, batch: int, length: int, compact: bool = False
                      ) -> dict | None:
        """The unit's timeline at `length` from its traces at three shorter lengths
        (`model/lengths.py`: exact), or None: `length` is not past them, the traces do not give it,
        or tracing them would cost more than tracing `length` (`_worth_interpolating`)."""
        key = setting + (batch,)
        if not self.interpolate:
            return None
        if key not in self._bases:
            self._bases[key] = self._basis(setting[3], batch)
        found = self._bases[key]
        if found is None or length <= found[1][-1] or length % LENGTH_QUANTUM:
            return None
        rules, basis = found
        if key not in self._interpolations:
            if not self._worth_interpolating(key, setting, batch, length):
                return None
            self._searching = True
            # a cache entry from before the shapes were recorded is traced again
            traced = [self._timeline(setting, batch, s, usable=lambda tl: "shapes" in tl)
                      for s in basis]
            self._interpolations[key] = Interpolation(traced, basis, rules, batch)
        return self._interpolations[key].at(length, compact=compact)

    def _basis(self, tiling: tuple, batch: int) -> tuple[TileRules, tuple[int, int, int]] | None:
        model = self.spec["model"]
        if model.get("architecture") != "mlp" or model.get("name_or_path"):
            self._config_for(None)   # the config, also when the inventory came from the cache
        rules = self._tile_rules(tiling)
        positions = getattr(self._config, "max_position_embeddings", None)
        basis = basis_lengths(rules, batch, positions if isinstance(positions, int) else None)
        return (rules, basis) if basis is not None else None

    def _worth_interpolating(self, key: tuple, setting: tuple, batch: int, length: int) -> bool:
        """Three short traces instead of one at `length`: once this tracer plans several lengths (a
        second one asked of a unit, or one interpolated already: `plan --longest`), when they are in
        the cache, or when `length` runs more tiles than the three together (a trace's time grows
        with its tiles; without tiles it does not grow with the length)."""
        asked = self._asked.setdefault(key, set())
        asked.add(length)
        rules, basis = self._bases[key]
        if self._searching or len(asked) > 1:
            return True
        if all(self._stored(_timeline_key(setting, batch, s)) for s in basis):
            return True
        return rules.tiled and \
            rules.tile_count(batch, length) >= sum(rules.tile_count(batch, s) for s in basis)

    def _tile_rules(self, tiling: tuple) -> TileRules:
        """How model/tiling.py cuts a sequence for this model (`tiling_setting`)."""
        loss, mlp, _ = tiling
        config = self._config
        vocab = int(getattr(config, "vocab_size", 0) or 0) or None
        hidden = int(getattr(config, "hidden_size", 0) or 0) or None
        return TileRules(mlp_hidden=hidden if mlp else None,
                         loss_tiles=int(loss) if loss is not True and loss is not False else None,
                         loss_vocab=vocab if loss is True else None)

    def full(self, precision: str, micro_batch: int, seq_len: int, checkpointing,
             tiling: tuple = NO_TILING
             ) -> UnitTrace:
        """A trace of every layer at the micro-batch itself, checkpointed by the training patch (the
        reference the shortcuts are tested against)."""
        key = ("full", precision, micro_batch, seq_len,
               json.dumps(checkpointing, sort_keys=True)) + _tiling_key(tiling)
        return self._cached(key, lambda: summarize(self._trace(precision, micro_batch, seq_len,
                                                                checkpointing=checkpointing,
                                                               tiling=tiling)))

    # ------------------------------------------------------------------ building
    def _config_for(self, kinds: tuple | None):
        """The spec's config, cut to the given layer kinds (None: as the spec says)."""
        from jobspec.model.build import build_config

        if self._config is None:
            self._auto_class, self._config = self._build_step(lambda: build_config(self.spec))
            _refuse_experts(self._config)
        config = copy.deepcopy(self._config)
        if kinds is not None:
            _set_layer_count(config, len(kinds))
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = list(kinds)
        return config

    def _build(self, layers: tuple | None):
        """The model on the meta device, cut to `layers` kinds (None: whole), `model.freeze`
        applied."""
        import torch

        from jobspec.model.build import build_skeleton
        from jobspec.model.structure import freeze

        if self.spec["model"].get("architecture") == "mlp" \
                and not self.spec["model"].get("name_or_path"):
            spec = copy.deepcopy(self.spec)
            if layers is not None:
                spec["model"].setdefault("config", {})["num_layers"] = len(layers)
            model = self._build_step(lambda: build_skeleton(spec))
        else:
            config = self._config_for(layers)
            attention = self.spec["model"]["attention"]
            trust = bool(self.spec["model"].get("trust_remote_code"))
            with torch.device("meta"):
                model = self._build_step(lambda: self._auto_class.from_config(
                    config, attn_implementation=attention, trust_remote_code=trust))
        if self.spec["model"].get("freeze"):
            freeze(model, self.spec["model"]["freeze"])
        return model

    def _adapt(self, model):
        """`model.lora`'s adapters on `model` (model/lora.apply_lora, the ranks' own call): the plan
        counts exactly the adapters PEFT makes, the frozen base without gradients or optimizer
        states."""
        from jobspec.model.lora import trace_lora

        return trace_lora(model, TraceSetting(self.spec, guard=self._build_step))

    def _build_step(self, make):
        from jobspec.model.build import loading_error

        try:
            return make()
        except SpecError:
            raise
        # any failure of transformers' code is the spec's model's
        except Exception as err:  # noqa: BLE001
            model = self.spec["model"]
            raise loading_error(model, model["task"], model["attention"], err) from None

    # ------------------------------------------------------------------ tracing
    def _trace(self, precision: str, micro_batch: int, seq_len: int, *, types: tuple | None = None,
               reentrant: bool = False, checkpointing=None, tiling: tuple = NO_TILING) -> dict:
        """One traced step: its timeline (`step.run_step`)."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from jobspec.model.structure import find_layer_stack

        kinds = tuple(kind for kind, _ in types) if types is not None else None
        model = self._build(layers=kinds)
        model.train()
        setting = f"{precision}, micro-batch {micro_batch}, seq {seq_len}"
        try:
            every = 0
            if types is None:
                every, reentrant = checkpoint_setting(checkpointing)
            # as on the ranks: the kernels, checkpointing, tiling, offload, then PEFT's wrap
            model = apply_techniques(model, TraceSetting(
                self.spec, tiling=tiling, types=types, every=every, reentrant=reentrant,
                guard=self._build_step))
            model = model.to(getattr(torch, PRECISION_DTYPES[precision]))   # on meta: no memory
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = model.to_empty(device="cpu")
                return run_step(model, self.spec, micro_batch, seq_len, find_layer_stack(model))
        except SpecError:
            raise
        # report which setting could not be traced, in one line
        except Exception as err:  # noqa: BLE001
            kind = type(err).__name__
            if "DataDependent" in kind or "DynamicOutputShape" in kind:
                raise spec_error(f"model type {self._model_type()!r} computes shapes from the data "
                                 f"({kind}); the planner traces without data and cannot plan it",
                                 path=("model",),
                                 hint="plan it with memory.fit: off and measure a few "
                                      "steps") from None
            raise spec_error(f"the planner's trace failed at {setting}: {kind}: {first_line(err)}",
                             path=("model",), hint="check model.config and model.attention; "
                             "`jobspec launch` still runs the job unplanned") from None
        finally:
            if self.spec["model"].get("kernels", "none") != "none":
                from jobspec.model.fused_kernels import restore_rope

                restore_rope()   # patched module-wide: the next trace may be unfused

    def _model_type(self) -> str:
        return str(self.spec["model"].get("architecture")
                   or getattr(self._config, "model_type", "?"))

    # ------------------------------------------------------------------ cache
    def _cached(self, key: tuple, make, *, trace: bool = True, usable=None):
        """`make()` once per key: in this process, then on disk (a UnitTrace, or with trace=False a
        timeline dict); `usable(stored)`: False for an entry to make again."""
        if key in self._units and (usable is None or usable(self._units[key])):
            return self._units[key]
        name = _cache_name(key)
        stored = self._load(name)
        if stored is not None and usable is not None and not usable(stored):
            stored = None
        if stored is not None:
            result = UnitTrace.from_dict(stored) if trace else stored
        else:
            result = make()
            self._store(name, result.as_dict() if trace else result)
        self._units[key] = result
        return result

    def _stored(self, key: tuple) -> bool:
        """Whether `_cached(key, ...)` would find it, in this process or on disk."""
        path = self._path(_cache_name(key))
        return key in self._units or (path is not None and path.is_file())

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
        """Atomic: a temporary file renamed into place, so concurrent launches never read half a
        file."""
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


def _cache_name(key: tuple) -> str:
    return hashlib.sha256(json.dumps([str(k) for k in key]).encode()).hexdigest()[:24]


def _timeline_key(setting: tuple, batch: int, length: int) -> tuple:
    precision, types, reentrant, tiling = setting
    return ("timeline", precision, batch, length, types, reentrant) + _tiling_key(tiling)


def default_cache_dir() -> Path:
    if os.environ.get("JOBSPEC_CACHE_DIR"):
        return Path(os.environ["JOBSPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jobspec"


def model_key(spec: JobSpec) -> str:
    """A hash of everything that changes a trace besides the job setting: the model section, a local
    checkpoint's config.json, and the versions of torch, transformers and this tracer."""
    model = spec["model"]
    fields = {k: model.get(k)
              for k in ("name_or_path", "architecture", "config", "revision", "task", "num_labels",
                                        "attention", "trust_remote_code", "freeze", "lora",
                        "quantization")}
    if model.get("kernels", "none") != "none":   # unfused: the keys traced before the field existed
        fields["kernels"] = model["kernels"]
    # the one data fact a trace depends on: whether the model gets a padding mask
    # (model/padding_mask.py)
    fields["attention_mask"] = mask_of(spec)
    name_or_path = model["name_or_path"]
    config_file = Path(name_or_path) / "config.json" if name_or_path else None
    if config_file is not None and config_file.is_file():
        fields["config.json"] = hashlib.sha256(config_file.read_bytes()).hexdigest()
    text = json.dumps({"model": fields, "versions": _versions(), "tracer": TRACE_VERSION},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    """torch's and transformers' versions (read once: a metadata read costs ~5 ms)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
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
        return int(checkpointing.get("every_n_layers", 1)), bool(checkpointing.get("use_reentrant",
                                                                                   False))
    return 1, False


def tiling_setting(memory: JobSpecMemory) -> tuple:
    """The long-sequence techniques of a `memory` section as the trace runs them (techniques.TRACED:
    tiled loss: False, True (tiles by the bound) or a tile count; tiled MLP; the checkpointed
    layers' inputs offloaded to the host)."""
    return techniques.trace_setting(memory)


def _tiling_key(tiling: tuple) -> tuple:
    """Nothing for an untiled trace: its cache key is the one a trace without tiling settings
    has."""
    return () if tuple(tiling) == NO_TILING else ("tiling", *tiling)


def apply_techniques(model, setting: TraceSetting):
    """Every patched technique the trace runs, in the registry's order (jobspec/techniques), as the
    ranks apply them: each by its trace call (`Technique.trace`), or by the ranks' own function
    with its args from the setting (`Technique.trace_args`). Returns the model (PEFT wraps it)."""
    tiled = dict(zip((t.name for t in techniques.TRACED), setting.tiling))
    for technique in techniques.PATCHED:
        if technique.trace is not None:
            model = named_function(technique.trace)(model, setting)
        elif technique.name in tiled:
            _apply_traced(model, technique, tiled[technique.name], setting.checkpointed)
    return model


def apply_tiling(model, tiling: tuple, checkpointed: list[int]) -> None:
    """The traced techniques alone (`tiling`: `tiling_setting`'s), in the registry's order."""
    tiled = dict(zip((t.name for t in techniques.TRACED), tiling))
    for technique in techniques.PATCHED:
        if technique.name in tiled:
            _apply_traced(model, technique, tiled[technique.name], checkpointed)


def _apply_traced(model, technique: Technique, value, checkpointed: list[int]) -> None:
    """One traced technique by the ranks' own function, its args from its setting `value`."""
    import importlib

    if technique.trace_args is None:
        return
    args = technique.trace_args(value, checkpointed)
    if args is None:
        return
    for module in technique.trace_imports:
        importlib.import_module(module)
    apply_function(technique)(model, **args)


def _set_layer_count(config, n: int) -> None:
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if hasattr(config, name):
            setattr(config, name, n)
            return


def _refuse_experts(config) -> None:
    for key in _EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            raise spec_error(f"model type {config.model_type!r} routes each token to {value} "
                             "experts by its values (mixture of experts): the planner traces "
                             "without data and does not guess the routing", path=("model",),
                             hint="plan a dense model, or launch with memory.fit: off and measure "
                                  "a few steps")


def _inventory_of(model, config, quantized: set[int] | frozenset[int] = frozenset()) -> Inventory:
    from jobspec.model.structure import find_layer_stack

    tensors = tuple((name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters())
    stack = find_layer_stack(model)
    num_layers = len(stack) if stack is not None else 0
    layer_params = max((sum(p.numel() for p in layer.parameters()) for layer in stack),
                       default=0) if stack else 0
    kinds = getattr(config, "layer_types", None)
    if not (isinstance(kinds, list) and len(kinds) == num_layers):
        kinds = ["layer"] * num_layers
    # the layers differ only in their layer_types kind: same module classes, same parameter shapes
    shapes = [tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
              + (type(layer).__name__,)
              for layer in (stack or [])]
    return Inventory(model_type=str(getattr(config, "model_type", "mlp")), tensors=tensors,
                     num_layers=num_layers,
                     layer_params=layer_params, layer_kinds=tuple(str(k) for k in kinds),
                     hidden_size=getattr(config, "hidden_size", None),
                     uniform=all(shape == shapes[0] for shape in shapes),
                     buffer_float_elements=sum(b.numel() for b in model.buffers()
                                               if b.is_floating_point()),
                     buffer_other_bytes=sum(b.numel() * b.element_size() for b in model.buffers()
                                            if not b.is_floating_point()),
                     quantized=tuple(name for name, p in model.named_parameters()
                                     if id(p) in quantized))


def job_profiler(cache_dir: Path | None = None, *, use_cache: bool = True,
                 interpolate: bool = True):
    """`profiler(spec, seq_len) -> ModelProfile` for `derive`: one tracer per model, unit traces
    cached in this process and (`use_cache`) on disk under `cache_dir` (default:
    `default_cache_dir()`); `interpolate`: `ModelTracer`'s."""
    directory = (cache_dir or default_cache_dir()) if use_cache else None
    tracers: dict[str, ModelTracer] = {}

    def profile(spec: JobSpec, seq_len: int) -> ModelProfile:
        key = model_key(spec)
        if key not in tracers:
            tracers[key] = ModelTracer(spec, directory, interpolate=interpolate)
        return tracers[key].profile(spec["memory"]["precision"],
                                    spec["training"]["micro_batch_size"], seq_len,
                                    spec["memory"]["activation_checkpointing"],
                                    tiling_setting(spec["memory"]))

    return profile
