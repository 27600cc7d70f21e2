"""One way for tests to build a job spec: a small base job, section overrides deep-merged, resolved by the
loader's own path (issue 38 item 1).

`write_job(directory, **sections)` writes the job as a YAML file (for tests that run a command on a file);
`resolve(**sections)` / `build_spec(**sections)` give what `jobspec validate` would: `validate_spec` on the
loaded job, so every schema default is filled, `model.attention` picked, `name`, `output_dir`,
`checkpoint.dir` and the MLflow experiment defaulted, every path absolute, and every cross-field rule run.
A job the rules refuse raises the same SpecError the loader would: the builder is for valid specs; a test of
a refusal writes its dict explicitly.

Overrides deep-merge into `base` (dicts merge key by key, anything else replaces); `replace(value)` puts a
value in whole (a model of another architecture, whose config must not inherit the base's keys) and
`DROP` removes a key. `base=BARE` starts from nothing but what the override sections say.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from jobspec.spec.loader import LoadedSpec
from jobspec.spec.types import JobSpec
from jobspec.spec.validation import ResolvedSpec, load_and_validate, validate_spec

# A model small enough that 2 CPU ranks train it in seconds; dropout stays on so that
# resume tests also check the RNG restore. Token classification over 64 ids (label: which half
# of the range) is learnable within a dozen steps.
TINY_JOB: dict = {
    "name": "tiny",
    "model": {"architecture": "bert", "task": "token-classification", "num_labels": 2,
              "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64}},
    "data": {"synthetic": {"num_samples": 128, "eval_samples": 16, "seq_len": 16, "vocab_range": [5, 69],
                           "labels": "learnable"},
             "num_workers": 0, "pin_memory": False},
    "training": {"max_steps": 8, "micro_batch_size": 4, "seed": 7,
                 "optimizer": {"lr": 2e-3}, "scheduler": {"name": "linear", "warmup_steps": 2}},
    "logging": {"every_n_steps": 1, "mlflow": {"enabled": False}, "progress": "lines"},
    "resources": {"gpus_per_node": 2},
}
BARE: dict = {}


class replace:   # noqa: N801 - reads as a marker in a call: model=replace({...})
    """An override value put in whole instead of merged."""

    def __init__(self, value: Any):
        self.value = value


DROP = object()   # an override that removes the key


def deep_merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in: dicts key by key, `replace(v)` whole, `DROP` removed; neither changed."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is DROP:
            out.pop(key, None)
        elif isinstance(value, replace):
            out[key] = copy.deepcopy(value.value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """A value with its markers applied (a `replace` or `DROP` inside a dict that had no base to merge into)."""
    if isinstance(value, replace):
        return copy.deepcopy(value.value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not DROP}
    return copy.deepcopy(value)


def job(base: dict = TINY_JOB, **sections: Any) -> dict:
    """The job as written (a plain dict, nothing filled): `base` with `sections` merged in."""
    return deep_merge(base, sections)


def write_job(directory: str | os.PathLike, base: dict = TINY_JOB, filename: str = "job.yaml",
              **sections: Any) -> Path:
    """The job written as `directory/filename`, as a user would write it; relative paths in it are relative
    to `directory` when the loader reads it."""
    path = Path(directory) / filename
    path.write_text(yaml.safe_dump(job(base, **sections), sort_keys=False))
    return path


def resolve(base: dict = TINY_JOB, directory: str | os.PathLike | None = None, **sections: Any) -> ResolvedSpec:
    """The job resolved as `jobspec validate` resolves it. With `directory`, written there as job.yaml and
    loaded from the file (`extends` followed); without, validated in memory as if it were the file
    ./job.yaml (relative paths against the current directory, nothing written)."""
    if directory is not None:
        return load_and_validate(write_job(directory, base, **sections))
    raw = job(base, **sections)
    if raw.get("extends"):
        raise ValueError("a job with `extends` is read from its file: pass directory=")
    return validate_spec(LoadedSpec(raw, Path.cwd() / "job.yaml", yaml.safe_dump(raw, sort_keys=False)))


def build_spec(base: dict = TINY_JOB, directory: str | os.PathLike | None = None, **sections: Any) -> JobSpec:
    """`resolve(...).spec`: the spec every stage after the loader takes."""
    return resolve(base, directory, **sections).spec


def validate_errors(capsys, job: str, *overrides: str) -> dict[str, list[dict]]:
    """{dotted path: the problems there} of what `jobspec validate --format json` reports (exit 2),
    {} when it accepts."""
    import json

    from jobspec.cli import main

    code = main(["validate", job, "--format", "json", *[x for o in overrides for x in ("--set", o)]])
    out = capsys.readouterr().out
    if code == 0:
        return {}
    assert code == 2, out
    found: dict[str, list[dict]] = {}
    for error in json.loads(out)["errors"]:
        found.setdefault(error["dotted_path"], []).append(error)
    return found
