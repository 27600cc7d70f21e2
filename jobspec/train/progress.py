"""What a training run reports: step metrics (the shared metric names), the console progress
(rank 0: a tqdm bar, plain lines, or nothing), and the content of `summary.json`.

The launcher picks the console mode from `logging.progress` and whether its own stdout is a
terminal, and passes it as `JOBSPEC_PROGRESS` (bar | lines | none); ranks cannot see the terminal
themselves because the deepspeed runner pipes their output.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field

from jobspec.rundir import RunSummary
from jobspec.spec.derived import DerivedJob
from jobspec.spec.types import JobSpecLogging

MODES = ("bar", "lines", "none")


def progress_mode(environ=os.environ) -> str:
    mode = environ.get("JOBSPEC_PROGRESS", "lines").strip().lower()
    return mode if mode in MODES else "lines"


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:  # unknown, NaN, negative
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def format_line(step: int, total: int, metrics: dict, eta_s: float | None) -> str:
    """`step 20/100 loss 0.6931 lr 4.0e-05 12.3 samples/s eta 0:01:05` (missing values are
    skipped)."""
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
        self._postfix: dict = {}
        self._rate: float | None = None
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
        # perf/* come at most once per logging.perf_window_s: a line between them shows the last
        # rate
        if "perf/samples_per_s" in metrics:
            self._rate = metrics["perf/samples_per_s"]
        elif self._rate is not None:
            metrics = {**metrics, "perf/samples_per_s": self._rate}
        if self.mode == "lines":
            self.stream.write(format_line(step, self.total, metrics, self.eta_s(step)) + "\n")
            self.stream.flush()
        elif self._bar is not None:
            if "train/loss" in metrics:
                self._postfix["loss"] = f"{metrics['train/loss']:.4f}"
            if "perf/samples_per_s" in metrics:
                self._postfix["samples/s"] = f"{metrics['perf/samples_per_s']:.1f}"
            self._bar.set_postfix(self._postfix, refresh=False)
            self.update(step)

    def eval(self, step: int, loss: float) -> None:
        """An eval result: its own line, or in the bar's postfix (lines between bar updates break it
        up)."""
        if self._bar is not None:
            self._postfix["eval"] = f"{loss:.4f}"
            self._bar.set_postfix(self._postfix)
        else:
            self.message(f"step {step} eval/loss {loss:.4f}")

    def message(self, text: str) -> None:
        """A one-off line (eval, checkpoint) that does not break the bar."""
        if self.mode == "none":
            return
        if self._bar is not None and self._bar.n >= self.total:
            # training is done: lines after it (final checkpoint, export) go below the bar
            self.close()
        # one write of the whole line: another process's output (the other ranks, a library's log
        # on stderr) shares the terminal, and print() or tqdm's write put the newline apart
        if self._bar is not None:
            self._bar.write(text + "\n", file=self.stream, end="")
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class NullProgress(Progress):
    """What ranks other than 0 get: every call does nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(0, mode="none")


@dataclass
class Window:
    """What happened since the last log step. Per micro-batch it only appends the detached loss (on
    the device) and its step: no kernel and no sync; the log step reduces them all at once."""

    micro_batches: int = 0
    samples: int = 0
    tokens: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    # one 0-d tensor per counted micro-batch: its summed loss over its step's labelled tokens (all
    # ranks'), so the sum over the micro-batches and ranks of a step is the step's token-weighted
    # loss
    losses: list = field(default_factory=list)
    loss_steps: list = field(default_factory=list)   # the optimizer step of each
    # the learning rate the window's last step ran at (read before its update)
    lr: float | None = None
    # what happened before start_timing(): the launch's first step, start-up, not training time
    untimed_steps: int = 0
    untimed_samples: int = 0
    untimed_tokens: int = 0

    def start_timing(self) -> None:
        """The launch's first optimizer step just ended (start-up ends there: allocation, lazy
        initialisation, JIT): the rates count from now; its samples still count as trained."""
        self.started = time.perf_counter()
        self.untimed_steps = self.steps
        self.untimed_samples, self.untimed_tokens = self.samples, self.tokens

    def add_loss(self, loss, step: int = 0) -> None:
        self.micro_batches += 1
        self.losses.append(loss.detach())
        self.loss_steps.append(step)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is left out of the window's rates: evaluation, checkpoint saves and
        exports are not training steps, and would otherwise show as a throughput dip."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - began

    def rewind(self) -> "Window":
        """Back to this window's counts after a copy of it (dataclasses.replace shares the lists)
        went on: jobspec.train.oom keeps such a copy from the start of each optimizer step."""
        del self.losses[self.micro_batches:], self.loss_steps[self.micro_batches:]
        return self

    def first_nonfinite_step(self) -> int:
        """The first optimizer step with a non-finite loss in this window, 0 if none (reads the
        device)."""
        import torch
        if not self.losses:
            return 0
        bad = (~torch.isfinite(torch.stack(self.losses))).nonzero()
        return self.loss_steps[int(bad[0])] if len(bad) else 0


@dataclass
class PerfWindow:
    """Log windows since the last perf/* and mem/* point: their time, counts (every rank's) and the
    memory maxima (each window's maximum over ranks; the allocator's peaks are reset per window)."""

    steps: int = 0
    samples: float = 0
    tokens: float = 0
    elapsed: float = 0.0
    memory: dict = field(default_factory=dict)

    def add(self, window: Window, samples: float, tokens: float, memory: dict) -> "PerfWindow":
        """`samples`, `tokens`: every rank's, timed ones only (Window.start_timing)."""
        self.steps += window.steps - window.untimed_steps
        self.samples += samples
        self.tokens += tokens
        # windows follow each other: no gap lost
        self.elapsed += time.perf_counter() - window.started
        for name, value in memory.items():
            self.memory[name] = max(value, self.memory.get(name, value))
        return self


@dataclass
class RunState:
    """Where the run is (checkpointed) and what it has measured so far (for summary.json)."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples: int = 0                 # global samples trained in this run (not before a resume)
    last_loss: float | None = None
    eval_loss: float | None = None
    # the last evaluation's task metrics: accuracy, f1, ...
    eval_metrics: dict = field(default_factory=dict)
    samples_per_s: list = field(default_factory=list)
    # tokens_per_s, tflops_per_device, mfu: one value per window
    rates: dict = field(default_factory=dict)
    # the launch's training time and what it trained in it (docs/architecture.md, "Throughput"):
    # summed over the perf windows, so the first step, evaluation and checkpoints are left out
    train_time_s: float = 0.0
    train_samples: float = 0.0
    train_tokens: float = 0.0
    # perf/run_*: the launch's averages, for summary.json
    run_perf: dict = field(default_factory=dict)
    peak_memory: dict = field(default_factory=dict)
    resumed_from: str | None = None
    last_checkpoint: str | None = None
    # model directories written (jobspec/export/exporter.py)
    exports: dict = field(default_factory=dict)
    # {"trainable", "total"} (model/lora.parameter_counts)
    parameters: dict = field(default_factory=dict)
    # the tokenised data's counts (data/loaders.data_params), for summary.json
    data: dict | None = None
    generation: dict | None = None   # the last evaluation's first answer (train/generation.py)
    startup: dict = field(default_factory=dict)   # the start-up's phases so far (train/startup)


class StepReporter:
    """The logging policy: turns windows of steps into the shared metric names at the steps
    `should_log` picks; collectives run on every rank. `engine`: the Trainer's (it sets it again
    when an OOM recovery rebuilds it)."""

    def __init__(self, engine, logging: JobSpecLogging, derived: DerivedJob, sink, progress, rank,
                 state: RunState):
        from jobspec import hardware
        from jobspec.train import metrics
        self.engine, self.sink, self.progress = engine, sink, progress
        self.rank, self.state = rank, state
        self.metrics = metrics
        self.world = derived.world_size
        self.count_tokens = metrics.count_tokens
        # From the derived job in launch.json: TFLOP/s counts the work the device did (checkpoint
        # recompute included); MFU counts the model's FLOPs only (PaLM's definition)
        self.model_flops_per_token = derived.model_flops_per_token
        self.hardware_flops_per_token = derived.hardware_flops_per_token
        self.peak_flops = metrics.peak_flops(hardware.cuda_device_name(), derived.precision)
        self._rss = metrics.RssReader()  # made once: the RSS reading is per log step
        self.perf_window_s = logging["perf_window_s"]
        self.every_n_steps = logging["every_n_steps"]
        self._perf = PerfWindow()

    def should_log(self, step: int, window: Window, *, last_step: bool) -> bool:
        """Whether `window` is logged at `step`: every `logging.every_n_steps` steps and at the last
        step (the run's, or before a stop's checkpoint), when it holds a loss (the steps
        `training.on_nan: skip` dropped have none)."""
        return bool(window.micro_batches) and (last_step or step % self.every_n_steps == 0)

    def log_window(self, step: int, window: Window, nan_guard=None, final: bool = False) -> Window:
        """Log the window's metrics (rank 0); returns the next, empty window. Every rank calls it:
        one collective gathers every rank's loss sum, counts and memory readings (the one sync point
        of the window; none on one rank). With `nan_guard` (policy `stop`), a non-finite loss on any
        rank (the sums are then non-finite) raises NonFiniteLoss here, before anything is logged.
        perf/* and mem/* cover `logging.perf_window_s` at least; `final` logs what they have."""
        import torch
        device = self.engine.device
        local_loss = torch.stack(window.losses).float().sum()  # non-finite if any loss was
        snapshot = self.metrics.memory_snapshot(device, self._rss)
        keys = sorted(snapshot)
        host = [window.micro_batches, window.samples, window.tokens, *(snapshot[k] for k in keys),
                window.untimed_samples, window.untimed_tokens]
        if self.world == 1:
            ranks = [[float(local_loss), *host]]
        else:
            ranks = self.metrics.gather_rows(torch.cat([local_loss.double().reshape(1),
                                                        torch.tensor(
                host, dtype=torch.float64).to(local_loss.device, non_blocking=True)]))
        self.metrics.reset_peaks(device)  # the next window reports its own peak
        loss_sum, micro_batches, samples, tokens = (sum(r[i] for r in ranks) for i in range(4))
        if not math.isfinite(loss_sum) and nan_guard is not None and nan_guard.policy == "stop":
            raise nan_guard.failure(window.first_nonfinite_step())  # 0 where another rank had it
        # the mean over the window's steps of each step's token-weighted loss
        # (jobspec.train.token_loss); the rate the last step used (get_lr() after the update is the
        # next step's)
        lr = window.lr if window.lr is not None else float(self.engine.get_lr()[0])
        out: dict[str, float] = {"train/loss": loss_sum / max(window.steps, 1), "train/lr": lr}
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            out["train/grad_norm"] = float(grad_norm)
        memory = {f"mem/{k}_max": max(r[4 + i] for r in ranks) for i, k in enumerate(keys)}
        memory.update({f"mem/{k}_rank0": float(snapshot[k])
                       for k in ("peak_allocated_mib", "peak_reserved_mib")
                       if k in snapshot})
        for name, value in memory.items():
            self.state.peak_memory[name] = max(value, self.state.peak_memory.get(name, value))
        untimed_samples, untimed_tokens = (sum(r[-2 + i] for r in ranks) for i in range(2))
        perf = self._perf.add(window, samples - untimed_samples, tokens - untimed_tokens, memory)
        if (final or perf.elapsed >= self.perf_window_s) and perf.steps:
            out.update(self._perf_metrics(perf))
            self._perf = PerfWindow()
        self.state.last_loss = out["train/loss"]
        self.state.samples += int(samples)
        if self.rank == 0:
            self.sink.log(out, step=step)
            self.progress.log(step, out)
        return Window()

    def _perf_metrics(self, perf: "PerfWindow") -> dict:
        """perf/* rates over the accumulated windows and their mem/* maxima; kept for summary.json
        too."""
        elapsed = max(perf.elapsed, 1e-9)
        out = {"perf/step_time_s": elapsed / perf.steps,
               **self._rates("perf/", perf.samples, perf.tokens, elapsed)}
        self.state.samples_per_s.append(out["perf/samples_per_s"])
        for key in ("tokens_per_s", "tflops_per_device", "mfu"):
            if f"perf/{key}" in out:
                self.state.rates.setdefault(key, []).append(out[f"perf/{key}"])
        state = self.state
        state.train_time_s += perf.elapsed
        state.train_samples += perf.samples
        state.train_tokens += perf.tokens
        state.run_perf = self._rates("perf/run_", state.train_samples, state.train_tokens,
                                     state.train_time_s)
        return {**out, **perf.memory}

    def _rates(self, prefix: str, samples: float, tokens: float, seconds: float) -> dict:
        """samples/s, tokens/s and (GPU ranks) TFLOP/s per device and MFU over `seconds` of
        training."""
        seconds = max(seconds, 1e-9)
        out = {f"{prefix}samples_per_s": samples / seconds,
               f"{prefix}tokens_per_s": tokens / seconds}
        # no peak on CPU
        if self.model_flops_per_token and self.hardware_flops_per_token and self.peak_flops:
            tokens_per_s_device = tokens / seconds / self.world
            tflops = self.hardware_flops_per_token * tokens_per_s_device / 1e12
            out[f"{prefix}tflops_per_device"] = tflops
            out[f"{prefix}mfu"] = self.model_flops_per_token * tokens_per_s_device / self.peak_flops
        return out

    def finish(self, step: int) -> dict:
        """At the launch's end (finished or stopped; every rank, no collective): the perf window
        still open becomes a last perf/* point, and the launch's averages perf/run_* are logged
        beside the series -- the numbers summary.json, the closing summary and `jobspec report`
        show."""
        if self._perf.steps:
            out = self._perf_metrics(self._perf)
            self._perf = PerfWindow()
            if self.rank == 0:
                self.sink.log(out, step=step)
        if self.rank == 0 and self.state.run_perf:
            self.sink.log(self.state.run_perf, step=step)
        return self.state.run_perf

    def log_eval(self, step: int, loss: float, metrics: dict | None = None) -> None:
        """`metrics`: the task metrics by name (accuracy, f1, perplexity), logged as eval/<name>."""
        if self.rank == 0:
            self.sink.log({"eval/loss": loss,
                           **{f"eval/{k}": v for k, v in (metrics or {}).items()}}, step=step)
            self.progress.eval(step, loss)


def summarize(state: RunState, status: str, total_steps: int | None, started: float,
              error: str | None = None) -> RunSummary:
    """summary.json's content (rundir.RunSummary) from what the run measured. The rates are the
    launch's averages over its training time (StepReporter: perf/run_*), the numbers MLflow and
    `jobspec report` show too."""
    def steady(key: str) -> float | None:
        return state.run_perf.get(f"perf/run_{key}")

    return RunSummary(
        status=status,
        steps=state.step,
        total_steps=total_steps,
        samples=state.samples,
        final_loss=state.last_loss,
        eval_loss=state.eval_loss,
        eval_metrics={f"eval/{k}": v for k, v in state.eval_metrics.items()},
        samples_per_s=steady("samples_per_s"),
        tokens_per_s=steady("tokens_per_s"),
        tflops_per_device=steady("tflops_per_device"),
        mfu=steady("mfu"),
        peak_memory=state.peak_memory,
        elapsed_s=round(time.time() - started, 3),
        resumed_from=state.resumed_from,
        checkpoint=state.last_checkpoint,
        exports=state.exports,
        parameters=state.parameters,
        data=state.data,
        error=error,
        generation=state.generation,
        startup=state.startup or None,
    )


