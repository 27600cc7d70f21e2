"""The job spec's JSON Schema: loading it, filling its defaults, looking up a field's sub-schema.

`schemas/jobspec.schema.json` is the single source of every field's description and default;
this module only reads it.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from jobspec.spec.types import JobSpec

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "schemas" / "jobspec.schema.json",  # source checkout
    # installed wheel
    Path(__file__).resolve().parents[1] / "_schemas" / "jobspec.schema.json",
)


def schema_path() -> Path:
    for candidate in _CANDIDATES:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("jobspec.schema.json not found next to the jobspec package")


@lru_cache(maxsize=1)
def shared_schema() -> dict:
    """The schema, parsed once per process and shared: read it, never change it (load_schema
    copies)."""
    schema: dict = json.loads(schema_path().read_text(encoding="utf-8"))
    return schema


def load_schema() -> dict:
    """The schema as a fresh dict (callers may mutate it)."""
    return copy.deepcopy(shared_schema())


def object_branch(node: dict) -> dict | None:
    """The object-typed schema of `node`, looking inside oneOf/anyOf (e.g. `null | {..}`)."""
    if "properties" in node:
        return node
    alternatives: list[dict] = node.get("oneOf", []) + node.get("anyOf", [])
    for alt in alternatives:
        if "properties" in alt:
            return alt
    return None


def subschema_at(path: tuple | list, schema: dict | None = None) -> dict | None:
    """The schema describing the value at `path` (keys only), or None if no field is there."""
    node = shared_schema() if schema is None else schema
    for key in path:
        branch = object_branch(node)
        if branch is None:
            # free-form mappings (model.config, deepspeed, tags) accept any key below them
            if node.get("type") != "object":
                return None
            extra = node.get("additionalProperties", True)
            if isinstance(extra, dict):
                node = extra
                continue
            return {} if extra is True else None
        props = branch.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(branch.get("additionalProperties"), dict):
            node = branch["additionalProperties"]
        elif branch.get("additionalProperties") is True:
            return {}
        else:
            return None
    return node


def filled_spec(spec: Mapping[str, Any]) -> JobSpec:
    """`spec` (a spec as written, or a resolved.yaml an older jobspec wrote) with every default
    filled: the one way a plain mapping becomes a JobSpec (jobspec/spec/types.py)."""
    return cast(JobSpec, fill_defaults(spec))


def fill_defaults(spec: Mapping[str, Any], schema: dict | None = None) -> dict:
    """A copy of `spec` with every missing field set to its schema default, recursively.

    Objects that are present (or default to `{}`) get their own fields' defaults filled;
    a field whose value is null or a non-object (e.g. `activation_checkpointing: true`) is left as
    is.
    """
    node = shared_schema() if schema is None else schema
    filled: dict = _fill(copy.deepcopy(spec), node)
    return filled


def _fill(value: Any, node: dict) -> Any:
    branch = object_branch(node)
    if branch is None or not isinstance(value, dict):
        return value
    for key, prop in branch.get("properties", {}).items():
        if key not in value and "default" in prop:
            value[key] = copy.deepcopy(prop["default"])
        if key in value:
            value[key] = _fill(value[key], prop)
    return value


def enum_values(path: tuple | list) -> list:
    """The allowed values of an enum field (used by registries' consistency tests)."""
    node = subschema_at(path)
    if node is None or "enum" not in node:
        raise KeyError(f"no enum field at {'.'.join(map(str, path))}")
    return list(node["enum"])


# ---- JSON types of schema nodes and values (for --set typing and messages) ----

_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def schema_types(node: dict) -> list[str]:
    """The JSON types a sub-schema accepts (looking inside oneOf/anyOf); [] means anything."""
    declared = node.get("type")
    if declared:
        return [declared] if isinstance(declared, str) else list(declared)
    out: list[str] = []
    for alt in node.get("oneOf", []) + node.get("anyOf", []):
        out += [t for t in schema_types(alt) if t not in out]
    return out


def has_type(value: Any, types: list[str]) -> bool:
    return any(_TYPE_CHECKS[t](value) for t in types)


_TYPE_WORDS = {"object": "a mapping", "array": "a list", "string": "a string",
               "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}


def types_text(types: list[str]) -> str:
    return " or ".join(_TYPE_WORDS.get(t, t) for t in types)


def type_name(value: Any) -> str:
    """The JSON-ish name of a Python value's type, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping"}.get(type(value), type(value).__name__)
