"""The launch's one decision (jobspec/launch/decision.py), table-driven over snapshots made by hand
(no disk): new, resume at K, complete, --new-run beside a finished run, the same spec's unfinished
run preferred, a changed spec refused with its fields, --continue taken or refused, another job's
directory, files no job claims, `resume: never` over checkpoints, a held lease, an unreadable owner
record. And jobspec/launch/snapshot.take reading a real directory tree."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import spec_builder

from jobspec.launch import decision, lease, snapshot
from jobspec.launch.snapshot import CheckpointSnapshot, DirectoryState, Latest

BASE = Path("/runs/out/checkpoints")
PRINTS = {"training.optimizer.lr": "0.002", "training.max_steps": "8", "derived.total_steps": "8"}
TOTAL = 8


def spec(resume: str = "auto", name: str = "job") -> dict:
    return {"name": name, "output_dir": "/runs/out", "training": {"max_steps": 8},
            "checkpoint": {"dir": str(BASE), "resume": resume}}


def directory(path: Path = BASE, step: int | None = None, complete: bool = True, *,
              owner: dict | None = None, files: bool | None = None, holder=None,
              unreadable: str | None = None) -> DirectoryState:
    """A checkpoint directory that exists, with a checkpoint at `step` (None: none)."""
    latest = Latest(path / f"step{step}", step, complete) if step is not None else Latest()
    return DirectoryState(path, exists=True,
                          has_checkpoints=step is not None if files is None else files,
                          owner=owner, owner_unreadable=unreadable, latest=latest, holder=holder)


def owned(fingerprint: dict | None = None, job: str = "job", run: str = "run-1") -> dict:
    return {"job": job, "spec": "/jobs/job.yaml", "mlflow_run_id": run,
            "fingerprint": PRINTS if fingerprint is None else fingerprint}


def snap(*directories: DirectoryState, prints: dict | None = None,
         resume_from: Latest | None = None) -> CheckpointSnapshot:
    return CheckpointSnapshot(BASE, directories or (DirectoryState(BASE),),
                              PRINTS if prints is None else prints, resume_from)


def live(token: str = "other", requeued: bool = False, state: str = "live") -> lease.Holder:
    record = {"host": "vm", "pid": 4242, "started": 0.0, "job": "job", "token": token,
              "run_dir": "/runs/out/run-a"}
    return lease.Holder(record, state, requeued)


SIBLING = BASE.with_name("checkpoints-2")
LONGER = {**PRINTS, "training.max_steps": "12", "derived.total_steps": "12"}
OTHER_LR = {**PRINTS, "training.optimizer.lr": "0.001"}

# name: (snapshot, spec, flags, action, checkpoint dir, step, MLflow run, a line said)
CASES = {
    "fresh": (snap(), spec(), {}, "new", BASE, 0, None, None),
    "fresh in an empty directory": (snap(directory(owner=owned())), spec(), {}, "new", BASE, 0,
                                    None, None),
    "resume at K": (snap(directory(step=4, owner=owned())), spec(), {}, "resume", BASE, 4,
                    "run-1", None),
    "an unfinished final save resumes": (snap(directory(step=8, complete=False, owner=owned())),
                                         spec(), {}, "resume", BASE, 8, "run-1", None),
    "complete": (snap(directory(step=8, owner=owned())), spec(), {}, "complete", BASE, 8,
                 "run-1", None),
    "never starts fresh beside another line": (
        snap(directory(), directory(SIBLING, step=4, owner=owned())), spec("never"), {}, "new",
        BASE, 0, None, None),
    "--new-run beside a finished run": (
        snap(directory(step=8, owner=owned())), spec(), {"new_run": True}, "new", SIBLING, 0,
        None, "untouched"),
    "--new-run with nothing earlier": (snap(), spec(), {"new_run": True}, "new", BASE, 0, None,
                                       "no earlier checkpoints"),
    "the same spec's unfinished run preferred": (
        snap(directory(step=8, owner=owned()), directory(SIBLING, step=4, owner=owned(run="r2"))),
        spec(), {}, "resume", SIBLING, 4, "r2", "earlier --new-run"),
    "the variant trained under this spec": (
        snap(directory(step=8, owner=owned(OTHER_LR)), directory(SIBLING, step=4, owner=owned())),
        spec(), {}, "resume", SIBLING, 4, "run-1", "earlier --new-run"),
    "--continue takes more steps": (
        snap(directory(step=4, owner=owned()), prints=LONGER), spec(), {"continue_run": True},
        "resume", BASE, 4, "run-1", "--continue: training.max_steps: 8 -> 12"),
    "a resume path names the checkpoint": (
        snap(directory(step=8, owner=owned()), resume_from=Latest(BASE / "step4", 4, True)),
        spec(str(BASE / "step4")), {}, "resume", BASE, 4, "run-1", None),
    "a live lease of this launch's own": (
        snap(directory(step=4, owner=owned(), holder=live("mine"))), spec(), {"holding": "mine"},
        "resume", BASE, 4, "run-1", None),
    "a requeued Slurm job's lease": (
        snap(directory(step=4, owner=owned(), holder=live(requeued=True))), spec(), {}, "resume",
        BASE, 4, "run-1", None),
    "a dead launcher's lease": (
        snap(directory(step=4, owner=owned(), holder=live(state="dead"))), spec(), {}, "resume",
        BASE, 4, "run-1", None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_a_launch_does(name):
    found, asked, flags, action, where, step, run, line = CASES[name]
    made = decision.decide(found, asked, {"total_steps": TOTAL}, **flags)
    assert made.refusal is None, made.refusal
    assert (made.action, made.checkpoint_dir, made.step, made.mlflow_run_id) == \
        (action, where, step, run)
    assert made.lineage is not None and made.lineage.fingerprint == found.fingerprint
    assert made.lineage.spec_flat["checkpoint.dir"] == json.dumps(str(where))
    assert made.state is not None and made.state.path == where
    if line is None:
        assert made.lineage.lines == ()
    else:
        assert any(line in said for said in made.lineage.lines), made.lineage.lines


# name: (snapshot, spec, flags, the words, the spec paths refused, whether a directory was chosen)
REFUSALS = {
    "a changed spec": (
        snap(directory(step=8, owner=owned()), prints=OTHER_LR), spec(), {},
        "were trained under a different spec", ["checkpoint.dir", "training.optimizer.lr"], False),
    "more steps without --continue": (
        snap(directory(step=8, owner=owned()), prints=LONGER), spec(), {},
        "were trained under a different spec", ["checkpoint.dir", "training.max_steps"], False),
    "--continue cannot take a new learning rate": (
        snap(directory(step=8, owner=owned()), prints=OTHER_LR), spec(), {"continue_run": True},
        "--continue cannot take 1 of these changes",
        ["checkpoint.dir", "training.optimizer.lr"], False),
    "another job's checkpoints": (
        snap(directory(step=4, owner=owned(job="other"))), spec(), {},
        "belongs to job 'other'", ["checkpoint.dir"], True),
    "another job's empty directory": (
        snap(directory(owner=owned(job="other"))), spec(), {"new_run": True},
        "belongs to job 'other'", ["checkpoint.dir"], True),
    "files no job claims": (
        snap(directory(files=True)), spec(), {}, "already holds files that no jobspec job claims",
        ["checkpoint.dir"], True),
    "resume: never over checkpoints": (
        snap(directory(step=4, owner=owned())), spec("never"), {},
        "checkpoint.resume is 'never'", ["checkpoint.resume"], True),
    "a held lease": (
        snap(directory(step=4, owner=owned(), holder=live())), spec(), {},
        "is already being launched into", ["checkpoint.dir"], True),
    "another launch's lease, while holding a stale token": (
        snap(directory(step=4, owner=owned(), holder=live())), spec(), {"holding": "mine"},
        "is already being launched into", ["checkpoint.dir"], True),
    "an unreadable owner record": (
        snap(directory(step=4, unreadable="Expecting value")), spec(), {},
        "jobspec_job.json is unreadable (Expecting value)", ["checkpoint.dir"], False),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_what_a_launch_refuses(name):
    found, asked, flags, words, paths, chosen = REFUSALS[name]
    made = decision.decide(found, asked, {"total_steps": TOTAL}, **flags)
    assert made.action == "refuse" and made.refusal is not None
    assert words in str(made.refusal)
    assert [issue.dotted_path for issue in made.refusal.issues] == paths
    assert (made.lineage is not None) == chosen


def test_a_changed_spec_names_each_field_old_to_new_and_the_choices():
    made = decision.decide(snap(directory(step=8, owner=owned()), prints=LONGER), spec(),
                           {"total_steps": 12})
    assert made.refusal is not None
    head, steps = made.refusal.issues
    assert "`--continue` goes on from them" in head.hint and "--new-run" in head.hint
    # derived.total_steps comes from training.max_steps: shown once, at its source
    assert steps.message == "changed since those checkpoints: 8 -> 12"
    made = decision.decide(snap(directory(step=8, owner=owned()), prints=OTHER_LR), spec(),
                           {"total_steps": TOTAL}, continue_run=True)
    assert made.refusal is not None
    lr = made.refusal.issues[1]
    assert lr.message == ("changed since those checkpoints: 0.002 -> 0.001 (--continue cannot "
                          "take this)")
    assert "`--continue` goes on" not in made.refusal.issues[0].hint


def test_complete_names_the_same_specs_unfinished_runs_elsewhere():
    """A launch pinned to the finished directory (a resume path) is complete, and names the same
    spec's run stopped in checkpoints-2; another spec's stopped run is not named."""
    third = BASE.with_name("checkpoints-3")
    found = snap(directory(step=8, owner=owned()), directory(SIBLING, step=4, owner=owned()),
                 directory(third, step=2, owner=owned(OTHER_LR)),
                 resume_from=Latest(BASE / "step8", 8, True))
    made = decision.decide(found, spec(str(BASE)), {"total_steps": TOTAL})
    assert made.action == "complete" and made.unfinished == ((SIBLING, 4),)
    assert decision.unfinished_runs(found, spec(), {"total_steps": TOTAL}) == [(SIBLING, 4)]


def test_a_new_run_takes_the_first_number_without_checkpoints():
    """checkpoints-2 holds a run; checkpoints-3 exists but never saved: it is the next one."""
    found = snap(directory(step=8, owner=owned()), directory(SIBLING, step=4, owner=owned()),
                 directory(BASE.with_name("checkpoints-3"), owner=owned()))
    made = decision.decide(found, spec(), {"total_steps": TOTAL}, new_run=True)
    assert made.action == "new" and made.checkpoint_dir == BASE.with_name("checkpoints-3")


def test_a_continued_run_records_its_changes_as_a_new_segment():
    before = decision.decide(snap(), spec(), {"total_steps": TOTAL})
    assert before.lineage is not None
    owner = {**owned(), "spec_flat": before.lineage.spec_flat, "segments": [{"segment": 1}]}
    longer = {**spec(), "training": {"max_steps": 12}}
    made = decision.decide(snap(directory(step=8, owner=owner), prints=LONGER), longer,
                           {"total_steps": 12}, continue_run=True)
    assert made.action == "resume" and made.lineage is not None and made.lineage.segment == 2
    assert [c.field for c in made.lineage.recorded] == ["training.max_steps"]
    assert [c.field for c in made.lineage.continued] == ["derived.total_steps",
                                                          "training.max_steps"]


def test_the_intent_rule():
    at = Latest(BASE / "step8", 8, True)
    assert decision.intent("auto", at, None, 8).describe().startswith("do nothing")
    assert decision.intent("auto", at, None, 12) == decision.Intent("resume", 12, 8, at.checkpoint)
    assert decision.intent("auto", at, None, None).action == "resume"   # unknown total
    assert decision.intent("never", at, None, 8) == decision.Intent("fresh", 8)
    assert decision.intent("/elsewhere", at, None, 8) == decision.Intent("fresh", 8)


def test_the_snapshot_reads_a_real_directory_tree(tmp_path):
    ckpt = tmp_path / "out" / "checkpoints"
    run_dir = tmp_path / "out" / "run-a"
    (ckpt / "step4").mkdir(parents=True)
    (ckpt / "step4" / snapshot.MANIFEST).write_text("{}")
    (ckpt / snapshot.LATEST).write_text("step4\n")
    owner = {"job": "tiny", "last_run_dir": str(run_dir)}
    (ckpt / snapshot.OWNER_FILE).write_text(json.dumps(owner))
    (ckpt / lease.LEASE_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "t",
                                                     "heartbeat": time.time()}))
    run_dir.mkdir()
    (run_dir / "mlflow_run.json").write_text(json.dumps({"run_id": "abc", "experiment_id": "1",
                                                         "tracking_uri": "file:/m"}))
    sibling = tmp_path / "out" / "checkpoints-2"
    sibling.mkdir()
    (sibling / snapshot.OWNER_FILE).write_text("{not json")
    (sibling / ".jobspec-write-test-1").write_text("ok")   # bookkeeping: no checkpoint
    (tmp_path / "out" / "checkpoints-old").mkdir()        # no sibling: not `-N`
    built = spec_builder.build_spec(output_dir=str(tmp_path / "out"),
                                    checkpoint={"dir": str(ckpt)})
    found = snapshot.take(built, {"global_batch_size": 8, "total_steps": 8})

    assert found.base == ckpt and [d.path for d in found.directories] == [ckpt, sibling]
    first, second = found.directories
    assert first.exists and first.has_checkpoints and first.owner_unreadable is None
    assert first.owner == owner
    assert first.latest == Latest(ckpt / "step4", 4, True)
    assert first.holder is not None and first.holder.state == "live" and first.holder.refuses
    assert first.writer_run_dir == run_dir and first.writer_mlflow["run_id"] == "abc"
    assert second.exists and not second.has_checkpoints and second.owner is None
    assert second.owner_unreadable and second.holder is None and second.latest == Latest()
    assert found.directory(tmp_path / "out" / "checkpoints-3") == \
        DirectoryState(tmp_path / "out" / "checkpoints-3")
    assert "training.optimizer.lr" in found.fingerprint and found.resume_from is None
    # a resume path: the checkpoint it names, read too
    named = snapshot.take({**built, "checkpoint": {**built["checkpoint"],
                                                   "resume": str(ckpt / "step4")}},
                          {"global_batch_size": 8, "total_steps": 8})
    assert named.resume_from == Latest(ckpt / "step4", 4, True)
