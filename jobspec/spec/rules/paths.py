"""The spec's path fields, and the rule every one of them keeps: no NUL character (no file has one;
the OS would refuse it later, far from the field)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.rules.base import get

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

PATH_FIELDS = (("data", "train"), ("data", "eval"), ("data", "tokenizer"),
               ("data", "chat_template"), ("model", "name_or_path"),
               ("output_dir",), ("checkpoint", "dir"), ("checkpoint", "resume"),
               ("memory", "offload", "nvme_path"), ("export", "dir"))


def nul_issues(r: ResolvedSpec) -> list[SpecIssue]:
    return [r.issue(path, "a path cannot contain a NUL character", "remove the `\\0` escape",
                    code="path-nul")
            for path in PATH_FIELDS if isinstance(get(r.spec, path), str)
            and "\0" in get(r.spec, path)]
