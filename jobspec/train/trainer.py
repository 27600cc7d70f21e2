"""The rank's training: a `Trainer` that owns the DeepSpeed engine and runs the optimizer steps
(`train` / `train_step` / `forward_backward_step`), with the policies around them.

Every policy is always there (a do-nothing one when its section is off) and decides its own timing;
the loop asks each at its point:

- stop (train/stopping.StopVote): after every optimizer step but the last; a signal or
  JOBSPEC_STOP_AFTER_STEPS, agreed by every rank, ends the run after a checkpoint ("preempted").
- OOM (train/oom.OomGuard, `training.on_oom`): every micro-batch's forward and backward. `fail`
  turns an OOM into a RunFailure; `halve_micro_batch` votes, and after an agreed OOM the Trainer
  rebuilds its own engine with the split the guard gives, and the guard restores the last
  completed step into it.
- NaN (train/faults.NanGuard, `training.on_nan`): every micro-batch's loss and update (`skip`),
  each log step and each checkpoint (`stop`).
- logging (train/progress.StepReporter, `logging.every_n_steps`): `should_log(step, window,
  last_step=)`: every n-th step and the last (the run's, or a stop's), a window with a loss.
- evaluation (train/evaluation.Evaluator, `training.eval_every`): `should_run(step, last_step=)`:
  every n-th step and the last; the eval data's loss and metrics, then the generation policy's
  answers (train/generation, `training.eval_generate`).
- checkpoint (train/checkpointer.Checkpointer, `checkpoint`): `save(..., last_step=, stopping=)`
  saves when one is due, after the NaN policy's confirmation, followed by the exporter's
  checkpoint exports.
- export (export/exporter.ModelExporter, `export`): after each checkpoint and evaluation, and at the
  end of a finished run.

Per micro-batch the loop does only host-side bookkeeping (counts, the detached loss appended to the
window): what needs the device's values is read at log and checkpoint steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from jobspec import tasks
from jobspec.rundir import RunFiles
from jobspec.spec.derived import DerivedJob
from jobspec.train import sequence_parallel, token_loss
from jobspec.train.checkpointer import Checkpointer
from jobspec.train.engine import build_engine
from jobspec.train.evaluation import Evaluator
from jobspec.train.faults import NanGuard
from jobspec.train.oom import OomGuard, halved_run_files
from jobspec.train.progress import RunState, StepReporter, Window
from jobspec.train.startup import StartupClock
from jobspec.train.step_batches import StepBatches
from jobspec.train.stopping import StopVote

FINISHED, PREEMPTED = "finished", "preempted"   # how `Trainer.train` ends (summary.json's status)


@dataclass
class Policies:
    """What acts around the optimizer steps, each at its own time (module docstring)."""

    stop: StopVote
    oom: OomGuard
    nan: NanGuard
    reporter: StepReporter
    evaluator: Evaluator
    checkpointer: Checkpointer
    exporter: Any            # export/exporter.ModelExporter
    startup: StartupClock    # the launch's first step ends the start-up


class Trainer:
    """Optimizer steps on this rank's engine, which the Trainer owns (an OOM recovery rebuilds it).

    `files`: the run files the engine is rebuilt from (the compiled ones: a resharded first
    engine's config is not kept); `count_groups`: the process groups a step's labelled tokens are
    summed over (the worker's gloo control group: the count never syncs a GPU); `pending_rng`: this
    rank's random state of the checkpoint it resumed from, restored once its loader has started."""

    def __init__(self, engine, files: RunFiles, job: DerivedJob, train_ds, state: RunState,
                 policies: Policies, *, progress, count_groups: tuple = (),
                 pending_rng: dict | None = None, build: Callable = build_engine):
        if job.total_steps is None:   # rundir.read_run_files refuses such a launch.json
            raise ValueError("the derived job has no total_steps")
        self.files, self.job, self.train_ds, self.state = files, job, train_ds, state
        self.policies, self.progress = policies, progress
        self.count_groups, self.build = count_groups, build
        self.total_steps: int = job.total_steps
        self.task = tasks.of(files.spec)
        self.window = Window()
        # memory.sequence_parallel: a group's N ranks load the same micro-batches
        self.sp = sequence_parallel.active()
        self.stream: StepBatches | None = None
        self._pending_rng = pending_rng
        self._engine = None
        self.engine = engine

    @property
    def engine(self):
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        # the step reporter reads the device, the rate and the gradient norm of the same engine
        self._engine = engine
        self.policies.reporter.engine = engine

    # --- the steps ------------------------------------------------------------------------------

    def train(self) -> str:
        """Optimizer steps until `derived.total_steps` (FINISHED) or an agreed stop (PREEMPTED);
        then the launch's throughput (StepReporter.finish) and, when finished, the final export
        (after the final checkpoint: a failed export loses no training)."""
        try:
            status = self._steps()
        finally:
            self.policies.stop.close()   # the vote in flight (every rank's), before the group goes
        self.policies.reporter.finish(self.state.step)
        if status == FINISHED:
            self.policies.exporter.final(self.engine, self.state)
        return status

    def _steps(self) -> str:
        self.engine.train()
        first_step = self.state.step + 1   # its end is the start-up's end (train/startup.py)
        self.stream = self._step_batches(self._pending_rng)
        while self.state.step < self.total_steps:
            if not self.train_step():
                self._rebuild_after_oom()
                continue
            self.state.step += 1
            self.window.steps += 1
            if self.state.step == first_step:
                self.policies.startup.first_step(self.state.step)
                # throughput counts from here (docs/architecture.md, "Throughput")
                if self.state.step < self.total_steps:
                    self.window.start_timing()
            self.progress.update(self.state.step)
            status = self._after_step()
            if status is not None:
                return status
        return FINISHED  # resumed from a checkpoint of the last step: nothing left to do

    def train_step(self) -> bool:
        """One optimizer step. Its micro-batches are taken first and their labelled tokens counted
        over every rank: each micro-batch's summed loss is back-propagated over that count of the
        whole global batch (jobspec.train.token_loss). False when some rank ran out of memory:
        nothing was applied, and every rank redoes the step once the engine is rebuilt."""
        engine, step = self.engine, self.state.step + 1
        self.policies.oom.mark(self.state, self.window)   # where the step began, to redo it
        assert self.stream is not None   # made by `train` before the first step
        micro_batches = self.stream.take(engine.gradient_accumulation_steps())
        parts = [token_loss.loss_inputs(self.task, self.sp, micro.batch) for micro in micro_batches]
        local_tokens = sum(token_loss.labelled_count(self.task, labels, shift)
                           for _, labels, shift in parts)
        step_tokens = token_loss.global_count(local_tokens, self.count_groups)
        # DeepSpeed averages the gradients over the data-parallel ranks: under Ulysses world / N
        # (its engine.dp_world_size is None then; the N ranks of a group are summed)
        averaged_over = engine.dp_world_size if self.sp is None else self.sp.averaged_over(engine)
        scale = token_loss.backward_scale(step_tokens, averaged_over)
        for micro, part in zip(micro_batches, parts):
            if not self.forward_backward_step(micro, part, step, step_tokens, scale):
                return False
        return True

    def forward_backward_step(self, micro, part: tuple, step: int, step_tokens: int,
                              scale: float) -> bool:
        """One micro-batch of optimizer step `step`: its forward, the NaN policy's check, its
        backward and `engine.step()` (the update at the accumulation boundary). `part`: its
        (inputs, labels, shift). False when some rank ran out of memory (OomGuard)."""
        engine, window, nan, oom = self.engine, self.window, self.policies.nan, self.policies.oom
        inputs, labels, shift = part
        if self.sp is None or self.sp.counts_data:   # a sequence-parallel group counts once
            window.tokens += self.policies.reporter.count_tokens(micro.batch)  # no device sync
            window.samples += int(micro.batch["input_ids"].shape[0])
        inputs = {k: v.to(engine.device, non_blocking=True) for k, v in inputs.items()}
        labels = labels.to(engine.device, non_blocking=True)
        boundary = engine.is_gradient_accumulation_boundary()  # ask before step() advances it
        if boundary:   # the rate this step runs at (step() moves the schedule on)
            window.lr = float(engine.get_lr()[0])
        summed = partial(token_loss.summed_loss, self.task, labels=labels, shift=shift)
        loss = oom.forward(engine, inputs, step, summed)
        if loss is None:
            return False   # out of memory on some rank
        loss = nan.inject(loss, step)   # a test's injected NaN, where a real one would come from
        reported = loss.detach() / step_tokens if step_tokens else loss.detach() * 0.0
        loss, nonfinite = nan.check(loss * scale, step)
        if not oom.backward(engine, loss, step):
            return False   # as above
        nan.step(engine, boundary, step)
        self.state.epoch, self.state.batches_in_epoch = micro.epoch, micro.batches_in_epoch
        if not nonfinite:  # a skipped micro-batch has no loss to report
            window.add_loss(reported, step)   # its share of the step's token mean
        return True

    # --- after a step: the policies' turns ------------------------------------------------------

    def _after_step(self) -> str | None:
        """Logging, evaluation, the stop vote and the checkpoint, each when it says; how the run
        ended, or None to go on."""
        step, last = self.state.step, self.state.step >= self.total_steps
        self._log(step, last_step=last)   # where training.on_nan: stop finds a non-finite loss too
        if self.policies.evaluator.should_run(step, last_step=last):
            with self.window.paused():
                self.policies.evaluator.run(self.engine, self.state, self._loader_args())
        checkpointer = self.policies.checkpointer
        if last:
            checkpointer.save(self.engine, self.state, self.window, last_step=True)
            return FINISHED
        if self.policies.stop(step):
            self._log(step, last_step=True)
            checkpointer.save(self.engine, self.state, self.window, stopping=True)
            return PREEMPTED
        with self.window.paused():
            checkpointer.save(self.engine, self.state, self.window)
        return None

    def _log(self, step: int, *, last_step: bool) -> None:
        reporter = self.policies.reporter
        if reporter.should_log(step, self.window, last_step=last_step):
            self.window = reporter.log_window(step, self.window, self.policies.nan, final=last_step)

    # --- the engine and the data ----------------------------------------------------------------

    def _rebuild_after_oom(self) -> None:
        """Every rank, after an agreed OOM: the last completed step saved and the engine released
        (OomGuard.save_and_release), the engine rebuilt here at half the micro-batch and twice the
        accumulation (its datasets too: the same content, unused), that state restored into it,
        and the data rewound to where the interrupted step began."""
        oom = self.policies.oom
        saved = oom.save_and_release(self.engine, self.state)
        self.engine = None   # the old engine's last reference (the reporter's too): freed first
        micro, accumulation = oom.next_split()
        self.files = halved_run_files(self.files, micro, accumulation)
        self.job = dataclasses.replace(self.job, micro_batch_size=micro,
                                       gradient_accumulation_steps=accumulation)
        engine, _, _, _ = self.build(self.files)
        self.window = oom.restore(engine, saved, self.state)
        self.engine = engine
        self.sp = sequence_parallel.active()   # registered again by the rebuilt engine
        self.stream = self._step_batches(None)

    def _loader_args(self) -> dict[str, Any]:
        """make_loader's keywords at the run's current split (an OOM recovery halves the
        micro-batch)."""
        import torch.distributed as dist
        training, data, sp = self.files.spec["training"], self.files.spec["data"], self.sp
        return dict(micro_batch_size=self.job.micro_batch_size,
                    rank=sp.data_rank if sp else dist.get_rank(),
                    world_size=sp.data_world if sp else dist.get_world_size(),
                    seed=training["seed"], num_workers=data["num_workers"],
                    pin_memory=data["pin_memory"])

    def _step_batches(self, rng: dict | None) -> StepBatches:
        """This rank's micro-batches from the run's data position (after an OOM: rewound); an
        epoch is whole global batches of the shuffled order, the same samples on every split.
        `rng`: restored after the loader's iter() (checkpoint/save_load.rng_state_of_this_rank)."""
        from jobspec.checkpoint import save_load
        from jobspec.data.loaders import make_loader
        args, shuffle = self._loader_args(), self.files.spec["data"]["shuffle"]
        global_batch = self.job.global_batch_size

        def loader(epoch: int, skip: int):
            return make_loader(self.train_ds, epoch=epoch, shuffle=shuffle, skip_batches=skip,
                               **args, global_batch_size=global_batch)
        restore = None if rng is None else partial(save_load.restore_rng_state, rng)
        return StepBatches(loader, self.state.epoch, self.state.batches_in_epoch,
                           after_first_iter=restore)
