"""The offload rules of `memory`: which ZeRO stage each offload needs, and the NVMe path.

`offload_problems` is the one definition (pure, on a `memory` section); `offload_issues` is the rule
validation runs, positioned and coded, on a written spec and on one `memory.fit` changed. Pure."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.types import JobSpecMemory

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def offload_problems(memory: JobSpecMemory) -> list[tuple[tuple, str, str]]:
    """(path, message, hint) of each offload rule `memory` (defaults filled) breaks."""
    offload, stage = memory["offload"], memory["zero_stage"]
    problems = []
    if offload["params"] != "none" and stage != 3:
        problems.append((("memory", "offload", "params"),
                         f"parameter offload needs ZeRO stage 3 (zero_stage is {stage})",
                         "set `memory.zero_stage: 3`"))
    if offload["optimizer"] != "none" and stage < 1:
        problems.append((("memory", "offload", "optimizer"),
                         "optimizer offload needs ZeRO stage >= 1 (zero_stage is 0)",
                         "set `memory.zero_stage` to 1, 2 or 3"))
    if "nvme" in (offload["params"], offload["optimizer"]) and not offload["nvme_path"]:
        which = "params" if offload["params"] == "nvme" else "optimizer"
        problems.append((("memory", "offload", which),
                         "nvme offload needs `memory.offload.nvme_path`",
                         "set it to a directory on a local NVMe drive"))
    return problems


def offload_issues(r: ResolvedSpec) -> list[SpecIssue]:
    return [r.issue(path, message, hint, code=offload_code(path, message))
            for path, message, hint in offload_problems(r.spec["memory"])]


def offload_code(path: tuple, message: str) -> str:
    """The rule code of an offload problem: the stage it needs, or the NVMe path."""
    return "offload-nvme-path" if "nvme_path" in message else f"offload-{path[-1]}-stage"
