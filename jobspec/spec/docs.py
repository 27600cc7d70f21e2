"""The job spec reference in Markdown, generated from the JSON Schema (docs/spec.md).

One table per top-level section; every field appears with its dotted path, type, default,
allowed values and description, so the schema stays the only place a field is described.
"""
from __future__ import annotations

import json

from jobspec.spec.schema import object_branch, schema_types

REGENERATE = "jobspec schema --format markdown > docs/spec.md"


def render_markdown(schema: dict) -> str:
    lines = [
        "# Job spec reference",
        "",
        f"<!-- Generated from schemas/jobspec.schema.json by `{REGENERATE}`; do not edit. -->",
        "",
        schema.get("description", ""),
        "",
        "Relative paths are resolved against the spec file that contains them (`--set` values: the",
        "current directory). For editor completion, start a spec with",
        "`# yaml-language-server: $schema=<path to>/schemas/jobspec.schema.json`.",
        "",
    ]
    properties = schema["properties"]
    top_level = [(name, node) for name, node in properties.items() if object_branch(node) is None]
    lines += _table("Top level", "", top_level)
    for name, node in properties.items():
        if object_branch(node) is not None:
            lines += _table(f"`{name}`", node.get("description", ""), [(name, node)])
    return "\n".join(lines).rstrip() + "\n"


def _table(title: str, description: str, fields: list) -> list[str]:
    rows: list[str] = []
    for name, node in fields:
        _rows(name, node, rows)
    return [f"## {title}", "", *([description, ""] if description else []),
            "| field | type | default | allowed | description |",
            "| --- | --- | --- | --- | --- |", *rows, ""]


def _rows(dotted: str, node: dict, rows: list[str]) -> None:
    rows.append("| " + " | ".join(_cell(c) for c in (
        f"`{dotted}`", " \\| ".join(schema_types(node)) or "any", _default(node), _allowed(node),
        _description(node))) + " |")
    branch = object_branch(node)
    if branch is not None:
        for name, child in branch.get("properties", {}).items():
            _rows(f"{dotted}.{name}", child, rows)


def _default(node: dict) -> str:
    return f"`{json.dumps(node['default'])}`" if "default" in node else "required"


def _allowed(node: dict) -> str:
    parts = []
    if "enum" in node:
        parts.append(", ".join(f"`{v}`" for v in node["enum"]))
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                      ("exclusiveMaximum", "<")):
        if key in node:
            parts.append(f"{sign} {node[key]}")
    items = node.get("items", {})
    if node.get("minItems") is not None or node.get("maxItems") is not None:
        low, high = node.get("minItems", 0), node.get("maxItems", "any")
        parts.append(f"{low} to {high} items" if low != high else f"exactly {low} items")
    for key, sign in (("minimum", ">="), ("exclusiveMaximum", "<")):
        if key in items:
            parts.append(f"items {sign} {items[key]}")
    if "minLength" in node or "minLength" in items:
        parts.append("non-empty")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    if isinstance(node.get("additionalProperties"), dict):
        parts.append("values: " + " \\| ".join(schema_types(node["additionalProperties"])))
    elif node.get("additionalProperties") is True:
        parts.append("any keys")
    return "; ".join(parts)


def _description(node: dict) -> str:
    text: str = node.get("description", "")
    branch = object_branch(node)
    if branch is not None and branch is not node and branch.get("description"):
        text += f" (mapping form: {branch['description']})"
    return text


def _cell(text: str) -> str:
    # A `|` inside a cell would end it; escape the ones not already escaped.
    return text.replace("\n", " ").replace("\\|", "\0").replace("|", "\\|").replace("\0", "\\|")
