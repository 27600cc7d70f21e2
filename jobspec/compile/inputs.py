"""Compiling a resolved spec with what it needs besides the spec: a local checkpoint's config.json
(the model's dimensions) and, for `training.epochs` with file data, the training file's row count.

`jobspec compile` and `jobspec launch` both compile through `compile_resolved`, so a launch runs
exactly what compile shows.
"""
from __future__ import annotations

import csv
from pathlib import Path

from jobspec.errors import spec_error
from jobspec.spec.data_format import data_format


def compile_resolved(resolved, *, run_dir: str = "RUN_DIR", master_port: int | None = None):
    """`compile_spec` of `resolved.spec` with the model dimensions and row count read here."""
    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.model_dims import model_dims, read_local_config

    spec = resolved.spec
    dims = model_dims(spec, read_local_config(spec["model"]["name_or_path"]))
    num_train_samples = None
    if spec["training"]["epochs"] is not None and spec["data"]["train"]:
        num_train_samples = count_rows(spec["data"]["train"], spec["data"]["format"])
    return compile_spec(spec, model_dims=dims, num_train_samples=num_train_samples, run_dir=run_dir,
                        master_port=master_port)


def count_rows(path: str | Path, fmt: str = "auto") -> int:
    """Training samples in a jsonl/csv/parquet file (rows; blank jsonl lines and the csv header excluded)."""
    path = Path(path)
    fmt = data_format(path, fmt)
    try:
        if fmt == "jsonl":
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if fmt == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                return max(0, sum(1 for _ in csv.reader(f)) - 1)  # csv.reader: quoted newlines stay one row
        import pyarrow.parquet as pq  # only for parquet data; metadata holds the row count
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, ImportError) as err:
        raise spec_error(f"cannot count the rows of {path}: {err}", path=("data", "train"),
                         hint="check the file and data.format") from None
