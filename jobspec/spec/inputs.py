"""What a derivation reads from disk: a local checkpoint's config.json and the training file's rows.

The one I/O edge of the spec layer (besides reading the spec itself): `jobspec compile`, `plan`,
`launch` and `report` all derive their job through `derive_job`, so they see the same numbers.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

from jobspec.data.formats import data_format, source_kind
from jobspec.errors import spec_error
from jobspec.spec.derived import DerivedJob, derive
from jobspec.spec.model_dims import read_local_config
from jobspec.spec.types import JobSpec


def derive_job(spec: JobSpec, profiler: Callable[..., Any] | None = None) -> DerivedJob:
    """The derived job of a resolved spec, with the model's config.json and the row count read here;
    `profiler` (`jobspec.model.planner_trace.job_profiler()`) adds the model's measured profile."""
    config_json = read_local_config(spec["model"]["name_or_path"])
    num_train_samples = None
    if spec["training"]["max_steps"] is None and spec["data"]["train"] \
            and source_kind(spec["data"]["train"], spec["data"]["format"]) in ("jsonl", "csv", "parquet"):
        # rows are samples; other sources (hf:, saved, text) have none to count here (validate refuses
        # epochs with them: spec/rules/data.epochs_issues), and the compiler says so if one gets this far
        num_train_samples = count_rows(spec["data"]["train"], spec["data"]["format"])
    return derive(spec, config_json=config_json, num_train_samples=num_train_samples, profiler=profiler)


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
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, ImportError) as err:
        raise spec_error(f"cannot count the rows of {path}: {err}", path=("data", "train"),
                         hint="check the file and data.format") from None
