"""What the cross-field rules share: a rule's type, paths read relative to the file that wrote them,
and rule codes given to issues raised without one."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jobspec.errors import SpecIssue
from jobspec.spec.loader import SET_FILE
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

Rule = Callable[["ResolvedSpec"], list[SpecIssue]]


def coded(issues: list[SpecIssue], code: str) -> list[SpecIssue]:
    """`issues`, each without a rule code given `code`."""
    return [issue if issue.code else replace(issue, code=code) for issue in issues]


def get(spec: JobSpec, path: tuple) -> Any:
    """The value at `path` (a field's keys, as in SpecIssue.path)."""
    node: Any = spec
    for key in path:
        node = node[key]
    return node


def base_dir(r: ResolvedSpec, path: tuple) -> Path:
    """Relative paths are relative to the file that wrote them; `--set` ones to the current
    directory."""
    where = r.positions.get(path)
    if where is None or where.file == SET_FILE:
        return Path.cwd() if where is not None else Path(r.source).resolve().parent
    return Path(where.file).resolve().parent


def local_path(r: ResolvedSpec, path: tuple) -> Path:
    """The absolute path the string at `path` names, read as validation resolves it."""
    return Path(os.path.abspath(base_dir(r, path) / os.path.expanduser(get(r.spec, path))))


def exists(path: Path, file: bool = False) -> bool:
    try:
        return path.is_file() if file else path.exists()
    except (OSError, ValueError):   # a name too long, or with a NUL byte, names nothing
        return False
