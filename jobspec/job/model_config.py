"""transformers' config classes read as a table of `model.config` keys and their JSON types.

Two users: scripts/gen_transformers_configs.py writes the table of every model type transformers
registers (schemas/transformers-configs/, what `jobspec validate` checks against without importing
transformers), and `plan`, `compile` and `launch` (dry or not) check here, through job/checks, with
the same positioned errors, what validate could not: a type outside that table (a newer
transformers), and a hub id's `model.config` once its config.json (Hugging Face cache, else the
hub) names the model type.
transformers 5 config classes are dataclasses that take any keyword: an unknown one becomes a stray
attribute, so this is the only thing that catches a typo.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import sys
import types
import typing

from jobspec.errors import SpecIssue, first_line
from jobspec.spec.freeform import local_checkpoint_config, model_config_issues

if typing.TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

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
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(type(value),
                                                                                "string")


def _union(arms: list[dict]) -> dict:
    if any(not arm for arm in arms):   # one arm of unknown type: anything may be right
        return {}
    out: dict = {"type": _ordered({t for arm in arms for t in arm["type"]})}
    typed = [arm for arm in arms if arm["type"] != ["null"]]
    if typed and all("enum" in arm for arm in typed):
        out["enum"] = [v for arm in typed for v in arm["enum"]] \
            + ([None] if len(typed) < len(arms) else [])
    items = [arm["items"] for arm in arms if "items" in arm]
    if len(items) == 1 and sum("array" in arm["type"] for arm in arms) == 1:
        out["items"] = items[0]
    return out


def _field_entry(field: dataclasses.Field, hints: dict) -> dict:
    entry = type_of(hints.get(field.name, field.type))
    if not entry and field.default not in (dataclasses.MISSING, None):
        entry = {"type": [_value_type(field.default)]}
    return entry


def dataclass_fields(cls) -> dict[str, dict]:
    """Each dataclass field of `cls` (public names) with its JSON type entry."""
    import torch

    # configuration_utils imports torch only for type checking; its annotations name torch.dtype
    hints = typing.get_type_hints(cls, localns={"torch": torch})
    return {f.name: _field_entry(f, hints) for f in dataclasses.fields(cls)
            if not f.name.startswith("_")}


def _check_keywords_exist(base) -> None:
    source = inspect.getsource(base.__post_init__)
    for name in POST_INIT_KEYWORDS:
        settable = isinstance(getattr(base, name, None), property) \
            and getattr(base, name).fset is not None
        if not settable and f'"{name}"' not in source:
            raise SystemExit(f"transformers no longer takes `{name}` in PreTrainedConfig: update "
                             "POST_INIT_KEYWORDS")
    rope_source = inspect.getsource(base.convert_rope_params_to_dict)
    for name in ROPE_KEYWORDS:
        if f'"{name}"' not in rope_source:
            raise SystemExit(f"transformers no longer converts `{name}`: update ROPE_KEYWORDS")


def transformers_entry(model_type: str, common: dict) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(cls):
        raise SystemExit(f"{cls.__name__} is not a dataclass: this script reads transformers 5 "
                         "config classes")
    fields = dataclass_fields(cls)
    if "rope_parameters" in fields:
        fields.update(ROPE_KEYWORDS)
    own = {name: entry for name, entry in fields.items() if common.get(name) != entry}
    aliases = {alias: target for alias, target in cls.attribute_map.items() if alias not in fields}
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "common": True,
            "fields": dict(sorted(own.items())), "aliases": dict(sorted(aliases.items()))}


def common_fields() -> dict:
    """The keys every transformers config takes (PreTrainedConfig's fields and post-init
    keywords)."""
    from transformers import PreTrainedConfig

    _check_keywords_exist(PreTrainedConfig)
    return {**dataclass_fields(PreTrainedConfig), **POST_INIT_KEYWORDS}


def job_model_config_issues(resolved: ResolvedSpec) -> list[SpecIssue]:
    """`model.config` and `model.lora`'s module names that validate could not check, found by
    `plan`, `compile` and `launch --dry-run` alike (job/checks), before anything is derived.

    Validate checks them when it knows the model type without transformers or the network
    (`model.architecture`, a local checkpoint's config.json, a hub id's in the local cache) and the
    type is in the generated table; those give nothing here. What is left:

    - a type outside the table (a transformers newer than it): checked against transformers' class;
    - a hub id: its config.json (`hub_config`: the local Hugging Face cache, else the hub, at
      `model.revision`) names the type, and the keys are checked against its generated entry, the
      checkpoint's own keys accepted as for a local directory.

    A hub config that cannot be read (no network and not cached, an unknown id or revision, a gated
    repository without a token) is a positioned error on `model.name_or_path`, not a skipped check:
    the ranks start by reading that same file (`AutoConfig.from_pretrained`) with the same cache,
    token and network, so they would fail on it too, only later; refusing now is the same outcome
    sooner, and a typo in `model.config` never goes through unchecked. A model type only the
    repository's own code defines (`trust_remote_code`) cannot be checked without running that code
    here: a notice line says so.
    """
    from jobspec.spec import model_table

    model = resolved.spec["model"]
    if not model["config"]:
        return []
    checkpoint = local_checkpoint_config(resolved)
    if model["architecture"] or checkpoint is not None:
        model_type = model_table.model_type(resolved.spec, checkpoint)
        if model_type is None or model_table.entry(model_type) is not None:
            # checked by validate (or no type to check against: the ranks' AutoConfig decides)
            return []
    else:   # a hub id outside the local cache: validate could not know its type
        name = model["name_or_path"]
        assert name is not None   # the schema requires model.architecture or model.name_or_path
        try:
            checkpoint = hub_config(name, model["revision"])
        except Exception as err:   # whatever stops this read stops the ranks' from_pretrained too
            return [resolved.issue(("model", "name_or_path"),
                                   f"cannot read the config.json of `{name}`, so model.config "
                                   f"cannot be checked: {first_line(err)}",
                                   "the ranks would fail to load it the same way: give a local "
                                   "checkpoint directory, or a hub id reachable from here (or in "
                                   "the Hugging Face cache)")]
        model_type = checkpoint.get("model_type")
        if model_type is None:
            return []
        if model_table.entry(model_type) is not None:
            return model_config_issues({**resolved.spec,
                                        "model": {**model, "architecture": model_type}},
                                       resolved.issue, checkpoint)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        if model["trust_remote_code"]:
            print(f"jobspec: model.config is not checked: model type `{model_type}` is defined by "
                  "the repository's own code (trust_remote_code), which runs only on the ranks",
                  file=sys.stderr, flush=True)
            return []
        return [resolved.issue(("model", "architecture") if model["architecture"]
                               else ("model", "name_or_path"),
                               f"transformers {_version()} has no model type `{model_type}`",
                               "use a model_type transformers knows (its AutoConfig names)")]
    entry = transformers_entry(model_type, common_fields())
    return model_config_issues({**resolved.spec, "model": {**model, "architecture": model_type}},
                               resolved.issue, checkpoint, entry=entry)


def hub_config(name: str, revision: str | None = None) -> dict:
    """The config.json of hub id `name` as a dict: from the local Hugging Face cache, else fetched
    (the file the ranks' `AutoConfig.from_pretrained` reads first; fetched here, it is cached for
    them). Raises what transformers raises when it cannot be read. No config class is built, so no
    repository code runs."""
    from transformers import PreTrainedConfig

    try:
        config, _ = PreTrainedConfig.get_config_dict(name, revision=revision, local_files_only=True)
    except OSError:   # not in the cache: the hub (HF_HUB_OFFLINE=1 fails at once)
        config, _ = PreTrainedConfig.get_config_dict(name, revision=revision)
    if not isinstance(config, dict):
        raise OSError(f"the config.json of {name} is not a mapping")
    return config


def _version() -> str:
    import transformers
    return transformers.__version__
