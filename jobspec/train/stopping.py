"""When the ranks stop early: a signal (Slurm's warning, a preemption, a user's Ctrl-C, `scancel`, a
closed terminal) or JOBSPEC_STOP_AFTER_STEPS.

Every stop signal is only a flag on the ranks: SIGUSR1 (Slurm's time-limit warning), SIGTERM (the
launcher's forward, DeepSpeed's launch.py, `scancel`, `docker stop`), SIGINT (a terminal's Ctrl-C
or `kill -INT` to the job's process group) and SIGHUP (a dropped ssh session). Python's default for
SIGINT would raise KeyboardInterrupt wherever the rank happens to be (a traceback, no checkpoint),
and SIGHUP's would end it silently; a flag lets the step finish and the checkpoint be written. The
flag's handler is inherited by DataLoader workers forked after it is installed, so a signal to every
process of the job does not kill them mid-batch either. A second signal changes nothing here: the
launcher decides whether to wait for the checkpoint or end the job at once (a second Ctrl-C).

All ranks must stop after the same optimizer step, so a signal that reached one rank has to be
agreed on. A blocking vote at every step would make every step wait for the slowest rank's host
and cost a collective's round trip each time; `StopVote` instead pipelines it: at step n each rank
starts an asynchronous all-reduce (MAX, over the gloo control group) of its flag, and reads the
result at step n+1, long after it completed. Every rank reads the same result at the same step,
so they stop together, one step after the first rank was signalled. One rank needs no vote at all;
JOBSPEC_STOP_AFTER_STEPS is the same on every rank and needs none either.
"""
from __future__ import annotations

import os
import signal
from typing import Any

STOP_AFTER_ENV = "JOBSPEC_STOP_AFTER_STEPS"


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopFlag:
    """Set by any of STOP_SIGNALS; acted on at a step boundary. `signum`: the first one received."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        # Only a flag, also on repeats: a SIGTERM to the job's process group reaches a rank twice
        # (directly and from DeepSpeed's launch.py); the launcher escalates to SIGKILL itself.
        self.requested = True
        if self.signum is None:
            self.signum = signum


class StopVote:
    """`vote(step)` after each optimizer step: True on every rank at the same step once any rank
    must stop."""

    def __init__(self, flag: StopFlag, group=None, world_size: int = 1, environ=os.environ):
        self.flag, self.group, self.world_size = flag, group, world_size
        self.stop_after = int(environ.get(STOP_AFTER_ENV) or 0)
        self._buffers: tuple[Any, Any] | None = None   # two torch tensors, made at the first vote
        self._slot = 0
        self._pending = None      # the all-reduce started at the previous step

    def __call__(self, step: int) -> bool:
        if self.stop_after and step >= self.stop_after:
            return True
        if self.world_size == 1:
            return self.flag.requested
        import torch
        import torch.distributed as dist
        if self._buffers is None:  # two: one in flight while the other is read
            self._buffers = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = bool(self._buffers[self._slot ^ 1][0])
        if agreed:
            self._pending = None
            return True
        buffer = self._buffers[self._slot]
        buffer[0] = 1 if self.flag.requested else 0
        self._pending = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)
        self._slot ^= 1
        return False

    def close(self) -> None:
        """Wait for the vote in flight (every rank started it), before the process group goes."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
