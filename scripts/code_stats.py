"""The shape of a jobspec source tree in numbers (docs/architecture.md, "The code in numbers").

    python scripts/code_stats.py                      # this checkout
    python scripts/code_stats.py --root /tmp/before   # another tree (a `git worktree add` of an old commit)
    python scripts/code_stats.py --format markdown --tree before=/tmp/before --tree after=.
                                                      # markdown tables, a column per tree

Prints: the package's module count and lines (total, the largest modules), the longest functions, the
import graph (cycles at module level and through imports inside functions, bench/'s cycles, imports
that run up the layers, judged by THIS checkout's scripts/import_graph.py rules so two trees are
measured by one ruler), the code lines that end in a comment, the `spec: dict` annotations, the share
of fully annotated functions (every parameter but self/cls and the return), and [tool.mypy] from
pyproject.toml.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_graph  # noqa: E402  (the script beside this one)

PACKAGE = "jobspec"
# a `spec: dict` annotation, as written in a signature or a field
SPEC_DICT = re.compile(r"\bspec: dict\b")


@dataclass
class Stats:
    root: Path
    modules: int = 0
    lines: int = 0
    largest: list[tuple[int, str]] = field(default_factory=list)
    over_400: int = 0
    functions: int = 0
    fully_annotated: int = 0
    longest: list[tuple[int, str]] = field(default_factory=list)
    spec_dict: int = 0
    cycles: list[list[str]] = field(default_factory=list)
    lazy_cycles: list[list[str]] = field(default_factory=list)   # through imports in functions (not TYPE_CHECKING)
    upward: list[str] = field(default_factory=list)
    bench_cycles: list[list[str]] = field(default_factory=list)   # bench/'s, imports inside functions included
    code_lines: int = 0
    trailing_comments: int = 0   # code lines that end in a comment
    imports: int = 0
    mypy: dict = field(default_factory=dict)


def _fully_annotated(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> bool:
    a = node.args
    params = a.posonlyargs + a.args + a.kwonlyargs
    if in_class and params and params[0].arg in ("self", "cls") and \
            not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
        params = params[1:]
    params += [p for p in (a.vararg, a.kwarg) if p is not None]
    if node.name == "__init__" and in_class and params and node.returns is None:
        return all(p.annotation is not None for p in params)   # mypy: typed without `-> None`
    return node.returns is not None and all(p.annotation is not None for p in params)


def _comment_lines(text: str) -> tuple[int, int]:
    """(code lines, code lines that end in a comment) of a module: a code line holds a token other
    than a comment (a docstring's lines count), a trailing comment shares its line with one."""
    code: set[int] = set()
    comments: set[int] = set()
    layout = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in layout:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code), len(code & comments)


def _functions(tree: ast.Module, module: str):
    """(qualified name, node, defined directly in a class) of every function in a module."""
    def walk(node: ast.AST, prefix: str, in_class: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child, in_class
                yield from walk(child, f"{prefix}{child.name}.", False)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.", True)
            else:
                yield from walk(child, prefix, in_class)
    yield from walk(tree, f"{module}:", False)


def measure(root: Path, top: int = 10) -> Stats:
    stats = Stats(root)
    sizes, lengths = [], []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root / PACKAGE).as_posix()
        count = len(text.splitlines())
        stats.modules += 1
        stats.lines += count
        stats.over_400 += count > 400
        sizes.append((count, rel))
        stats.spec_dict += len(SPEC_DICT.findall(text))
        code, trailing = _comment_lines(text)
        stats.code_lines += code
        stats.trailing_comments += trailing
        for name, node, in_class in _functions(ast.parse(text), rel):
            stats.functions += 1
            stats.fully_annotated += _fully_annotated(node, in_class)
            lengths.append((node.end_lineno - node.lineno + 1, name))
    stats.largest = sorted(sizes, key=lambda s: (-s[0], s[1]))[:top]
    stats.longest = sorted(lengths, key=lambda s: (-s[0], s[1]))[:top]
    graph = import_graph.build(root, PACKAGE)
    stats.imports = sum(len(m.eager) + len(m.lazy - m.eager) for m in graph.values())
    stats.cycles = import_graph.cycles(graph)
    stats.lazy_cycles = sorted((c for c in import_graph.cycles(graph, deferred=True) if c not in stats.cycles),
                               key=lambda c: (len(c), c))
    if (root / "bench").is_dir():
        stats.bench_cycles = import_graph.cycles(import_graph.build(root, "bench"), deferred=True)
    stats.upward = [p for p in import_graph.problems(graph, PACKAGE) if "from a layer above it" in p]
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        stats.mypy = tomllib.loads(pyproject.read_text()).get("tool", {}).get("mypy", {})
    return stats


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _mypy_text(mypy: dict) -> str:
    flags = [f"{k} = {_toml(v)}" for k, v in mypy.items() if k not in ("overrides", "files", "python_version")]
    for override in mypy.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        rest = ", ".join(f"{k} = {_toml(v)}" for k, v in override.items() if k != "module")
        flags.append(f"for {', '.join(modules)}: {rest}")
    return "; ".join(flags) or "(none)"


def render_text(s: Stats) -> str:
    share = s.fully_annotated / s.functions if s.functions else 0.0
    lines = [
        f"tree: {s.root}",
        f"modules: {s.modules}   lines: {s.lines}   modules over 400 lines: {s.over_400}",
        "largest modules: " + ", ".join(f"{name} {n}" for n, name in s.largest),
        "longest functions:",
        *[f"  {n:4d}  {name}" for n, name in s.longest],
        f"imports (package edges): {s.imports}   module-level cycles: {len(s.cycles)}   "
        f"upward imports: {len(s.upward)}",
        *[f"  cycle: {' <-> '.join(c)}" for c in s.cycles],
        f"cycles through imports inside functions: {len(s.lazy_cycles)}",
        *[f"  cycle: {' <-> '.join(c)}" for c in s.lazy_cycles],
        *[f"  upward: {u}" for u in s.upward],
        f"bench/ import cycles (imports inside functions included): {len(s.bench_cycles)}",
        *[f"  cycle: {' <-> '.join(c)}" for c in s.bench_cycles],
        f"trailing comments: {s.trailing_comments} of {s.code_lines} code lines "
        f"({s.trailing_comments / max(s.code_lines, 1):.1%})",
        f"`spec: dict` annotations: {s.spec_dict}",
        f"fully annotated functions: {s.fully_annotated}/{s.functions} ({share:.0%})",
        f"mypy: {_mypy_text(s.mypy)}",
    ]
    return "\n".join(lines)


def _cycle_text(component: list[str]) -> str:
    names = [c.removeprefix(f"{PACKAGE}.") for c in component]
    shown = " <-> ".join(names[:3]) + (f" <-> ... ({len(names)} modules)" if len(names) > 3 else "")
    return f" (`{shown}`)"


def _upward_text(problem: str) -> str:
    source = problem.split(" (")[0].removeprefix(f"{PACKAGE}.")
    target = problem.split(" imports ")[1].split(" from")[0].removeprefix(f"{PACKAGE}.")
    return f"`{source} -> {target}`"


def render_markdown(trees: list[tuple[str, Stats]]) -> str:
    """Three tables, a column per tree: the measures, the largest modules, the longest functions."""
    def table(header: str, rows: list[tuple[str, list[str]]]) -> str:
        lines = [f"| {header} | " + " | ".join(label for label, _ in trees) + " |",
                 "| --- |" + " --- |" * len(trees)]
        return "\n".join(lines + [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows])

    def each(value) -> list[str]:
        return [value(s) for _, s in trees]

    measures = [
        ("modules", each(lambda s: str(s.modules))),
        ("modules over 400 lines", each(lambda s: str(s.over_400))),
        ("lines", each(lambda s: str(s.lines))),
        ("imports between package modules", each(lambda s: str(s.imports))),
        ("module-level import cycles", each(lambda s: str(len(s.cycles)) + "".join(_cycle_text(c) for c in s.cycles))),
        ("cycles through imports inside functions",
         each(lambda s: str(len(s.lazy_cycles)) + "".join(_cycle_text(c) for c in s.lazy_cycles))),
        ("upward imports (this checkout's layer rules)",
         each(lambda s: str(len(s.upward)) + "".join(f" ({_upward_text(u)})" for u in s.upward))),
        ("bench/ import cycles (imports inside functions included)",
         each(lambda s: str(len(s.bench_cycles)) + "".join(_cycle_text(c) for c in s.bench_cycles))),
        ("code lines ending in a comment", each(lambda s: f"{s.trailing_comments} of {s.code_lines} "
                                                f"({s.trailing_comments / max(s.code_lines, 1):.1%})")),
        ("`spec: dict` annotations", each(lambda s: str(s.spec_dict))),
        ("fully annotated functions", each(lambda s: f"{s.fully_annotated} of {s.functions} "
                                           f"({s.fully_annotated / max(s.functions, 1):.0%})")),
        ("mypy flags ([tool.mypy])", each(lambda s: _mypy_text(s.mypy))),
    ]
    top = max(len(s.longest) for _, s in trees)
    largest = [(str(i + 1), each(lambda s, i=i: f"`{s.largest[i][1]}` {s.largest[i][0]}" if i < len(s.largest) else ""))
               for i in range(max(len(s.largest) for _, s in trees))]
    longest = [(str(i + 1), each(lambda s, i=i: f"`{s.longest[i][1]}` {s.longest[i][0]}" if i < len(s.longest) else ""))
               for i in range(top)]
    return "\n\n".join((table("measure", measures), table("largest modules (lines)", largest),
                         table("longest functions (lines)", longest)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the tree to measure (default: this checkout)")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="measure several trees side by side (markdown: a column each); repeatable")
    parser.add_argument("--top", type=int, default=10, help="how many largest modules / longest functions")
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    args = parser.parse_args(argv)
    trees = [(label, Path(path)) for label, _, path in (t.partition("=") for t in args.tree)] or \
        [(str(args.root), args.root)]
    measured = [(label, measure(root, args.top)) for label, root in trees]
    if args.format == "markdown":
        print(render_markdown(measured))
    else:
        print("\n\n".join(render_text(stats) for _, stats in measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
