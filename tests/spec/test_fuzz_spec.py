"""Property tests: whatever a spec file or --set contains, validation returns or raises SpecError."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO_ROOT
from jobspec.errors import SpecError
from jobspec.spec.validation import load_and_validate

VALID_FILE = REPO_ROOT / "tests" / "assets" / "valid" / "tiny-bert.yaml"
VALID_TEXT = VALID_FILE.read_text()
VALID_SPEC = yaml.safe_load(VALID_TEXT)
# JOBSPEC_FUZZ_EXAMPLES=2000 for a longer hunt; the default keeps these tests under ~15 s.
FAST = settings(max_examples=int(os.environ.get("JOBSPEC_FUZZ_EXAMPLES", 60)), deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["auto", "cpu", "nvme", "bf16", "adamw", "sqlite:///x"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def paths(spec, prefix=()):
    yield prefix
    if isinstance(spec, dict):
        for key, sub in spec.items():
            yield from paths(sub, prefix + (key,))


ALL_PATHS = [p for p in paths(VALID_SPEC) if p]


@st.composite
def mutated_specs(draw):
    spec = copy.deepcopy(VALID_SPEC)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = spec
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or path[-1] not in parent:
            continue
        action = draw(st.sampled_from(["drop", "rename", "replace"]))
        if action == "drop":
            del parent[path[-1]]
        elif action == "rename":
            parent[path[-1] + draw(st.text("xs_", min_size=1, max_size=2))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = draw(values)
    return spec


def check(text: str, overrides=()) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            resolved = load_and_validate(path, overrides)
        except SpecError as err:
            assert err.issues and all(i.message for i in err.issues)
            err.render("json")
        else:
            assert resolved.spec["name"] == "job"


@FAST
@given(mutated_specs())
def test_mutated_spec_validates_or_raises_spec_error(spec):
    check(yaml.safe_dump(spec, sort_keys=False))


@FAST
@given(st.text(max_size=200))
def test_random_text_validates_or_raises_spec_error(text):
    check(text)


@FAST
@given(st.lists(st.tuples(st.integers(0, len(VALID_TEXT)), st.sampled_from(list(":-[]{}&*!#'\" \t\n|>%@`,?"))
                          | st.text(max_size=3)), min_size=1, max_size=4))
def test_edited_yaml_text_validates_or_raises_spec_error(edits):
    text = VALID_TEXT
    for offset, insert in edits:
        text = text[:offset] + insert + text[offset:]
    check(text)


@FAST
@given(st.lists(st.tuples(st.sampled_from(["-".join(p) for p in ALL_PATHS]), st.text(max_size=10)), max_size=3))
def test_random_overrides_validate_or_raise_spec_error(pairs):
    check(VALID_TEXT, [f"{key.replace('-', '.')}={value}" for key, value in pairs])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_specs())
def test_cli_on_mutated_spec_exits_0_or_2_without_traceback(spec):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec), encoding="utf-8")
        out = subprocess.run([sys.executable, "-m", "jobspec", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode in (0, 2), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
