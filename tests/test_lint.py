"""ruff and mypy pass on jobspec/ (pyproject.toml's [tool.ruff] and [tool.mypy]): `python -m pytest`
alone holds the line that scripts/test.sh draws. Skipped only where the tool is not installed
(`pip install -e ".[dev]"` installs both)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool, args", [
    ("ruff", ["check", "jobspec"]),
    ("mypy", ["jobspec"]),
])
def test_tool_passes(tool, args):
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{tool} {' '.join(args)}:\n{result.stdout}{result.stderr}"


# The spec is typed end to end (issue 38): a resolved spec is a JobSpec (jobspec/spec/types.py), its
# sections their TypedDicts. Only the loader holds a spec as a plain mapping before it is filled.
LOADER = {"jobspec/spec/loader.py", "jobspec/spec/schema.py"}


def untyped_spec_annotations(source: str, filename: str = "<source>") -> list[str]:
    """`name:line` of each parameter or annotated attribute called `spec` whose annotation is a plain
    dict (`dict`, `dict[str, Any]`, `dict | None`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            named = [(a.arg, a.annotation) for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            named = [(node.target.id, node.annotation)]
        else:
            continue
        for name, annotation in named:
            if name != "spec" or annotation is None:
                continue
            parts = [p.strip() for p in ast.unparse(annotation).split("|")]
            if any(p == "dict" or p.startswith("dict[") for p in parts):
                found.append(f"{filename}:{annotation.lineno}")
    return found


def test_no_spec_typed_as_a_plain_dict_outside_the_loader():
    found = [hit for path in sorted((ROOT / "jobspec").rglob("*.py"))
             if path.relative_to(ROOT).as_posix() not in LOADER
             for hit in untyped_spec_annotations(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]
    assert not found, "annotate the spec as JobSpec (jobspec/spec/types.py), not dict:\n" + "\n".join(found)


@pytest.mark.parametrize("source, hits", [
    ("def f(spec: dict) -> None: ...", 1),
    ("def f(x, *, spec: dict[str, Any] | None = None): ...", 1),
    ("class C:\n    spec: dict\n", 1),
    ("def f(spec: JobSpec, memory: dict) -> dict: ...", 0),
    ("def f(spec: 'JobSpec | None'): ...", 0),
])
def test_the_spec_annotation_scan_sees_a_plain_dict(source, hits):
    assert len(untyped_spec_annotations(source)) == hits
