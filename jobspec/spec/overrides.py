"""`--set a.b.c=VALUE` overrides, typed by the schema at that path, positioned as `<--set>:1:N`.

VALUE is read as YAML, then checked against the field's JSON types: a string field keeps `007` as
the string "007"; a number field given `abc` is an error; an unknown key gets "did you mean".
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from jobspec.errors import SpecError, SpecIssue, did_you_mean, spec_error
from jobspec.spec.loader import SET_FILE, LoadedSpec, Position, iter_paths, parse_yaml
from jobspec.spec.schema import (
    has_type,
    object_branch,
    schema_types,
    shared_schema,
    subschema_at,
    type_name,
    types_text,
)


def apply_overrides(loaded: LoadedSpec, overrides: Iterable[str]) -> LoadedSpec:
    """Apply `a.b.c=VALUE` overrides to `loaded` in order (it is changed and returned); every bad
    one is reported, together."""
    issues: list[SpecIssue] = []
    for index, override in enumerate(overrides, start=1):
        where = Position(SET_FILE, 1, index)
        try:
            path, value = parse_override(override, where)
            _set_value(loaded, path, value, where)
        except SpecError as err:
            issues.extend(err.issues)
    if issues:
        raise SpecError(issues)
    return loaded


def parse_override(override: str, where: Position) -> tuple[tuple, Any]:
    """`a.b.c=VALUE` -> (("a","b","c"), VALUE typed by the schema at that path)."""
    def fail(message: str, hint: str | None, path: tuple = ()) -> SpecError:
        return spec_error(f"{message} (from --set {override})", path=path, hint=hint,
                          file=where.file, line=where.line, column=where.col)

    dotted, sep, raw = override.partition("=")
    keys = tuple(k.strip() for k in dotted.split("."))
    if not sep or not all(keys):
        raise fail("expected KEY.PATH=VALUE", "e.g. --set training.max_steps=100")
    node = _schema_for_override(keys, fail)
    try:
        value, _, _ = parse_yaml(raw, SET_FILE) if raw.strip() else ("", {}, {})
    except SpecError as err:
        raise fail(f"cannot read the value: {_unreadable(raw, err.issues[0])}", "quote the value",
                   keys) from None
    return keys, _typed(value, raw, node, keys, fail)


def _unreadable(raw: str, issue: SpecIssue) -> str:
    """Why VALUE is not YAML, where in it: for a value written as JSON (an object with quoted keys,
    a list) Python's JSON parser says what and at which column, as `json.loads` would; else YAML's
    message at the column its mark gives (YAML's "opened at column 1" is where a mapping starts)."""
    text = raw.lstrip()
    if text.startswith(('{"', "[")):
        try:
            json.loads(raw)
        except json.JSONDecodeError as err:
            return f"not valid JSON: {err.msg} at column {err.colno} of the value"
    where = f" at column {issue.column} of the value" if issue.column else ""
    return f"{issue.message}{where}"


def _schema_for_override(keys: tuple, fail: Callable[..., SpecError]) -> dict:
    node = shared_schema()   # the schema at ()
    for depth, key in enumerate(keys):
        branch = object_branch(node) or node
        props = branch.get("properties", {})
        extra = branch.get("additionalProperties", True)
        if key in props:
            node = props[key]
        elif branch.get("type") in ("object", None) and "properties" not in branch \
                and extra is not False:
            # free-form: model.config, deepspeed, tags
            node = extra if isinstance(extra, dict) else {}
        else:
            here = ".".join(keys[:depth]) or "the top level"
            if not props:
                raise fail(f"`{'.'.join(keys[:depth])}` is not a mapping",
                           "set the whole value instead", keys[:depth + 1])
            hint = did_you_mean(key, list(props), f"keys under {here}",
                                prefix="".join(f"{k}." for k in keys[:depth]))
            raise fail(f"unknown key `{key}` under {here}", hint, keys[:depth + 1])
    return node


def _typed(value: Any, raw: str, node: dict, keys: tuple, fail: Callable[..., SpecError]) -> Any:
    types = schema_types(node)
    if not types or has_type(value, types):
        return value
    if "string" in types:
        return raw.strip()   # `--set name=007` means the string "007"
    numeric = isinstance(value, str) and ("number" in types or "integer" in types) \
        and _is_number(value)
    raise fail(f"expected {types_text(types)}, got {type_name(value)} `{raw.strip()}`",
               "write the number without quotes" if numeric else "pass a value of that type", keys)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _set_value(loaded: LoadedSpec, keys: tuple, value: Any, where: Position) -> None:
    target = loaded.spec
    for depth, key in enumerate(keys[:-1]):
        prefix = keys[:depth + 1]
        existing = target.get(key)
        # --set memory.activation_checkpointing.every_n_layers=2 turns an absent, null or `true`
        # value into a mapping when the schema allows one there.
        if existing is None \
                or (not isinstance(existing, dict) and object_branch(subschema_at(prefix) or {})):
            target[key] = {}
            for table in (loaded.positions, loaded.key_positions):
                table[prefix] = where
        target = target[key]
        if not isinstance(target, dict):
            raise spec_error(f"cannot set `{'.'.join(keys)}`: `{'.'.join(keys[:depth + 1])}` is a "
                             f"{type_name(target)}, not a mapping", path=keys, file=where.file,
                             line=where.line, column=where.col, hint="set the whole value instead")
    target[keys[-1]] = value
    for table in (loaded.positions, loaded.key_positions):
        for stale in [p for p in table if p[:len(keys)] == keys]:
            del table[stale]
    for path in iter_paths(value, keys):
        loaded.positions[path] = where
    loaded.key_positions[keys] = where
