"""What one data format declares (jobspec/data/formats/: one module per format), and what the
formats share.

A `DataFormat` is a kind of data source: a file format `data.format` names (jsonl, csv, parquet,
text) or a source told by itself (`hf:` names, `save_to_disk` directories). It says which extensions
`auto` reads it from and what the data code may ask of it:

- validate's record checks (data/record_checks.py): `columns` (a table's header or schema), `rows`
  (the first records, each at its file:line, a bad one as a `BadRecord`), `check_documents` (a text
  corpus);
- `first_rows` (the data pre-flight's renders, validate's look at the first record), `count_rows`
  (the derived job's training samples), `row_location` (file:line of a record the template fails
  on);
- `records`: the preparation pass's chunks of work (`RecordSource`: a table's row ranges here, byte
  ranges of a jsonl file in formats/jsonl.py), and `dataset`: the records as a `datasets.Dataset`.

Pure: pyarrow and datasets are imported inside the methods that read with them.
"""
from __future__ import annotations

import abc
import functools
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jobspec.data.records.base import BadRecord
from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec, JobSpecData
from jobspec.units import MiB

CHUNK_ROWS = 1000          # rows of a table per chunk of the preparation pass
# files up to this size are hashed whole; larger ones by SAMPLE_BLOCKS blocks
SAMPLE_HASH_LIMIT = 64 * MiB
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK = 1 * MiB

# (where: file:line, the record or what is wrong with it)
Rows = Iterator[tuple[str, "dict | BadRecord"]]


class UnreadableFile(Exception):
    """`datasets` could not read a local data file (the cause chained): the caller finds the bad row
    (data/record_checks.load_dataset)."""


class DataFormat:
    """One kind of data source. The attributes say what the data code may ask of it; a method a
    format cannot answer raises NotImplementedError (its attributes say so before)."""

    name: str = ""
    # what `data.format: auto` reads it from (lower case, with the dot)
    suffixes: tuple[str, ...] = ()
    # a value of the schema's `data.format` enum (hub and saved datasets: no)
    schema_value = True
    # records (chat, prompt/completion, text rows); False: documents (a text corpus)
    holds_records = True
    # a local file validate and the launcher read; False: read by the ranks only
    local = True
    nested = True             # a record may hold lists (chat messages)
    light_rows = False        # `first_rows` needs no library (validate reads the first record)
    counted = True            # `count_rows` counts the training samples before any tokenizer runs
    # validate reads this many rows (its bytes are compressed), else bytes
    checked_rows: int | None = None
    datasets_builder: str | None = None   # datasets.load_dataset's builder of the file

    @property
    def described(self) -> str:
        """What a source of this format is, in messages (`... and x.jsonl is a jsonl file`)."""
        return f"a {self.name} file"

    def claims(self, source: str) -> bool:
        """Whether `source` is this format's whatever `data.format` says (`hf:` names,
        directories)."""
        return False

    def files(self, source: str, setting: str = "auto") -> list[Path]:
        """The files the source is made of (a directory of text files: each of them; `setting`:
        data.format)."""
        return [Path(source)]

    # ---- validate's record checks (data/record_checks.py)

    def columns(self, path: Path, split: str) -> list[str] | None:
        """The columns every record has (a table's header or schema), read before the rows; None:
        each record has its own fields. BadRecord when the file cannot be read as this format."""
        return None

    def missing_column(self, path: Path, name: str, columns: list[str]) -> str:
        return f"{path} has no column {name!r} (columns: {', '.join(columns)})"

    def rows(self, path: Path, split: str, *, columns: list[str] | None, label: str | None,
             max_rows: int | None, max_bytes: int | None) -> Rows:
        """The first records (`max_rows`, or those in the first `max_bytes`; None: no limit) with
        the `columns` the checks read (None: every field; `label`: the label column), each at its
        file:line; a record that cannot be read is a BadRecord and the reading goes on; BadRecord
        raised ends the reading."""
        raise NotImplementedError(f"{self.name} holds no records")

    def check_documents(self, path: Path, split: str, max_bytes: int | None,
                        may_be_empty: bool = False) -> None:
        """A text corpus's file (`may_be_empty`: one of a directory's): BadRecord for what is wrong
        with it."""
        raise NotImplementedError(f"{self.name} holds no documents")

    def documents(self, source: str, setting: str, document: str, split: str) -> list[str]:
        """A text corpus's documents, in order (`setting`: data.format, `document`:
        data.document)."""
        raise NotImplementedError(f"{self.name} holds no documents")

    # ---- reads of the first records, the row count, where a record is

    def first_rows(self, path: Path, limit: int) -> list[dict]:
        """The file's first `limit` records (OSError, ValueError: the record checks report it)."""
        raise NotImplementedError(f"{self.name}'s records are read by the ranks")

    def count_rows(self, path: Path) -> int:
        """The file's records: the training samples (OSError, ValueError: formats.count_rows says
        so)."""
        raise NotImplementedError(f"{self.name} has no rows to count before tokenizing")

    def row_location(self, path: Path, index: int) -> str:
        """Where record `index` (0-based, as datasets numbers them) is: `file:line`, or `file: row
        N`."""
        return f"{path}: row {index + 1}"

    def where(self, spec: JobSpec, split: str, index: int) -> str:
        return self.row_location(Path(split_source(spec["data"], split)), index)

    # ---- the preparation pass and the loaders

    def records(self, spec: JobSpec, split: str, load: Callable[[], Any]) -> RecordSource:
        """`data.<split>`'s records in chunks of work for the preparation pass (data/prepare.py);
        `load` gives the split's `datasets.Dataset` (data/record_checks.load_dataset)."""
        return TableRecords(self, spec, split, load)

    def fingerprint(self, spec: JobSpec, split: str, table: Any) -> dict:
        """What the data cache's key holds of the content: a local file's size, mtime and hash."""
        return file_fingerprint(Path(split_source(spec["data"], split)))

    def builder_options(self) -> dict:
        """datasets.load_dataset's options for the file beyond its builder (a csv's delimiter)."""
        return {}

    def dataset(self, spec: JobSpec, split: str) -> Any:
        """`data.<split>` as a datasets.Dataset; UnreadableFile when datasets cannot read the
        file."""
        import datasets

        path = split_source(spec["data"], split)
        if self.datasets_builder is None:
            raise NotImplementedError(f"{self.name} is no table datasets loads")
        if not Path(path).is_file():
            raise spec_error(f"{split} file not found: {path}", path=("data", split),
                             hint="check the path")
        try:
            return datasets.load_dataset(self.datasets_builder, data_files=str(path), split="train",
                                         **self.builder_options())
        except Exception as err:  # datasets raises many types for unreadable files
            raise UnreadableFile(path) from err


class RecordSource(abc.ABC):
    """Where a split's records come from, for the preparation pass: the first record's fields, a
    fingerprint of the content, the chunks of work and their records as [(where, record or
    RecordError)]."""

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


class TableRecords(RecordSource):
    """Rows of a table `datasets` loads (csv, parquet, `hf:` names, saved datasets), in row ranges
    of CHUNK_ROWS, which the forked workers share (memory-mapped Arrow)."""

    def __init__(self, data_format: DataFormat, spec: JobSpec, split: str, load: Callable[[], Any]):
        self.format, self.spec, self.split, self._load = data_format, spec, split, load
        self._table = None

    @property
    def table(self):
        if self._table is None:
            self._table = self._load()
        return self._table

    def fields(self):
        return self.table.column_names

    def fingerprint(self) -> dict:
        return self.format.fingerprint(self.spec, self.split, self.table)

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
        return [(self.format.where(self.spec, self.split, start + i), row)
                for i, row in enumerate(rows)]


def split_source(data: JobSpecData, split: str) -> str:
    """`data.<split>` ("train" or "eval"): the file, directory or hub name of a split the spec
    has."""
    source = data["train"] if split == "train" else data["eval"] if split == "eval" else None
    if source is None:
        raise ValueError(f"the spec has no data.{split}")
    return source


def split_name(spec: JobSpec, split: str) -> str:
    """The dataset split a dataset by name or a saved DatasetDict is read at: data.train_split /
    eval_split."""
    return spec["data"]["train_split" if split == "train" else "eval_split"]


def file_fingerprint(path: Path) -> dict:
    """Size, mtime and a content hash (the whole file up to SAMPLE_HASH_LIMIT, else evenly spaced
    blocks)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if stat.st_size <= SAMPLE_HASH_LIMIT:
            for block in iter(functools.partial(fh.read, 4 * MiB), b""):
                digest.update(block)
        else:
            step = (stat.st_size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                fh.seek(i * step)
                digest.update(fh.read(SAMPLE_BLOCK))
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": digest.hexdigest(), "sampled": stat.st_size > SAMPLE_HASH_LIMIT}


def utf8_lines(path: Path, split: str, max_lines: int | None,
               max_bytes: int | None) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) of the file's first lines; a line that is not UTF-8 is the
    problem (BadRecord at its line and byte)."""
    read = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise not_utf8(path, number, raw, err, split) from None
            yield number, text
            read += len(raw)
            if (max_bytes is not None and read >= max_bytes) \
                    or (max_lines is not None and number >= max_lines):
                return


def not_utf8(path: Path, number: int, raw: bytes, err: UnicodeDecodeError, split: str) -> BadRecord:
    return BadRecord(("data", split), f"{path}:{number}: byte {err.start + 1} of the line "
                     f"(0x{raw[err.start]:02x}) is not valid UTF-8",
                     "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")

