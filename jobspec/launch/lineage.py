"""Which checkpoints a launch trains into, decided by what it trains (its fingerprint).

A job's checkpoints live in `checkpoint.dir`; `--new-run` starts a new line of checkpoints beside
them, in `<checkpoint.dir>-2`, `-3`, ..., and never touches the old ones. A relaunch looks through
these for the one trained under the same fingerprint (launch/fingerprint.py) and resumes it, so
a sweep over learning rates resumes each variant in its own directory without a new output_dir.
When several directories were trained under the same spec (a finished run, then a `--new-run` of
it that was stopped), the newest unfinished one is resumed: the command a stopped launch prints
continues that launch's checkpoints, and a finished directory has nothing left to train.

When none matches, the launch is refused (exit 2) with every changed field, old -> new, at its place
in the spec, and the choices: a new `output_dir`; `--new-run`; and `--continue` when every change is
one that is safe to continue (more steps, other eval data). A continued run records what changed and
the step it took effect at (launch/tracking.py, tracking/run.py: a new segment of the MLflow run).

The choice is launch/decision.choose's, part of the launch's one decision (launch/decision.decide);
`choose` and `unfinished_of_same_spec` here make it for a spec against its directories read now.
"""
from __future__ import annotations

from pathlib import Path

from jobspec.errors import SpecError
from jobspec.launch import decision, snapshot
from jobspec.launch.decision import Lineage
from jobspec.spec.types import JobSpec


def choose(resolved, derived: dict, *, new_run: bool = False,
           continue_run: bool = False) -> Lineage:
    """The checkpoint directory a launch of `resolved` trains into, or a SpecError (exit 2, at the
    spec's lines) saying why none fits."""
    spec = resolved.spec
    try:
        return decision.choose(snapshot.take(spec, derived), spec, derived, new_run=new_run,
                               continue_run=continue_run)
    except SpecError as err:
        raise resolved.locate(err) from None


def unfinished_of_same_spec(spec: JobSpec, derived: dict) -> list[tuple[Path, int]]:
    """(directory, step) of each checkpoint directory of this lineage trained under this spec that
    holds a checkpoint short of the job's last step: what "already complete" points at."""
    return decision.unfinished_runs(snapshot.take(spec, derived), spec, derived)
