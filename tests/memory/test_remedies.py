"""`jobspec plan`'s advice (jobspec/memory/remedies.py): only settings that are not on already and that
validation accepts, on every shipped job."""
from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT as REPO
from jobspec.memory.planner import plan_memory
from jobspec.memory.remedies import REMEDIES, advice, remedies
from jobspec.model.planner_trace import job_profiler
from jobspec.spec.derived import derive
from jobspec.spec.validation import load_and_validate

JOBS = sorted((REPO / "jobs").glob("*.yaml"))
SET = re.compile(r"--set (\S+?)=(.+?)(?= --set | \(|$)")
PROFILER = job_profiler()


def _planned(job, overrides=()):
    spec = load_and_validate(job, overrides=list(overrides)).spec
    return spec, plan_memory(spec, derive(spec, profiler=PROFILER), budget=1)   # 1 byte: never fits


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.stem)
def test_every_remedy_offered_changes_a_setting_and_validates(job):
    spec, plan = _planned(job)
    for term in REMEDIES:
        for text in remedies(term, spec, plan):
            sets = [f"{path}={value}" for path, value in SET.findall(text)]
            if sets:
                changed = load_and_validate(job, overrides=sets).spec   # raises when refused
                assert changed != spec, f"{job.stem}: {text!r} is on already"
    assert advice(plan, spec).startswith("over by")


def test_a_quantised_long_sequence_job_is_told_what_it_can_still_do():
    """Checkpointing and the tiled MLP are on, inputs offloaded, a 4-bit base: no setting it has, no
    ZeRO-3; a shorter sequence and where to find the longest."""
    spec, plan = _planned(REPO / "jobs" / "llama-8b-qlora-32k-24gb.yaml")
    text = advice(plan, spec)
    assert "activation_checkpointing=true" not in text and "tiled_mlp=true" not in text
    assert "zero_stage: 3" not in text and "--longest" in text
    assert all("zero_stage: 3" not in r for term in REMEDIES for r in remedies(term, spec, plan))


def test_checkpointing_every_layer_is_offered_only_where_a_layer_keeps_its_activations():
    spec, plan = _planned(REPO / "jobs" / "xlmr-large.yaml", ["memory.activation_checkpointing=false"])
    assert any("activation_checkpointing=true" in r for r in remedies("activations", spec, plan))
    spec, plan = _planned(REPO / "jobs" / "xlmr-large.yaml")
    assert not any("activation_checkpointing=true" in r for r in remedies("activations", spec, plan))
    assert not any("tiled" in r for r in remedies("activations", spec, plan))   # an encoder: nothing to tile
