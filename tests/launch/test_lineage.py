"""A relaunch trains into the checkpoints its spec was trained under (jobspec/launch/lineage.py and
fingerprint.py), in-process against checkpoint directories made by hand: the same spec resumes,
a changed one is refused with every field (old -> new) at its place in the spec, `--continue`
takes only more steps and other eval data, `--new-run` starts beside the old checkpoints, which a
later relaunch of that spec finds again. The `jobspec launch --dry-run` refusal is exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import spec_builder
from conftest import TINY_SPEC

from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.launch import fingerprint, intent, lineage, ownership
from jobspec.spec.inputs import derive_job
from jobspec.spec.validation import load_and_validate


def write_job(tmp_path: Path, **over) -> Path:
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"row {i}", "label": i % 2}) + "\n" for i in range(32)))
    return spec_builder.write_job(tmp_path, **{"output_dir": str(tmp_path / "out"), **over})


def resolve(job: Path, *overrides: str):
    resolved = load_and_validate(job, list(overrides))
    return resolved, derive_job(resolved.spec).as_dict()


def trained(resolved, derived, chosen, step: int) -> Path:
    """Checkpoints at `step` in the chosen directory, owned as a launch of `resolved` would leave them."""
    directory = chosen.checkpoint_dir
    (directory / f"step{step}").mkdir(parents=True)
    (directory / f"step{step}" / intent.MANIFEST).write_text("{}")
    (directory / intent.LATEST).write_text(f"step{step}")
    spec = {**resolved.spec, "checkpoint": {**resolved.spec["checkpoint"], "dir": str(directory)}}
    ownership.write_owner(spec, resolved.source, "run-1", lineage=chosen, run_dir=directory.parent / "run-a",
                          start_step=0 if not (directory / ownership.OWNER_FILE).exists() else step)
    return directory


def choose(job: Path, *overrides: str, **flags):
    resolved, derived = resolve(job, *overrides)
    return lineage.choose(resolved, derived, **flags)


def test_the_same_spec_resumes_its_checkpoints_and_a_free_change_is_recorded(tmp_path):
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    base = trained(resolved, derived, lineage.choose(resolved, derived), 8)
    again = choose(job)
    assert again.checkpoint_dir == base and not again.recorded and not again.lines
    assert intent.decide(resolved.spec, derived["total_steps"]).action == "complete"
    # memory, logging and checkpoint settings do not change what is trained: no flag needed, recorded
    tuned = choose(job, "memory.zero_stage=2", "logging.every_n_steps=4")
    assert tuned.checkpoint_dir == base and tuned.segment == 2
    assert {c.field for c in tuned.recorded} == {"memory.zero_stage", "logging.every_n_steps"}


def test_a_changed_spec_is_refused_with_every_field_at_its_place(tmp_path):
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    trained(resolved, derived, lineage.choose(resolved, derived), 8)
    with pytest.raises(SpecError) as err:
        choose(job, "training.optimizer.lr=1e-4", "model.config.hidden_size=64", "training.max_steps=20",
               continue_run=True)
    issues = {issue.dotted_path: issue for issue in err.value.issues}
    assert set(issues) == {"checkpoint.dir", "training.optimizer.lr", "model.config.hidden_size",
                           "training.max_steps"}
    assert "0.002 -> 0.0001" in issues["training.optimizer.lr"].message
    assert "--continue cannot take this" in issues["model.config.hidden_size"].message
    assert "--continue cannot take this" not in issues["training.max_steps"].message
    assert issues["training.optimizer.lr"].file == "<--set>"   # located where the change was made
    head = issues["checkpoint.dir"]
    assert "--continue cannot take 2 of these changes" in head.message
    assert "--new-run" in head.hint and "--continue` goes on" not in head.hint


def test_continue_takes_more_steps_and_other_eval_data_only(tmp_path):
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    base = trained(resolved, derived, lineage.choose(resolved, derived), 8)
    with pytest.raises(SpecError) as err:   # without --continue: refused, and told it would do
        choose(job, "training.max_steps=12")
    assert "`--continue` goes on from them" in err.value.issues[0].hint
    longer = choose(job, "training.max_steps=12", continue_run=True)
    assert longer.checkpoint_dir == base and longer.segment == 2
    assert [c.field for c in longer.recorded] == ["training.max_steps"]
    assert "--continue: training.max_steps: 8 -> 12" in longer.lines[0]
    with pytest.raises(SpecError, match="--continue cannot take"):   # fewer steps: the schedule went past them
        choose(job, "training.max_steps=6", continue_run=True)


def test_changed_data_content_is_a_change_of_data_train(tmp_path):
    job = write_job(tmp_path, data={"train": str(tmp_path / "train.jsonl"), "synthetic": None,
                                    "tokenizer": "a-hub-tokenizer", "max_length": 16},
                    model={**TINY_SPEC["model"], "task": "sequence-classification"})
    resolved, derived = resolve(job)
    trained(resolved, derived, lineage.choose(resolved, derived), 8)
    assert choose(job).recorded == ()
    with open(tmp_path / "train.jsonl", "a") as rows:
        rows.write(json.dumps({"text": "one more", "label": 1}) + "\n")
    with pytest.raises(SpecError) as err:
        choose(job)
    [change] = [i for i in err.value.issues if i.dotted_path == "data.train"]
    assert "sha256:" in change.message and "--continue cannot take this" in change.message


def test_new_run_starts_beside_and_a_relaunch_finds_each_variant(tmp_path):
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    base = trained(resolved, derived, lineage.choose(resolved, derived), 8)
    variant = choose(job, "training.optimizer.lr=1e-3", new_run=True)
    assert variant.checkpoint_dir == base.with_name("checkpoints-2") and "untouched" in variant.lines[0]
    resolved_b, derived_b = resolve(job, "training.optimizer.lr=1e-3")
    trained(resolved_b, derived_b, variant, 4)
    assert choose(job, "training.optimizer.lr=1e-3").checkpoint_dir == base.with_name("checkpoints-2")
    assert choose(job).checkpoint_dir == base
    assert choose(job, new_run=True).checkpoint_dir == base.with_name("checkpoints-3")
    assert json.loads((base / ownership.OWNER_FILE).read_text())["fingerprint"] == \
        fingerprint.fingerprint(resolved.spec, derived)   # the old checkpoints' record is untouched


def test_the_fingerprint_covers_what_trains_and_nothing_else():
    spec = spec_builder.build_spec(output_dir="/o")   # as the loader gives it: every field the fingerprint reads
    derived = {"global_batch_size": 8, "total_steps": 8}
    prints = fingerprint.fingerprint(spec, derived)
    assert {"model.config.hidden_size", "training.optimizer.lr", "training.seed", "derived.global_batch_size",
            "data.synthetic.seq_len"} <= set(prints)
    assert not any(k.startswith(("logging.", "resources.", "output_dir")) for k in prints)
    other = fingerprint.fingerprint(spec, {**derived, "global_batch_size": 16})
    [change] = fingerprint.compare(prints, other)
    assert change.field == "derived.global_batch_size" and not change.continuable


def test_dry_run_refuses_a_changed_spec_with_exit_2(tmp_path, capsys):
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    trained(resolved, derived, lineage.choose(resolved, derived), 8)
    assert main(["launch", str(job), "--dry-run", "--set", "training.seed=8"]) == 2
    err = capsys.readouterr().err
    assert "training.seed: changed since those checkpoints: 7 -> 8" in err and "Traceback" not in err
    assert main(["launch", str(job), "--dry-run", "--set", "training.seed=8", "--new-run"]) == 0
    assert "checkpoints-2" in capsys.readouterr().out
    assert not (tmp_path / "out" / "checkpoints-2").exists()   # a dry run creates nothing


def test_the_owner_record_holds_no_credentials(tmp_path):
    job = write_job(tmp_path, logging={**TINY_SPEC["logging"],
                                       "mlflow": {"enabled": True, "tracking_uri": "http://ada:s3cret-pw@mlflow:5000"}})
    resolved, derived = resolve(job)
    base = trained(resolved, derived, lineage.choose(resolved, derived), 8)
    assert "s3cret-pw" not in (base / ownership.OWNER_FILE).read_text()
    assert choose(job).checkpoint_dir == base and not choose(job).recorded   # the same spec still matches


def test_a_relaunch_resumes_the_newest_unfinished_run_of_the_same_spec(tmp_path):
    """A finished run, then a `--new-run` of the same spec stopped at step 4: the plain relaunch (the
    command the stop printed) continues checkpoints-2, not "already complete" at checkpoints."""
    job = write_job(tmp_path)
    resolved, derived = resolve(job)
    base = trained(resolved, derived, lineage.choose(resolved, derived), derived["total_steps"])
    assert choose(job).checkpoint_dir == base   # finished, and nothing else: already complete
    assert lineage.unfinished_of_same_spec(resolved.spec, derived) == []
    stopped = trained(resolved, derived, choose(job, new_run=True), 4)
    assert stopped == base.with_name("checkpoints-2")
    again = choose(job)
    assert again.checkpoint_dir == stopped and "earlier --new-run" in again.lines[0]
    assert lineage.unfinished_of_same_spec(resolved.spec, derived) == [(stopped, 4)]
    # another spec's unfinished run is not offered to this one
    other, other_derived = resolve(job, "training.optimizer.lr=1e-3")
    assert lineage.unfinished_of_same_spec(other.spec, other_derived) == []
    # "already complete" (a launch pinned to the finished directory) names the unfinished one
    spec = {**resolved.spec, "checkpoint": {**resolved.spec["checkpoint"], "dir": str(base)}}
    what = intent.decide(spec, derived["total_steps"])
    lines = intent.complete_lines(spec, what, [(stopped, 4, "jobspec launch job.yaml")])
    assert what.action == "complete" and any(
        f"{stopped} holds a run of the same spec stopped at step 4 of {derived['total_steps']}; resume it with: "
        "jobspec launch job.yaml" in line for line in lines)
