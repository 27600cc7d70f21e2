"""docs/architecture.md's worked examples (add an optimizer, a task, a cross-field rule, a tracker,
a data format) are executed, so they cannot drift from the code (issue 38 item 6).

Each example is a set of fenced blocks tagged `example=<name>` and what to do with them:

    ```json example=optimizer schema        a JSON Patch (RFC 6902: `add`) on schemas/jobspec.schema.json
    ```python example=optimizer create=PATH a new file (a module, a data file)
    ```diff example=optimizer patch         a unified diff (git apply), e.g. the registry's one line
    ```yaml example=optimizer job           a job that must validate (`refused=CODE`: must be refused so)

The test copies the package, the schemas and the registry test into a temporary directory, applies one
example's blocks there (regenerating spec/types.py when the schema changed), and runs in subprocesses with
PYTHONPATH at the copy: tests/test_registries.py (the registry of that example's kind), `jobspec validate`
of its job, and an example-specific check (the optimizer's client args, the task's registry entry, the
tracker fed a metric row through the metrics sink, the data format's rows counted and tokenised). A
block that names a registry key, a field, a file or a line that is no longer there fails here. No
launch: seconds per example.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
BLOCK = re.compile(r"^```(\w+) example=(\S+) (\S+)(?: (\S+))?\n(.*?)^```$", re.M | re.S)
EXAMPLES = ("optimizer", "task", "technique", "rule", "tracker")
# the registry tests each example must keep passing (-k of tests/test_registries.py)
REGISTRY_TESTS = {"optimizer": "optimizer or no_torch", "task": "task or no_torch", "tracker": "tracker",
                  "technique": "technique or no_torch", "rule": None}


def blocks(example: str) -> list[tuple[str, str, str | None, str]]:
    """(language, action, argument, text) of each block of `example`, in the document's order."""
    found = []
    for language, name, action, extra, text in BLOCK.findall(DOC.read_text()):
        if name == example:
            kind, _, argument = action.partition("=")
            if extra:
                argument = extra.partition("=")[2]
            found.append((language, kind, argument or None, text))
    return found


def json_patch_add(document: dict, operations: list[dict]) -> None:
    """RFC 6902's `add` (the only operation the examples use): a key of an object, or `-` (append) /
    an index of an array. A pointer whose parent is missing fails, as a drifted example must."""
    for op in operations:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            assert last not in node, f"{op['path']} exists already"
            node[last] = op["value"]


def copy_tree(tmp: Path) -> Path:
    root = tmp / "copy"
    # __pycache__ too: copy2 keeps the sources' times, so the compiled modules stay valid (seconds under load)
    shutil.copytree(REPO / "jobspec", root / "jobspec")
    (root / "schemas").mkdir(parents=True)
    for name in ("jobspec.schema.json", "deepspeed-config.schema.json"):
        shutil.copy(REPO / "schemas" / name, root / "schemas" / name)
    # read-only tables (3.9 MB): a link is enough
    (root / "schemas" / "transformers-configs").symlink_to(REPO / "schemas" / "transformers-configs")
    (root / "jobs" / "data").mkdir(parents=True)   # the small tokenizer a data example's job names
    (root / "jobs" / "data" / "tokenizer").symlink_to(REPO / "jobs" / "data" / "tokenizer")
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gen_spec_types.py", root / "scripts")
    (root / "tests").mkdir()
    shutil.copy(REPO / "tests" / "test_registries.py", root / "tests")
    (root / "pytest.ini").write_text("[pytest]\n")   # not the repository's options or plugins
    return root


def run(root: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "JOBSPEC_CACHE_DIR": str(root / "cache"),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}   # the copy's pytest needs none of the installed plugins
    done = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert done.returncode == 0, f"{' '.join(argv)} in the copy:\n{done.stdout}\n{done.stderr}"
    return done


def apply(root: Path, example: str) -> list[tuple[str, str | None]]:
    """Apply the example's edits in the copy; the jobs it declares, as (path, refused code)."""
    found = blocks(example)
    assert found, f"docs/architecture.md has no `example={example}` blocks"
    jobs, schema_changed = [], False
    for index, (_, kind, argument, text) in enumerate(found):
        if kind == "schema":
            path = root / "schemas" / "jobspec.schema.json"
            document = json.loads(path.read_text())
            json_patch_add(document, json.loads(text))
            path.write_text(json.dumps(document, indent=2) + "\n")
            schema_changed = True
        elif kind == "create":
            target = root / argument
            assert not target.exists(), f"example {example} creates {argument}, which exists already"
            target.write_text(text)
        elif kind == "patch":
            done = subprocess.run(["git", "apply", "--verbose", "-"], cwd=root, input=text,
                                  capture_output=True, text=True)
            assert done.returncode == 0, (f"example {example}'s diff no longer applies (make the edit it shows "
                                          f"and paste `git diff -U1 FILE` into the doc):\n{done.stderr}")
        elif kind == "job":
            path = root / f"{example}-job-{index}.yaml"
            path.write_text(text)
            jobs.append((str(path), argument))
        else:
            raise AssertionError(f"example {example}: unknown block action {kind!r}")
    if schema_changed:
        run(root, "scripts/gen_spec_types.py")
    assert jobs, f"example {example} declares no job to validate"
    return jobs


# what each example's new piece must do once registered, read through the registries (in the copy)
CHECKS = {
    "optimizer": """
        from jobspec.optimizers import OPTIMIZERS, client_built
        from jobspec.spec.validation import load_and_validate
        spec = load_and_validate(JOB).spec
        lion = OPTIMIZERS["lion"]
        assert "lion" in client_built() and lion.hf_trainer_optim, lion
        assert lion.client_args(spec["training"]["optimizer"])["name"] == "lion"
    """,
    "task": """
        from jobspec import tasks
        from jobspec.spec.validation import load_and_validate
        spec = load_and_validate(JOB).spec
        task = tasks.of(spec)
        assert task.name == "pos-tagging" and "accuracy" in task.metrics, task
    """,
    "technique": """
        import torch
        from jobspec.compile.compiler import compile_patches, patch_text
        from jobspec.spec.validation import load_and_validate
        from jobspec.train.patches import apply_patches
        spec = load_and_validate(JOB).spec
        patches = compile_patches(spec)
        assert [p["name"] for p in patches] == ["attention_implementation", "no_dropout"], patches
        assert patch_text(patches[-1]) == "dropout off"
        model, notes = apply_patches(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)),
                                     patches[1:])
        assert model[1].p == 0.0 and notes == ["dropout off in 1 modules"], notes
    """,
    "rule": """
        from jobspec.spec import validation
        assert any(rule.__name__ == "eval_every_issues" for rule in validation.CROSS_FIELD_RULES)
    """,
    "tracker": """
        import csv, pathlib, tempfile
        from jobspec.spec.validation import load_and_validate
        from jobspec.tracking import trackers
        from jobspec.tracking.sink import MetricSink
        spec = load_and_validate(JOB).spec
        assert [t.name for t in trackers.enabled(spec)] == ["csv"], trackers.enabled(spec)
        run_dir = pathlib.Path(tempfile.mkdtemp())
        sink = MetricSink.open(run_dir, spec)
        sink.log({"train/loss": 2.5, "train/lr": 1e-3}, step=10)
        sink.close()
        rows = list(csv.reader((run_dir / "metrics.csv").open()))
        assert [r[:1] + r[2:] for r in rows] == [["step", "name", "value"], ["10", "train/loss", "2.5"],
                                                  ["10", "train/lr", "0.001"]], rows
        assert (run_dir / "metrics.jsonl").read_text().count("train/loss") == 1
    """,
    "format": """
        from jobspec.data import formats, prepare
        from jobspec.spec.inputs import derive_job
        from jobspec.spec.validation import load_and_validate
        spec = load_and_validate(JOB).spec
        assert formats.source_format(spec["data"]["train"]).name == "tsv"
        assert derive_job(spec).num_train_samples == 3
        lines, counts = prepare.prepare_data(spec, build=True, num_proc=1)
        assert counts["data.train.records"] == 3, (lines, counts)
        assert counts["data.train.tokens"] > 0, (lines, counts)
    """,
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_worked_example_runs_in_a_copy_of_the_package(example, tmp_path):
    root = copy_tree(tmp_path)
    jobs = apply(root, example)
    where = run(root, "-c", "import jobspec; print(jobspec.__file__)").stdout.strip()
    assert Path(where).is_relative_to(root), where   # the copy is what runs, not the installed checkout
    if REGISTRY_TESTS[example]:
        run(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pytest.ini",
            "tests/test_registries.py", "-k", REGISTRY_TESTS[example])
    passing = [job for job, refused in jobs if refused is None]
    for job, refused in jobs:
        done = run(root, "-m", "jobspec", "validate", "--format", "json", job, check=refused is None)
        if refused is not None:
            assert done.returncode == 2, (done.stdout, done.stderr)
            assert [e["code"] for e in json.loads(done.stdout)["errors"]] == [refused], done.stdout
    assert passing, f"example {example} declares no job that validates"
    check = f"JOB = {passing[0]!r}\n" + textwrap.dedent(CHECKS[example])
    run(root, "-c", check)
