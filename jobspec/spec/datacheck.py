"""Data files checked before any rank starts, and located when a rank trips over one later.

`preflight_issues(spec)` runs in `jobspec launch` before anything is created: for `data.train` and
`data.eval`, the path is a readable, non-empty regular file, its first PREFLIGHT_ROWS rows are
valid UTF-8 and parse in `data.format`, they hold the columns the task needs, and their labels are
valid class ids (or at most `model.num_labels` class names). It reads at most PREFLIGHT_BYTES of a
file, so a 100 GB file costs what a small one does; the rows after those are read by the ranks,
and when datasets/pyarrow or the tokenizer fail on one, the rank calls `check_file(..., max_rows=None)`
to name the file and line of the first bad row (jobspec/train/data.py).

Neutral ground (like shm.py): the launcher and the ranks both use it; no torch, no datasets.
"""
from __future__ import annotations

import csv
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from jobspec import tasks
from jobspec.errors import SpecError, SpecIssue, first_line, spec_error
from jobspec.spec.data_format import data_format
from jobspec.units import MiB

PREFLIGHT_ROWS = 1000
PREFLIGHT_BYTES = 32 * MiB
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Columns:
    """What the job's task needs from each row of a data file."""

    text_fields: tuple
    label_field: str | None   # None: language-model tasks have no label column
    task: str
    num_labels: int

    @classmethod
    def of(cls, spec: dict) -> "Columns":
        data, model = spec["data"], spec["model"]
        task = model["task"]
        label = data["label_field"] if tasks.get(task).classification else None
        return cls(tuple(data.get("text_fields") or ["text"]), label, task, model["num_labels"])

    def needed(self) -> list[str]:
        return [*self.text_fields, *([self.label_field] if self.label_field else [])]


def preflight_issues(spec: dict) -> list[SpecIssue]:
    """The first problem of each data file the spec names (unpositioned: `ResolvedSpec.locate` them)."""
    data = spec["data"]
    if data.get("synthetic") is not None:
        return []
    issues = []
    for split in SPLITS:
        if data.get(split):
            try:
                issue = check_file(data[split], data["format"], Columns.of(spec), split)
            except SpecError as err:  # data.format cannot be told from the extension
                issues.extend(err.issues)
                continue
            if issue is not None:
                issues.append(issue)
    return issues


class _Bad(Exception):
    """One problem, raised where it is found and turned into a SpecIssue by check_file."""

    def __init__(self, field: tuple, message: str, hint: str):
        super().__init__(message)
        self.field, self.message, self.hint = field, message, hint


def check_file(path: str | os.PathLike, fmt: str, columns: Columns, split: str, *,
               max_rows: int | None = PREFLIGHT_ROWS, max_bytes: int | None = PREFLIGHT_BYTES) -> SpecIssue | None:
    """The first problem in `path` (None: none in the rows read). `max_rows=None` reads the whole file."""
    path = Path(path)
    fmt = data_format(path, fmt)
    try:
        _check_stat(path, split)
        reader = {"jsonl": _jsonl_rows, "csv": _csv_rows, "parquet": _parquet_rows}[fmt]
        rows = _RowChecker(path, columns, split)
        count = 0
        for where, row in reader(path, columns, split, max_rows, max_bytes):
            rows.check(where, row)
            count += 1
        if count == 0:
            raise _Bad(("data", split), f"{path} has no rows", "a data file needs at least one row")
    except _Bad as bad:
        return SpecIssue(path=bad.field, message=bad.message, hint=bad.hint)
    return None


def _check_stat(path: Path, split: str) -> None:
    field = ("data", split)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _Bad(field, f"data file not found: {path}", "paths are relative to the spec file that sets them")
    except OSError as err:
        raise _Bad(field, f"{path} cannot be read ({err.strerror or err})", "check the path and its permissions")
    if stat.S_ISDIR(info.st_mode):
        raise _Bad(field, f"{path} is a directory, not a data file",
                   f"point data.{split} at one jsonl, csv or parquet file")
    if not stat.S_ISREG(info.st_mode):
        raise _Bad(field, f"{path} is not a regular file", f"point data.{split} at a jsonl, csv or parquet file")
    if info.st_size == 0:
        raise _Bad(field, f"{path} is empty (0 bytes)", f"point data.{split} at the file with the data")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as err:
        raise _Bad(field, f"{path} is not readable ({err.strerror or err})", "fix its permissions")


def _lines(path: Path, split: str, max_lines: int | None, max_bytes: int | None):
    """(line number, decoded line) of the file's first lines; a line that is not UTF-8 is the problem."""
    read = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _Bad(("data", split), f"{path}:{number}: byte {err.start + 1} of the line "
                           f"(0x{raw[err.start]:02x}) is not valid UTF-8",
                           "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None
            yield number, text
            read += len(raw)
            if (max_bytes is not None and read >= max_bytes) or (max_lines is not None and number >= max_lines):
                return


def _jsonl_rows(path: Path, columns: Columns, split: str, max_rows: int | None, max_bytes: int | None):
    rows = 0
    for number, line in _lines(path, split, None, max_bytes):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            where = f", column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
            message = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
            raise _Bad(("data", split), f"{path}:{number}: not valid JSON ({message}{where})",
                       "each line of a jsonl file must be one JSON object") from None
        if not isinstance(row, dict):
            raise _Bad(("data", split), f"{path}:{number}: a JSON object per line expected, found "
                       f"{_kind(row)}", "each line of a jsonl file must be one JSON object")
        yield f"{path}:{number}", row
        rows += 1
        if max_rows is not None and rows >= max_rows:
            return


def _csv_rows(path: Path, columns: Columns, split: str, max_rows: int | None, max_bytes: int | None):
    # a quoted field may span lines: read a few more lines than rows, and forgive a record cut at the end
    max_lines = None if max_rows is None else 2 * max_rows + 1
    lines = _lines(path, split, max_lines, max_bytes)
    last = [0]

    def texts():
        for number, text in lines:
            last[0] = number
            yield text
    reader = csv.reader(texts())
    try:
        header = next(reader, None)
        if header is None:
            return
        missing = [c for c in columns.needed() if c not in header]
        if missing:
            raise _Bad(_column_field(columns, missing[0]), f"{path}: the header has no column "
                       f"{missing[0]!r} (columns: {', '.join(header)})", "name one of the file's columns")
        index = {name: header.index(name) for name in columns.needed()}
        rows = 0
        for fields in reader:
            where = f"{path}:{reader.line_num}"
            if not fields:
                continue
            if len(fields) != len(header):
                raise _Bad(("data", split), f"{where}: {len(fields)} fields, the header names {len(header)}",
                           "quote fields that contain commas or line breaks")
            # what pandas (datasets' csv reader) makes of a field: missing when empty; labels that are
            # all integers become class ids
            row = {name: (EMPTY if fields[i] == "" else fields[i]) for name, i in index.items()}
            if columns.label_field and isinstance(label := row[columns.label_field], str):
                row[columns.label_field] = _int_or_text(label)
            yield where, row
            rows += 1
            if max_rows is not None and rows >= max_rows:
                return
    except csv.Error as err:
        if max_lines is not None and last[0] >= max_lines:
            return  # the record the line limit cut in two
        raise _Bad(("data", split), f"{path}:{reader.line_num}: not valid CSV ({err})",
                   "check the quoting of that line") from None


class _Empty:
    """An empty csv field (pandas reads it as missing)."""

    def __repr__(self) -> str:
        return "''"


EMPTY = _Empty()


def _int_or_text(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _parquet_rows(path: Path, columns: Columns, split: str, max_rows: int | None, max_bytes: int | None):
    import pyarrow.parquet as pq  # only for parquet data
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError with a reason
        raise _Bad(("data", split), f"{path} is not a readable parquet file ({first_line(err)})",
                   "check the file and data.format") from None
    names = parquet.schema_arrow.names
    missing = [c for c in columns.needed() if c not in names]
    if missing:
        raise _Bad(_column_field(columns, missing[0]), f"{path} has no column {missing[0]!r} "
                   f"(columns: {', '.join(names)})", "name one of the file's columns")
    number = 0
    for batch in parquet.iter_batches(batch_size=min(max_rows or 10_000, 10_000), columns=columns.needed()):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # find the row: one at a time
            rows = None
        for offset in range(batch.num_rows):
            number += 1
            if rows is not None:
                row = rows[offset]
            else:
                try:
                    row = batch.slice(offset, 1).to_pylist()[0]
                except UnicodeDecodeError as err:
                    raise _Bad(("data", split), f"{path}: row {number} holds a string that is not valid UTF-8 "
                               f"({err})", "rewrite the file with UTF-8 strings") from None
            yield f"{path}: row {number}", row
            if max_rows is not None and number >= max_rows:
                return


class _RowChecker:
    """The columns and label values of each row, with what earlier rows established (label kind, names)."""

    def __init__(self, path: Path, columns: Columns, split: str):
        self.path, self.columns, self.split = path, columns, split
        self.label_kind: str | None = None   # "id" or "name", from the first label seen
        self.names: set = set()

    def check(self, where: str, row: dict) -> None:
        c = self.columns
        for name in c.needed():
            if name not in row:
                raise _Bad(_column_field(c, name), f"{where}: no {name!r} field (it has: "
                           f"{', '.join(map(str, row)) or 'nothing'})", "name one of the file's columns")
        words = None
        for i, name in enumerate(c.text_fields):
            value = row[name]
            if tasks.get(c.task).words and i == 0:
                if not (isinstance(value, list) and all(isinstance(w, str) for w in value)):
                    raise _Bad(("data", "text_fields"), f"{where}: {name!r} is {_kind(value)}; token-classification "
                               "needs a list of words", "store words and per-word labels as lists")
                words = value
            elif not isinstance(value, str):
                raise _Bad(("data", self.split), f"{where}: {name!r} is {_kind(value)}, text expected",
                           "every row needs its text")
        if c.label_field is None:
            return
        label = row[c.label_field]
        if words is not None:
            if not isinstance(label, list) or len(label) != len(words):
                raise _Bad(("data", self.split), f"{where}: {c.label_field!r} is {_kind(label)} for "
                           f"{len(words)} words; one label per word expected", "store per-word labels as a list")
            for value in label:
                self.label(where, value)
        else:
            self.label(where, label)

    def label(self, where: str, value) -> None:
        c = self.columns
        kind = "id" if isinstance(value, int) and not isinstance(value, bool) else \
            "name" if isinstance(value, str) else None
        if kind is None:
            raise _Bad(("data", self.split), f"{where}: label {value!r} is {_kind(value)}; "
                       "an integer class id or a class name expected", "fix the row's label")
        if self.label_kind is not None and kind != self.label_kind:
            raise _Bad(("data", self.split), f"{where}: label {value!r} is a class {kind} but earlier labels are "
                       f"class {self.label_kind}s", "use class ids or class names throughout")
        self.label_kind = kind
        if kind == "id" and not 0 <= value < c.num_labels:
            raise _Bad(("model", "num_labels"), f"{where}: label {value} is not a class id in [0, {c.num_labels})",
                       "set model.num_labels to the number of classes, or fix the label")
        if kind == "name":
            self.names.add(value)
            if len(self.names) > c.num_labels:
                shown = ", ".join(repr(n) for n in sorted(self.names)[:6])
                raise _Bad(("model", "num_labels"), f"{where}: {len(self.names)} different label names ({shown}"
                           f"{', ...' if len(self.names) > 6 else ''}) but model.num_labels is {c.num_labels}",
                           "set model.num_labels to the number of classes")


def _column_field(columns: Columns, name: str) -> tuple:
    return ("data", "label_field") if name == columns.label_field and name not in columns.text_fields \
        else ("data", "text_fields")


def _kind(value) -> str:
    if value is EMPTY:
        return "empty"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:30]!r})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"an object ({type(value).__name__})" if not isinstance(value, dict) else "an object"


def locate_error(spec: dict, split: str) -> SpecError | None:
    """A rank's failure on a data file turned into the first bad row's file:line (None when the whole
    file checks out: the failure was not the data's)."""
    data = spec["data"]
    issue = check_file(data[split], data["format"], Columns.of(spec), split, max_rows=None, max_bytes=None)
    return SpecError([issue]) if issue is not None else None


def unreadable(spec: dict, split: str, fmt: str, err: BaseException) -> SpecError:
    """A data file datasets could not read, where the row check found nothing more precise."""
    path = spec["data"][split]
    return spec_error(f"cannot read {path} as {fmt}: {first_line(err)}", path=("data", split),
                      hint="check the file and data.format")
