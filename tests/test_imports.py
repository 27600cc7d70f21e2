"""Every module of jobspec/ and bench/ imports in a fresh process with the declared dependencies.

CI installs the project into a brand-new virtualenv (.ci/run), so an import that only works because
something was installed by hand fails here instead of on a user's machine.
"""
from __future__ import annotations

import ast
import os
import pkgutil
import re
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


# One interpreter that has imported the standard library and a few declared dependencies (PRELOAD),
# and nothing of jobspec or bench, forks a child per module: each child imports its one module in that
# untouched state (a fresh interpreter, less the start-up and the ~2 s torch import that 8 modules
# share), so one module's imports still cannot hide another's. Preloading hides nothing: a missing
# package fails the server itself, and what `import torch` brings is what each module's own would.
PRELOAD = {"torch": "torch", "yaml": "pyyaml", "jsonschema": "jsonschema", "numpy": "numpy"}   # module: distribution
FORK_SERVER = r"""
import os, signal, sys, tempfile
for name in sys.argv[1:]:
    __import__(name)
assert not [m for m in sys.modules if m.split(".")[0] in ("jobspec", "bench")], "the server imported the project"
for line in sys.stdin:
    module = line.strip()
    with tempfile.TemporaryFile() as out:
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            signal.alarm(120)
            code = 0
            try:
                __import__(module)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        text = out.read().decode(errors="replace")[-2000:]
    print(repr((os.waitstatus_to_exitcode(status), text)), flush=True)
"""


PROBES = {  # the server's own check: a child sees nothing a sibling imported, and a failure comes back
    "jobspec_import_probe_a": "import builtins\nbuiltins.JOBSPEC_PROBE_A = True\n",
    "jobspec_import_probe_b": "import builtins\nassert not hasattr(builtins, 'JOBSPEC_PROBE_A'), 'saw a sibling'\n",
    "jobspec_import_probe_ab": "import jobspec_import_probe_a\nimport jobspec_import_probe_b\n",
}


@pytest.fixture(scope="module")
def import_in_fresh_child(tmp_path_factory):
    probes = tmp_path_factory.mktemp("import_probes")
    for name, text in PROBES.items():
        (probes / f"{name}.py").write_text(text)
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER, *PRELOAD], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(probes), os.environ.get("PYTHONPATH")]))})

    def run(module: str) -> tuple[int, str]:
        assert server.poll() is None, "the import server died"
        server.stdin.write(module + "\n")
        server.stdin.flush()
        return ast.literal_eval(server.stdout.readline())

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module, import_in_fresh_child):
    code, output = import_in_fresh_child(module)
    assert code == 0, output


def test_the_import_server_isolates_children_and_reports_failures(import_in_fresh_child):
    assert import_in_fresh_child("jobspec_import_probe_a") == (0, "")
    code, output = import_in_fresh_child("jobspec_import_probe_b")   # a would have failed b in one process
    assert code == 0, output
    code, output = import_in_fresh_child("jobspec.no_such_module_here")
    assert code == 1 and "ModuleNotFoundError" in output and "no_such_module_here" in output
    # and b does fail where a ran before it in the same interpreter
    code, output = import_in_fresh_child("jobspec_import_probe_ab")
    assert code == 1 and "saw a sibling" in output


def test_the_preloaded_packages_are_declared_dependencies():
    import importlib.metadata as md
    declared = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in md.requires("jobspec") or []
                if "extra ==" not in r}
    assert set(PRELOAD.values()) <= declared, declared


def test_hf_trainer_baseline_dependency_is_declared():
    # transformers' Trainer needs accelerate; bench/trainer_baseline.py is the HF Trainer baseline
    import importlib.metadata as md
    dev = [r for r in md.requires("jobspec") or [] if "extra == 'dev'" in r.replace('"', "'")]
    assert any(r.startswith("accelerate") for r in dev), dev


def _project_imports() -> list[tuple[str, int, str, str | None]]:
    """(file, line, module, name) of every import of jobspec/bench anywhere in a file, functions included."""
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
