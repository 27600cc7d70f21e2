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

Reads the checkpoint directories only; `--dry-run` gets the same answer a launch would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.errors import SpecError, SpecIssue
from jobspec.launch import fingerprint as fp
from jobspec.launch import intent, ownership
from jobspec.secrets import mask_tree
from jobspec.spec.types import JobSpec

LINEAGE_SUFFIX = re.compile(r"^-(\d+)$")


@dataclass(frozen=True)
class Lineage:
    checkpoint_dir: Path
    fingerprint: dict[str, str]
    # the resolved spec (flattened) this launch runs
    spec_flat: dict[str, str]
    continued: tuple[fp.Change, ...] = ()                # fingerprint changes `--continue` accepted
    # every spec change since the previous segment
    recorded: tuple[fp.Change, ...] = ()
    # 1: the checkpoints' first launch, else a continuation
    segment: int = 1
    lines: tuple[str, ...] = field(default=())           # what the launch says about it


def lineage_dirs(base: Path) -> list[Path]:
    """`base` and its `--new-run` siblings `base-N`, in order."""
    siblings = []
    if base.parent.is_dir():
        for path in base.parent.iterdir():
            match = LINEAGE_SUFFIX.match(path.name[len(base.name):]) \
                if path.name.startswith(base.name) else None
            if match and path.is_dir():
                siblings.append((int(match.group(1)), path))
    return [base] + [path for _, path in sorted(siblings)]


def choose(resolved, derived: dict, *, new_run: bool = False,
           continue_run: bool = False) -> Lineage:
    """The checkpoint directory this launch trains into, or a SpecError (exit 2) saying why none
    fits."""
    spec = resolved.spec
    base = Path(spec["checkpoint"]["dir"])
    prints = fp.fingerprint(spec, derived)
    used = [d for d in lineage_dirs(base) if _has_checkpoints(d)]

    if new_run:
        if not used and not _has_checkpoints(base):
            return Lineage(base, prints, _flat(spec, base),
                           lines=("--new-run: no earlier checkpoints; training "
                                                                    f"starts in {base}",))
        target = _next_free(base)
        return Lineage(target, prints, _flat(spec, target), lines=(
            f"checkpoints: {target} (--new-run: a new run beside the earlier checkpoints in "
            f"{base}, which stay untouched)",))
    if spec["checkpoint"]["resume"] == "never" or not used:
        # ownership refuses `never` over existing checkpoints
        return Lineage(base, prints, _flat(spec, base))
    candidates = used if spec["checkpoint"]["resume"] == "auto" else [d for d in used if d == base]
    if not candidates:
        return Lineage(base, prints, _flat(spec, base))

    scored = []
    for directory in candidates:
        owner = ownership.read_owner(directory) or {}
        if owner.get("job") not in (None, spec["name"]):
            # another job's directory: ownership.claim_checkpoints refuses it if it is ours to use
            continue
        old = owner.get("fingerprint")
        # older checkpoints carry no fingerprint
        changes = [] if old is None else fp.compare(old, prints)
        scored.append((directory, owner, changes))
    if not scored:
        return Lineage(base, prints, _flat(spec, base))
    same = [(directory, owner) for directory, owner, changes in scored if not changes]
    if same:
        unfinished = [item for item in same if not _complete(spec, item[0], derived)]
        directory, owner = unfinished[-1] if unfinished else same[0]
        return _continuing(directory, base, owner, prints, spec, ())
    directory, owner, changes = min(scored,
                                    key=lambda item: (not all(c.continuable for c in item[2]),
                                                      len(item[2])))
    if continue_run and all(c.continuable for c in changes):
        return _continuing(directory, base, owner, prints, spec, tuple(changes))
    raise _refusal(resolved, directory, changes, continue_run)


def _continuing(directory: Path, base: Path, owner: dict, prints: dict, spec: JobSpec,
                continued: tuple[fp.Change, ...]) -> Lineage:
    segments = owner.get("segments") or []
    previous = owner.get("spec_flat") or {}
    spec_flat = _flat(spec, directory)
    ignored = {"checkpoint.dir"}
    recorded = tuple(c for c in fp.diff_specs(previous, spec_flat) if c.field not in ignored) \
        if previous else ()
    lines = []
    if directory != base:
        lines.append(f"checkpoints: {directory} (trained under this spec, by an earlier --new-run)")
    if continued:
        shown = [c for c in continued if not c.field.startswith("derived.")] or list(continued)
        lines.append("--continue: " + "; ".join(c.describe(40) for c in shown))
    segment = len(segments) + 1 if recorded or not segments else len(segments)
    return Lineage(directory, prints, spec_flat, continued, recorded, segment, tuple(lines))


def unfinished_of_same_spec(spec: JobSpec, derived: dict) -> list[tuple[Path, int]]:
    """(directory, step) of each checkpoint directory of this lineage trained under this spec that
    holds a checkpoint short of the job's last step: what "already complete" points at."""
    base = Path(spec["checkpoint"]["dir"])
    prints = fp.fingerprint(spec, derived)
    found = []
    for directory in lineage_dirs(base):
        owner = ownership.read_owner(directory) if _has_checkpoints(directory) else None
        if not owner or owner.get("job") not in (None, spec["name"]):
            continue
        if owner.get("fingerprint") is not None and fp.compare(owner["fingerprint"], prints):
            continue
        what = _intent(spec, directory, derived)
        if what.action == "resume":
            found.append((directory, what.step))
    return found


def _intent(spec: JobSpec, directory: Path, derived: dict) -> intent.Intent:
    return intent.decide({**spec, "checkpoint": {**spec["checkpoint"], "dir": str(directory),
                                                 "resume": "auto"}},
                         derived.get("total_steps"))


def _complete(spec: JobSpec, directory: Path, derived: dict) -> bool:
    return _intent(spec, directory, derived).action == "complete"


def _flat(spec: JobSpec, directory: Path) -> dict[str, str]:
    # credentials masked (a tracking URI with a password): it is stored in the owner record
    return fp.flat(mask_tree({**spec, "checkpoint": {**spec["checkpoint"], "dir": str(directory)}}))


def _refusal(resolved, directory: Path, changes: list[fp.Change], continue_run: bool) -> SpecError:
    blocking = [c for c in changes if not c.continuable]
    choices = ["`--new-run` trains from scratch in a new checkpoint directory beside them (they "
               "stay untouched)",
               "or set output_dir to a new directory"]
    if not blocking:
        choices.insert(0, "`--continue` goes on from them with these changes, recorded in the run")
    head = (f"the checkpoints in {directory} were trained under a different spec" +
            (f"; --continue cannot take {len(blocking)} of these changes (only more steps and "
             "other eval data can)"
             if continue_run and blocking else ""))
    issues = [SpecIssue(("checkpoint", "dir"), head, "; ".join(choices))]
    shown = set()
    # a derived field is shown only when the field it comes from did not change
    for change in changes:
        path = _spec_path(change.field)
        if path in shown \
                or (change.field.startswith("derived.")
                    and any(c.field == ".".join(path) for c in changes)):
            continue
        shown.add(path)
        what = change.describe() if ".".join(path) != change.field \
            else change.describe().partition(": ")[2]
        issues.append(SpecIssue(path, f"changed since those checkpoints: {what}"
                                + ("" if change.continuable else " (--continue cannot take this)")))
    return resolved.locate(SpecError(issues))


def _spec_path(dotted: str) -> tuple:
    """Where a fingerprint field is set in the spec (derived and content fields point at their
    source)."""
    mapped = {"derived.global_batch_size": "training.global_batch_size",
              "derived.total_steps": "training.max_steps",
              "data.train.content": "data.train", "data.eval.content": "data.eval",
              "model.config.json": "model.name_or_path"}
    return tuple(mapped.get(dotted, dotted).split("."))


def _has_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and any(ownership.is_checkpoint_entry(p) for p in directory.iterdir())


def _next_free(base: Path) -> Path:
    """The first `base-N` (N >= 2) holding no checkpoint: a new directory, or one whose launch never
    saved."""
    number = 2
    while _has_checkpoints(base.with_name(f"{base.name}-{number}")):
        number += 1
    return base.with_name(f"{base.name}-{number}")
