"""The `checkpoint` section on the ranks: when a checkpoint is due, and its save.

`Checkpointer.save(engine, state, window, last_step=, stopping=)` saves when one is due: every
`checkpoint.every_n_steps` steps, at the last step with `save_final` (or when it falls on the
period), and at an agreed stop always (the run then resumes from it: exit 75). Before a save the NaN
policy confirms that no rank saw a non-finite loss since the last log step (`training.on_nan: stop`:
the last checkpoint stays the newest good state); after it, the exporter copies the spec and label
names beside it and makes its checkpoint exports. A save is collective (checkpoint/save_load.save).
"""
from __future__ import annotations

from typing import Callable

from jobspec.spec.derived import DerivedJob
from jobspec.spec.types import JobSpecCheckpoint


class Checkpointer:
    """Saves this rank's part of a checkpoint when the section says one is due (module doc)."""

    def __init__(self, section: JobSpecCheckpoint, job: DerivedJob, *, job_name: str,
                 zero_stage: int, nan, exporter, progress,
                 in_compiled_units: Callable[[int], int]):
        self.section, self.dir = section, section["dir"]
        self.job_name, self.zero_stage = job_name, zero_stage
        # the data position is counted in micro-batches of the compiled size (what a resume starts
        # from), whatever split an OOM recovery runs at (OomGuard.batches_in_compiled_units)
        self.compiled_micro, self.sequence_parallel = job.micro_batch_size, job.sequence_parallel
        self.in_compiled_units = in_compiled_units
        self.nan, self.exporter, self.progress = nan, exporter, progress

    def due(self, step: int, *, last_step: bool = False, stopping: bool = False) -> bool:
        every = self.section["every_n_steps"]
        periodic = step % every == 0 if every else False
        if last_step:
            return self.section["save_final"] or periodic
        return stopping or periodic

    def save(self, engine, state, window, *, last_step: bool = False,
             stopping: bool = False) -> bool:
        """A checkpoint of `state.step` when one is due (`due`); whether it was saved."""
        if not self.due(state.step, last_step=last_step, stopping=stopping):
            return False
        from jobspec.checkpoint import save_load
        self.nan.confirm(window)  # never save a state that followed a non-finite loss
        state.last_checkpoint = save_load.save(
            engine, self.dir, step=state.step, epoch=state.epoch,
            batches_in_epoch=self.in_compiled_units(state.batches_in_epoch), job_name=self.job_name,
            keep_last=self.section["keep_last"], zero_stage=self.zero_stage,
            micro_batch_size=self.compiled_micro, sequence_parallel=self.sequence_parallel)
        self.progress.message(f"checkpoint {state.last_checkpoint} saved to {self.dir}")
        self.exporter.after_checkpoint(engine, state, self.dir)
        return True
