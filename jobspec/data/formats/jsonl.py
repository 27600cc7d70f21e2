"""`data.format: jsonl` (.jsonl, .json): one JSON object per line, blank lines skipped.

The preparation pass reads a jsonl file in byte ranges of about CHUNK_BYTES cut at line ends, each
read and parsed by the worker that encodes it, so a bad line is named exactly (`file:line`) and the
parent reads nothing but the line ends.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.data.formats.base import (
    DataFormat,
    RecordSource,
    Rows,
    file_fingerprint,
    not_utf8,
    split_source,
)
from jobspec.data.records.base import BadRecord, RecordError, describe
from jobspec.spec.types import JobSpec
from jobspec.units import MiB

CHUNK_BYTES = 1 * MiB


class JsonlFormat(DataFormat):
    name = "jsonl"
    suffixes = (".jsonl", ".json")
    light_rows = True
    datasets_builder = "json"

    def rows(self, path: Path, split: str, *, columns: list[str] | None, label: str | None,
             max_rows: int | None, max_bytes: int | None) -> Rows:
        """(file:line, record), or (file:line, BadRecord) for a line that is not UTF-8, not JSON or
        not an object: the reading goes on with the next line (every bad record is reported)."""
        rows = 0
        read = 0
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                read += len(raw)
                if raw.strip():
                    yield f"{path}:{number}", _record(path, number, raw, split)
                    rows += 1
                if (max_rows is not None and rows >= max_rows) \
                        or (max_bytes is not None and read >= max_bytes):
                    return

    def first_rows(self, path: Path, limit: int) -> list[dict]:
        found: list[dict] = []
        with open(path, "rb") as fh:
            for line in fh:
                if len(found) >= limit:
                    break
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"{path}: a JSON object per line expected")
                    found.append(record)
        return found

    def count_rows(self, path: Path) -> int:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())

    def row_location(self, path: Path, index: int) -> str:
        try:
            with open(path, "rb") as fh:
                rows = (number for number, line in enumerate(fh, start=1) if line.strip())
                for _ in range(index):
                    next(rows)
                return f"{path}:{next(rows)}"
        except (OSError, StopIteration):
            return super().row_location(path, index)

    def records(self, spec: JobSpec, split: str, load: Callable[[], Any]) -> RecordSource:
        return JsonlRecords(Path(split_source(spec["data"], split)))


def _record(path: Path, number: int, raw: bytes, split: str) -> dict | BadRecord:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return not_utf8(path, number, raw, err, split)
    try:
        row = json.loads(line)
    except ValueError as err:
        where = f", column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        message = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
        return BadRecord(("data", split), f"{path}:{number}: not valid JSON ({message}{where})",
                         "each line of a jsonl file must be one JSON object")
    if not isinstance(row, dict):
        return BadRecord(("data", split),
                         f"{path}:{number}: a JSON object per line expected, found "
                         f"{describe(row)}", "each line of a jsonl file must be one JSON object")
    return row


class JsonlRecords(RecordSource):
    """A local jsonl file, split into byte ranges the workers read and parse themselves (file:line
    exact)."""

    def __init__(self, path: Path):
        self.path = path
        self._chunks: list | None = None

    def fields(self):
        with open(self.path, "rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        return None
                    return record.keys() if isinstance(record, dict) else None
        return None

    def fingerprint(self) -> dict:
        return file_fingerprint(self.path)

    def chunks(self) -> list:
        """(byte offset, byte length, first line number, lines) per chunk, cut at line ends."""
        if self._chunks is None:
            self._chunks = []
            offset, line = 0, 1
            with open(self.path, "rb") as fh:
                while True:
                    block = fh.read(CHUNK_BYTES)
                    if not block:
                        break
                    block += fh.readline()
                    lines = block.count(b"\n") + (not block.endswith(b"\n"))
                    self._chunks.append((offset, len(block), line, lines))
                    offset, line = offset + len(block), line + lines
        return self._chunks

    def total(self) -> int:
        return sum(chunk[3] for chunk in self.chunks())

    def head(self, records: int):
        with open(self.path, "rb") as fh:
            block = fh.read(CHUNK_BYTES)
        end, count = 0, 0
        while count < records and end < len(block):
            found = block.find(b"\n", end)
            end = len(block) if found < 0 else found + 1
            count += 1
        return (0, end, 1, count)

    def read(self, chunk) -> list:
        offset, length, first, _ = chunk
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            block = fh.read(length)
        out = []
        for number, line in enumerate(block.split(b"\n"), start=first):
            if not line.strip():
                continue
            where = f"{self.path}:{number}"
            try:
                out.append((where, json.loads(line)))
            except UnicodeDecodeError:
                out.append((where,
                            RecordError("the line is not UTF-8 text", "save the file as UTF-8")))
            except ValueError as err:
                out.append((where, RecordError(f"not valid JSON: {err}",
                                               "write one JSON object per line")))
        return out


FORMAT = JsonlFormat()
