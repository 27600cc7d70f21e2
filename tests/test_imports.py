"""Every module of jobspec/ and bench/ imports in a fresh process with the declared dependencies.

CI installs the project into a brand-new virtualenv (.ci/run), so an import that only works because
something was installed by hand fails here instead of on a user's machine.
"""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _modules(package: str) -> list[str]:
    root = REPO / package
    names = [package]
    for info in pkgutil.walk_packages([str(root)], prefix=f"{package}."):
        if not info.name.endswith("__main__"):   # __main__ modules run their command on import
            names.append(info.name)
    return sorted(names)


MODULES = _modules("jobspec") + _modules("bench")


def test_every_package_directory_is_walked():
    assert "jobspec.train.worker" in MODULES and "bench.trainer_baseline" in MODULES
    assert len(MODULES) > 40


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module):
    # a fresh interpreter each: one module's imports must not hide another's missing dependency
    out = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_hf_trainer_baseline_dependency_is_declared():
    # transformers' Trainer needs accelerate; bench/trainer_baseline.py is the HF Trainer baseline
    import importlib.metadata as md
    dev = [r for r in md.requires("jobspec") or [] if "extra == 'dev'" in r.replace('"', "'")]
    assert any(r.startswith("accelerate") for r in dev), dev


def _project_imports() -> list[tuple[str, int, str, str | None]]:
    """(file, line, module, name) of every import of jobspec/bench anywhere in a file, functions included."""
    import ast
    found = []
    for folder in ("jobspec", "bench", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in ("jobspec", "bench"):
                    found += [(str(path.relative_to(REPO)), node.lineno, node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    found += [(str(path.relative_to(REPO)), node.lineno, a.name, None) for a in node.names
                              if a.name.split(".")[0] in ("jobspec", "bench")]
    return found


def test_imports_inside_functions_name_what_exists():
    # a module split leaves `from jobspec.x import y` inside a function pointing at nothing until that
    # function runs (bench/step_profile.py once imported jobspec.tracking.telemetry, gone since the split)
    import importlib
    imports = _project_imports()
    assert len(imports) > 300
    stale = []
    for path, line, module, name in imports:
        try:
            owner = importlib.import_module(module)
        except ImportError as error:
            stale.append(f"{path}:{line}: {module}: {error}")
            continue
        if name is not None and name != "*" and not hasattr(owner, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                stale.append(f"{path}:{line}: {module} has no {name}")
    assert not stale, "\n".join(stale)
