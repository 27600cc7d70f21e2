"""The batch split: a global batch that micro-batches times ranks divide, and epochs that give every
rank a micro-batch. Both are derived in one place (spec/derived.derive); this rule reports its
refusals positioned, and `derived_job` hands the derived job to the rules that read its numbers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecError, SpecIssue
from jobspec.spec.derived import DerivedJob, derive
from jobspec.spec.freeform import local_checkpoint_config

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def derived_job(r: ResolvedSpec) -> tuple[DerivedJob | None, list[SpecIssue]]:
    """The derived job of `r` (no profile, no row count: what validate knows) and the problems that
    kept it from being derived; (None, []) when model.config's values have the wrong type (reported
    by the model.config check)."""
    try:
        return derive(r.spec, config_json=local_checkpoint_config(r)), []
    except SpecError as err:
        return None, [r.issue(problem.path, problem.message, problem.hint,
                              code=problem.code or "batch-split")
                      for problem in err.issues]
    except (TypeError, ValueError, ZeroDivisionError):
        return None, []


def batch_split_issues(r: ResolvedSpec) -> list[SpecIssue]:
    return derived_job(r)[1]
