"""The comments and docstrings of jobspec/ name only modules and attributes that exist.

A reference is one of three precise shapes, read from each comment (tokenize) and docstring (ast):

- dotted, from the package: `jobspec.spec.derived.derive`, `jobspec.hardware`;
- slashed, from a subpackage: `data/prepare.py`, `launch/console.header_lines`,
  `spec/rules/data.epochs_issues` (a path with neither `.py` nor an attribute names no module: it
  may be a run directory's `model/final`);
- a module's constant or class by the module's name alone: `loaders.IGNORE_INDEX`,
  `save_load.LATEST` (a name that is no module of jobspec, of the standard library nor of a library
  jobspec imports names nothing: `packing.Packer` with no such module).

Each resolves against the source tree: the module file (or package), then the first name after it
among the module's top-level definitions, assignments and imports (and, for a class, the names its
body defines). A dotted name whose first part is no subpackage or top-level module is not a module
reference (MLflow's `jobspec.world_size` tag, say), nor is a slashed one whose tail is a file
extension (`model/config.json`).
"""
from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import sys
import tokenize
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "jobspec"
DOTTED = re.compile(r"(?<![\w./-])jobspec((?:\.[A-Za-z_]\w*)+)")
SLASHED = re.compile(r"(?<![\w./~<>-])((?:[a-z_][a-z0-9_]*/)+[a-z_][a-z0-9_]*)((?:\.[A-Za-z_]\w*)+)")
BARE = re.compile(r"(?<![\w./])([a-z_][a-z0-9_]*)\.([A-Z][A-Za-z0-9_]*)((?:\.[A-Za-z_]\w*)?)\b")
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "yml", "md", "txt", "log", "db", "csv", "parquet", "bin",
                 "jinja", "sh", "toml", "lock", "pt", "safetensors", "html", "png", "partial"}
NOT_MODULES = {"self", "cls"}


def module_path(parts: tuple[str, ...]) -> Path | None:
    """The file of module `jobspec.<parts>` (a package's __init__.py), or None."""
    base = PACKAGE.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and path.is_file():
            return path
    return None


@cache
def names_of(path: Path) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """A module's top-level names (defined, assigned, imported) and each class's own names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    classes: dict[str, frozenset[str]] = {}

    def targets(node: ast.AST) -> set[str]:
        found = set()
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
            found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        return found

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                own = set()
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        own |= targets(item)
                classes[node.name] = frozenset(own)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            names |= targets(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):   # `if TYPE_CHECKING:` imports, guarded definitions
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in inner.names}
                elif isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                    names.add(inner.name)
                elif isinstance(inner, (ast.Assign, ast.AnnAssign)):
                    names |= targets(inner)
    return frozenset(names), classes


def resolves(parts: tuple[str, ...], attrs: tuple[str, ...]) -> bool:
    """Whether module `jobspec.<parts>` exists and defines `attrs[0]` (a submodule counts; for a
    class, `attrs[1]` among its own names)."""
    path = module_path(parts)
    if path is None:
        return False
    if not attrs:
        return True
    if module_path(parts + attrs[:1]) is not None:
        return resolves(parts + attrs[:1], attrs[1:])
    names, classes = names_of(path)
    if attrs[0] not in names:
        return False
    if len(attrs) > 1 and attrs[0] in classes and classes[attrs[0]]:
        return attrs[1] in classes[attrs[0]] or not attrs[1].isidentifier()
    return True


def dotted(parts: tuple[str, ...]) -> bool:
    """`jobspec.a.b.c`: the longest module prefix, then the names after it."""
    if module_path(parts[:1]) is None:
        return True   # no subpackage or top-level module: an MLflow tag, a config key
    cut = max(i for i in range(1, len(parts) + 1) if module_path(parts[:i]) is not None)
    return resolves(parts[:cut], parts[cut:])


@cache
def basenames() -> dict[str, tuple[tuple[str, ...], ...]]:
    """A module's last name -> the modules of that name (`loaders` -> data/loaders)."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            found.setdefault(parts[-1], []).append(parts)
    return {name: tuple(modules) for name, modules in found.items()}


@cache
def library_modules() -> frozenset[str]:
    """Every module and package name (the last part) of the libraries jobspec imports and of the
    standard library: `signal`, `nn` (torch.nn), `zero` (deepspeed.zero)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    libraries = {name for module in import_graph.build(REPO_ROOT, "jobspec").values() for name in module.external}
    found = set(sys.stdlib_module_names) | libraries
    for library in sorted(libraries):
        try:
            spec = importlib.util.find_spec(library)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            for directory, subdirectories, files in os.walk(root):
                found.update(subdirectories)
                found.update(name[:-3] for name in files if name.endswith(".py"))
    return frozenset(found)


def unresolved(text: str) -> list[str]:
    """The references in `text` (one comment or docstring) that name nothing in jobspec/."""
    found = []
    for match in DOTTED.finditer(text):
        parts = tuple(match.group(1).lstrip(".").split("."))
        if not dotted(parts):
            found.append(match.group(0))
    for match in SLASHED.finditer(text):
        parts, attrs = tuple(match.group(1).split("/")), tuple(match.group(2).lstrip(".").split("."))
        if not (PACKAGE / parts[0]).is_dir() or attrs[0] in FILE_SUFFIXES - {"py"}:
            continue
        if attrs[0] == "py":
            ok = module_path(parts) is not None and (PACKAGE.joinpath(*parts).with_suffix(".py").is_file()
                                                     or len(attrs) == 1)
        else:
            ok = resolves(parts, attrs)
        if not ok:
            found.append(match.group(0))
    for match in BARE.finditer(text):
        name, attr, member = match.groups()
        if name in NOT_MODULES:
            continue
        modules = basenames().get(name)
        attrs = (attr, member[1:]) if member else (attr,)
        if modules is not None:
            if not any(resolves(parts, attrs) for parts in modules):
                found.append(match.group(0))
        elif name not in library_modules():
            found.append(match.group(0))
    return found


def texts(path: Path):
    """(line, text) of each comment and docstring of a module."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def test_every_reference_in_a_comment_or_docstring_exists():
    problems = [f"{path.relative_to(REPO_ROOT)}:{line}: {ref}"
                for path in sorted(PACKAGE.rglob("*.py")) for line, text in texts(path)
                for ref in unresolved(text)]
    assert problems == [], "comments and docstrings name what does not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, refs", [
    ("FLOPs from the derived job (jobspec.spec.flops)", ["jobspec.spec.flops"]),
    ("see jobspec.spec.derived.derive and jobspec.hardware", []),
    ("the header (report/console.header_lines)", ["report/console.header_lines"]),
    ("the header (launch/console.header_lines), data/prepare.py", []),
    ("rendered as train/chat_data.Renderer does", ["train/chat_data.Renderer"]),
    ("spec/rules/data.py and spec/rules/nothing.py", ["spec/rules/nothing.py"]),
    ("`latest` (checkpoints.LATEST); torch's nn.Linear, deepspeed's zero.Init", ["checkpoints.LATEST"]),
    ("the label value (loaders.IGNORE_INDEX, signal.SIGINT)", []),
    ("loaders.NO_SUCH_NAME", ["loaders.NO_SUCH_NAME"]),
    ("tags `jobspec.world_size`, files model/config.json and <run dir>/model/final", []),
    ("hardware.Host.probe and hardware.Host.no_such_method", ["hardware.Host.no_such_method"]),
])
def test_the_scan_finds_what_names_nothing(text, refs):
    assert unresolved(text) == refs
