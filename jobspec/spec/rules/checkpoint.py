"""`checkpoint.resume`: `auto`, `never`, or the path of an existing checkpoint (a near miss of the
two words gets a did-you-mean)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue, did_you_mean
from jobspec.spec.rules.base import exists, local_path

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def resume_issues(r: ResolvedSpec) -> list[SpecIssue]:
    resume = r.spec["checkpoint"]["resume"]
    if resume in ("auto", "never") or exists(local_path(r, ("checkpoint", "resume"))):
        return []
    return [r.issue(("checkpoint", "resume"),
                    f"`{resume[:80]}` is neither `auto`, `never` nor an existing "
                    "checkpoint path",
                    did_you_mean(resume, ["auto", "never"], cutoff=0.5,
                                 otherwise="use `auto`, `never` or the path of a checkpoint"),
                    code="checkpoint-resume")]
