"""`data.format`: the file formats a job trains on, and what `auto` reads from a file's extension."""
from __future__ import annotations

from pathlib import Path

from jobspec.errors import spec_error

FORMATS = ("jsonl", "csv", "parquet")
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


def data_format(path: str | Path, fmt: str = "auto") -> str:
    """`fmt` itself, or for `auto` the format `path`'s extension names; SpecError when it names none."""
    if fmt != "auto":
        return fmt
    found = FORMAT_BY_SUFFIX.get(Path(path).suffix.lower())
    if found is None:
        raise spec_error(f"cannot tell the format of {Path(path).name} from its extension", path=("data", "format"),
                         hint=f"set data.format to {', '.join(FORMATS[:-1])} or {FORMATS[-1]}")
    return found
