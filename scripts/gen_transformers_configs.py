"""Generate schemas/transformers-configs.json: the `model.config` keys each supported architecture takes.

    python scripts/gen_transformers_configs.py              # rewrite the shipped table
    python scripts/gen_transformers_configs.py --out FILE   # write it elsewhere (the staleness test)

`jobspec validate` checks `model.config` against this table without importing transformers
(jobspec/spec/freeform.py). transformers 5 config classes are dataclasses that take any keyword:
an unknown one becomes a stray attribute, so the table is the only thing that catches a typo.
Per architecture it records the config class's dataclass fields (with a type derived from each
annotation), the class's `attribute_map` aliases (`hidden_size` for GPT-2's `n_embd`), and the
keywords `PreTrainedConfig.__post_init__` consumes without a field. Types are JSON Schema type
names plus "float": a Python `float` annotation, which transformers' strict dataclasses refuse
an int for (`initializer_range: 1` fails, `1.0` passes).
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import inspect
import json
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "schemas" / "transformers-configs.json"
sys.path.insert(0, str(ROOT))

# Keywords PreTrainedConfig accepts without a dataclass field (consumed in __post_init__ or by a
# property setter). Left out on purpose: `name_or_path` and `attn_implementation`, which
# `model.name_or_path` and `model.attention` set, and the generation parameters (max_length, ...)
# that transformers 5 drops from the config.
POST_INIT_KEYWORDS = {
    "num_labels": {"type": ["integer"]},
    "output_attentions": {"type": ["boolean"]},
    "torch_dtype": {"type": ["string", "null"]},
}
# Legacy RoPE keywords that `convert_rope_params_to_dict` folds into `rope_parameters`, for the
# classes that have that field (llama, mistral).
ROPE_KEYWORDS = {
    "rope_theta": {"type": ["number"]},
    "rope_scaling": {"type": ["object", "null"]},
    "partial_rotary_factor": {"type": ["number"]},
}
TYPE_ORDER = ("boolean", "integer", "float", "number", "string", "array", "object", "null")


def architectures() -> list[str]:
    from jobspec.spec.model_dims import ARCHITECTURE_DEFAULTS
    return sorted(ARCHITECTURE_DEFAULTS)


def _ordered(names: set[str]) -> list[str]:
    if {"integer", "float"} <= names:   # `float | int` takes both: a JSON number
        names = (names - {"integer", "float"}) | {"number"}
    if "number" in names:
        names = names - {"integer", "float"}
    return [t for t in TYPE_ORDER if t in names]


def type_of(annotation) -> dict:
    """The JSON type of a config annotation; {} when it cannot be told (no check is made)."""
    import torch
    from transformers import PreTrainedConfig

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is typing.Any or isinstance(annotation, (str, typing.ForwardRef)):
        return {}
    if annotation is None or annotation is type(None):
        return {"type": ["null"]}
    if origin is typing.Annotated:
        return type_of(args[0])
    if origin in (typing.Union, types.UnionType):
        return _union([type_of(arm) for arm in args])
    if origin is typing.Literal:
        return {"type": _ordered({_value_type(v) for v in args}), "enum": list(args)}
    if annotation is bool:
        return {"type": ["boolean"]}
    if annotation is int:
        return {"type": ["integer"]}
    if annotation is float:
        return {"type": ["float"]}
    if annotation is str or annotation is torch.dtype:   # a dtype is written as its name
        return {"type": ["string"]}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        return {"type": _ordered({_value_type(v) for v in values}), "enum": values}
    container = origin or annotation
    if container in (list, tuple, set, frozenset, collections.abc.Sequence):
        items = type_of(args[0]) if args and (len(args) == 1 or args[1] is Ellipsis) else {}
        return {"type": ["array"], **({"items": items} if items else {})}
    if container in (dict, collections.abc.Mapping) or typing.is_typeddict(annotation) or (
            isinstance(annotation, type) and issubclass(annotation, PreTrainedConfig)):
        return {"type": ["object"]}
    return {}


def _value_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(type(value), "string")


def _union(arms: list[dict]) -> dict:
    if any(not arm for arm in arms):   # one arm of unknown type: anything may be right
        return {}
    out: dict = {"type": _ordered({t for arm in arms for t in arm["type"]})}
    typed = [arm for arm in arms if arm["type"] != ["null"]]
    if typed and all("enum" in arm for arm in typed):
        out["enum"] = [v for arm in typed for v in arm["enum"]] + ([None] if len(typed) < len(arms) else [])
    items = [arm["items"] for arm in arms if "items" in arm]
    if len(items) == 1 and sum("array" in arm["type"] for arm in arms) == 1:
        out["items"] = items[0]
    return out


def _field_entry(field: dataclasses.Field, hints: dict) -> dict:
    entry = type_of(hints.get(field.name, field.type))
    if not entry and field.default not in (dataclasses.MISSING, None):
        entry = {"type": [_value_type(field.default)]}
    return entry


def _fields(cls) -> dict[str, dict]:
    import torch

    # configuration_utils imports torch only for type checking; its annotations name torch.dtype
    hints = typing.get_type_hints(cls, localns={"torch": torch})
    return {f.name: _field_entry(f, hints) for f in dataclasses.fields(cls) if not f.name.startswith("_")}


def _check_keywords_exist(base) -> None:
    source = inspect.getsource(base.__post_init__)
    for name in POST_INIT_KEYWORDS:
        settable = isinstance(getattr(base, name, None), property) and getattr(base, name).fset is not None
        if not settable and f'"{name}"' not in source:
            raise SystemExit(f"transformers no longer takes `{name}` in PreTrainedConfig: update POST_INIT_KEYWORDS")
    rope_source = inspect.getsource(base.convert_rope_params_to_dict)
    for name in ROPE_KEYWORDS:
        if f'"{name}"' not in rope_source:
            raise SystemExit(f"transformers no longer converts `{name}`: update ROPE_KEYWORDS")


def transformers_entry(model_type: str, common: dict) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(cls):
        raise SystemExit(f"{cls.__name__} is not a dataclass: this script reads transformers 5 config classes")
    fields = _fields(cls)
    if "rope_parameters" in fields:
        fields.update(ROPE_KEYWORDS)
    own = {name: entry for name, entry in fields.items() if common.get(name) != entry}
    aliases = {alias: target for alias, target in cls.attribute_map.items() if alias not in fields}
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "common": True, "fields": own, "aliases": aliases}


def mlp_entry() -> dict:
    from jobspec.train.mlp import CONFIG_KEYS, MLPConfig

    fields = _fields(MLPConfig)
    return {"class": "jobspec.train.mlp.MLPConfig", "common": False,
            "fields": {name: fields[name] for name in CONFIG_KEYS}, "aliases": {}}


def build() -> dict:
    import transformers
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    _check_keywords_exist(PreTrainedConfig)
    common = {**_fields(PreTrainedConfig), **POST_INIT_KEYWORDS}
    table = {}
    for model_type in architectures():
        if model_type == "mlp":
            table[model_type] = mlp_entry()
        elif model_type in CONFIG_MAPPING:
            table[model_type] = transformers_entry(model_type, common)
        else:
            raise SystemExit(f"{model_type} (jobspec/spec/model_dims.py) is not a transformers model_type")
    return {
        "generated_by": "scripts/gen_transformers_configs.py",
        "transformers_version": transformers.__version__,
        "types": "JSON Schema type names; float: a Python float annotation (an integer is refused)",
        "common": common,
        "architectures": table,
    }


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
