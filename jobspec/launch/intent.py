"""What a launch of a job would do with the checkpoints it finds: start fresh, resume at step K, or
nothing because the job is complete. `jobspec launch` stops before creating anything when the job is
complete (so the finished run's summary and MLflow run are never overwritten by an empty one), and
`--dry-run` says which of the three a launch would do.

Reads the checkpoint directory only (no torch). The layout is jobspec/checkpoint/save_load.py's:
`<dir>/latest` names the newest complete checkpoint `step<N>`, whose `jobspec_manifest.json` is
written last.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from jobspec import rundir
from jobspec.launch import ownership
from jobspec.spec.types import JobSpec

LATEST = "latest"                       # checkpoint/save_load.LATEST
MANIFEST = "jobspec_manifest.json"      # checkpoint/save_load.MANIFEST
STEP_TAG = re.compile(r"^step(\d+)$")   # checkpoint/save_load.tag_for


@dataclass(frozen=True)
class Intent:
    action: str                  # "fresh" | "resume" | "complete"
    total_steps: int | None      # None: unknown (compile_spec refuses such a job)
    step: int = 0                # the step training starts from
    checkpoint: Path | None = None

    def describe(self) -> str:
        """What a launch would do, as the end of "a launch would ..."."""
        if self.action == "complete":
            return (f"do nothing: the job is complete ({self.checkpoint} is at step {self.step} of "
                    f"{self.total_steps})")
        if self.action == "resume":
            return (f"resume from {self.checkpoint} at step {self.step} and train to step "
                    f"{self.total_steps}")
        return f"start fresh and train steps 1-{self.total_steps}"


def decide(spec: JobSpec, total_steps: int | None) -> Intent:
    """The intent of a launch of `spec` now (`checkpoint.resume`: auto, never, or a checkpoint
    path)."""
    resume, ckpt_dir = spec["checkpoint"]["resume"], Path(spec["checkpoint"]["dir"])
    if resume == "never":
        return Intent("fresh", total_steps)
    if resume == "auto":
        load_dir, tag = ckpt_dir, _read_latest(ckpt_dir)
    else:
        path = Path(resume)
        load_dir, tag = (path, _read_latest(path)) if _read_latest(path) \
            else (path.parent, path.name)
    match = STEP_TAG.match(tag or "")
    if match is None or tag is None:
        return Intent("fresh", total_steps)
    step, checkpoint = int(match.group(1)), load_dir / tag
    # a final checkpoint whose save did not complete is passed over by the ranks, which then train
    complete = total_steps is not None and step >= total_steps and (checkpoint / MANIFEST).is_file()
    action = "complete" if complete else "resume"
    return Intent(action, total_steps, step, checkpoint)


def _read_latest(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def writer_run_dir(ckpt_dir: str | Path) -> Path | None:
    """The run directory of the launch that last trained into `ckpt_dir` (its owner record says)."""
    owner = ownership.read_owner(Path(ckpt_dir)) if Path(ckpt_dir).is_dir() else None
    last = (owner or {}).get("last_run_dir")
    return Path(last) if last and Path(last).is_dir() else None


def complete_lines(spec: JobSpec, intent: Intent,
                   unfinished: list[tuple[Path, int, str]] | None = None) -> list[str]:
    """What `jobspec launch` says instead of launching a complete job: the run that wrote the
    checkpoint (not merely the newest run directory: a --from-run or --new-run child may be newer),
    and each unfinished checkpoint directory of the same spec `unfinished` names (directory, step,
    the command that resumes it)."""
    from jobspec.launch.console import mlflow_open

    ckpt_dir = spec["checkpoint"]["dir"]
    lines = [f"jobspec: {spec['name']} is already complete: checkpoint {intent.checkpoint} is at "
             f"step {intent.step} of {intent.total_steps}. Nothing was started; the finished run's "
             "results are unchanged."]
    writer = writer_run_dir(ckpt_dir)
    tracked = rundir.read_mlflow_run(writer) if writer else None
    if writer is not None:
        lines.append(f"  results     {writer}")
    if tracked:
        link = mlflow_open(tracked["tracking_uri"], tracked["experiment_id"], tracked["run_id"])
        lines.append(f"  MLflow      {link}")
    else:
        owner = ownership.read_owner(Path(ckpt_dir)) if Path(ckpt_dir).is_dir() else None
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
