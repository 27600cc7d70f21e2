"""Settings that are one choice written two ways: set exactly one (steps or epochs; a checkpoint or
an architecture), or at most one (warmup steps or ratio)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.rules.base import get

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def _exactly_one(r: ResolvedSpec, section: str, a: str, b: str, what: str,
                 code: str) -> list[SpecIssue]:
    values = get(r.spec, (section,))
    if values[a] is None and values[b] is None:
        return [r.issue((section,), f"set either `{a}` or `{b}`", what, key=True, code=code)]
    if values[a] is not None and values[b] is not None:
        return [r.issue((section, b), f"`{a}` and `{b}` are exclusive", f"remove one: {what}",
                        key=True, code=code)]
    return []


def steps_or_epochs(r: ResolvedSpec) -> list[SpecIssue]:
    return _exactly_one(r, "training", "max_steps", "epochs",
                        "train for a number of optimizer steps or of epochs", "steps-or-epochs")


def checkpoint_or_architecture(r: ResolvedSpec) -> list[SpecIssue]:
    return _exactly_one(r, "model", "name_or_path", "architecture",
                        "load a checkpoint (name_or_path) or build a fresh model from a config "
                        "(architecture)",
                        "checkpoint-or-architecture")


def warmup(r: ResolvedSpec) -> list[SpecIssue]:
    scheduler = r.spec["training"]["scheduler"]
    if scheduler["warmup_steps"] and scheduler["warmup_ratio"]:
        return [r.issue(("training", "scheduler", "warmup_ratio"),
                        "`warmup_steps` and `warmup_ratio` are exclusive",
                        "keep one of them", code="warmup-exclusive")]
    return []
