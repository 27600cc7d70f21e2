"""What the worker does about a non-finite loss (`training.on_nan`), and the fault-injection hook
for tests.

Env: JOBSPEC_INJECT_NAN_AT_STEP=K makes the training loss NaN in (every micro-batch of) optimizer
step K, on every rank, so that both policies can be tested on a healthy model.

Why the check sits between the forward and the backward pass: a NaN that reaches `backward` ends up
in the gradients, the Adam moments and the weights, and a checkpoint saved after that would carry
it. Deciding before the backward keeps every rank's collectives in step (all ranks vote, all ranks
do the same thing) and leaves the last checkpoint as the newest good state.
"""
from __future__ import annotations

import math
import os
import sys

INJECT_ENV = "JOBSPEC_INJECT_NAN_AT_STEP"
SKIPPED_METRIC = "train/nan_skipped"


class NonFiniteLoss(RuntimeError):
    """The loss is NaN/inf and `training.on_nan` is `stop`."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step  # the first bad optimizer step, when this rank saw it


class NanGuard:
    """`skip`: per micro-batch, vote across ranks and neutralise a bad step. `stop`: nothing per
    micro-batch; the window's losses are checked where a log or a checkpoint records state."""

    def __init__(self, policy: str, vote, sink=None, rank: int = 0):
        self.policy = policy          # "stop" | "skip"
        # bool -> bool: true on every rank if true on one (a collective)
        self.vote = vote
        self.sink, self.rank = sink, rank
        self.inject_at = int(os.environ.get(INJECT_ENV) or 0)
        self.skipped = 0              # optimizer steps whose update was dropped
        self._step_is_bad = False     # a micro-batch of the current optimizer step was non-finite

    def inject(self, loss, step: int):
        """The model's loss, NaN in optimizer step `step` under JOBSPEC_INJECT_NAN_AT_STEP: applied
        where a real NaN would appear (straight after the forward), so the reported loss carries it
        too."""
        if self.inject_at and step == self.inject_at:
            import torch
            # a constant: the graph below stays finite
            return loss + torch.full_like(loss, float("nan"))
        return loss

    def check(self, loss, step: int):
        """The loss to back-propagate for micro-batch of optimizer step `step`, and whether it was
        bad."""
        import torch
        if self.policy == "stop":
            # Nothing per micro-batch (a host read would stall a GPU's kernel queue): the loop's
            # Window keeps every loss on the device, and the log step (StepReporter.log_window) or
            # confirm() before a checkpoint finds the first bad one.
            return loss, False
        bad = self.vote(not math.isfinite(float(loss.detach())))
        if not bad:
            return loss, False
        self._step_is_bad = True
        # Zero, finite, and still connected to the graph: the backward runs its usual collectives
        # (ZeRO's reduce hooks) but adds nothing to the gradients (nan_to_num's gradient is 0 at
        # NaN).
        return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0, True

    def confirm(self, window) -> None:
        """`stop` policy: raise if any rank saw a non-finite loss in `window` (the steps since the
        last log step, which checked the ones before). One vote; called on every rank before a
        checkpoint is saved, so no state that followed a NaN is ever written and the last checkpoint
        stays the newest good one."""
        if self.policy != "stop":
            return
        first = window.first_nonfinite_step()
        if self.vote(first != 0):
            raise self.failure(first)

    def failure(self, first: int) -> NonFiniteLoss:
        """The error for a non-finite loss first seen in optimizer step `first` (0: on another
        rank)."""
        where = f"at optimizer step {first}" if first else "on another rank"
        return NonFiniteLoss(f"training loss is not finite {where}; stopped without saving this "
                             "state (training.on_nan: stop). The last checkpoint is the newest "
                             "good one: lower training.optimizer.lr, check the data, or set "
                             "training.on_nan: skip to drop such steps", step=first or None)

    def step(self, engine, boundary: bool, step: int) -> None:
        """`engine.step()`; at the boundary of a bad optimizer step with learning rate 0 (no
        update)."""
        if not (boundary and self._step_is_bad):
            engine.step()
            return
        groups = engine.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group in groups:
            # the moments only decay; the weights (incl. weight decay) do not move
            group["lr"] = 0.0
        engine.step()
        if engine.lr_scheduler is None:  # with a scheduler, its step already set the next lr
            for group, lr in zip(groups, saved):
                group["lr"] = lr
        self._step_is_bad = False
        self.skipped += 1
        if self.rank == 0:
            print(f"WARNING: non-finite loss at optimizer step {step}: update skipped "
                  f"({self.skipped} so far, training.on_nan: skip)", file=sys.stderr, flush=True)
            if self.sink is not None:
                self.sink.log({SKIPPED_METRIC: self.skipped}, step=step)
