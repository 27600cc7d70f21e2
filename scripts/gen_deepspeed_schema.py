"""Generate schemas/deepspeed-config.schema.json: every key the installed DeepSpeed reads from its config.

    python scripts/gen_deepspeed_schema.py              # rewrite the shipped schema
    python scripts/gen_deepspeed_schema.py --out FILE   # write it elsewhere (the staleness test)

`jobspec validate` checks the spec's `deepspeed:` section against it without importing DeepSpeed
(jobspec/spec/freeform.py). DeepSpeed reads its config two ways, and both are covered:

- pydantic sections (`zero_optimization`, `fp16`, `bf16`, the monitors, ...): their
  `model_json_schema`, `$ref`s inlined, with each aliased field also under its Python name
  (DeepSpeed's models set `populate_by_name`, so `prefetch_bucket_size` and
  `stage3_prefetch_bucket_size` both work). DeepSpeed forbids unknown keys there itself, but
  only inside the ranks, after launch.
- everything else is read with `dict.get(key, default)`, and an unknown key is silently
  ignored (`gradient_clippping: 0.5` leaves clipping at 1.0). These keys are found by running
  `DeepSpeedConfig` over a recording dict that logs every key asked for, with its default;
  a key's type is its default's. Sections are opened one at a time to find the keys below them.

A top-level key DeepSpeed reads that this script has no rule for stops it with an error, so a
new DeepSpeed release cannot silently widen or narrow what jobspec accepts.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "schemas" / "deepspeed-config.schema.json"

# Sections DeepSpeed builds with a pydantic model (`Model(**section)`), so the recording dict
# sees the section's name but none of its keys.
PYDANTIC_SECTIONS = {
    ("zero_optimization",): "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    ("fp16",): "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    ("bf16",): "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    ("bfloat16",): "deepspeed.runtime.precision_config:DeepSpeedBF16Config",   # bf16's older name
    ("comms_logger",): "deepspeed.comm.config:CommsLoggerConfig",
    ("compile",): "deepspeed.compile.config:CompileConfig",
    ("hybrid_engine",): "deepspeed.runtime.config:HybridEngineConfig",
    ("tensorboard",): "deepspeed.monitor.config:TensorBoardConfig",
    ("wandb",): "deepspeed.monitor.config:WandbConfig",
    ("csv_monitor",): "deepspeed.monitor.config:CSVConfig",
    ("comet",): "deepspeed.monitor.config:CometConfig",
    ("tensor_parallel",): "deepspeed.runtime.tensor_parallel.config:TPTrainingConfig",
    ("weight_quantization",): "deepspeed.inference.config:WeightQuantConfig",
    ("timers", "throughput"): "deepspeed.utils.config:DeepSpeedThroughputTimerConfig",
}
# Mappings whose keys depend on something else (the optimizer's type, the pipeline module,
# curriculum metric names), or which DeepSpeed copies whole: any key is accepted below them.
FREE_FORM = {
    ("optimizer", "params"): "the optimizer's constructor arguments",
    ("scheduler", "params"): "the scheduler's constructor arguments",
    ("pipeline",): "copied whole to the pipeline engine",
    ("data_efficiency",): "curriculum metrics and routing settings are user-named",
    ("autotuning", "arg_mappings"): "maps autotuning keys to the training script's arguments",
}
# Keys whose default (None, or "auto") does not tell their type.
TYPES = {
    ("train_batch_size",): ["integer"],
    ("train_micro_batch_size_per_gpu",): ["integer"],
    ("gradient_accumulation_steps",): ["integer"],
    ("steps_per_print",): ["integer", "null"],
    ("communication_data_type",): ["string", "null"],
    ("log_level",): ["string", "null"],
    ("vocabulary_size",): ["integer", "null"],
    ("sequence_parallel_size",): ["integer"],
    ("optimizer", "type"): ["string"],
    ("optimizer", "legacy_fusion"): ["boolean"],
    ("scheduler", "type"): ["string"],
    ("activation_checkpointing", "number_checkpoints"): ["integer", "null"],
    ("flops_profiler", "output_file"): ["string", "null"],
    ("data_types", "grad_accum_dtype"): ["string", "null"],
    ("data_types", "param_dtype"): ["string", "null"],
    ("data_types", "buffer_dtype"): ["string", "null"],
    ("checkpoint", "writer", "data_parallel"): ["string", "null"],
    ("torch_autocast", "dtype"): ["string"],
    ("torch_autocast", "lower_precision_safe_modules"): ["array"],
    ("datastates_ckpt",): ["boolean", "object"],   # false, or the DataStates engine's own settings
}
# Values the recording dict answers with, so DeepSpeed goes on to read the keys behind them.
PROBE_VALUES = {("optimizer", "type"): "AdamW", ("scheduler", "type"): "WarmupLR",
                ("train_batch_size",): 1, ("train_micro_batch_size_per_gpu",): 1,
                ("gradient_accumulation_steps",): 1}


class Recorder(dict):
    """A config dict that logs each key DeepSpeed asks for; keys in `opened` answer with a Recorder."""

    def __init__(self, path: tuple, log: dict, opened: frozenset):
        super().__init__()
        self.path, self.log, self.opened = path, log, opened

    def _seen(self, key, default=None, has_default=False) -> tuple:
        path = self.path + (key,)
        if isinstance(key, str):
            entry = self.log.setdefault(path, {})
            if has_default and "default" not in entry:
                entry["default"] = default
        return path

    def _answer(self, path: tuple, missing):
        if path in PROBE_VALUES:
            return PROBE_VALUES[path]
        if path in self.opened or isinstance(missing, dict):
            return Recorder(path, self.log, self.opened)
        return missing

    def get(self, key, default=None):
        return self._answer(self._seen(key, default, True), default)

    def __getitem__(self, key):
        path = self._seen(key)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        answer = self._answer(path, KeyError)
        if answer is KeyError:
            raise KeyError(key)
        return answer

    def __contains__(self, key):
        path = self._seen(key)
        return dict.__contains__(self, key) or path in PROBE_VALUES or path in self.opened

    def keys(self):
        recorder = self

        class Keys:   # `key in d.keys()` is logged too; iterating (`**d`) sees no keys
            def __contains__(self, key):
                return key in recorder

            def __iter__(self):
                return iter(())
        return Keys()

    def __bool__(self):
        return True


def record(opened: frozenset) -> dict:
    """{path: {"default": value}} for every key one DeepSpeedConfig(...) asked for."""
    from deepspeed.runtime.config import DeepSpeedConfig

    log: dict = {}
    try:
        DeepSpeedConfig(Recorder((), log, opened))
    except Exception:   # opening a scalar as a section breaks the parse; the keys read so far count
        pass
    return log


def discover() -> tuple[dict, set]:
    """Every key DeepSpeed reads (with its default, if read with one), and which paths are sections."""
    from deepspeed import comm
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS

    # As rank 0 of a group of 1, so DeepSpeedConfig takes the path that reads sequence_parallel_size.
    comm.get_rank = lambda *a, **k: 0
    comm.get_world_size = lambda *a, **k: 1
    removed = {(k,) for k in _REMOVED_TOP_LEVEL_CONFIG_KEYS} | {("zero_optimization", k)
                                                                  for k in _REMOVED_ZERO_CONFIG_KEYS}
    keys = record(frozenset())
    sections: set = set()
    tried: set = set()
    pending = sorted(keys)
    while pending:
        path = pending.pop()
        if path in tried or path in removed or path in PYDANTIC_SECTIONS or path in FREE_FORM:
            continue
        tried.add(path)
        found = record(frozenset(sections | {path}))
        if any(len(p) > len(path) and p[:len(path)] == path for p in found):
            sections.add(path)
            for p, entry in found.items():
                keys.setdefault(p, {}).update({k: v for k, v in entry.items() if k not in keys[p]})
            pending += sorted(set(found) - tried)
    return {p: e for p, e in keys.items() if p not in removed and not _below_any(p, removed)}, sections


def _below_any(path: tuple, roots) -> bool:
    return any(len(path) > len(r) and path[:len(r)] == r for r in roots)


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- pydantic sections

def _models_under(model, seen=None) -> dict:
    """{class name: class} for `model` and every pydantic model its fields use."""
    from pydantic import BaseModel
    import typing

    seen = {} if seen is None else seen
    seen[model.__name__] = model
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel) and t.__name__ not in seen:
                _models_under(t, seen)
            stack += list(typing.get_args(t))
    return seen


def _scrub(node):
    """A copy of a core schema without callables in its JSON extras (DeepSpeed keeps
    `new_param_fn` lambdas there, which pydantic cannot serialise)."""
    if isinstance(node, dict):
        node = {k: _scrub(v) for k, v in node.items()}
        extra = node.get("metadata", {}).get("pydantic_js_extra") if isinstance(node.get("metadata"), dict) else None
        if isinstance(extra, dict):
            node["metadata"] = {**node["metadata"],
                                "pydantic_js_extra": {k: v for k, v in extra.items() if not callable(v)}}
        return node
    if isinstance(node, list):
        return [_scrub(v) for v in node]
    return node


def pydantic_schema(model) -> dict:
    import warnings

    from pydantic.json_schema import GenerateJsonSchema, PydanticJsonSchemaWarning

    # a torch.dtype default cannot be written as JSON; the field is kept without it
    warnings.filterwarnings("ignore", category=PydanticJsonSchemaWarning)

    class Generator(GenerateJsonSchema):
        def handle_invalid_for_json_schema(self, schema, error_info):
            return {}   # e.g. a torch.dtype field: no type check

    raw = Generator(by_alias=True).generate(_scrub(model.__pydantic_core_schema__), mode="validation")
    models = _models_under(model)
    definitions = raw.pop("$defs", {})

    def inline(node, owner=None):
        if isinstance(node, list):
            return [inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            merged = {**definitions[name], **{k: v for k, v in node.items() if k != "$ref"}}
            return inline(merged, models.get(name))
        out = {k: inline(v) for k, v in node.items() if k != "title"}
        if owner is None and node.get("title") in models and "properties" in node:
            owner = models[node["title"]]
        if owner is not None and "properties" in out:
            for name, field in owner.model_fields.items():
                if field.alias and field.alias != name and field.alias in out["properties"]:
                    out["properties"][name] = {**out["properties"][field.alias], "x-alias-of": field.alias}
        return out

    # which model parses the section: it coerces as pydantic's lax mode does (5e8 -> 500000000)
    return {**inline(raw, model), "x-pydantic": f"{model.__module__}.{model.__qualname__}"}


# ---------------------------------------------------------------- assembly

def _type_of_default(path: tuple, value) -> dict:
    if path in TYPES:
        return {"type": TYPES[path]}
    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return {}   # nothing tells the type: no check
    name = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value))
    return {"type": name} if name else {}


def build() -> dict:
    import deepspeed
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS

    keys, sections = discover()
    root = {"type": "object", "additionalProperties": False, "properties": {},
            "x-removed": dict(_REMOVED_TOP_LEVEL_CONFIG_KEYS)}
    for path in sorted(keys, key=lambda p: (len(p), p)):
        parent = root
        for part in path[:-1]:
            parent = parent["properties"].setdefault(part, _section())
        node = parent["properties"].setdefault(path[-1], {})
        if path in PYDANTIC_SECTIONS:
            node.update(pydantic_schema(_load(PYDANTIC_SECTIONS[path])))
        elif path in FREE_FORM:
            node.update({"type": "object", "additionalProperties": True, "description": FREE_FORM[path]})
        elif path in sections:
            node.update({k: v for k, v in _section().items() if k not in node})
        else:
            node.update(_type_of_default(path, keys[path].get("default")))
            if "default" in keys[path] and _jsonable(keys[path]["default"]):
                node["default"] = keys[path]["default"]
    stale = [p for p in (*PYDANTIC_SECTIONS, *FREE_FORM, *TYPES) if p not in keys]
    if stale:
        raise SystemExit("DeepSpeed no longer reads " + ", ".join(".".join(p) for p in stale)
                         + ": remove them from this script's tables")
    zero = root["properties"]["zero_optimization"]
    zero["x-removed"] = dict(_REMOVED_ZERO_CONFIG_KEYS)
    unexplained = [p for p in keys if len(p) == 1 and p not in PYDANTIC_SECTIONS and p not in FREE_FORM
                   and p not in sections and "default" not in keys[p] and p not in TYPES]
    if unexplained:
        raise SystemExit("DeepSpeed reads top-level keys this script has no rule for: "
                         + ", ".join(p[0] for p in unexplained)
                         + " (add them to PYDANTIC_SECTIONS, FREE_FORM or TYPES)")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "DeepSpeed config",
        "description": "Every key DeepSpeed reads from its config, generated from the installed DeepSpeed by "
                       "scripts/gen_deepspeed_schema.py. x-removed: keys DeepSpeed refuses, with its reason; "
                       "x-alias-of: the key's other accepted name; x-pydantic: the model that parses a "
                       "section (in lax mode: an integral number is an integer there).",
        "x-deepspeed-version": deepspeed.__version__,
        **root,
    }


def _section() -> dict:
    return {"type": "object", "additionalProperties": False, "properties": {}}


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def render(schema: dict) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
