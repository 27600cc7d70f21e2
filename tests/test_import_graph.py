"""scripts/import_graph.py: the package keeps its layering rules, and the script catches each break."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from fnmatch import fnmatch
from pathlib import Path

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "import_graph.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_jobspec_keeps_every_import_rule():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "jobspec.launch.pipeline\n" in result.stdout and "-> jobspec.rundir" in result.stdout
    assert "(lazy)" in result.stdout and ", 0 problem(s)" in result.stderr


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in {p.parent for p in (root / "pkg").rglob("*.py")} | {root / "pkg"}:
        (directory / "__init__.py").touch()


def test_each_broken_rule_is_reported(tmp_path):
    write_package(tmp_path, {
        "spec/a.py": "from pkg.spec import b\n",
        "spec/b.py": "import pkg.spec.a\n",                                   # cycle a <-> b
        "spec/heavy.py": "from pkg.report import plots\n",                    # torch two hops away
        "report/plots.py": "import torch\n",
        "train/worker.py": "def f():\n    from pkg.launch.supervise import run\n",  # rank -> launch
        "launch/supervise.py": "def run():\n    pass\ndef _secret():\n    pass\n",
        "tracking/sync.py": "from pkg.launch import supervise\nsupervise._secret()\n",
        "tracking/sink.py": "from pkg.launch.supervise import _secret\n",
        "commands/launch.py": "def run(args):\n    from pkg.commands.compile import run\n",
        "commands/__init__.py": "def add_set_argument(parser):\n    pass\n",
        "commands/compile.py": "from pkg.commands import add_set_argument\n",  # the package's helpers: fine
        "commands/plan.py": "from pkg.commands import compile\n",
        "train/lazy_ok.py": "def f():\n    import torch\n",                    # not on the light path
    })
    result = run_script("--root", str(tmp_path), "--package", "pkg", "--quiet")
    assert result.returncode == 1
    err = result.stderr
    assert "import cycle (module level): pkg.spec.a <-> pkg.spec.b" in err
    assert "pkg.spec.heavy imports torch at module level (via pkg.spec.heavy -> pkg.report.plots)" in err
    assert "pkg.train.worker (rank side) imports pkg.launch.supervise (launch side)" in err
    assert "sync.py:2: private name pkg.launch.supervise._secret" in err
    assert "sink.py:1: private name pkg.launch.supervise._secret" in err
    assert "command pkg.commands.launch imports command pkg.commands.compile" in err
    assert "command pkg.commands.plan imports command pkg.commands.compile" in err
    assert "pkg.tracking.sync (layer tracking) imports pkg.launch.supervise from a layer above it" in err
    assert "pkg.spec.heavy (layer spec) imports pkg.report.plots from a layer above it" in err
    assert "lazy_ok" not in err and len(err.strip().splitlines()) == 10


def test_mlflow_outside_tracking_and_a_read_only_command_reaching_launch_are_reported(tmp_path):
    write_package(tmp_path, {
        "tracking/run.py": "def f():\n    import mlflow\n    from mlflow.entities import ViewType\n",  # fine
        "report/table.py": "def f():\n    from mlflow.entities import ViewType\n",       # lazily: still broken
        "report/build.py": "def f():\n    from pkg.launch import console\n",            # report may; its command not
        "launch/console.py": "def patch_text(patch):\n    return ''\n",
        "commands/compile.py": "def run(args):\n    from pkg.launch.console import patch_text\n",
        "commands/report.py": "from pkg.report import build\n",
        "commands/launch.py": "from pkg.launch import console\n",                     # not a read-only command
        "commands/validate.py": "from pkg.tracking import run\n",
    })
    result = run_script("--root", str(tmp_path), "--package", "pkg", "--quiet")
    assert result.returncode == 1
    err = result.stderr
    assert "pkg.report.table imports mlflow: only pkg.tracking may" in err
    assert "read-only command pkg.commands.compile imports pkg.launch" in err
    assert "read-only command pkg.commands.report imports pkg.launch" in err
    assert "via pkg.commands.report -> pkg.report.build -> pkg.launch" in err
    assert "pkg.tracking.run" not in err and "commands.launch" not in err and "commands.validate" not in err
    assert len(err.strip().splitlines()) == 3


def test_the_read_only_commands_exist_and_load_neither_launch_nor_mlflow():
    """The static rule above, checked by importing them: `jobspec validate`, `report`, `sync`, ...
    never load jobspec.launch (or mlflow, which they reach through jobspec.tracking when they run)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import import_graph
    finally:
        sys.path.remove(str(SCRIPT.parent))
    commands = import_graph.READ_ONLY_COMMANDS
    assert all((REPO_ROOT / "jobspec" / "commands" / f"{c}.py").is_file() for c in commands), commands
    code = ("import sys\n" + "".join(f"import jobspec.commands.{c}\n" for c in commands)
            + "print(sorted(m for m in sys.modules if m.startswith('jobspec.launch') or m.split('.')[0] == 'mlflow'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_clean_package_passes(tmp_path):
    write_package(tmp_path, {"spec/a.py": "import json\n\ndef f():\n    import torch\n",
                             "train/b.py": "import torch\nfrom pkg.spec import a\n"})
    result = run_script("--root", str(tmp_path), "--package", "pkg")
    assert result.returncode == 0, result.stderr


def test_an_import_under_type_checking_is_no_cycle_but_still_an_edge(tmp_path):
    """`if TYPE_CHECKING:` imports never run (a rule module naming validation's ResolvedSpec): no
    cycle; the same import at module level is one, and the layering rule still sees the edge."""
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.spec.a import R\n"
    write_package(tmp_path, {"spec/a.py": "from pkg.spec import b\nR = int\n", "spec/b.py": typed})
    assert run_script("--root", str(tmp_path), "--package", "pkg", "--quiet").returncode == 0
    (tmp_path / "pkg" / "spec" / "b.py").write_text("from pkg.spec.a import R\n")
    assert "import cycle (module level): pkg.spec.a <-> pkg.spec.b" in \
        run_script("--root", str(tmp_path), "--package", "pkg", "--quiet").stderr
    (tmp_path / "pkg" / "spec" / "b.py").write_text(typed.replace("pkg.spec.a", "pkg.launch.c"))
    (tmp_path / "pkg" / "launch").mkdir()
    (tmp_path / "pkg" / "launch" / "__init__.py").touch()
    (tmp_path / "pkg" / "launch" / "c.py").write_text("R = int\n")
    assert "pkg.spec.b (layer spec) imports pkg.launch.c from a layer above it" in \
        run_script("--root", str(tmp_path), "--package", "pkg", "--quiet").stderr


def module_table() -> set[str]:
    """The modules docs/architecture.md's module table names in its first column (paths under jobspec/)."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return {name for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+\.py)`", line.split("|")[1])}


def test_the_module_table_names_every_module_and_only_modules_that_exist():
    package = REPO_ROOT / "jobspec"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
               if not (p.name == "__init__.py" and not p.read_text(encoding="utf-8").strip())}  # bare packages
    named = module_table()
    assert named, "docs/architecture.md has no module table"
    unlisted = sorted(m for m in modules if not any(fnmatch(m, name) for name in named))
    assert unlisted == [], f"add these modules to docs/architecture.md's module table: {unlisted}"
    gone = sorted(name for name in named if not any(fnmatch(m, name) for m in modules))
    assert gone == [], f"docs/architecture.md's module table names modules that do not exist: {gone}"


# `pkg/module.attr` citations in docs/architecture.md (the flow diagram, the tables, the prose)
CITED = re.compile(r"\b((?:[a-z_]+/)+[a-z_0-9]+)((?:\.[A-Za-z_][A-Za-z_0-9]*)+)")
NOT_CODE = ("jobs/", "docs/", "schemas/", "bench/", "scripts/", "tests/", "dir/", "jobspec/")   # files, not modules


def test_every_function_and_class_the_architecture_doc_cites_exists():
    """`launch/lineage.choose`, `spec/inputs.derive_job`, ...: the module exists under jobspec/ and
    defines the name (a def, class or assignment at its top level), so the doc cannot drift from
    the code unnoticed (issue 23 item 6). Example modules of the "Adding an optimizer" walk-through
    (`optimizers/lion.py`) name code a reader would write, and are skipped."""
    import ast

    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    problems = []
    for module, attrs in sorted(set(CITED.findall(text))):
        if module.startswith(NOT_CODE) or attrs.split(".")[1] in ("py", "json", "yaml", "md", "log", "txt", "db"):
            continue
        path = REPO_ROOT / "jobspec" / f"{module}.py"
        if not path.is_file():
            path = REPO_ROOT / "jobspec" / module / "__init__.py"
        if not path.is_file():
            if (REPO_ROOT / "jobspec" / module.split("/")[0]).is_dir() and module != "optimizers/lion":
                problems.append(f"{module}{attrs}: no module jobspec/{module}.py")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.ClassDef))}
        defined |= {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
        defined |= {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        first = attrs.split(".")[1]
        if first not in defined:
            problems.append(f"{module}{attrs}: jobspec/{module}.py defines no {first!r}")
    assert problems == [], "docs/architecture.md cites names the code does not have:\n" + "\n".join(problems)


def test_bench_has_no_import_cycle_and_the_package_never_imports_bench():
    """The same cycle rule over bench/, imports inside functions included (its scripts import
    jobspec, never the reverse)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import import_graph
    finally:
        sys.path.remove(str(SCRIPT.parent))
    bench = import_graph.build(REPO_ROOT, "bench")
    assert import_graph.cycles(bench) == []
    assert import_graph.cycles(bench, deferred=True) == []
    package = import_graph.build(REPO_ROOT, "jobspec")
    assert not any("bench" in module.external for module in package.values())


def test_a_cycle_through_imports_inside_functions_is_reported(tmp_path):
    """Two modules that import each other, one of them inside a function, are still a cycle; an
    import under `if TYPE_CHECKING:` never runs and makes none."""
    write_package(tmp_path, {"model/a.py": "from pkg.model import b\n",
                             "model/b.py": "def f():\n    from pkg.model import a\n"})
    result = run_script("--root", str(tmp_path), "--package", "pkg", "--quiet")
    assert result.returncode == 1
    assert "import cycle (through imports inside functions): pkg.model.a <-> pkg.model.b" in result.stderr
    (tmp_path / "pkg" / "model" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.model import a\n")
    assert run_script("--root", str(tmp_path), "--package", "pkg", "--quiet").returncode == 0
