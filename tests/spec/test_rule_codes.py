"""Every problem validate reports carries the code of the rule that found it (`--format json`)."""
from __future__ import annotations

import json

import yaml

from jobspec.cli import main

TINY_MODEL = {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "vocab_size": 100}}


def write(tmp_path, **sections) -> str:
    raw = {"model": TINY_MODEL, "data": {"synthetic": {"num_samples": 10}}, "training": {"max_steps": 2}}
    raw.update(sections)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def codes(capsys, job: str) -> dict:
    assert main(["validate", job, "--format", "json"]) == 2
    report = json.loads(capsys.readouterr().out)
    return {error["dotted_path"]: error["code"] for error in report["errors"]}


def test_cross_field_rules_carry_their_code(tmp_path, capsys):
    job = write(tmp_path, training={"max_steps": 2, "optimizer": {"name": "adafactor", "momentum": 0.5}},
                memory={"zero_stage": 0, "offload": {"optimizer": "cpu"}})
    assert codes(capsys, job) == {"training.optimizer.name": "client-optimizer-offload",
                                  "training.optimizer.momentum": "momentum-sgd-only",
                                  "memory.offload.optimizer": "offload-optimizer-stage"}


def test_schema_errors_carry_the_keyword_that_failed(tmp_path, capsys):
    job = write(tmp_path, training={"max_steps": 2, "schedular": {}}, memory={"precision": "fp33"})
    assert codes(capsys, job) == {"training.schedular": "schema-unknown-key", "memory.precision": "schema-enum"}


def test_rules_of_the_adam_fields_and_text_output_unchanged(tmp_path, capsys):
    job = write(tmp_path, training={"max_steps": 2, "optimizer": {"implementation": "cpu"}})
    assert codes(capsys, job) == {"training.optimizer.implementation": "adam-settings"}
    assert main(["validate", job]) == 2
    err = capsys.readouterr().err
    assert "adam-settings" not in err and "`cpu` Adam needs optimizer offload" in err


def test_every_problem_of_every_broken_asset_has_a_rule_code():
    """Each rule of validation.CROSS_FIELD_RULES (and each schema keyword) codes what it finds, on the
    broken specs of tests/assets/broken that load (a file the YAML loader refuses reaches no rule)."""
    from pathlib import Path

    from jobspec.errors import SpecError
    from jobspec.spec.loader import load_spec
    from jobspec.spec.validation import validate_spec

    broken = sorted((Path(__file__).resolve().parent.parent / "assets" / "broken").glob("*.yaml"))
    uncoded, seen = [], set()
    for job in broken:
        try:
            loaded = load_spec(job)
        except SpecError:
            continue
        try:
            validate_spec(loaded)
        except SpecError as err:
            uncoded += [f"{job.name}: {issue.dotted_path}: {issue.message}" for issue in err.issues if not issue.code]
            seen |= {issue.code for issue in err.issues}
    assert uncoded == []
    assert {"steps-or-epochs", "offload-params-stage", "adam-settings", "checkpoint-resume"} <= seen
