"""What a launch finds on disk, read once: the state of `checkpoint.dir` and of its `--new-run`
siblings `<checkpoint.dir>-2`, `-3`, ... that launch/decision.decide maps to an action.

For each directory: whether it holds checkpoints, its owner record (`jobspec_job.json`,
launch/ownership.py), the checkpoint its `latest` tag names and whether that save completed, its
lease (`jobspec_lease.json`, launch/lease.py) and whether the holder lives, and the run directory
that last trained into it with that run's MLflow record. Beside them: the fingerprint of what the
spec trains (launch/fingerprint.py: the data files' content is read here) and, when
`checkpoint.resume` names a checkpoint, that checkpoint.

Only reads; nothing here raises for what it finds (an unreadable owner record is kept as the
reason, for the decision to refuse with). The checkpoint layout is checkpoint/save_load.py's:
`<dir>/latest` names the newest complete checkpoint `step<N>`, whose `jobspec_manifest.json` is
written last.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from jobspec import rundir
from jobspec.launch import fingerprint as fp
from jobspec.launch import lease
from jobspec.spec.types import JobSpec

OWNER_FILE = "jobspec_job.json"         # launch/ownership.py
LATEST = "latest"                       # checkpoint/save_load.LATEST
MANIFEST = "jobspec_manifest.json"      # checkpoint/save_load.MANIFEST
STEP_TAG = re.compile(r"^step(\d+)$")   # checkpoint/save_load.tag_for
LINEAGE_SUFFIX = re.compile(r"^-(\d+)$")


@dataclass(frozen=True)
class Latest:
    """The checkpoint a resume loads: the `step<N>` a directory's `latest` names."""

    checkpoint: Path | None = None   # None: no `latest`, or a tag that names no step
    step: int = 0
    complete: bool = False           # its manifest is there: the save finished


@dataclass(frozen=True)
class DirectoryState:
    """One checkpoint directory as found."""

    path: Path
    exists: bool = False
    has_checkpoints: bool = False            # anything besides jobspec's own bookkeeping
    owner: dict | None = None                # jobspec_job.json
    owner_unreadable: str | None = None      # why jobspec_job.json could not be read
    latest: Latest = Latest()
    holder: lease.Holder | None = None       # who holds its lease
    writer_run_dir: Path | None = None       # the run directory that last trained into it
    writer_mlflow: dict | None = None        # that run's mlflow_run.json


@dataclass(frozen=True)
class CheckpointSnapshot:
    """Every checkpoint directory of a job's lineage (`base` first, then its `--new-run`
    siblings in order), the fingerprint of the spec, and the checkpoint `checkpoint.resume` names
    (None when it is auto or never)."""

    base: Path
    directories: tuple[DirectoryState, ...]
    fingerprint: dict[str, str]
    resume_from: Latest | None = None

    def directory(self, path: str | Path) -> DirectoryState:
        """The state of `path`: one of the lineage's, else a directory that does not exist (a
        `--new-run`'s next one)."""
        path = Path(path)
        return next((d for d in self.directories if d.path == path), DirectoryState(path))


def take(spec: JobSpec, derived: dict) -> CheckpointSnapshot:
    """The snapshot a launch of `spec` decides on (`derived`: the derived job, as a dict)."""
    base = Path(spec["checkpoint"]["dir"])
    resume = spec["checkpoint"]["resume"]
    return CheckpointSnapshot(
        base, tuple(read_directory(d) for d in lineage_dirs(base)), fp.fingerprint(spec, derived),
        None if resume in ("auto", "never") else named_checkpoint(Path(resume)))


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


def read_directory(directory: Path) -> DirectoryState:
    """One checkpoint directory's state."""
    directory = Path(directory)
    if not directory.is_dir():
        return DirectoryState(directory)
    owner, unreadable = owner_record(directory)
    writer = _writer(owner)
    return DirectoryState(
        directory, exists=True,
        has_checkpoints=any(is_checkpoint_entry(p) for p in directory.iterdir()),
        owner=owner, owner_unreadable=unreadable, latest=latest_of(directory),
        holder=lease.holder(directory), writer_run_dir=writer,
        writer_mlflow=_mlflow_record(writer) if writer else None)


def is_checkpoint_entry(path: Path) -> bool:
    """Whether a directory entry is (part of) a checkpoint, not jobspec's bookkeeping."""
    name = path.name
    return name not in (OWNER_FILE, lease.LEASE_FILE) and not name.startswith(
        (".jobspec-write-test", f".{lease.LEASE_FILE}", f".{OWNER_FILE}"))


def latest_of(directory: Path) -> Latest:
    """The checkpoint `<directory>/latest` names."""
    return _latest(directory, _read_latest(directory))


def named_checkpoint(path: Path) -> Latest:
    """The checkpoint `checkpoint.resume: PATH` names: a checkpoint directory's latest, else the
    checkpoint `PATH` itself (`<dir>/step<N>`)."""
    tag = _read_latest(path)
    return _latest(path, tag) if tag else _latest(path.parent, path.name)


def _latest(load_dir: Path, tag: str | None) -> Latest:
    match = STEP_TAG.match(tag or "")
    if match is None or tag is None:
        return Latest()
    checkpoint = load_dir / tag
    return Latest(checkpoint, int(match.group(1)), (checkpoint / MANIFEST).is_file())


def _read_latest(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def owner_record(directory: Path) -> tuple[dict | None, str | None]:
    """The owner record (None: there is none), or why it is unreadable."""
    try:
        return json.loads((directory / OWNER_FILE).read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, str(err)


def _writer(owner: dict | None) -> Path | None:
    last = (owner or {}).get("last_run_dir")
    return Path(last) if last and Path(last).is_dir() else None


def _mlflow_record(run_dir: Path) -> dict | None:
    try:
        return rundir.read_mlflow_run(run_dir)
    except (OSError, ValueError):   # a damaged record: the message names the run directory alone
        return None
