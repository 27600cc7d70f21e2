"""Out-of-memory policy of the worker (`training.on_oom`): fail with a clear reason, or halve the
micro-batch and redo the interrupted optimizer step.

`halve_micro_batch`: every rank votes after each micro-batch's forward and again after its backward
(an all-reduce MAX of an OOM flag over the gloo control group), so a rank that ran out of memory
never leaves the others waiting in a collective it skipped. When any rank voted OOM, all ranks:

1. save weights, optimizer and LR-scheduler state of the last completed optimizer step (the
   interrupted step's partial gradients are dropped: no update was applied yet) to
   `<run_dir>/.oom-recovery/`, and release the engine;
2. the Trainer (jobspec.train.trainer) rebuilds its engine with micro-batch / 2 and accumulation x 2
   (`next_split`: global batch, schedule and step count unchanged), and `restore` loads that state;
3. rewind the data to where the step began and redo it from its first micro-batch: the same samples,
   re-split into halves (the sampler's order depends only on seed and epoch).

Two 1-element host all-reduces per micro-batch are the price (about 0.1 ms each on one node); the
default policy `fail` pays nothing. An OOM inside the optimizer update (`engine.step()` at the
accumulation boundary) is not retried: the update may be partly applied, and its memory (fp32
gradient copy, optimizer states) does not depend on the micro-batch anyway.

Limits: an OOM on one rank only, in a phase where the others are inside a collective (ZeRO-3's
forward all-gathers, the gradient reduction in the boundary micro-batch's backward), cannot be
voted on; the launcher's watchdog then ends the job as failed.

Test hooks (documented in docs/memory-planner.md): `JOBSPEC_INJECT_OOM_AT_STEP=K` raises
`torch.OutOfMemoryError` in the forward of optimizer step K's last micro-batch, once;
`JOBSPEC_INJECT_OOM_RANK=R` limits it to rank R (the others must agree through the vote).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
import shutil
from pathlib import Path
from typing import Any

from jobspec import rundir
from jobspec.compile.compiler import rebatched
from jobspec.errors import RunFailure, first_line
from jobspec.spec.derived import DerivedJob
from jobspec.spec.types import JobSpecTraining
from jobspec.train.metrics import any_rank

INJECT_AT_STEP_ENV = "JOBSPEC_INJECT_OOM_AT_STEP"
INJECT_RANK_ENV = "JOBSPEC_INJECT_OOM_RANK"
RECOVERY_TAG = "last-completed-step"
POLICIES = ("fail", "halve_micro_batch")


class OomGuard:
    """Runs one micro-batch under the OOM policy (`training.on_oom`; `fail` votes on nothing and
    turns an OOM into a RunFailure); after an agreed OOM, saves the last completed step and
    restores it into the engine the Trainer rebuilds with the split `next_split` gives."""

    def __init__(self, training: JobSpecTraining, job: DerivedJob, *, run_dir: Path, rank: int,
                 group, progress, sink, environ=os.environ):
        self.policy = training["on_oom"]
        self.run_dir = Path(run_dir)
        self.rank, self.control = rank, group
        self.progress, self.sink = progress, sink
        self.compiled_micro = job.micro_batch_size
        self.micro = self.compiled_micro
        self.accumulation = job.gradient_accumulation_steps
        self._split_before: tuple[int, int] = (self.micro, self.accumulation)
        self.events = 0
        self.inject_at = int(environ.get(INJECT_AT_STEP_ENV) or 0)
        inject_rank = environ.get(INJECT_RANK_ENV)
        self.inject_rank = int(inject_rank) if inject_rank not in (None, "") else None
        self._injected = False
        self._marked_step: int | None = None
        # (epoch, batches_in_epoch, window) where the current step began
        self._step_start: tuple[int, int, Any] | None = None
        # why the current step must be redone (an agreed OOM), or None
        self.pending: str | None = None

    # --- the training loop's calls ----------------------------------------------------------------

    def mark(self, state, window) -> None:
        """Remember where an optimizer step begins (call before its micro-batch is counted)."""
        if self.policy == "halve_micro_batch" and self._marked_step != state.step:
            self._marked_step = state.step
            self._step_start = (state.epoch, state.batches_in_epoch, dataclasses.replace(window))

    def forward(self, engine, batch, step: int, loss_of):
        """The loss of one micro-batch of optimizer step `step`, or None when some rank ran out of
        memory (then every rank gets None and must call `save_and_release` and `rebuild`)."""
        import torch
        oom = None
        try:
            self._maybe_inject(step, engine.is_gradient_accumulation_boundary())
            loss = loss_of(engine(**batch))
        except torch.OutOfMemoryError as err:
            if self.policy != "halve_micro_batch":
                raise self._failure(step, "forward", err, "training.on_oom is 'fail'") from None
            oom, loss = f"forward: {first_line(err)}", None
        if self.policy == "halve_micro_batch" and any_rank(oom is not None, self.control):
            self.pending = oom or "forward: out of memory on another rank"
            return None
        return loss

    def backward(self, engine, loss, step: int) -> bool:
        """jobspec.train.token_loss.backward(engine, loss); False when some rank ran out of memory
        (as `forward`'s None)."""
        import torch

        from jobspec.train import token_loss
        oom = None
        try:
            token_loss.backward(engine, loss)
        except torch.OutOfMemoryError as err:
            if self.policy != "halve_micro_batch":
                raise self._failure(step, "backward", err, "training.on_oom is 'fail'") from None
            oom = f"backward: {first_line(err)}"
        if self.policy == "halve_micro_batch" and any_rank(oom is not None, self.control):
            self.pending = oom or "backward: out of memory on another rank"
            return False
        return True

    def batches_in_compiled_units(self, batches_in_epoch: int) -> int:
        """Checkpoints count micro-batches of the compiled size, so a resumed run (which starts from
        the spec's micro-batch) skips the right number of samples."""
        return batches_in_epoch * self.micro // self.compiled_micro

    def save_and_release(self, engine, state):
        """Every rank: the state of the last completed optimizer step on disk; the engine released.
        Returns what `rebuild` needs. Raises a clear error when the micro-batch cannot be halved."""
        step = state.step + 1
        if self.micro == 1:
            raise self._failure(step, self.pending, None,
                                "the micro-batch is already 1 and cannot be halved")
        from jobspec.checkpoint import save_load
        rng = save_load.capture_rng_state()
        save_dir = self.run_dir / rundir.OOM_RECOVERY
        engine.zero_grad()   # the interrupted step's partial gradients are not part of the state
        engine.save_checkpoint(str(save_dir), tag=RECOVERY_TAG, client_state={}, save_latest=False)
        _barrier()
        engine.destroy()
        return {"dir": save_dir, "rng": rng, "step": step}

    def next_split(self) -> tuple[int, int]:
        """Every rank, once the old engine's last references are gone: its memory returned, and
        the (micro-batch, accumulation) the engine is rebuilt with: half and twice (the global
        batch as compiled)."""
        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._split_before = (self.micro, self.accumulation)
        self.micro, self.accumulation = self.micro // 2, self.accumulation * 2
        return self.micro, self.accumulation

    def restore(self, engine, saved: dict, state):
        """Every rank: the saved state loaded into the rebuilt `engine`, the data position rewound
        to where the interrupted step began. Returns the window as it was at that step's start."""
        from jobspec.checkpoint import save_load
        save_load.load(engine, str(saved["dir"]), RECOVERY_TAG)
        engine.train()
        # build_engine re-seeded: keep the run's stream
        save_load.restore_rng_state(saved["rng"])
        _barrier()
        if self.rank == 0:
            shutil.rmtree(saved["dir"], ignore_errors=True)
        if self._step_start is None:
            # mark() runs before every step's forward
            raise RuntimeError("redo without a marked step")
        epoch, batches, window = self._step_start
        window.rewind()  # the copy shares the loss list: drop the interrupted step's losses
        # counted in halved micro-batches now
        state.epoch, state.batches_in_epoch = epoch, batches * 2
        self.events += 1
        (old_micro, old_accumulation), step = self._split_before, saved["step"]
        self.progress.message(
            f"out of memory in step {step} ({self.pending}): micro-batch {old_micro} -> "
            f"{self.micro}, gradient accumulation {old_accumulation} -> {self.accumulation}; "
            f"redoing step {step}")
        if self.sink is not None:
            self.sink.log({"oom/micro_batch_size": self.micro,
                           "oom/gradient_accumulation_steps": self.accumulation,
                           "oom/events": self.events}, step=step)
        self.pending, self._marked_step = None, None
        return window

    # --- helpers --------------------------------------------------------------------------------

    def _maybe_inject(self, step: int, last_micro: bool) -> None:
        if (self.inject_at and step == self.inject_at and last_micro and not self._injected
                and self.inject_rank in (None, self.rank)):
            import torch
            self._injected = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected by "
                                         f"{INJECT_AT_STEP_ENV}={self.inject_at})")

    def _failure(self, step: int, where: str | None, err, why: str) -> RunFailure:
        detail = f": {first_line(err)}" if err is not None else ""
        return RunFailure(
            f"out of memory in optimizer step {step} ({where}{detail}) with micro-batch "
            f"{self.micro}; {why}; run `jobspec plan JOB --fit` for settings that fit "
            "(checkpointing, ZeRO stage, offload), or set training.on_oom: halve_micro_batch")


def halved_run_files(files, micro: int, accumulation: int):
    """The run files with the new batch split; the global batch stays as compiled."""
    spec = copy.deepcopy(files.spec)
    spec["training"]["micro_batch_size"] = micro
    # the compiler writes DeepSpeed's batch keys
    ds_config = rebatched(files.ds_config, micro, accumulation)
    launch = copy.deepcopy(files.launch)
    launch["derived"].update(micro_batch_size=micro, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(files, spec=spec, ds_config=ds_config, launch=launch)


def _barrier() -> None:
    import torch.distributed as dist
    dist.barrier()
