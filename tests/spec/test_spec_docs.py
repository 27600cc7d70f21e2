"""docs/spec.md is generated from the schema and must stay in sync with it."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT
from jobspec.spec.docs import REGENERATE, render_markdown
from jobspec.spec.schema import load_schema, object_branch

SPEC_MD = REPO_ROOT / "docs" / "spec.md"


def dotted_fields(node: dict, prefix: str = ""):
    branch = object_branch(node)
    for name, child in (branch or {}).get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        yield path, child
        yield from dotted_fields(child, path)


def test_spec_md_is_up_to_date():
    assert SPEC_MD.read_text(encoding="utf-8") == render_markdown(load_schema()), \
        f"docs/spec.md is stale: run `{REGENERATE}`"


def test_every_field_is_documented_with_its_default():
    text = render_markdown(load_schema())
    fields = list(dotted_fields(load_schema()))
    assert len(fields) > 100
    for path, node in fields:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} missing from the reference"
        if "default" in node:
            assert f"`{json.dumps(node['default'])}`" in row, row
        for value in node.get("enum", []):
            assert f"`{value}`" in row
        assert row.count(" | ") >= 4   # pipes inside cells are escaped: the table keeps 5 columns


def test_cli_markdown_matches_the_file():
    out = subprocess.run([sys.executable, "-m", "jobspec", "schema", "--format", "markdown"],
                         capture_output=True, text=True, check=True)
    assert out.stdout == SPEC_MD.read_text(encoding="utf-8")
