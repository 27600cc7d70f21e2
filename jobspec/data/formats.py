"""`data.format`: the file formats a job trains on, and what `auto` reads from a file's extension.

A data source (`data.train`, `data.eval`) is a file, a directory of text files, or a dataset by name
(`hf:org/name`, or a local `save_to_disk` directory): `source_kind` tells which without reading it.
"""
from __future__ import annotations

import csv
from pathlib import Path

from jobspec.errors import spec_error
from jobspec.spec.types import JobSpecData

FORMATS = ("jsonl", "csv", "parquet", "text")
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
                    ".pq": "parquet", ".txt": "text", ".md": "text"}
TEXT_SUFFIXES = tuple(suffix for suffix, fmt in FORMAT_BY_SUFFIX.items() if fmt == "text")
HF_PREFIX = "hf:"
# what datasets' save_to_disk leaves in a directory (a Dataset, a DatasetDict)
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def split_source(data: JobSpecData, split: str) -> str:
    """`data.<split>` ("train" or "eval"): the file, directory or hub name of a split the spec
    has."""
    source = data["train"] if split == "train" else data["eval"] if split == "eval" else None
    if source is None:
        raise ValueError(f"the spec has no data.{split}")
    return source


def data_format(path: str | Path, fmt: str = "auto") -> str:
    """`fmt` itself, or for `auto` the format `path`'s extension names; SpecError when it names
    none."""
    if fmt != "auto":
        return fmt
    found = FORMAT_BY_SUFFIX.get(Path(path).suffix.lower())
    if found is None:
        raise spec_error(f"cannot tell the format of {Path(path).name} from its extension",
                         path=("data", "format"),
                         hint=f"set data.format to {', '.join(FORMATS[:-1])} or {FORMATS[-1]}")
    return found


def is_hub_name(source: str) -> bool:
    """`hf:org/name`: a dataset by name (datasets.load_dataset), never a local path of the
    spec's."""
    return isinstance(source, str) and source.startswith(HF_PREFIX)


def is_saved_dataset(path: str | Path) -> bool:
    """A directory written by datasets' `save_to_disk` (read with `load_from_disk`)."""
    path = Path(path)
    try:
        return path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS)
    except OSError:
        return False


def source_kind(source: str | Path, fmt: str = "auto") -> str:
    """`hub` (hf:name), `saved` (a save_to_disk directory), `text_dir` (a directory of text files),
    or the file's format (jsonl, csv, parquet, text; SpecError when `auto` cannot tell it)."""
    if is_hub_name(str(source)):
        return "hub"
    path = Path(source)
    if is_saved_dataset(path):
        return "saved"
    try:
        if path.is_dir():
            return "text_dir"
    except OSError:
        pass
    return data_format(path, fmt)


def text_files(directory: str | Path, fmt: str = "auto") -> list[Path]:
    """A directory's documents, one per file, in sorted path order: its .txt/.md files at any depth
    (with `data.format: text`, every file), hidden files and directories left out."""
    root = Path(directory)
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).parts
        if any(part.startswith(".") for part in relative) or not path.is_file():
            continue
        if fmt == "text" or path.suffix.lower() in TEXT_SUFFIXES:
            found.append(path)
    return found


def count_rows(path: str | Path, fmt: str = "auto") -> int:
    """Training samples in a jsonl/csv/parquet file (rows; blank jsonl lines and the csv header
    excluded)."""
    path = Path(path)
    fmt = data_format(path, fmt)
    try:
        if fmt == "jsonl":
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if fmt == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                # csv.reader: quoted newlines stay one row
                return max(0, sum(1 for _ in csv.reader(f)) - 1)
        import pyarrow.parquet as pq  # only for parquet data; metadata holds the row count
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, ImportError) as err:
        raise spec_error(f"cannot count the rows of {path}: {err}", path=("data", "train"),
                         hint="check the file and data.format") from None
