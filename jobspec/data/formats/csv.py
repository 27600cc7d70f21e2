"""`data.format: csv` (.csv): a header naming the columns, then one record per row (a quoted field
may span lines). A field is text; read as `datasets` (pandas) reads it: an empty field is missing,
and a label column of integers holds class ids."""
from __future__ import annotations

import csv
from pathlib import Path

from jobspec.data.formats.base import DataFormat, Rows, utf8_lines
from jobspec.data.records.base import EMPTY, BadRecord


class CsvFormat(DataFormat):
    name = "csv"
    suffixes = (".csv",)
    nested = False            # a field is text: no chat messages
    light_rows = True
    datasets_builder = "csv"
    delimiter = ","

    def builder_options(self) -> dict:
        return {"delimiter": self.delimiter}

    def columns(self, path: Path, split: str) -> list[str] | None:
        reader = csv.reader((text for _, text in utf8_lines(path, split, None, None)),
                            delimiter=self.delimiter)
        try:
            return next(reader, None) or []
        except csv.Error as err:
            raise BadRecord(("data", split), f"{path}:{reader.line_num}: not valid CSV ({err})",
                            "check the quoting of that line") from None

    def missing_column(self, path: Path, name: str, columns: list[str]) -> str:
        return f"{path}: the header has no column {name!r} (columns: {', '.join(columns)})"

    def rows(self, path: Path, split: str, *, columns: list[str] | None, label: str | None,
             max_rows: int | None, max_bytes: int | None) -> Rows:
        # a quoted field may span lines: read a few more lines than rows, and forgive a record cut
        # at the end
        max_lines = None if max_rows is None else 2 * max_rows + 1
        lines = utf8_lines(path, split, max_lines, max_bytes)
        last = [0]

        def texts():
            for number, text in lines:
                last[0] = number
                yield text
        reader = csv.reader(texts(), delimiter=self.delimiter)
        try:
            header = next(reader, None)
            if header is None:
                return
            index = {name: header.index(name) for name in (header if columns is None else columns)}
            rows = 0
            for fields in reader:
                where = f"{path}:{reader.line_num}"
                if not fields:
                    continue
                if len(fields) != len(header):
                    yield where, BadRecord(("data", split),
                                           f"{where}: {len(fields)} fields, the header names "
                                           f"{len(header)}",
                                           "quote fields that contain commas or line breaks")
                else:
                    yield where, _record(fields, index, label)
                rows += 1
                if max_rows is not None and rows >= max_rows:
                    return
        except csv.Error as err:
            if max_lines is not None and last[0] >= max_lines:
                return  # the record the line limit cut in two
            raise BadRecord(("data", split), f"{path}:{reader.line_num}: not valid CSV ({err})",
                            "check the quoting of that line") from None

    def first_rows(self, path: Path, limit: int) -> list[dict]:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh, delimiter=self.delimiter)
            try:
                return [dict(row) for _, row in zip(range(limit), reader)]
            except csv.Error as err:
                raise ValueError(f"{path}:{reader.line_num}: not valid CSV ({err})") from None

    def count_rows(self, path: Path) -> int:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter=self.delimiter)
            try:   # csv.reader: quoted newlines stay one row; the header is no row
                return max(0, sum(1 for _ in reader) - 1)
            except csv.Error as err:
                raise ValueError(f"line {reader.line_num}: {err}") from None

    def row_location(self, path: Path, index: int) -> str:
        try:
            with open(path, newline="", encoding="utf-8", errors="replace") as fh:
                reader = csv.reader(fh, delimiter=self.delimiter)
                next(reader, None)   # the header
                records = (reader.line_num for fields in reader if fields)
                for _ in range(index):
                    next(records)
                return f"{path}:{next(records)}"
        except (OSError, StopIteration, csv.Error):
            return super().row_location(path, index)


def _record(fields: list[str], index: dict[str, int], label: str | None) -> dict:
    """A row's fields as pandas (datasets' csv reader) makes them: missing when empty; a label that
    is an integer becomes a class id."""
    row = {name: (EMPTY if fields[i] == "" else fields[i]) for name, i in index.items()}
    if label is not None and isinstance(value := row.get(label), str):
        row[label] = _int_or_text(value)
    return row


def _int_or_text(text: str):
    try:
        return int(text)
    except ValueError:
        return text


FORMAT = CsvFormat()
