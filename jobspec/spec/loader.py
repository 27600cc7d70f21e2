"""Reading a job spec: safe YAML with the position of every key and value, `extends`, `--set`.

PyYAML composes a node tree (which keeps line/column marks) and this module builds the plain
dict itself, so it can refuse what `yaml.safe_load` would silently accept: duplicate keys
(last-wins), non-core tags, alias bombs, absurd nesting.

Positions are 1-based `(file, line, col)`. `file` is the path as the user wrote it (bases
joined onto it), or `<--set>` for an override: line 1, column = the override's 1-based index
among the `--set` flags.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from jobspec.errors import SpecError, first_line, spec_error
from jobspec.spec.schema import type_name

MAX_NODES = 100_000   # nodes visited while building, aliases counted each time they expand
MAX_DEPTH = 64        # nested mappings/sequences; a job spec needs about 5
MAX_FILE_BYTES = 1_000_000  # a job spec is a few KiB; refuse before reading a huge (hostile) file
SET_FILE = "<--set>"

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null")}
_TIMESTAMP = _CORE + "timestamp"   # an unquoted date stays the text it was written as
_MERGE = _CORE + "merge"
# YAML 1.2 (and JSON) floats that PyYAML's YAML 1.1 resolver leaves as strings: `1e-3`, `2E5`,
# `-1e4` (1.1 wants a dot in the mantissa and a sign in the exponent). People write learning rates
# this way.
_YAML12_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")


class Position(NamedTuple):
    file: str
    line: int
    col: int


@dataclass
class LoadedSpec:
    """The merged spec before validation, with where each piece came from."""

    spec: dict
    source: Path
    text: str
    positions: dict[tuple, Position] = field(default_factory=dict)       # values
    key_positions: dict[tuple, Position] = field(default_factory=dict)   # mapping keys


def load_spec(path: str | os.PathLike) -> LoadedSpec:
    """Load `path` (following `extends`); raise SpecError if unreadable. `--set` overrides are
    applied on top by jobspec.spec.overrides.apply_overrides."""
    display = os.fspath(path)
    loaded = _load_with_bases(display, chain=())
    loaded.spec["extends"] = None
    return loaded


# ---------------------------------------------------------------- reading one file

def read_text(display: str) -> str:
    """The file's text; a clean SpecError for missing, unreadable or non-UTF-8 files."""
    p = Path(display)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise spec_error(f"file is {size:,} bytes; a job spec may be at most "
                             f"{MAX_FILE_BYTES:,}", file=display,
                             line=1, column=1,
                             hint="is this the right file? a spec is a few KiB of YAML")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise spec_error("file not found", file=display, hint="check the path") from None
    except IsADirectoryError:
        raise spec_error("is a directory, not a spec file", file=display,
                         hint="pass a .yaml file") from None
    except OSError as err:
        raise spec_error(f"cannot read file: {err.strerror or err}", file=display) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        col = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise spec_error(f"byte 0x{raw[err.start]:02x} is not valid UTF-8", file=display, line=line,
                         column=col, hint="save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


def parse_yaml(text: str, display: str) -> tuple[Any, dict, dict]:
    """(value, positions, key_positions) of one YAML document; SpecError on anything unsafe."""
    _reject_tab_indentation(text, display)
    try:
        if _FAST_LOADER is not None:
            _check_depth(text)   # libyaml composes recursively in C: refuse deep input first
            root = yaml.compose(text, Loader=_FAST_LOADER)
        else:
            root = yaml.compose(text, Loader=_DepthCheckedLoader)
    except _TooDeep as err:
        raise _nesting_error(display, err.mark) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or "invalid YAML"
        if err.context:
            started = err.context_mark
            opened = f" (opened at line {started.line + 1}, column {started.column + 1})" \
                if started else ""
            problem = f"{err.context}{opened}: {problem}"
        hint = "indent with spaces, not tabs" if "\\t" in problem or "'\\t'" in problem else \
            "check indentation, quotes and the `key: value` form on this line"
        raise spec_error(f"YAML syntax error: {problem}", file=display, hint=hint,
                         line=mark.line + 1 if mark else None,
                         column=mark.column + 1 if mark else None) from None
    except yaml.reader.ReaderError as err:  # a control character: positioned by offset, not by mark
        line = text.count("\n", 0, err.position) + 1
        column = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        raise spec_error(f"character #x{err.character:04x} is not allowed in YAML (control "
                         "character)",
                         file=display, line=line, column=column,
                         hint="delete it; save the file as plain text") from None
    except yaml.YAMLError as err:
        raise spec_error(f"YAML error: {first_line(err)}", file=display) from None
    if root is None:
        return None, {}, {}
    builder = _Builder(display)
    value = builder.build(root, ())
    return value, builder.positions, builder.key_positions


class _TooDeep(Exception):
    def __init__(self, mark: Any) -> None:
        self.mark = mark


# libyaml (when PyYAML was built with it) parses ~10x faster; `jobspec validate` has a 0.3 s budget.
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)


def _check_depth(text: str) -> None:
    if _FAST_LOADER is None:
        # the callers check _FAST_LOADER first
        raise RuntimeError("_check_depth needs libyaml's CSafeLoader")
    parser = _FAST_LOADER(text)
    depth = 0
    try:
        while parser.check_event():
            event = parser.get_event()
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _TooDeep(event.start_mark)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.MarkedYAMLError as err:
        # libyaml >= 0.2.5 stops at 1,000 levels by itself, and its scanner reads a flow
        # collection's brackets ahead of the events counted above: the same refusal, worded as ours
        if "maximum nesting depth" not in (err.problem or ""):
            raise
        raise _TooDeep(err.problem_mark) from None
    finally:
        parser.dispose()


class _DepthCheckedLoader(yaml.SafeLoader):
    """Stops composing before Python's recursion limit can turn deep nesting into a traceback."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _nesting_error(display: str, mark: Any) -> SpecError:
    return spec_error(f"nested more than {MAX_DEPTH} levels deep", file=display, line=mark.line + 1,
                      column=mark.column + 1,
                      hint="a job spec needs a few levels; check for runaway brackets or recursive "
                           "aliases")


def _reject_tab_indentation(text: str, display: str) -> None:
    # YAML forbids tabs in indentation; PyYAML's own message for it is cryptic.
    for number, line in enumerate(text.splitlines(), start=1):
        indent = len(line) - len(line.lstrip(" \t"))
        if "\t" in line[:indent] and line.strip() and not line.lstrip().startswith("#"):
            raise spec_error("tab character in indentation", file=display, line=number,
                             column=line.index("\t") + 1, hint="indent with spaces, not tabs")


class _Builder:
    """Node tree -> plain Python values, recording positions and refusing unsafe YAML."""

    def __init__(self, display: str) -> None:
        self.display = display
        self.positions: dict[tuple, Position] = {}
        self.key_positions: dict[tuple, Position] = {}
        self.visited = 0
        self.scalars = SafeConstructor()

    def pos(self, node: Node) -> Position:
        return Position(self.display, node.start_mark.line + 1, node.start_mark.column + 1)

    def fail(self, node: Node, message: str, hint: str | None = None,
             path: tuple = ()) -> SpecError:
        p = self.pos(node)
        return spec_error(message, path=path, file=p.file, line=p.line, column=p.col, hint=hint)

    def build(self, node: Node, path: tuple, depth: int = 0) -> Any:
        self.visited += 1
        if self.visited > MAX_NODES:
            top = self.key_positions.get(path[:1]) or self.pos(node)
            raise spec_error(f"the YAML expands to more than {MAX_NODES} values (aliases nested "
                             "too often)",
                             path=path[:1], file=top.file, line=top.line, column=top.col,
                             hint="a job spec is small; remove the repeated `*alias` references")
        if depth > MAX_DEPTH:
            raise self.fail(node, f"nested more than {MAX_DEPTH} levels deep", path=path[:1],
                            hint="check for recursive aliases")
        self.positions[path] = self.pos(node)
        if isinstance(node, ScalarNode):
            return self.scalar(node, path)
        if isinstance(node, SequenceNode):
            self.check_tag(node, _CORE + "seq", path)
            return [self.build(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, MappingNode):
            self.check_tag(node, _CORE + "map", path)
            return self.mapping(node, path, depth)
        raise self.fail(node, "unsupported YAML node", path=path)

    def check_tag(self, node: Node, expected: str, path: tuple) -> None:
        if node.tag != expected:
            raise self.fail(node, f"YAML tag `{_short_tag(node.tag)}` is not allowed", path=path,
                            hint="job specs hold plain mappings, lists, strings, numbers, booleans "
                                 "and null")

    def scalar(self, node: ScalarNode, path: tuple) -> Any:
        if node.tag == _TIMESTAMP:
            return node.value
        if node.tag == _CORE + "str" and not node.style and _YAML12_FLOAT.fullmatch(node.value):
            # plain (unquoted) only: a quoted "1e-3" stays the string it says
            return float(node.value)
        if node.tag not in _SCALAR_TAGS:
            self.check_tag(node, _CORE + "str", path)
        try:
            return self.scalars.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise self.fail(node, f"bad YAML value: {getattr(err, 'problem', err)}",
                            path=path) from None

    def mapping(self, node: MappingNode, path: tuple, depth: int) -> dict:
        out: dict = {}
        explicit: dict[str, Position] = {}
        merged: list = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                merged.append((key_node, value_node))
                continue
            key = self.key(key_node, path)
            kpos = self.pos(key_node)
            if key in explicit:
                first = explicit[key]
                raise spec_error(f"duplicate key `{key}` (first defined at line {first.line}, "
                                 f"column {first.col})",
                                 path=path + (key,), file=kpos.file, line=kpos.line,
                                 column=kpos.col,
                                 hint="keep only one of them; YAML would silently use the last")
            explicit[key] = kpos
            self.key_positions[path + (key,)] = kpos
            out[key] = self.build(value_node, path + (key,), depth + 1)
        for key_node, value_node in merged:
            # `<<: *base` fills keys that the mapping does not set itself.
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, MappingNode):
                    raise self.fail(source, "`<<` merges only mappings", path=path)
                for sub_key_node, sub_value_node in source.value:
                    key = self.key(sub_key_node, path)
                    if key not in out:
                        self.key_positions[path + (key,)] = self.pos(sub_key_node)
                        out[key] = self.build(sub_value_node, path + (key,), depth + 1)
        return out

    def key(self, key_node: Node, path: tuple) -> str:
        if not isinstance(key_node, ScalarNode):
            raise self.fail(key_node, "mapping keys must be plain words, not lists or mappings",
                            path=path)
        if key_node.tag not in _SCALAR_TAGS | {_TIMESTAMP}:
            self.check_tag(key_node, _CORE + "str", path)
        self.visited += 1
        # `1:` or `on:` are still the key the user typed, not an int or a YAML 1.1 boolean.
        return str(key_node.value)


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag


# ---------------------------------------------------------------- extends

def _load_with_bases(display: str, chain: tuple) -> LoadedSpec:
    text = read_text(display)
    value, positions, key_positions = parse_yaml(text, display)
    if not isinstance(value, dict):
        kind = "empty" if value is None else f"a {type_name(value)}"
        raise spec_error(f"the top level of a job spec must be a mapping, but this file is {kind}",
                         file=display, line=1, column=1,
                         hint="start with `model:` and the other sections")
    loaded = LoadedSpec(value, Path(display), text, positions, key_positions)
    base_ref = value.get("extends")
    if base_ref is None:
        return loaded
    where = positions[("extends",)]   # the key is in the file: it has a position
    if not isinstance(base_ref, str) or not base_ref.strip():
        raise spec_error("`extends` must be the path of a base spec", path=("extends",),
                         file=where.file,
                         line=where.line, column=where.col,
                         hint="e.g. `extends: base.yaml` (relative to this file)")
    base_display = os.path.normpath(os.path.join(os.path.dirname(display),
                                                 os.path.expanduser(base_ref)))
    me = os.path.realpath(display)
    if os.path.realpath(base_display) in chain + (me,):
        names = " -> ".join([*(os.path.basename(c) for c in chain), os.path.basename(me), base_ref])
        raise spec_error(f"`extends` cycle: {names}", path=("extends",), file=where.file,
                         line=where.line,
                         column=where.col,
                         hint="a base spec must not extend the files that extend it")
    if not os.path.isfile(base_display):
        raise spec_error(f"base spec `{base_ref}` not found (looked for {base_display})",
                         path=("extends",), file=where.file, line=where.line, column=where.col,
                         hint="`extends` is relative to the file that contains it")
    base = _load_with_bases(base_display, chain + (me,))
    return merge_loaded(base, loaded)


def merge_loaded(base: LoadedSpec, child: LoadedSpec) -> LoadedSpec:
    """`child` over `base`: mappings merge key by key, anything else is replaced."""
    merged = deep_merge(base.spec, child.spec)
    merged["extends"] = child.spec.get("extends")
    out = LoadedSpec(merged, child.source, child.text)
    # A path present in the child came from the child; everything else from the base.
    for path in iter_paths(merged):
        for mine, theirs, target in ((child.positions, base.positions, out.positions),
                                     (child.key_positions, base.key_positions, out.key_positions)):
            pos = mine.get(path) or theirs.get(path)
            if pos is not None:
                target[path] = pos
    return out


def deep_merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = deep_merge(base[key], value) if key in base else value
        return out
    return over


def dotted_leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """{`model.config.hidden_size`: value} for every leaf of nested mappings; lists, scalars and
    empty mappings are leaves. One walk for the MLflow params (tracking/run.flatten) and the
    checkpoints' fingerprint (launch/fingerprint.flat), which then write the leaves each their own
    way."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(dotted_leaves(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def iter_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from iter_paths(sub, path + (key,))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from iter_paths(sub, path + (i,))
