"""The jobspec package's import graph, read from the source (ast), and the layering rules it must keep.

    python scripts/import_graph.py            # print the graph; exit 1 (problems on stderr) if a rule is broken
    python scripts/import_graph.py --quiet    # only the problems

Every `import` / `from ... import` of a package module is an edge, marked `lazy` when it sits inside a
function (it runs only when the function is called) or under `if TYPE_CHECKING:` (it never runs). Rules:

1. no import cycle, neither among module-level imports nor through imports inside functions
   (`if TYPE_CHECKING:` imports never run and make no cycle);
2. no private name (`_x`, not dunder) of one module used by another: neither `from m import _x` nor
   `m._x` through an imported module;
3. the rank side (train/) never imports the launch side (launch/), at any level;
4. a command (commands/<name>.py) never imports another command (the commands package's own
   helpers in commands/__init__.py are shared);
5. the validate/compile path (optimizers/, tasks/, spec/, compile/, memory/, errors, cli, commands/)
   reaches none of torch, deepspeed, transformers, mlflow through module-level imports, followed transitively
   (importing `a.b.c` also runs `a` and `a.b`), so `jobspec validate` stays light;
6. a module imports only from its own layer or the layers below it (LAYERS, bottom up; the
   top-level modules not listed there, such as errors, rundir or units, are neutral ground below all;
   MODULE_LAYERS places a single module (or a whole package) in another layer than its package's,
   or on neutral ground);
7. only tracking/ imports mlflow, at any level: every other module reaches MLflow through
   jobspec.tracking's functions (or the client a tracked run holds);
8. a read-only command (READ_ONLY_COMMANDS) reaches nothing in launch/ through its imports, the ones
   inside functions included, followed transitively: reading a spec or a run never loads the launcher.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

HEAVY = ("torch", "deepspeed", "transformers", "mlflow")
LIGHT_PATH = ("optimizers", "tasks", "spec", "techniques", "compile", "memory", "job", "errors", "cli",
              "commands")
# The data flow, bottom up: a file -> spec -> compiled plan; the model and its memory plan; the data
# (loaders, checks, the preparation pass); the derived job; tracking; checkpoints (save/load, reshard);
# exports (read checkpoints); launch; the ranks; reports; the commands.
LAYERS = ("optimizers", "tasks", "spec", "compile", "model", "memory", "data", "job", "tracking",
          "checkpoint", "export", "launch", "train", "report", "commands", "cli", "__main__")
# Single modules (or subpackages, or a whole package) placed in another layer than their package's:
# pure modules on the validate path (spec/validation, the planner, the pre-flight read them). export/
# sits between tracking and launch (below the ranks that export and the launcher that records the
# exports), but its pure rules are read by validate; data/'s formats and record kinds (subpackages),
# record checks and tokenizer files are validate's read of the data files; memory/'s model profile
# (the planner's data types) is what spec/derived carries and model/'s trace produces; techniques/
# (a package placed whole) sits in the spec layer: validation runs its rules, and the compiler, the
# trace, the planner and the ranks above read its declarations. spec/types.py (the spec's generated
# TypedDicts, pure typing) is neutral ground: every layer's signatures name the spec's sections,
# optimizers/ and tasks/ below spec/ included.
MODULE_LAYERS = {"techniques": "spec", "export.rules": "spec", "data.formats": "spec",
                 "data.records": "spec", "data.record_checks": "spec",
                 "data.tokenizer_files": "spec", "memory.model_profile": "spec",
                 "spec.types": "neutral"}
MLFLOW_LAYER = "tracking"   # the only subpackage that imports mlflow
READ_ONLY_COMMANDS = ("validate", "compile", "plan", "report", "schema", "sync", "export")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    eager: set = field(default_factory=set)        # package modules imported at module level
    lazy: set = field(default_factory=set)         # ... inside functions or under TYPE_CHECKING
    deferred: set = field(default_factory=set)     # ... inside functions only (they run when called)
    eager_external: set = field(default_factory=set)  # top-level names of third-party packages, module level
    external: set = field(default_factory=set)        # ... at any level
    private_uses: list = field(default_factory=list)  # (line, "module._name")


def discover(root: Path, package: str) -> dict[str, Module]:
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _placement(node: ast.AST, parents: dict) -> str:
    """Where an import runs: "module" (when its module is imported), "function" (when a function
    calling it runs) or "typing" (never: under `if TYPE_CHECKING:`, an annotation's import read by
    type checkers only; a rule module naming validation's ResolvedSpec this way is no cycle)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and _type_checking(node.test):
            return "typing"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return "function"
    return "module"


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def read_imports(module: Module, modules: dict[str, Module], package: str) -> None:
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    aliases: dict[str, str] = {}  # local name -> package module it is bound to

    def add(target: str, node: ast.AST) -> None:
        placement = _placement(node, parents)
        lazy = placement != "module"
        if target.split(".")[0] != package:
            module.external.add(target.split(".")[0])
            if not lazy:
                module.eager_external.add(target.split(".")[0])
            return
        if target != module.name:
            (module.lazy if lazy else module.eager).add(target)
            if placement == "function":
                module.deferred.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:          # `from pkg import module`
                    add(submodule, node)
                    aliases[alias.asname or alias.name] = submodule
                    continue
                add(source, node)
                if _is_private(alias.name) and source.split(".")[0] == package and source != module.name:
                    module.private_uses.append((node.lineno, f"{source}.{alias.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _is_private(node.attr) and aliases[node.value.id] != module.name):
            module.private_uses.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def cycles(modules: dict[str, Module], deferred: bool = False) -> list[list[str]]:
    """Strongly connected components of the module-level graph with more than one module (Tarjan);
    with `deferred`, of the graph whose edges include the imports inside functions."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].eager | (modules[v].deferred if deferred else set())):
            if w not in modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(modules)))
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def heavy_reach(start: str, modules: dict[str, Module]) -> dict[str, list[str]]:
    """Heavy packages reached from `start` by module-level imports: package -> the import chain."""
    chains = {start: [start]}
    queue = [start]
    reached: dict[str, list[str]] = {}
    while queue:
        current = queue.pop(0)
        for heavy in HEAVY:
            if heavy in modules[current].eager_external and heavy not in reached:
                reached[heavy] = chains[current]
        for target in sorted(modules[current].eager):
            for step in with_parents(target):
                if step in modules and step not in chains:
                    chains[step] = chains[current] + [step]
                    queue.append(step)
    return reached


def reach(start: str, modules: dict[str, Module]) -> dict[str, list[str]]:
    """Every package module `start` imports, at any level, followed transitively: module -> the chain."""
    chains = {start: [start]}
    queue = [start]
    while queue:
        current = queue.pop(0)
        for target in sorted(modules[current].eager | modules[current].lazy):
            for step in with_parents(target):
                if step in modules and step not in chains:
                    chains[step] = chains[current] + [step]
                    queue.append(step)
    return chains


def layer(name: str, modules: dict[str, Module]) -> int:
    """Position of a module's subpackage in LAYERS; -1 for neutral ground (the package's own
    top-level modules that are no layer: errors, secrets, rundir, units, ...)."""
    parts = name.split(".")
    if len(parts) == 1:
        return -1
    name_in_package = ".".join(parts[1:3])
    placed = MODULE_LAYERS.get(name_in_package, MODULE_LAYERS.get(parts[1], parts[1]))
    return LAYERS.index(placed) if placed in LAYERS else -1


def problems(modules: dict[str, Module], package: str) -> list[str]:
    found = []
    eager_cycles = cycles(modules)
    for component in eager_cycles:
        found.append(f"import cycle (module level): {' <-> '.join(component)}")
    for component in cycles(modules, deferred=True):
        if component not in eager_cycles:
            found.append(f"import cycle (through imports inside functions): {' <-> '.join(component)}")
    for module in modules.values():
        for line, name in module.private_uses:
            found.append(f"{module.path}:{line}: private name {name} used outside its module")
        imports = module.eager | module.lazy
        if module.name.startswith(f"{package}.train"):
            for target in sorted(imports):
                if target == f"{package}.launch" or target.startswith(f"{package}.launch."):
                    found.append(f"{module.name} (rank side) imports {target} (launch side)")
        for target in sorted(imports):
            if target in modules and layer(target, modules) > layer(module.name, modules):
                below = "neutral ground" if layer(module.name, modules) < 0 else \
                    f"layer {LAYERS[layer(module.name, modules)]}"
                found.append(f"{module.name} ({below}) imports {target} from a layer above it")
        if "mlflow" in module.external and not module.name.startswith(f"{package}.{MLFLOW_LAYER}"):
            found.append(f"{module.name} imports mlflow: only {package}.{MLFLOW_LAYER} may (call its functions)")
        commands = f"{package}.commands"
        if module.name.startswith(commands + ".") and not module.is_package:
            for target in sorted(imports):
                if target.startswith(commands + ".") and target != module.name:
                    found.append(f"command {module.name} imports command {target}")
    for command in READ_ONLY_COMMANDS:
        name = f"{package}.commands.{command}"
        if name not in modules:
            continue
        for target, chain in reach(name, modules).items():
            if target == f"{package}.launch" or target.startswith(f"{package}.launch."):
                found.append(f"read-only command {name} imports {target} (via {' -> '.join(chain)})")
                break
    for name in sorted(modules):
        first = name.split(".")[1] if "." in name else ""
        if first not in LIGHT_PATH and MODULE_LAYERS.get(".".join(name.split(".")[1:3])) not in LIGHT_PATH:
            continue
        for heavy, chain in heavy_reach(name, modules).items():
            found.append(f"{name} imports {heavy} at module level (via {' -> '.join(chain)}): "
                         "the validate/compile path must stay light")
    return found


def build(root: Path, package: str) -> dict[str, Module]:
    modules = discover(root, package)
    for module in modules.values():
        read_imports(module, modules, package)
    return modules


def render(modules: dict[str, Module]) -> str:
    lines = []
    for name in sorted(modules):
        module = modules[name]
        deps = [d for d in sorted(module.eager) if d in modules or d.split(".")[0] == name.split(".")[0]]
        lazy = [d for d in sorted(module.lazy - module.eager)]
        lines.append(name)
        lines += [f"    -> {d}" for d in deps]
        lines += [f"    -> {d}  (lazy)" for d in lazy]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="directory holding the package (default: the repository)")
    parser.add_argument("--package", default="jobspec")
    parser.add_argument("--quiet", action="store_true", help="print only the problems")
    args = parser.parse_args(argv)
    modules = build(args.root, args.package)
    if not args.quiet:
        print(render(modules))
    found = problems(modules, args.package)
    for problem in found:
        print(f"import rule broken: {problem}", file=sys.stderr)
    if not args.quiet:
        edges = sum(len(m.eager) + len(m.lazy - m.eager) for m in modules.values())
        print(f"{len(modules)} modules, {edges} imports, {len(found)} problem(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
