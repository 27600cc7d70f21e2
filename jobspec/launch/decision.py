"""What a launch does with the checkpoints it finds, decided in one place: `decide` maps the
snapshot of the disk (launch/snapshot.take), the spec and the command line's --new-run/--continue
to a Decision: start a new run, resume at step K, do nothing (complete), or refuse (exit 2).

    lineage    which checkpoint directory: the one trained under the spec's fingerprint
               (launch/fingerprint.py; of several, the newest unfinished), a --new-run's next
               `<checkpoint.dir>-N`, or a refusal listing every changed field, old -> new, at its
               place in the spec (--continue takes more steps and other eval data)
    ownership  another job's checkpoints, files no job claims, `checkpoint.resume: never` over
               checkpoints: refused; else the MLflow run a resume continues
    lease      a live launch holding the directory: refused (unless it is the caller's own)
    intent     fresh, resume at step K, or complete: nothing starts, and the same spec's
               unfinished runs in the other directories are named

Pure: it reads nothing, so a launch decides before taking the lease and again under it, and
`launch --dry-run` gets the answer a launch would. A refusal carries its SpecError unlocated: the
caller places it in the spec's file (ResolvedSpec.locate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jobspec.errors import SpecError, SpecIssue, spec_error
from jobspec.launch import fingerprint as fp
from jobspec.launch import lease
from jobspec.launch.snapshot import OWNER_FILE, CheckpointSnapshot, DirectoryState, Latest
from jobspec.secrets import mask_tree
from jobspec.spec.types import JobSpec

# an Intent's action -> the Decision's
ACTIONS = {"fresh": "new", "resume": "resume", "complete": "complete"}


@dataclass(frozen=True)
class Intent:
    action: str                  # "fresh" | "resume" | "complete"
    total_steps: int | None      # None: unknown (compile_spec refuses such a job)
    step: int = 0                # the step training starts from
    checkpoint: Path | None = None

    def describe(self) -> str:
        """What a launch would do, as the end of "a launch would ..."."""
        if self.action == "complete":
            return (f"do nothing: the job is complete ({self.checkpoint} is at step {self.step} of "
                    f"{self.total_steps})")
        if self.action == "resume":
            return (f"resume from {self.checkpoint} at step {self.step} and train to step "
                    f"{self.total_steps}")
        return f"start fresh and train steps 1-{self.total_steps}"


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


@dataclass(frozen=True)
class Decision:
    action: str                               # "new" | "resume" | "complete" | "refuse"
    lineage: Lineage | None = None            # the checkpoints chosen; None: no directory fits
    intent: Intent | None = None              # where training starts in them
    mlflow_run_id: str | None = None          # the MLflow run a resume continues
    state: DirectoryState | None = None       # the chosen directory, as found
    # complete: this spec's runs stopped short in the other directories (directory, step)
    unfinished: tuple[tuple[Path, int], ...] = ()
    refusal: SpecError | None = None          # refuse: why (unlocated)

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.lineage.checkpoint_dir if self.lineage else None

    @property
    def step(self) -> int:
        return self.intent.step if self.intent else 0


def decide(snap: CheckpointSnapshot, spec: JobSpec, derived: dict, *, new_run: bool = False,
           continue_run: bool = False, holding: str | None = None) -> Decision:
    """What a launch of `spec` (as written: `checkpoint.dir` its own) does, given `snap` taken for
    it. `holding`: the token of the lease the caller holds on the chosen directory, which is then no
    refusal."""
    try:
        chosen = choose(snap, spec, derived, new_run=new_run, continue_run=continue_run)
    except SpecError as err:
        return Decision("refuse", refusal=err)
    state = snap.directory(chosen.checkpoint_dir)
    what = intent(spec["checkpoint"]["resume"], state.latest, snap.resume_from,
                  derived.get("total_steps"))
    try:
        run_id = claim(state, spec)
        held = state.holder
        if held is not None and held.refuses and held.record.get("token") != holding:
            raise lease.refusal(state.path, spec["name"], held.record)
        unfinished = tuple(item for item in unfinished_runs(snap, spec, derived)
                           if item[0] != state.path) if what.action == "complete" else ()
    except SpecError as err:
        return Decision("refuse", chosen, what, state=state, refusal=err)
    return Decision(ACTIONS[what.action], chosen, what, run_id, state, unfinished)


def intent(resume: str, latest: Latest, named: Latest | None, total_steps: int | None) -> Intent:
    """Fresh, resume or complete (`checkpoint.resume`: auto: the directory's `latest`; never; or a
    checkpoint path: `named`). A final checkpoint whose save did not complete is passed over by the
    ranks, which then train: a resume."""
    if resume == "never":
        return Intent("fresh", total_steps)
    found = latest if resume == "auto" else (named or Latest())
    if found.checkpoint is None:
        return Intent("fresh", total_steps)
    complete = total_steps is not None and found.step >= total_steps and found.complete
    return Intent("complete" if complete else "resume", total_steps, found.step, found.checkpoint)


def choose(snap: CheckpointSnapshot, spec: JobSpec, derived: dict, *, new_run: bool = False,
           continue_run: bool = False) -> Lineage:
    """The checkpoint directory a launch trains into, or a SpecError saying why none fits: a
    `--new-run` starts beside the used ones; else the one trained under this fingerprint (the
    newest unfinished of several), or one whose changes `--continue` takes."""
    base, prints = snap.base, snap.fingerprint
    used = [d for d in snap.directories if d.has_checkpoints]
    if new_run:
        if not used:
            return Lineage(base, prints, _flat(spec, base), lines=(
                f"--new-run: no earlier checkpoints; training starts in {base}",))
        target = _next_free(snap)
        return Lineage(target, prints, _flat(spec, target), lines=(
            f"checkpoints: {target} (--new-run: a new run beside the earlier checkpoints in "
            f"{base}, which stay untouched)",))
    resume = spec["checkpoint"]["resume"]
    # `never` over existing checkpoints: claim refuses
    candidates = [] if resume == "never" else \
        used if resume == "auto" else [d for d in used if d.path == base]
    scored = []
    for state in candidates:
        owner = owner_of(state) or {}
        if owner.get("job") not in (None, spec["name"]):
            continue   # another job's directory: claim refuses it if it is the one chosen
        old = owner.get("fingerprint")
        # older checkpoints carry no fingerprint
        scored.append((state, owner, [] if old is None else fp.compare(old, prints)))
    if not scored:
        return Lineage(base, prints, _flat(spec, base))
    same = [(state, owner) for state, owner, changes in scored if not changes]
    if same:
        unfinished = [item for item in same if _resumed(item[0], derived).action != "complete"]
        state, owner = unfinished[-1] if unfinished else same[0]
        return _continuing(state.path, base, owner, prints, spec, ())
    state, owner, changes = min(scored,
                                key=lambda item: (not all(c.continuable for c in item[2]),
                                                  len(item[2])))
    if continue_run and all(c.continuable for c in changes):
        return _continuing(state.path, base, owner, prints, spec, tuple(changes))
    raise _changed_spec(state.path, changes, continue_run)


def claim(state: DirectoryState, spec: JobSpec) -> str | None:
    """Refuse another job's checkpoints, files no job claims and `resume: never` over checkpoints;
    the MLflow run id to continue when resuming ours. Checkpoints exist when the directory holds
    anything besides jobspec's own files."""
    if not state.exists:
        return None
    owner = owner_of(state)
    where = ("checkpoint", "dir")
    if owner is not None and owner.get("job") != spec["name"]:
        raise spec_error(f"{state.path} belongs to job {owner.get('job')!r} (from "
                         f"{owner.get('spec')}), not {spec['name']!r}", path=where,
                         hint="set checkpoint.dir to a directory of this job, or rename the job")
    if state.has_checkpoints and owner is None:
        raise spec_error(f"{state.path} already holds files that no jobspec job claims",
                         path=where,
                         hint="point checkpoint.dir at an empty directory, or move those files "
                              "away")
    if state.has_checkpoints and spec["checkpoint"]["resume"] == "never":
        raise spec_error(f"{state.path} already holds checkpoints of job {spec['name']!r} and "
                         "checkpoint.resume is 'never'", path=("checkpoint", "resume"),
                         hint="use `--set checkpoint.resume=auto` to continue them, or delete the "
                              "directory / set checkpoint.dir elsewhere to start over")
    return owner.get("mlflow_run_id") if (owner and state.has_checkpoints) else None


def unfinished_runs(snap: CheckpointSnapshot, spec: JobSpec,
                    derived: dict) -> list[tuple[Path, int]]:
    """(directory, step) of each checkpoint directory of the lineage trained under this spec that
    holds a checkpoint short of the job's last step: what "already complete" points at."""
    found = []
    for state in snap.directories:
        owner = owner_of(state) if state.has_checkpoints else None
        if not owner or owner.get("job") not in (None, spec["name"]):
            continue
        if owner.get("fingerprint") is not None and fp.compare(owner["fingerprint"],
                                                               snap.fingerprint):
            continue
        what = _resumed(state, derived)
        if what.action == "resume":
            found.append((state.path, what.step))
    return found


def owner_of(state: DirectoryState) -> dict | None:
    """The directory's owner record; an unreadable one refuses."""
    if state.owner_unreadable is not None:
        raise unreadable_owner(state.path, state.owner_unreadable)
    return state.owner


def unreadable_owner(ckpt_dir: Path, why: object) -> SpecError:
    return spec_error(f"{ckpt_dir / OWNER_FILE} is unreadable ({why})",
                      path=("checkpoint", "dir"),
                      hint="fix or delete that file, or point checkpoint.dir elsewhere")


def _resumed(state: DirectoryState, derived: dict) -> Intent:
    """The intent of a relaunch with `checkpoint.resume: auto` into `state`'s directory."""
    return intent("auto", state.latest, None, derived.get("total_steps"))


def _next_free(snap: CheckpointSnapshot) -> Path:
    """The first `base-N` (N >= 2) holding no checkpoint: a new directory, or one whose launch never
    saved."""
    used = {d.path for d in snap.directories if d.has_checkpoints}
    number = 2
    while snap.base.with_name(f"{snap.base.name}-{number}") in used:
        number += 1
    return snap.base.with_name(f"{snap.base.name}-{number}")


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


def _flat(spec: JobSpec, directory: Path) -> dict[str, str]:
    # credentials masked (a tracking URI with a password): it is stored in the owner record
    return fp.flat(mask_tree({**spec, "checkpoint": {**spec["checkpoint"], "dir": str(directory)}}))


def _changed_spec(directory: Path, changes: list[fp.Change], continue_run: bool) -> SpecError:
    """The checkpoints were trained under another spec: every changed field at its place."""
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
    return SpecError(issues)


def _spec_path(dotted: str) -> tuple:
    """Where a fingerprint field is set in the spec (derived and content fields point at their
    source)."""
    mapped = {"derived.global_batch_size": "training.global_batch_size",
              "derived.total_steps": "training.max_steps",
              "data.train.content": "data.train", "data.eval.content": "data.eval",
              "model.config.json": "model.name_or_path"}
    return tuple(mapped.get(dotted, dotted).split("."))
