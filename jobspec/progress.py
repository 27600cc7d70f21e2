"""Progress output of the worker (rank 0 only): a tqdm bar, plain lines, or nothing.

The launcher picks the mode from `logging.progress` and whether its own stdout is a terminal,
and passes it as `JOBSPEC_PROGRESS` (bar | lines | none); ranks cannot see the terminal themselves
because the deepspeed runner pipes their output.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

MODES = ("bar", "lines", "none")


def progress_mode(environ=os.environ) -> str:
    mode = environ.get("JOBSPEC_PROGRESS", "lines").strip().lower()
    return mode if mode in MODES else "lines"


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:  # unknown, NaN, negative
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def format_line(step: int, total: int, metrics: dict, eta_s: float | None) -> str:
    """`step 20/100 loss 0.6931 lr 4.0e-05 12.3 samples/s eta 0:01:05` (missing values are skipped)."""
    parts = [f"step {step}/{total}"]
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.4f}")
    if "train/lr" in metrics:
        parts.append(f"lr {metrics['train/lr']:.1e}")
    if "perf/samples_per_s" in metrics:
        parts.append(f"{metrics['perf/samples_per_s']:.1f} samples/s")
    parts.append(f"eta {format_eta(eta_s)}")
    return " ".join(parts)


class Progress:
    """Reports optimizer steps; `update` is called at every step, `log` at every logging step."""

    def __init__(self, total_steps: int, start_step: int = 0, mode: str | None = None, stream=None):
        self.mode = mode or progress_mode()
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stdout
        self._t0 = time.monotonic()
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=self.stream)

    def eta_s(self, step: int) -> float | None:
        done = step - self.start_step  # steps restored from a checkpoint took no time in this run
        if done <= 0:
            return None
        return (time.monotonic() - self._t0) / done * (self.total - step)

    def update(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def log(self, step: int, metrics: dict) -> None:
        if self.mode == "lines":
            print(format_line(step, self.total, metrics, self.eta_s(step)), file=self.stream, flush=True)
        elif self._bar is not None:
            postfix = {}
            if "train/loss" in metrics:
                postfix["loss"] = f"{metrics['train/loss']:.4f}"
            if "perf/samples_per_s" in metrics:
                postfix["samples/s"] = f"{metrics['perf/samples_per_s']:.1f}"
            self._bar.set_postfix(postfix, refresh=False)
            self.update(step)

    def message(self, text: str) -> None:
        """A one-off line (eval, checkpoint) that does not break the bar."""
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class NullProgress(Progress):
    """What ranks other than 0 get: every call does nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(0, mode="none")
