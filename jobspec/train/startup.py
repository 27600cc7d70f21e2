"""Start-up on the ranks, from the command to the end of the first optimizer step, in named phases.

Each rank writes its marks to launcher.log (`jobspec-log: phase rank<N> <mark> <time> <cpu>`, read
by bench/startup.py). Rank 0 also prints each phase as it ends, then the total at the first step:

    startup  launcher and runner 3.3 s
    startup  imports 8.7 s
    startup  model built on cpu (from config, fp32) 6.6 s
    startup  data synthetic 0.0 s
    startup  engine 0.9 s
    startup  trackers 0.5 s
    startup  first step 0.2 s · 20.2 s to step 1

and, while a phase runs longer than HEARTBEAT_S, a line every HEARTBEAT_S naming it (a daemon
thread). The phases follow each other without a gap, so their seconds add up to the total. The
launcher's part comes from launch.json's `startup` record (its start time, its data pass and whether
that prepared the data or found it cached); without one (a run directory of `jobspec compile`) the
clock starts at this rank's process start. The durations go to summary.json (`startup`), to the
metric sink at the first step (`startup/<phase>_s`, `startup/to_first_step_s`) and from MLflow to
`jobspec report`.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jobspec import launcher_log
from jobspec.spec.types import JobSpec

HEARTBEAT_S = 30.0
TICK_S = 1.0   # how often the heartbeat thread looks at the running phase
PREFIX = "startup  "
TOTAL = "to_first_step"


@dataclass(frozen=True)
class Phase:
    key: str      # summary.json's `startup.<key>_s`, MLflow's `startup/<key>_s`
    label: str    # what its line says
    doing: str    # what the heartbeat says is running
    mark: str     # the rank's launcher.log mark that ends it


LAUNCH = Phase("launch", "launcher and runner", "starting the ranks", "start")
PHASES = (
    Phase("imports", "imports", "importing torch, DeepSpeed and the model code",
          "imported-model-code"),
    Phase("model", "model", "building the model", "model"),
    Phase("data", "data", "loading the data", "data"),
    Phase("engine", "engine", "initialising the DeepSpeed engine", "engine"),
    Phase("resume", "resume", "loading the checkpoint to resume from", "resumed"),
    Phase("trackers", "trackers", "opening the metric sink and trackers", "loop"),
    Phase("first_step", "first step", "running the first step", "first-step"),
)
RESUME_SHOWN_S = 1.0   # a launch that resumed nothing shows its resume line only past this


def metric_names() -> list[str]:
    """Every MLflow metric the clock logs: `startup/<phase>_s` and `startup/to_first_step_s`."""
    return [f"startup/{phase.key}_s" for phase in (LAUNCH, *PHASES)] + [f"startup/{TOTAL}_s"]


def rank_label() -> str:
    return f"rank{os.environ.get('RANK', '0')}"


def write_line(text: str) -> None:
    sys.stdout.write(text + "\n")   # one write: the ranks share the pipe
    sys.stdout.flush()


class StartupClock:
    """The phases of one rank's start-up. `mark(name)` writes the launcher.log mark and, where it
    ends a phase (PHASES), records its seconds and says its line (`say`: rank 0's; None: no line, no
    heartbeat). `record` (summary.json's `startup`) is filled in as the phases end, so a rank that
    fails before its first step still reports the phases it got through."""

    def __init__(self, who: str, say: Callable[[str], None] | None, *, origin: float,
                 rank_start: float, launcher: dict | None = None, data_how: str | None = None,
                 now: Callable[[], float] = time.time, heartbeat_s: float = HEARTBEAT_S,
                 record: dict | None = None):
        self.who, self._say, self.now, self.heartbeat_s = who, say, now, heartbeat_s
        self.origin = origin   # the command's start (the launcher's), else this rank's start
        self.record: dict = {} if record is None else record
        self.sink = None
        # prepared | cached (the launcher's data pass), synthetic; None: the ranks load it
        self.data_how = (launcher or {}).get("data") or data_how
        self._launcher_data_s = float((launcher or {}).get("data_s") or 0.0)
        self._lock = threading.Lock()
        self._next = 0                 # the index in PHASES of the phase running now
        self._began = rank_start       # when it began
        self._beats = 0                # heartbeat lines said for it
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if launcher is not None:
            self._record(LAUNCH, rank_start - origin - self._launcher_data_s, "")

    @classmethod
    def for_rank(cls, spec: JobSpec, launch: dict, record: dict,
                 worker_started: float) -> StartupClock:
        """This rank's clock, its first marks written (process start, the worker's start) and rank
        0's heartbeat running. `launch`: launch.json (its `startup` record, the launcher's part)."""
        from jobspec.train.progress import progress_mode

        who = rank_label()
        shown = who == "rank0" and progress_mode() != "none"
        launcher = launch.get("startup") if isinstance(launch.get("startup"), dict) else None
        rank_start = launcher_log.process_start()
        origin = float(launcher["started"]) if launcher and launcher.get("started") else rank_start
        clock = cls(who, write_line if shown else None, origin=origin, rank_start=rank_start,
                    launcher=launcher, record=record,
                    data_how="synthetic" if spec["data"].get("synthetic") else None)
        launcher_log.phase(who, "start", rank_start, 0.0)
        clock.mark("worker", at=worker_started)
        clock.start_heartbeat()
        return clock

    @classmethod
    def log_only(cls) -> StartupClock:
        """Marks to launcher.log, nothing else: an engine rebuilt after the start-up (train/oom)."""
        started = time.time()
        clock = cls(rank_label(), None, origin=started, rank_start=started)
        clock._next = len(PHASES)
        return clock

    def report_to(self, say: Callable[[str], None] | None, sink=None) -> None:
        """Rank 0's progress from now on (`Progress.message`: below a bar) and its metric sink."""
        with self._lock:
            if say is not None and self._say is not None:
                self._say = say
            self.sink = sink

    def mark(self, name: str, detail: str = "", at: float | None = None) -> None:
        """launcher.log's `phase <who> <name>`; the end of the running phase when it is `name`."""
        at = self.now() if at is None else at
        launcher_log.phase(self.who, name, at)
        with self._lock:
            if self._next >= len(PHASES) or PHASES[self._next].mark != name:
                return
            phase = PHASES[self._next]
            seconds = at - self._began
            if phase.key == "data":
                seconds += self._launcher_data_s
                detail = detail or self._data_detail()
            self._next, self._began, self._beats = self._next + 1, at, 0
            self._record(phase, seconds, detail)

    def first_step(self, step: int) -> None:
        """The end of the launch's first optimizer step: its phase, the total, the metrics."""
        at = self.now()
        self.mark("first-step", at=at)
        self.stop()
        if TOTAL + "_s" in self.record or "first_step_s" not in self.record:
            return
        total = round(at - self.origin, 3)
        self.record[TOTAL + "_s"] = total
        if self._say is not None:
            self._say(f"{PREFIX}{line_text('first step', self.record['first_step_s'], '')}"
                      f" · {total:.1f} s to step {step}")
        if self.sink is not None:
            self.sink.log(self.metrics(), step=step)

    def metrics(self) -> dict[str, float]:
        """`startup/<key>_s` of every phase recorded (MLflow, metrics.jsonl)."""
        return {f"startup/{key}": value for key, value in self.record.items() if key.endswith("_s")}

    def beat(self) -> None:
        """A heartbeat line for each HEARTBEAT_S the running phase has taken since its last one."""
        with self._lock:
            if self._say is None or self._next >= len(PHASES):
                return
            elapsed = self.now() - self._began
            if elapsed < (self._beats + 1) * self.heartbeat_s:
                return
            self._beats = int(elapsed // self.heartbeat_s)
            self._say(f"{PREFIX}still {PHASES[self._next].doing}: {elapsed:.0f} s so far")

    def start_heartbeat(self, tick_s: float = TICK_S) -> None:
        if self._say is None or self._thread is not None:
            return

        def run() -> None:
            while not self._stopped.wait(tick_s):
                self.beat()
        self._thread = threading.Thread(target=run, name="jobspec-startup-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more heartbeats (the first step ended, or the rank is ending)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _record(self, phase: Phase, seconds: float, detail: str) -> None:
        seconds = max(seconds, 0.0)
        self.record[f"{phase.key}_s"] = round(seconds, 3)
        if detail:
            self.record[phase.key] = detail
        if phase.key == "resume" and not detail and seconds < RESUME_SHOWN_S:
            return   # nothing to resume from, and looking took no time: no line
        if self._say is not None and phase.key != "first_step":   # first_step: with the total
            self._say(PREFIX + line_text(phase.label, seconds, detail))

    def _data_detail(self) -> str:
        return {"prepared": "prepared", "cached": "read from cache", "synthetic": "synthetic"}.get(
            self.data_how or "", "loaded")


def line_text(label: str, seconds: float, detail: str) -> str:
    """`model built on cpu (from config, fp32) 6.6 s`."""
    return f"{label}{' ' + detail if detail else ''} {seconds:.1f} s"


def model_detail(spec: JobSpec, model) -> str:
    """Where and how the model was built: `built on cuda:0 (from config, bf16)`, `built partitioned
    by ZeRO-3 (from checkpoint, bf16, 4-bit nf4)`: the device of its first parameter (a ZeRO-3
    parameter is a partition), its source, the dtype of its first floating-point parameter."""
    parameters = list(_first_parameters(model))
    if not parameters:
        return "built (no parameters)"
    first = parameters[0]
    where = "partitioned by ZeRO-3" if hasattr(first, "ds_id") else f"on {first.device}"
    how = ["from checkpoint" if spec["model"].get("name_or_path") else "from config"]
    floating = next((p for p in parameters if p.is_floating_point()), None)
    if floating is not None:
        how.append(dtype_name(floating.dtype))
    quantization = spec["model"].get("quantization")
    if quantization:
        how.append(f"{quantization['bits']}-bit {quantization['quant_type']}")
    return f"built {where} ({', '.join(how)})"


def dtype_name(dtype) -> str:
    """`torch.bfloat16` -> `bf16`, as the spec's `memory.precision` names it."""
    text = str(dtype).removeprefix("torch.")
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    return names.get(text, text)


def _first_parameters(model, count: int = 64):
    """Up to `count` parameters in the model's order (a quantised model's first may be packed)."""
    for index, parameter in enumerate(model.parameters()):
        if index >= count:
            return
        yield parameter
