"""Generate jobspec/spec/types.py: the resolved spec's shape as TypedDicts, from the JSON Schema.

    python scripts/gen_spec_types.py              # rewrite jobspec/spec/types.py
    python scripts/gen_spec_types.py --out FILE   # write it elsewhere (the staleness test)

schemas/jobspec.schema.json is the one place each field is described and defaulted; the types are
derived from it, never written by hand, so a field added to the schema reaches the type checker by
re-running this script (tests/spec/test_spec_types.py fails while the file is stale).

The types describe a spec after validation (`fill_defaults` + `resolve_paths`): every field is
present, so every key is required; a field whose schema allows null is `X | None`; `enum`s become
`Literal`s; an object with free-form keys (`model.config`, `logging.mlflow.tags`, `deepspeed`)
is `dict[str, Any]`; `oneOf` (e.g. `memory.activation_checkpointing: bool | {every_n_layers}`)
becomes the union of its branches. The fields validation fills when the schema's default is null
(FILLED_BY_LOADER: the job name from the file, the output and checkpoint directories, the MLflow
experiment) are never null after it, so they are typed without `None`.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schemas" / "jobspec.schema.json"
DEFAULT_OUT = ROOT / "jobspec" / "spec" / "types.py"
SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}
# null in the schema, set by jobspec/spec/validation.resolve_paths on every resolved spec
FILLED_BY_LOADER = {("name",), ("output_dir",), ("checkpoint", "dir"), ("logging", "mlflow", "experiment")}

HEADER = '''"""The resolved job spec's types, generated from schemas/jobspec.schema.json by
scripts/gen_spec_types.py: do not edit by hand (tests/spec/test_spec_types.py keeps it in step).

A spec after validation has every field (defaults filled), so every key is required.
"""
from __future__ import annotations

from typing import Any, Literal, TypedDict

'''


class Generator:
    def __init__(self) -> None:
        self.classes: list[str] = []   # class definitions, dependencies first

    def type_of(self, node: dict, name: str, path: tuple = ()) -> str:
        """The annotation for the schema node at `path`; object nodes become TypedDicts named `name`."""
        annotation = self._type_of(node, name, path)
        if path in FILLED_BY_LOADER:
            annotation = " | ".join(part for part in annotation.split(" | ") if part != "None")
        return annotation

    def _type_of(self, node: dict, name: str, path: tuple) -> str:
        if "oneOf" in node or "anyOf" in node:
            branches = node.get("oneOf") or node.get("anyOf")
            # one branch at most is an object (the others scalars): it gets the field's name
            return _union([self.type_of(branch, name, path) for branch in branches])
        if "enum" in node:
            return _union([f"Literal[{', '.join(json.dumps(v) for v in node['enum'] if v is not None)}]"]
                          + (["None"] if None in node["enum"] else []))
        kinds = node.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
        if not kinds:
            return "Any"
        return _union([self._one(kind, node, name, path) for kind in kinds])

    def _one(self, kind: str, node: dict, name: str, path: tuple) -> str:
        if kind in SCALARS:
            return SCALARS[kind]
        if kind == "array":
            items = node.get("items")
            return f"list[{self.type_of(items, name + 'Item') if isinstance(items, dict) else 'Any'}]"
        if kind == "object":
            properties = node.get("properties")
            if not properties:
                return "dict[str, Any]"
            fields = [(key, self.type_of(child, name + _camel(key), path + (key,)))
                      for key, child in properties.items()]
            doc = (node.get("description") or "").split(". ")[0].strip().rstrip(".")
            lines = [f"class {name}(TypedDict):"]
            if doc:
                # within 100 columns once indented behind the opening quotes
                wrapped = textwrap.wrap(doc.replace('"""', "") + ".", width=93)
                lines.append('    """' + "\n    ".join(wrapped) + ('\n    """' if len(wrapped) > 1 else '"""'))
            lines += [f"    {key}: {annotation}" for key, annotation in fields]
            self.classes.append("\n".join(lines))
            return name
        return "Any"


def _union(parts: list[str]) -> str:
    seen: list[str] = []
    for part in parts:
        for piece in part.split(" | "):
            if piece not in seen:
                seen.append(piece)
    if "None" in seen:   # None last, as written by hand
        seen = [p for p in seen if p != "None"] + ["None"]
    return " | ".join(seen)


def _camel(key: str) -> str:
    return "".join(part.capitalize() for part in key.replace("-", "_").split("_"))


def generate(schema: dict) -> str:
    generator = Generator()
    generator.type_of({**schema, "description": "A resolved job spec"}, "JobSpec")
    return HEADER + "\n" + "\n\n\n".join(generator.classes) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    text = generate(json.loads(SCHEMA.read_text(encoding="utf-8")))
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
