"""jobspec/spec/types.py is generated from the schema (scripts/gen_spec_types.py) and stays in step
with it; a validated spec has exactly the keys its TypedDicts name, at every level."""
from __future__ import annotations

import sys
import typing
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from jobspec.spec import types
from jobspec.spec.validation import load_and_validate

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gen_spec_types  # noqa: E402


def test_the_types_are_generated_from_the_current_schema(tmp_path):
    out = tmp_path / "types.py"
    gen_spec_types.main(["--out", str(out)])
    assert out.read_text() == (REPO_ROOT / "jobspec" / "spec" / "types.py").read_text(), \
        "jobspec/spec/types.py is stale: run python scripts/gen_spec_types.py"


def _typed_dict_of(annotation):
    """The TypedDict inside an annotation (`X | None` included), or None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.is_typeddict(candidate):
            return candidate
    return None


def _check(value: dict, shape, where: str) -> None:
    hints = typing.get_type_hints(shape)
    assert set(value) == set(hints), f"{where}: keys {sorted(set(value) ^ set(hints))} differ from {shape.__name__}"
    for key, annotation in hints.items():
        inner = _typed_dict_of(annotation)
        if inner is not None and isinstance(value[key], dict):
            _check(value[key], inner, f"{where}.{key}")


@pytest.mark.parametrize("job", sorted(p.name for p in (REPO_ROOT / "jobs").glob("*.yaml")))
def test_every_shipped_job_resolves_to_the_generated_shape(job):
    spec = load_and_validate(REPO_ROOT / "jobs" / job).spec
    _check(spec, types.JobSpec, "spec")


def test_enums_become_literals():
    hints = typing.get_type_hints(types.JobSpecTrainingOptimizer)
    assert set(typing.get_args(hints["name"])) == {"adamw", "adamw_8bit", "adafactor", "sgd"}
    checkpointing = typing.get_type_hints(types.JobSpecMemory)["activation_checkpointing"]
    assert bool in typing.get_args(checkpointing) and _typed_dict_of(checkpointing) is not None
    assert Path(types.__file__).read_text().count("do not edit by hand") == 1


def test_the_derived_job_round_trips_through_launch_json():
    import json

    from jobspec.spec.derived import DerivedJob
    from jobspec.spec.inputs import derive_job
    job = derive_job(load_and_validate(REPO_ROOT / "jobs" / "quickstart.yaml").spec)
    carried = json.loads(json.dumps(job.as_dict()))   # what launch.json holds
    back = DerivedJob.from_dict(carried)
    assert back == job and back.dims == job.dims and back.total_steps == 40
    assert back.as_dict() == {**carried, "profile": None}   # the profile stays with the launcher
