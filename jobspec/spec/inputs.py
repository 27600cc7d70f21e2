"""What a derivation reads from disk: a local checkpoint's config.json (spec/model_dims) and the
training file's rows (data/formats.count_rows, for a format that is `counted`).

The one I/O edge of the derivation (besides reading the spec itself): `jobspec compile`, `plan`,
`launch` and `report` all derive their job through `derive_job`, so they see the same numbers.
"""
from __future__ import annotations

from typing import Any, Callable

from jobspec.data.formats import count_rows, source_format
from jobspec.spec.derived import DerivedJob, derive
from jobspec.spec.model_dims import read_local_config
from jobspec.spec.types import JobSpec


def derive_job(spec: JobSpec, profiler: Callable[..., Any] | None = None) -> DerivedJob:
    """The derived job of a resolved spec, with the model's config.json and the row count read here;
    `profiler` (`jobspec.model.planner_trace.job_profiler()`) adds the model's measured profile."""
    config_json = read_local_config(spec["model"]["name_or_path"])
    num_train_samples = None
    train, setting = spec["data"]["train"], spec["data"]["format"]
    if spec["training"]["max_steps"] is None and train and source_format(train, setting).counted:
        # rows are samples; other sources (hf:, saved, text) have none to count here (validate
        # refuses epochs with them: spec/rules/data.epochs_issues), and the compiler says so if one
        # gets this far
        num_train_samples = count_rows(train, setting)
    return derive(spec, config_json=config_json, num_train_samples=num_train_samples,
                  profiler=profiler)

