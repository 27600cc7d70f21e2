"""What a launch would do with the checkpoints it finds: start fresh, resume at step K, or nothing
because the job is complete. `jobspec launch` stops before creating anything when the job is
complete (so the finished run's summary and MLflow run are never overwritten by an empty one), and
`--dry-run` says which of the three a launch would do.

The rule is launch/decision.intent's, over what launch/snapshot.py reads; `decide` applies it to
one spec's checkpoint directory read now, and `complete_lines` says what a launch of a complete job
says instead of launching.
"""
from __future__ import annotations

from pathlib import Path

from jobspec.launch import decision, snapshot
from jobspec.launch.decision import Intent
from jobspec.launch.snapshot import LATEST, MANIFEST, DirectoryState
from jobspec.spec.types import JobSpec

__all__ = ["LATEST", "MANIFEST", "Intent", "complete_lines", "decide"]


def decide(spec: JobSpec, total_steps: int | None) -> Intent:
    """The intent of a launch of `spec` now (`checkpoint.resume`: auto, never, or a checkpoint
    path)."""
    resume, ckpt_dir = spec["checkpoint"]["resume"], Path(spec["checkpoint"]["dir"])
    named = None if resume in ("auto", "never") else snapshot.named_checkpoint(Path(resume))
    return decision.intent(resume, snapshot.latest_of(ckpt_dir), named, total_steps)


def complete_lines(spec: JobSpec, intent: Intent,
                   unfinished: list[tuple[Path, int, str]] | None = None,
                   state: DirectoryState | None = None) -> list[str]:
    """What `jobspec launch` says instead of launching a complete job: the run that wrote the
    checkpoint (not merely the newest run directory: a --from-run or --new-run child may be newer),
    and each unfinished checkpoint directory of the same spec `unfinished` names (directory, step,
    the command that resumes it). `state`: the checkpoint directory as the launch found it (else
    read now)."""
    from jobspec.launch.console import mlflow_open

    state = state or snapshot.read_directory(Path(spec["checkpoint"]["dir"]))
    lines = [f"jobspec: {spec['name']} is already complete: checkpoint {intent.checkpoint} is at "
             f"step {intent.step} of {intent.total_steps}. Nothing was started; the finished run's "
             "results are unchanged."]
    tracked = state.writer_mlflow
    if state.writer_run_dir is not None:
        lines.append(f"  results     {state.writer_run_dir}")
    if tracked:
        link = mlflow_open(tracked["tracking_uri"], tracked["experiment_id"], tracked["run_id"])
        lines.append(f"  MLflow      {link}")
    else:
        owner = decision.owner_of(state)
        if owner and owner.get("mlflow_run_id"):
            lines.append(f"  MLflow      run {owner['mlflow_run_id']}")
    for directory, step, command in unfinished or []:
        lines.append(f"  unfinished  {directory} holds a run of the same spec stopped at step "
                     f"{step} of {intent.total_steps}; resume it with: {command}")
    lines += ["  to train again from scratch: add --new-run (fresh checkpoints beside these, which "
              "stay), or --set output_dir=<a new directory>",
              f"  to train longer: --set training.max_steps=N with N > {intent.step} --continue "
              f"goes on from step {intent.step}"]
    return lines
