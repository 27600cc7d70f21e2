"""Every third-party module that jobspec/, bench/, scripts/ or tests/ import is declared in
pyproject.toml (the core dependencies or an extra), by the distribution that provides it.

A package installed by hand once hid an undeclared dependency: CI passed on that machine while a
fresh clone failed. .ci/run builds a new virtualenv every run; this test names the culprit directly,
even when another dependency happens to pull the package in."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

from conftest import REPO_ROOT

SOURCES = ("jobspec", "bench", "scripts", "tests")


# modules of the `gpu` extra (pyproject.toml), which a CPU-only install (CI's `.[dev]`) leaves
# out: jobspec imports them on GPU ranks only, so on a CPU machine no distribution provides them
GPU_ONLY = {"liger_kernel": "liger-kernel"}


def imported_top_level_names() -> dict[str, set[str]]:
    """Top-level module name -> the files importing it (imports inside functions included)."""
    found: dict[str, set[str]] = {}
    for base in SOURCES:
        for path in (REPO_ROOT / base).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    found.setdefault(module.split(".")[0], set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def local_modules() -> set[str]:
    """Our own packages, the test suite's helper modules (imported by name from tests/) and the
    scripts/ generators the staleness tests import by name."""
    tests = {path.stem for path in (REPO_ROOT / "tests").rglob("*.py")}
    test_packages = {path.name for path in (REPO_ROOT / "tests").iterdir() if path.is_dir()}  # tests/train, ...
    scripts = {path.stem for path in (REPO_ROOT / "scripts").glob("*.py")}
    return {"jobspec", "bench", "scripts", "tests", *tests, *test_packages, *scripts}


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {normalise(re.match(r"[A-Za-z0-9._-]+", req).group(0)) for req in requirements}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_declared():
    providers = importlib.metadata.packages_distributions()
    declared = declared_distributions()
    local = local_modules()
    undeclared, unknown = {}, {}
    for module, files in sorted(imported_top_level_names().items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        distributions = {normalise(d) for d in providers.get(module, [])}
        if not distributions and module in GPU_ONLY:   # declared by an extra CPU installs leave out
            distributions = {GPU_ONLY[module]}
        if not distributions:
            unknown[module] = sorted(files)
        elif not distributions & declared:
            undeclared[module] = (sorted(distributions), sorted(files))
    assert not undeclared, f"imported but not declared in pyproject.toml (module: distributions, files): {undeclared}"
    # an import no installed distribution provides fails on every machine, or is a typo
    assert not unknown, f"imported modules that no installed distribution provides: {unknown}"


def test_the_check_sees_imports_inside_functions_and_the_extras():
    """Guards the scan itself: lazy imports (torch inside functions) and extras (hypothesis in dev)."""
    names = imported_top_level_names()
    assert "jobspec/spec/validation.py" not in names.get("torch", set())   # validate stays light
    assert any(path.startswith("jobspec/") for path in names["torch"])
    assert {"hypothesis", "accelerate"} <= declared_distributions()
    assert "pyyaml" in declared_distributions() and "yaml" in names
