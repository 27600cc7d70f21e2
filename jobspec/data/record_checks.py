"""Data files checked before any rank starts, and located when a rank trips over one later.

`record_issues(spec)` is validate's (so plan's, compile's and launch's) read of the local data
files: every bad record, up to MAX_REPORTED per file and then a count, each at its file:line, in the
first PREFLIGHT_BYTES of a file (`unread` says what was left). `RecordChecker.problem` is one
record's check, for the data preparation pass too. `preflight_issues(spec)`, the first problem of
each file: for `data.train` and `data.eval`, the path is a readable, non-empty regular file, its
first PREFLIGHT_ROWS rows are valid UTF-8 and parse in `data.format`, they hold the columns the task
needs, and their labels are valid class ids (or at most `model.num_labels` class names). It reads at
most PREFLIGHT_BYTES of a file, so a 100 GB file costs what a small one does; the rows after those
are read by the ranks, and when datasets/pyarrow or the tokenizer fail on one, the rank calls
`check_file(..., max_rows=None)` to name the file and line of the first bad row
(jobspec/data/loaders.py).

Records are of the kind `data.records` says (`record_kind`: `auto` looks at the first row's fields):
`text` rows hold `text_fields` (and a label); `chat` rows a `messages_field` list of {role, content}
with a known role and string content; `prompt_completion` rows a string prompt and completion. Text
files (`data.format: text`, a directory of them) are read for UTF-8 and for at least one document.
Datasets by name (`hf:`) and `save_to_disk` directories are read by the ranks only.

Neutral ground (like shm.py): the launcher and the ranks both use it; no torch, no datasets.
"""
from __future__ import annotations

import csv
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from jobspec import tasks
from jobspec.data.formats import TEXT_SUFFIXES, data_format, source_kind, split_source, text_files
from jobspec.errors import SpecError, SpecIssue, did_you_mean, first_line, spec_error
from jobspec.spec.types import JobSpec, JobSpecData
from jobspec.units import MiB, fmt_bytes_any_unit

PREFLIGHT_ROWS = 1000
PREFLIGHT_BYTES = 32 * MiB
MAX_REPORTED = 20          # bad records listed per file by validate; the rest are counted
PARQUET_ROWS = 200_000     # validate reads a parquet file's first rows (its bytes are compressed)
SPLITS = ("train", "eval")
# a chat message's roles (schema: data.messages_field)
ROLES = ("system", "user", "assistant", "tool")


def record_kind(data: JobSpecData, fields) -> str:
    """What a record holds, `text`, `chat` or `prompt_completion`: `data.records`, or for `auto`
    what the first record's `fields` (its keys, or a table's columns) show (the schema's rule)."""
    return _record_kind(data["records"], data["messages_field"], data["prompt_field"],
                        data["completion_field"], fields)


def _record_kind(setting: str, messages_field: str, prompt_field: str, completion_field: str,
                 fields) -> str:
    if setting != "auto":
        return setting
    fields = set(fields)
    if messages_field in fields:
        return "chat"
    if {prompt_field, completion_field} <= fields:
        return "prompt_completion"
    return "text"


@dataclass(frozen=True)
class Columns:
    """What the job's task needs from each row of a data file."""

    text_fields: tuple
    label_field: str | None   # None: language-model tasks have no label column
    task: str
    num_labels: int
    # data.records; `resolved` turns auto into the kind the first record shows
    records: str = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"

    @classmethod
    def of(cls, spec: JobSpec) -> "Columns":
        data, model = spec["data"], spec["model"]
        task = model["task"]
        label = data["label_field"] if tasks.get(task).classification else None
        return cls(tuple(data["text_fields"] or ["text"]), label, task, model["num_labels"],
                   data["records"], data["messages_field"], data["prompt_field"],
                   data["completion_field"])

    def resolved(self, fields) -> "Columns":
        """These columns with `records: auto` decided by the first record's `fields`."""
        if self.records != "auto":
            return self
        return replace(self, records=_record_kind("auto", self.messages_field, self.prompt_field,
                                                  self.completion_field, fields))

    def needed(self) -> list[str]:
        if self.records == "chat":
            return [self.messages_field]
        if self.records == "prompt_completion":
            return [self.prompt_field, self.completion_field]
        return [*self.text_fields, *([self.label_field] if self.label_field else [])]


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
    count), each at its file:line, in the first PREFLIGHT_BYTES of a jsonl/csv file (PARQUET_ROWS
    rows of a parquet file); unpositioned (`ResolvedSpec.locate` them). `unread` says what it left
    out."""
    data = spec["data"]
    issues: list[SpecIssue] = []
    for split, source in named_sources(data):
        try:
            kind = source_kind(source, data["format"])
            if kind in ("hub", "saved"):
                continue
            paths = text_files(source, data["format"]) if kind == "text_dir" else [source]
        except SpecError as err:   # data.format cannot be told from the extension
            issues.extend(err.issues)
            continue
        if kind == "text_dir" and not paths:
            issues.append(check_source(source, data["format"], Columns.of(spec), split) or
                          SpecIssue(path=("data", split), message=f"{source} holds no text files"))
            continue
        for path in paths:
            fmt = "text" if kind == "text_dir" else data["format"]
            rows = PARQUET_ROWS if _is_parquet(path, fmt) else None
            found = file_issues(path, fmt, Columns.of(spec), split, max_rows=rows,
                                max_bytes=PREFLIGHT_BYTES, limit=limit)
            issues += [i for i in found if not i.message.endswith("has no text")] \
                if kind == "text_dir" else found
    return issues


def unread(spec: JobSpec) -> list[str]:
    """What `record_issues` did not read, one line per file (the launch's data pass and the ranks
    read it)."""
    data = spec["data"]
    lines = []
    for split, source in named_sources(data):
        try:
            kind = source_kind(source, data["format"])
            if kind in ("hub", "saved"):
                lines.append(f"data.{split}: {source} is read by the ranks (a dataset by name or a "
                             "saved one): its records are not checked here")
                continue
            if kind == "text_dir":
                continue
            size = Path(source).stat().st_size
            if _is_parquet(source, data["format"]):
                import pyarrow.parquet as pq  # only for parquet data
                total = pq.ParquetFile(source).metadata.num_rows
                if total > PARQUET_ROWS:
                    lines.append(f"data.{split}: the first {PARQUET_ROWS:,} of {total:,} rows "
                                 "checked; the rest when the ranks read them")
            elif size > PREFLIGHT_BYTES:
                lines.append(f"data.{split}: the first {fmt_bytes_any_unit(PREFLIGHT_BYTES)} of "
                             f"{fmt_bytes_any_unit(size)} checked; the rest when the launch's data "
                             "pass or the ranks read them")
        # OSError, SpecError, pyarrow's: record_issues reported the file
        except Exception:  # noqa: BLE001
            continue
    return lines


def _is_parquet(path: str | os.PathLike, fmt: str) -> bool:
    try:
        return data_format(Path(path), fmt) == "parquet"
    except SpecError:
        return False


def check_source(source: str, fmt: str, columns: Columns, split: str, *,
                 max_rows: int | None = PREFLIGHT_ROWS,
                 max_bytes: int | None = PREFLIGHT_BYTES) -> SpecIssue | None:
    """`check_file` for a file, the text files of a directory; nothing for `hf:` or saved
    datasets."""
    kind = source_kind(source, fmt)
    if kind in ("hub", "saved"):
        return None
    if kind != "text_dir":
        return check_file(source, fmt, columns, split, max_rows=max_rows, max_bytes=max_bytes)
    files = text_files(source, fmt)
    if not files:
        return SpecIssue(path=("data", split),
                         message=f"{source} is a directory, not a data file (it holds no "
                         f"{'/'.join(TEXT_SUFFIXES)} files and no saved dataset)",
                         hint=f"point data.{split} at a data file, or a directory of text files")
    for path in files[:max_rows] if max_rows is not None else files:
        issue = check_file(path, "text", columns, split, max_rows=max_rows, max_bytes=max_bytes)
        # an empty document is allowed
        if issue is not None and not issue.message.endswith("has no text"):
            return issue
    return None


class _Bad(Exception):
    """One problem, raised where it is found and turned into a SpecIssue by check_file."""

    def __init__(self, field: tuple, message: str, hint: str):
        super().__init__(message)
        self.field, self.message, self.hint = field, message, hint


def check_file(path: str | os.PathLike, fmt: str, columns: Columns, split: str, *,
               max_rows: int | None = PREFLIGHT_ROWS,
               max_bytes: int | None = PREFLIGHT_BYTES) -> SpecIssue | None:
    """The first problem in `path` (None: none in the rows read). `max_rows=None` reads the whole
    file."""
    issues = file_issues(path, fmt, columns, split, max_rows=max_rows, max_bytes=max_bytes,
                         limit=1, count_rest=False)
    return issues[0] if issues else None


def file_issues(path: str | os.PathLike, fmt: str, columns: Columns, split: str, *,
                max_rows: int | None = None, max_bytes: int | None = PREFLIGHT_BYTES,
                limit: int = MAX_REPORTED, count_rest: bool = True) -> list[SpecIssue]:
    """Every bad record of `path` among those read, each at its file:line: the first `limit`, then
    (with `count_rest`) one more issue counting the others. A problem of the whole file (missing,
    empty, not UTF-8 in a csv, a missing column) ends the reading. The record checks are
    `RecordChecker`'s."""
    path = Path(path)
    fmt = data_format(path, fmt)
    found: list[SpecIssue] = []
    more = 0

    def bad(problem: _Bad) -> bool:   # whether to go on reading
        nonlocal more
        if len(found) < limit:
            found.append(SpecIssue(path=problem.field, message=problem.message, hint=problem.hint))
        else:
            more += 1
        return count_rest or len(found) < limit

    try:
        _check_stat(path, split)
        if fmt == "text":
            _check_text(path, split, max_bytes)
            return []
        reader = {"jsonl": _jsonl_rows, "csv": _csv_rows, "parquet": _parquet_rows}[fmt]
        rows = RecordChecker(columns, split)
        count = 0
        for where, row in reader(path, columns, split, max_rows, max_bytes):
            count += 1
            problem = row if isinstance(row, _Bad) else rows.problem(where, row)
            if problem is not None and not bad(problem):
                break
        if count == 0:
            raise _Bad(("data", split), f"{path} has no rows", "a data file needs at least one row")
    except _Bad as problem:
        bad(problem)
    if more:
        found.append(SpecIssue(path=("data", split),
                               message=f"{path}: {more:,} more bad records after these "
                               f"{limit}",
                               hint="fix the records above first; validate lists the next ones "
                                    "then"))
    return found


def _check_stat(path: Path, split: str) -> None:
    field = ("data", split)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _Bad(field, f"data file not found: {path}",
                   "paths are relative to the spec file that sets them")
    except OSError as err:
        raise _Bad(field, f"{path} cannot be read ({err.strerror or err})",
                   "check the path and its permissions")
    if stat.S_ISDIR(info.st_mode):
        raise _Bad(field, f"{path} is a directory, not a data file",
                   f"point data.{split} at one jsonl, csv or parquet file")
    if not stat.S_ISREG(info.st_mode):
        raise _Bad(field, f"{path} is not a regular file",
                   f"point data.{split} at a jsonl, csv or parquet file")
    if info.st_size == 0:
        raise _Bad(field, f"{path} is empty (0 bytes)",
                   f"point data.{split} at the file with the data")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as err:
        raise _Bad(field, f"{path} is not readable ({err.strerror or err})", "fix its permissions")


def _check_text(path: Path, split: str, max_bytes: int | None) -> None:
    """A text file: valid UTF-8 (its first `max_bytes`), with at least one non-blank line."""
    text = False
    for _, line in _lines(path, split, None, max_bytes):
        text = text or bool(line.strip())
    if not text:
        raise _Bad(("data", split), f"{path} has no text",
                   "a text file needs at least one non-blank line")


def _lines(path: Path, split: str, max_lines: int | None, max_bytes: int | None):
    """(line number, decoded line) of the file's first lines; a line that is not UTF-8 is the
    problem."""
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
            if (max_bytes is not None and read >= max_bytes) \
                    or (max_lines is not None and number >= max_lines):
                return


def _jsonl_rows(path: Path, columns: Columns, split: str, max_rows: int | None,
                max_bytes: int | None):
    """(file:line, record), or (file:line, _Bad) for a line that is not UTF-8, not JSON or not an
    object: the reading goes on with the next line (every bad record is reported)."""
    rows = 0
    read = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            read += len(raw)
            if raw.strip():
                yield f"{path}:{number}", _json_record(path, number, raw, split)
                rows += 1
            if (max_rows is not None and rows >= max_rows) \
                    or (max_bytes is not None and read >= max_bytes):
                return


def _json_record(path: Path, number: int, raw: bytes, split: str):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _Bad(("data", split), f"{path}:{number}: byte {err.start + 1} of the line "
                    f"(0x{raw[err.start]:02x}) is not valid UTF-8",
                    "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
    try:
        row = json.loads(line)
    except ValueError as err:
        where = f", column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        message = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
        return _Bad(("data", split), f"{path}:{number}: not valid JSON ({message}{where})",
                    "each line of a jsonl file must be one JSON object")
    if not isinstance(row, dict):
        return _Bad(("data", split),
                    f"{path}:{number}: a JSON object per line expected, found {_kind(row)}",
                    "each line of a jsonl file must be one JSON object")
    return row


def _csv_rows(path: Path, columns: Columns, split: str, max_rows: int | None,
              max_bytes: int | None):
    # a quoted field may span lines: read a few more lines than rows, and forgive a record cut at
    # the end
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
        columns = columns.resolved(header)
        missing = [c for c in columns.needed() if c not in header]
        if missing:
            raise _Bad(_column_field(columns, missing[0]), f"{path}: the header has no column "
                       f"{missing[0]!r} (columns: {', '.join(header)})",
                       "name one of the file's columns")
        index = {name: header.index(name) for name in columns.needed()}
        rows = 0
        for fields in reader:
            where = f"{path}:{reader.line_num}"
            if not fields:
                continue
            if len(fields) != len(header):
                yield where, _Bad(("data", split),
                                  f"{where}: {len(fields)} fields, the header names {len(header)}",
                                  "quote fields that contain commas or line breaks")
                rows += 1
                continue
            # what pandas (datasets' csv reader) makes of a field: missing when empty; labels that
            # are all integers become class ids
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


def _parquet_rows(path: Path, columns: Columns, split: str, max_rows: int | None,
                  max_bytes: int | None):
    import pyarrow.parquet as pq  # only for parquet data
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError with a reason
        raise _Bad(("data", split), f"{path} is not a readable parquet file ({first_line(err)})",
                   "check the file and data.format") from None
    names = parquet.schema_arrow.names
    columns = columns.resolved(names)
    missing = [c for c in columns.needed() if c not in names]
    if missing:
        raise _Bad(_column_field(columns, missing[0]), f"{path} has no column {missing[0]!r} "
                   f"(columns: {', '.join(names)})", "name one of the file's columns")
    number = 0
    for batch in parquet.iter_batches(batch_size=min(max_rows or 10_000, 10_000),
                                      columns=columns.needed()):
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
                    row = _Bad(("data", split),
                               f"{path}: row {number} holds a string that is not valid UTF-8 "
                               f"({err})", "rewrite the file with UTF-8 strings")
            yield f"{path}: row {number}", row
            if max_rows is not None and number >= max_rows:
                return


class RecordChecker:
    """The checks of one data record: its columns (or chat messages, or prompt and completion) and
    label values, with what earlier records established (`records: auto` decided by the first, the
    label kind, the label names seen). Torch-free; `problem(where, record)` is the importable entry
    point (validate's full read here; the data preparation pass, data/prepare, checks records the
    same way)."""

    def __init__(self, columns: Columns, split: str):
        self.columns, self.split = columns, split
        self.label_kind: str | None = None   # "id" or "name", from the first label seen
        self.names: set = set()

    def problem(self, where: str, row: dict) -> _Bad | None:
        """What is wrong with this record (None: nothing), at `where` (its file:line)."""
        try:
            self.check(where, row)
        except _Bad as bad:
            return bad
        return None

    def check(self, where: str, row: dict) -> None:
        if self.columns.records == "auto":   # decided by the first record
            self.columns = self.columns.resolved(row)
        c = self.columns
        for name in c.needed():
            if name not in row:
                raise _Bad(_column_field(c, name), f"{where}: no {name!r} field (it has: "
                           f"{', '.join(map(str, row)) or 'nothing'})", _missing_hint(c, name))
        if c.records == "chat":
            check_messages(where, row[c.messages_field], c.messages_field, self.split)
            return
        if c.records == "prompt_completion":
            for name in (c.prompt_field, c.completion_field):
                if not isinstance(row[name], str):
                    raise _Bad(("data", self.split),
                               f"{where}: {name!r} is {_kind(row[name])}, text expected",
                               "every prompt/completion record needs both texts")
            return
        words = None
        for i, name in enumerate(c.text_fields):
            value = row[name]
            if tasks.get(c.task).words and i == 0:
                if not (isinstance(value, list) and all(isinstance(w, str) for w in value)):
                    raise _Bad(("data", "text_fields"),
                               f"{where}: {name!r} is {_kind(value)}; token-classification "
                               "needs a list of words", "store words and per-word labels as lists")
                words = value
            elif not isinstance(value, str):
                raise _Bad(("data", self.split),
                           f"{where}: {name!r} is {_kind(value)}, text expected",
                           "every row needs its text")
        if c.label_field is None:
            return
        label = row[c.label_field]
        if words is not None:
            if not isinstance(label, list) or len(label) != len(words):
                raise _Bad(("data", self.split),
                           f"{where}: {c.label_field!r} is {_kind(label)} for "
                           f"{len(words)} words; one label per word expected",
                           "store per-word labels as a list")
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
            raise _Bad(("data", self.split),
                       f"{where}: label {value!r} is a class {kind} but earlier labels are "
                       f"class {self.label_kind}s", "use class ids or class names throughout")
        self.label_kind = kind
        if kind == "id" and not 0 <= value < c.num_labels:
            raise _Bad(("model", "num_labels"),
                       f"{where}: label {value} is not a class id in [0, {c.num_labels})",
                       "set model.num_labels to the number of classes, or fix the label")
        if kind == "name":
            self.names.add(value)
            if len(self.names) > c.num_labels:
                shown = ", ".join(repr(n) for n in sorted(self.names)[:6])
                raise _Bad(("model", "num_labels"),
                           f"{where}: {len(self.names)} different label names ({shown}"
                           f"{', ...' if len(self.names) > 6 else ''}) but model.num_labels is "
                           f"{c.num_labels}",
                           "set model.num_labels to the number of classes")


def check_messages(where: str, messages, field: str, split: str) -> None:
    problem = messages_problem(messages, field)
    if problem is not None:
        raise _Bad(("data", split), f"{where}: {problem[0]}", problem[1])


def messages_problem(messages, field: str) -> tuple[str, str] | None:
    """What is wrong with a chat record's messages, with a hint (None: a non-empty list of {role,
    content}, known roles, string content)."""
    if not isinstance(messages, list) or not messages:
        return (f"{field!r} is {_kind(messages)}; a non-empty list of {{role, content}} messages "
                "expected",
                "store each conversation as a list of messages")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return (f"message {number} is {_kind(message)}; an object with role and content "
                    "expected",
                    'write each message as {"role": ..., "content": ...}')
        role = message.get("role")
        if role not in ROLES:
            return (f"message {number} has role {role!r}; one of {', '.join(ROLES)} expected",
                    did_you_mean(role if isinstance(role, str) else "", ROLES,
                                 "give each message a role", cutoff=0.5, quote="'"))
        if not isinstance(message.get("content"), str):
            return (f"message {number} ({role}) content is {_kind(message.get('content'))}, text "
                    "expected",
                    "give each message its text as a string")
    return None


def _column_field(columns: Columns, name: str) -> tuple:
    if columns.records == "chat":
        return ("data", "messages_field")
    if columns.records == "prompt_completion":
        return ("data", "prompt_field") if name == columns.prompt_field \
            else ("data", "completion_field")
    return ("data",
            "label_field") if name == columns.label_field and name not in columns.text_fields \
        else ("data", "text_fields")


def _missing_hint(columns: Columns, name: str) -> str:
    if columns.records == "chat":
        return f"every chat record needs its {name!r} list (or set data.messages_field)"
    if columns.records == "prompt_completion":
        return ("every prompt/completion record needs both fields (or set data.prompt_field / "
                "completion_field)")
    return "name one of the file's columns"


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


def locate_error(spec: JobSpec, split: str) -> SpecError | None:
    """A rank's failure on a data file turned into the first bad row's file:line (None when the
    whole file checks out: the failure was not the data's)."""
    data = spec["data"]
    issue = check_source(split_source(data, split), data["format"], Columns.of(spec), split,
                         max_rows=None, max_bytes=None)
    return SpecError([issue]) if issue is not None else None


def row_location(path: str | os.PathLike, fmt: str, index: int) -> str:
    """`file:line` of a data file's row `index` (0-based, as datasets numbers them), for a problem
    found in a well-formed row (a chat template that fails on it); `file: row N` where lines do not
    tell."""
    path = Path(path)
    try:
        fmt = data_format(path, fmt)
        if fmt == "jsonl":
            with open(path, "rb") as fh:
                rows = (number for number, line in enumerate(fh, start=1) if line.strip())
                for _ in range(index):
                    next(rows)
                return f"{path}:{next(rows)}"
        if fmt == "csv":
            with open(path, newline="", encoding="utf-8", errors="replace") as fh:
                reader = csv.reader(fh)
                next(reader, None)   # the header
                records = (reader.line_num for fields in reader if fields)
                for _ in range(index):
                    next(records)
                return f"{path}:{next(records)}"
    except (OSError, StopIteration, csv.Error, SpecError):
        pass
    return f"{path}: row {index + 1}"


def unreadable(spec: JobSpec, split: str, fmt: str, err: BaseException) -> SpecError:
    """A data file datasets could not read, where the row check found nothing more precise."""
    path = split_source(spec["data"], split)
    return spec_error(f"cannot read {path} as {fmt}: {first_line(err)}", path=("data", split),
                      hint="check the file and data.format")
