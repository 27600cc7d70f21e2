"""Data files checked before any rank starts, and located when a rank trips over one later.

`record_issues(spec)` is validate's (so plan's, compile's and launch's) read of the local data
files: every bad record, up to MAX_REPORTED per file and then a count, each at its file:line, in the
first PREFLIGHT_BYTES of a file (or its format's `checked_rows`; `unread` says what was left).
`RecordChecker.problem` is one record's check, for the data preparation pass too.
`preflight_issues(spec)`, the first problem of each file: for `data.train` and `data.eval`, the path
is a readable, non-empty regular file, its first PREFLIGHT_ROWS rows are valid UTF-8 and parse in
their format, they hold the columns the task needs, and their labels are valid class ids (or at most
`model.num_labels` class names). It reads at most PREFLIGHT_BYTES of a file, so a 100 GB file costs
what a small one does; the rows after those are read by the ranks, and when datasets/pyarrow or the
tokenizer fail on one, the rank calls `check_file(..., max_rows=None)` to name the file and line of
the first bad row (`load_dataset`, jobspec/data/loaders.py).

How a file is read is its format's (data/formats/: `columns`, `rows`, `check_documents`); how a
record is checked is its kind's (data/records/: `data.records`, `auto` decided by the first record's
fields). Text corpora are read for UTF-8 and for at least one document. Datasets by name (`hf:`) and
`save_to_disk` directories (formats that are not `local`) are read by the ranks only.

Neutral ground (like shm.py): the launcher and the ranks both use it; no torch, no datasets.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobspec.data.formats import (
    FORMATS,
    file_format,
    listed,
    source_format,
    split_format,
    split_source,
)
from jobspec.data.formats.base import DataFormat, UnreadableFile
from jobspec.data.records import Columns
from jobspec.data.records.base import BadRecord, describe
from jobspec.errors import SpecError, SpecIssue, first_line, spec_error
from jobspec.spec.types import JobSpec, JobSpecData
from jobspec.units import MiB, fmt_bytes_any_unit

PREFLIGHT_ROWS = 1000
PREFLIGHT_BYTES = 32 * MiB
MAX_REPORTED = 20          # bad records listed per file by validate; the rest are counted
SPLITS = ("train", "eval")


def preflight_issues(spec: JobSpec) -> list[SpecIssue]:
    """The first problem of each data file the spec names (unpositioned: `ResolvedSpec.locate`
    them)."""
    data = spec["data"]
    issues = []
    for split, source in named_sources(data):
        try:
            issue = check_source(source, data["format"], Columns.of(spec), split)
        except SpecError as err:  # data.format cannot be told from the extension
            issues.extend(err.issues)
            continue
        if issue is not None:
            issues.append(issue)
    return issues


def named_sources(data: JobSpecData) -> Iterator[tuple[str, str]]:
    """(split, source) for each split the spec names data for; none for synthetic data."""
    if data.get("synthetic") is not None:
        return
    for split in SPLITS:
        if data.get(split):
            yield split, split_source(data, split)


def record_issues(spec: JobSpec, limit: int = MAX_REPORTED) -> list[SpecIssue]:
    """Validate's read of the local data files: every bad record (up to `limit` per file, then a
    count), each at its file:line, in the first PREFLIGHT_BYTES of a file (its format's
    `checked_rows` rows of a compressed one); unpositioned (`ResolvedSpec.locate` them). `unread`
    says what it left out."""
    data = spec["data"]
    issues: list[SpecIssue] = []
    for split, source in named_sources(data):
        try:
            fmt = source_format(source, data["format"])
            if not fmt.local:
                continue
            paths = fmt.files(source, data["format"])
        except SpecError as err:   # data.format cannot be told from the extension
            issues.extend(err.issues)
            continue
        if not paths:
            issues.append(check_source(source, data["format"], Columns.of(spec), split) or
                          SpecIssue(path=("data", split), message=f"{source} holds no text files"))
            continue
        directory = fmt.claims(source)
        for path in paths:
            issues += file_issues(path, fmt.name, Columns.of(spec), split,
                                  max_rows=fmt.checked_rows,
                                  max_bytes=PREFLIGHT_BYTES, limit=limit, whole_file=not directory)
    return issues


def unread(spec: JobSpec) -> list[str]:
    """What `record_issues` did not read, one line per file (the launch's data pass and the ranks
    read it)."""
    data = spec["data"]
    lines = []
    for split, source in named_sources(data):
        try:
            fmt = source_format(source, data["format"])
            if not fmt.local:
                lines.append(f"data.{split}: {source} is read by the ranks (a dataset by name or a "
                             "saved one): its records are not checked here")
                continue
            if fmt.claims(source):   # a directory of text files
                continue
            line = _unread_line(fmt, Path(source), split)
            if line:
                lines.append(line)
        # OSError, SpecError, pyarrow's: record_issues reported the file
        except Exception:  # noqa: BLE001
            continue
    return lines


def _unread_line(fmt: DataFormat, path: Path, split: str) -> str | None:
    if fmt.checked_rows is not None:
        total = fmt.count_rows(path)
        if total > fmt.checked_rows:
            return (f"data.{split}: the first {fmt.checked_rows:,} of {total:,} rows checked; "
                    "the rest when the ranks read them")
        return None
    size = path.stat().st_size
    if size > PREFLIGHT_BYTES:
        return (f"data.{split}: the first {fmt_bytes_any_unit(PREFLIGHT_BYTES)} of "
                f"{fmt_bytes_any_unit(size)} checked; the rest when the launch's data pass or the "
                "ranks read them")
    return None


def check_source(source: str, fmt: str, columns: Columns, split: str, *,
                 max_rows: int | None = PREFLIGHT_ROWS,
                 max_bytes: int | None = PREFLIGHT_BYTES) -> SpecIssue | None:
    """`check_file` for a file, the text files of a directory; nothing for `hf:` or saved
    datasets."""
    found = source_format(source, fmt)
    if not found.local:
        return None
    if not found.claims(source):
        return check_file(source, fmt, columns, split, max_rows=max_rows, max_bytes=max_bytes)
    files = found.files(source, fmt)
    if not files:
        return SpecIssue(path=("data", split),
                         message=f"{source} is a directory, not a data file (it holds no "
                         f"{'/'.join(found.suffixes)} files and no saved dataset)",
                         hint=f"point data.{split} at a data file, or a directory of text files")
    for path in files[:max_rows] if max_rows is not None else files:
        issue = check_file(path, found.name, columns, split, max_rows=max_rows, max_bytes=max_bytes,
                           whole_file=False)
        if issue is not None:
            return issue
    return None


def check_file(path: str | os.PathLike, fmt: str, columns: Columns, split: str, *,
               max_rows: int | None = PREFLIGHT_ROWS, max_bytes: int | None = PREFLIGHT_BYTES,
               whole_file: bool = True) -> SpecIssue | None:
    """The first problem in `path` (None: none in the rows read). `max_rows=None` reads the whole
    file."""
    issues = file_issues(path, fmt, columns, split, max_rows=max_rows, max_bytes=max_bytes, limit=1,
                         count_rest=False, whole_file=whole_file)
    return issues[0] if issues else None


def file_issues(path: str | os.PathLike, fmt: str, columns: Columns, split: str, *,
                max_rows: int | None = None, max_bytes: int | None = PREFLIGHT_BYTES,
                limit: int = MAX_REPORTED,
                count_rest: bool = True, whole_file: bool = True) -> list[SpecIssue]:
    """Every bad record of `path` among those read, each at its file:line: the first `limit`, then
    (with `count_rest`) one more issue counting the others. A problem of the whole file (missing,
    empty, not UTF-8 in a csv, a missing column) ends the reading. The record checks are
    `RecordChecker`'s. A text file of a directory (`whole_file` False) may be empty: its directory
    holds the documents."""
    path = Path(path)
    data_format = file_format(path, fmt)
    found: list[SpecIssue] = []
    more = 0

    def bad(problem: BadRecord) -> bool:   # whether to go on reading
        nonlocal more
        if len(found) < limit:
            found.append(SpecIssue(path=problem.field, message=problem.message, hint=problem.hint))
        else:
            more += 1
        return count_rest or len(found) < limit

    try:
        _check_stat(path, split)
        if not data_format.holds_records:
            data_format.check_documents(path, split, max_bytes, may_be_empty=not whole_file)
            return []
        if _records(data_format, path, columns, split, max_rows, max_bytes, bad) == 0:
            raise BadRecord(("data", split), f"{path} has no rows",
                            "a data file needs at least one row")
    except BadRecord as problem:
        bad(problem)
    if more:
        found.append(SpecIssue(path=("data", split),
                               message=f"{path}: {more:,} more bad records after these "
                               f"{limit}",
                               hint="fix the records above first; validate lists the next ones "
                                    "then"))
    return found


def _records(data_format: DataFormat, path: Path, columns: Columns, split: str,
             max_rows: int | None, max_bytes: int | None, bad) -> int:
    """Reads the file's records through `RecordChecker`, each problem to `bad` (False: stop); the
    count."""
    names = data_format.columns(path, split)
    if names is not None:
        columns = columns.resolved(names)
        missing = [c for c in columns.needed() if c not in names]
        if missing:
            raise BadRecord(columns.kind.column_field(columns, missing[0]),
                            data_format.missing_column(path, missing[0], names),
                            "name one of the file's columns")
    checker = RecordChecker(columns, split)
    wanted = columns.needed() if names is not None else None
    count = 0
    for where, row in data_format.rows(path, split, columns=wanted, label=columns.label_field,
                                       max_rows=max_rows, max_bytes=max_bytes):
        count += 1
        problem = row if isinstance(row, BadRecord) else checker.problem(where, row)
        if problem is not None and not bad(problem):
            break
    return count


def _check_stat(path: Path, split: str) -> None:
    field = ("data", split)
    files = listed([name for name, f in FORMATS.items() if f.schema_value and f.holds_records])
    try:
        info = path.stat()
    except FileNotFoundError:
        raise BadRecord(field, f"data file not found: {path}",
                        "paths are relative to the spec file that sets them")
    except OSError as err:
        raise BadRecord(field, f"{path} cannot be read ({err.strerror or err})",
                        "check the path and its permissions")
    if stat.S_ISDIR(info.st_mode):
        raise BadRecord(field, f"{path} is a directory, not a data file",
                        f"point data.{split} at one {files} file")
    if not stat.S_ISREG(info.st_mode):
        raise BadRecord(field, f"{path} is not a regular file",
                        f"point data.{split} at a {files} file")
    if info.st_size == 0:
        raise BadRecord(field, f"{path} is empty (0 bytes)",
                        f"point data.{split} at the file with the data")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as err:
        raise BadRecord(field, f"{path} is not readable ({err.strerror or err})",
                        "fix its permissions")


class RecordChecker:
    """The checks of one data record: its fields (what its kind needs: data/records/) and label
    values, with what earlier records established (`records: auto` decided by the first, the label
    kind, the label names seen). Torch-free; `problem(where, record)` is the importable entry point
    (validate's full read here; the data preparation pass, data/prepare, checks records the same
    way)."""

    def __init__(self, columns: Columns, split: str):
        self.columns, self.split = columns, split
        self.label_kind: str | None = None   # "id" or "name", from the first label seen
        self.names: set = set()

    def problem(self, where: str, row: dict) -> BadRecord | None:
        """What is wrong with this record (None: nothing), at `where` (its file:line)."""
        try:
            self.check(where, row)
        except BadRecord as bad:
            return bad
        return None

    def check(self, where: str, row: dict) -> None:
        if self.columns.records == "auto":   # decided by the first record
            self.columns = self.columns.resolved(row)
        c = self.columns
        kind = c.kind
        for name in kind.needed(c):
            if name not in row:
                raise BadRecord(kind.column_field(c, name), f"{where}: no {name!r} field (it has: "
                                f"{', '.join(map(str, row)) or 'nothing'})",
                                kind.missing_hint(c, name))
        kind.check(self, where, row)

    def label(self, where: str, value) -> None:
        """One class label: an id below `num_labels`, or a name; the same sort as the earlier
        ones."""
        c = self.columns
        kind = "id" if isinstance(value, int) and not isinstance(value, bool) else \
            "name" if isinstance(value, str) else None
        if kind is None:
            raise BadRecord(("data", self.split), f"{where}: label {value!r} is {describe(value)}; "
                            "an integer class id or a class name expected", "fix the row's label")
        if self.label_kind is not None and kind != self.label_kind:
            raise BadRecord(("data", self.split),
                            f"{where}: label {value!r} is a class {kind} but earlier labels "
                            f"are class {self.label_kind}s",
                            "use class ids or class names throughout")
        self.label_kind = kind
        if kind == "id" and not 0 <= value < c.num_labels:
            raise BadRecord(("model", "num_labels"), f"{where}: label {value} is not a class id in "
                            f"[0, {c.num_labels})",
                            "set model.num_labels to the number of classes, or fix the label")
        if kind == "name":
            self.names.add(value)
            if len(self.names) > c.num_labels:
                shown = ", ".join(repr(n) for n in sorted(self.names)[:6])
                raise BadRecord(("model", "num_labels"),
                                f"{where}: {len(self.names)} different label names "
                                f"({shown}{', ...' if len(self.names) > 6 else ''}) but "
                                f"model.num_labels is {c.num_labels}",
                                "set model.num_labels to the number of classes")


def locate_error(spec: JobSpec, split: str) -> SpecError | None:
    """A rank's failure on a data file turned into the first bad row's file:line (None when the
    whole file checks out: the failure was not the data's)."""
    data = spec["data"]
    issue = check_source(split_source(data, split), data["format"], Columns.of(spec), split,
                         max_rows=None, max_bytes=None)
    return SpecError([issue]) if issue is not None else None


def row_location(spec: JobSpec, split: str, index: int) -> str:
    """Where `data.<split>`'s record `index` (0-based, as datasets numbers them) is, for a problem
    found in a well-formed record (a chat template that fails on it): `file:line`, else `file: row
    N`."""
    try:
        return split_format(spec["data"], split).where(spec, split, index)
    except SpecError:
        return f"{split_source(spec['data'], split)}: row {index + 1}"


def load_dataset(spec: JobSpec, split: str) -> Any:
    """`data.<split>` as a datasets.Dataset (its format's `dataset`): a local file datasets cannot
    read is named at its first bad row."""
    fmt = split_format(spec["data"], split)
    try:
        return fmt.dataset(spec, split)
    except UnreadableFile as err:
        raise locate_error(spec, split) \
            or unreadable(spec, split, fmt.name, err.__cause__ or err) from None


def unreadable(spec: JobSpec, split: str, fmt: str, err: BaseException) -> SpecError:
    """A data file datasets could not read, where the row check found nothing more precise."""
    path = split_source(spec["data"], split)
    return spec_error(f"cannot read {path} as {fmt}: {first_line(err)}", path=("data", split),
                      hint="check the file and data.format")
