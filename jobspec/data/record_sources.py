"""Where the data preparation pass (data/prepare.py) reads a split's records, in chunks of work:

- a local jsonl file: byte ranges of about CHUNK_BYTES cut at line ends, each read and parsed by the
  worker that encodes it, so a bad line is named exactly (`file:line`) and the parent reads nothing
  but the line ends;
- a table `datasets` loads (csv, parquet, `hf:` names, saved datasets): row ranges of CHUNK_ROWS of
  the Arrow table, which the forked workers share (memory-mapped).

Each source also gives the first record's fields (`data.records: auto`) and a fingerprint of its
content for the cache key (data/cache.py).
"""
from __future__ import annotations

import abc
import json
from pathlib import Path

from jobspec.data import cache as data_cache
from jobspec.data import record_checks
from jobspec.data.chat_render import RecordError
from jobspec.data.formats import split_source
from jobspec.spec.types import JobSpec
from jobspec.units import MiB

CHUNK_BYTES = 1 * MiB
CHUNK_ROWS = 1000
TABLE_KINDS = ("csv", "parquet", "hub", "saved")


class Source(abc.ABC):
    """Where a split's records come from: the first record's fields, a fingerprint of the content,
    the chunks of work and their records as [(where, record or RecordError)]."""

    @abc.abstractmethod
    def fields(self): ...

    @abc.abstractmethod
    def fingerprint(self) -> dict: ...

    @abc.abstractmethod
    def chunks(self) -> list: ...

    @abc.abstractmethod
    def total(self) -> int: ...

    @abc.abstractmethod
    def read(self, chunk) -> list: ...

    @abc.abstractmethod
    def head(self, records: int): ...   # a chunk of the first `records` records


def source_for(spec: JobSpec, split: str, kind: str) -> Source:
    return JsonlSource(Path(split_source(spec["data"], split))) if kind == "jsonl" \
        else TableSource(spec, split, kind)


class JsonlSource(Source):
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
        return data_cache.file_fingerprint(self.path)

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


class TableSource(Source):
    """Rows of a table `datasets` loads (csv, parquet, `hf:` names, saved datasets), in row
    ranges."""

    def __init__(self, spec: JobSpec, split: str, kind: str):
        self.spec, self.split, self.kind = spec, split, kind
        self.source = split_source(spec["data"], split)
        self._table = None

    @property
    def table(self):
        if self._table is None:
            from jobspec.data import hf_datasets

            self._table = hf_datasets.load_table(self.spec, self.split, self.kind)
        return self._table

    def fields(self):
        return self.table.column_names

    def fingerprint(self) -> dict:
        if self.kind in ("csv", "parquet"):
            return data_cache.file_fingerprint(Path(self.source))
        from jobspec.data import hf_datasets

        data = self.spec["data"]
        # datasets' fingerprint of the loaded table: its Arrow files in the local cache (hub), or
        # the saved directory's state
        return {"name": self.source, "subset": data.get("subset"),
                "split": hf_datasets.split_name(self.spec, self.split),
                "fingerprint": getattr(self.table, "_fingerprint", None), "rows": len(self.table)}

    def chunks(self) -> list:
        return [(start, min(start + CHUNK_ROWS, len(self.table)))
                for start in range(0, len(self.table), CHUNK_ROWS)]

    def total(self) -> int:
        return len(self.table)

    def head(self, records: int):
        return (0, min(records, len(self.table)))

    def read(self, chunk) -> list:
        start, stop = chunk
        columns = self.table[start:stop]
        names = list(columns)
        rows = [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]
        return [(self.where(start + i), row) for i, row in enumerate(rows)]

    def where(self, index: int) -> str:
        if self.kind in ("hub", "saved"):
            from jobspec.data import hf_datasets

            return (f"{self.source} [{hf_datasets.split_name(self.spec, self.split)}] row "
                    f"{index + 1}")
        return record_checks.row_location(self.source, self.spec["data"]["format"], index)
