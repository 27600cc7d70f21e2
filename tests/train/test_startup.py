"""train/startup.py: the start-up's phases as rank 0 prints them, their seconds (adding up to the
total from the command), the heartbeat of a long phase, the launcher.log marks bench/startup.py
reads, what summary.json and the metric sink get."""
from __future__ import annotations

import io
import time

import pytest
import torch

from bench.startup import PHASE
from jobspec import launcher_log
from jobspec.train import startup
from jobspec.train.progress import RunState, summarize
from jobspec.train.startup import PHASES, StartupClock, model_detail


class FakeClock:
    def __init__(self, at: float):
        self.at = at

    def __call__(self) -> float:
        return self.at


class Sink:
    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


@pytest.fixture
def log_lines(monkeypatch):
    """The `jobspec-log:` lines the clock writes (stdout on a rank)."""
    out = io.StringIO()
    real = launcher_log.note
    monkeypatch.setattr(launcher_log, "note", lambda text, stream=None: real(text, stream or out))
    return out


def a_clock(said: list, *, launcher: dict | None, data_how: str | None = None,
            heartbeat_s: float = 30.0):
    now = FakeClock(1000.0)
    clock = StartupClock("rank0", said.append, origin=launcher["started"] if launcher else 1000.0,
                         rank_start=1000.0, launcher=launcher, data_how=data_how, now=now,
                         heartbeat_s=heartbeat_s, record={})
    return clock, now


def run_phases(clock: StartupClock, now: FakeClock, seconds: dict) -> None:
    """Each phase of PHASES but the first step, ending after its `seconds` (the model's with a
    detail)."""
    for mark in ("worker", "imported", "ops", "distributed"):   # marks inside a phase end none
        clock.mark(mark)
    for phase in PHASES[:-1]:
        now.at += seconds[phase.key]
        clock.mark(phase.mark, "built on cpu (from config, fp32)" if phase.key == "model" else "")


def test_each_phase_is_a_line_as_it_ends_and_they_add_up_to_the_total_from_the_command(log_lines):
    said: list[str] = []
    # the command started 4 s before this rank; 1.5 s of that the launcher read the data cache
    clock, now = a_clock(said, launcher={"started": 996.0, "data_s": 1.5, "data": "cached"})
    assert said == ["startup  launcher and runner 2.5 s"]
    seconds = {"imports": 8.25, "model": 6.5, "data": 0.25, "engine": 0.75, "resume": 0.0,
               "trackers": 0.5}
    run_phases(clock, now, seconds)
    sink = Sink()
    clock.report_to(said.append, sink)
    now.at += 0.25
    clock.first_step(1)
    assert said[1:] == ["startup  imports 8.2 s",
                        "startup  model built on cpu (from config, fp32) 6.5 s",
                        "startup  data read from cache 1.8 s",   # launcher 1.5 + rank 0.25
                        "startup  engine 0.8 s",
                        "startup  trackers 0.5 s",   # nothing was resumed: no resume line
                        "startup  first step 0.2 s · 20.5 s to step 1"]
    record = clock.record
    total = sum(value for key, value in record.items()
                if key.endswith("_s") and key != "to_first_step_s")
    assert record["to_first_step_s"] == pytest.approx(total) == pytest.approx(now.at - 996.0)
    assert record["model"] == "built on cpu (from config, fp32)" and record["resume_s"] == 0.0
    assert record["data_s"] == 1.75 and record["launch_s"] == 2.5
    # the sink gets startup/<phase>_s at the first step, the same numbers as summary.json
    assert sink.logged == [({f"startup/{k}": v for k, v in record.items() if k.endswith("_s")}, 1)]
    assert set(sink.logged[0][0]) == set(startup.metric_names())
    # every mark is a launcher.log line bench/startup.py reads, in order
    marks = [name for _, name, _, _ in PHASE.findall(log_lines.getvalue())]
    assert marks == ["worker", "imported", "ops", "distributed", *[p.mark for p in PHASES]]


def test_a_second_first_step_and_marks_after_the_start_up_change_nothing(log_lines):
    said: list[str] = []
    clock, now = a_clock(said, launcher=None, data_how="synthetic")
    run_phases(clock, now, {p.key: 1.0 for p in PHASES})
    now.at += 1.0
    clock.first_step(3)
    record = dict(clock.record)
    assert "launch_s" not in record and record["to_first_step_s"] == 7.0   # from this rank's start
    assert "startup  data synthetic 1.0 s" in said
    assert said[-1] == "startup  first step 1.0 s · 7.0 s to step 3"
    count = len(said)
    now.at += 5.0
    clock.mark("model", "again")   # an engine rebuilt after an OOM: launcher.log marks only
    clock.first_step(4)
    assert clock.record == record and len(said) == count


def test_a_resume_is_shown_with_its_checkpoint_and_data_without_the_launcher_is_loaded(log_lines):
    said: list[str] = []
    clock, now = a_clock(said, launcher=None)
    for phase in PHASES[:-1]:
        now.at += 2.0
        clock.mark(phase.mark, "from /ckpt/step20" if phase.key == "resume" else "")
    assert "startup  resume from /ckpt/step20 2.0 s" in said
    assert "startup  data loaded 2.0 s" in said


def test_a_long_phase_gets_a_heartbeat_line_every_interval_and_a_short_one_none(log_lines):
    said: list[str] = []
    clock, now = a_clock(said, launcher=None, heartbeat_s=30.0)
    now.at += 29.0
    clock.beat()
    assert said == []
    now.at += 1.0
    clock.beat()
    clock.beat()   # once per interval, however often the thread looks
    now.at += 45.0
    clock.beat()
    assert said == ["startup  still importing torch, DeepSpeed and the model code: 30 s so far",
                    "startup  still importing torch, DeepSpeed and the model code: 75 s so far"]
    clock.mark("imported-model-code")   # the next phase's heartbeat counts from its own start
    said.clear()
    now.at += 31.0
    clock.beat()
    assert said == ["startup  still building the model: 31 s so far"]


def test_the_heartbeat_thread_says_the_running_phase_and_stops_at_the_first_step(log_lines):
    said: list[str] = []
    clock = StartupClock("rank0", said.append, origin=time.time(), rank_start=time.time(),
                         heartbeat_s=0.1, record={})
    clock.start_heartbeat(tick_s=0.02)
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.02)
    assert said and said[0].startswith("startup  still importing torch")
    clock.first_step(1)
    count = len(said)
    time.sleep(0.3)
    assert len(said) == count and not clock._thread.is_alive()


def test_ranks_other_than_0_say_nothing_and_run_no_heartbeat(log_lines):
    now = FakeClock(0.0)
    clock = StartupClock("rank1", None, origin=0.0, rank_start=0.0, launcher={"started": 0.0},
                         now=now, record={})
    clock.start_heartbeat(tick_s=0.01)
    assert clock._thread is None
    now.at = 100.0
    clock.beat()
    clock.mark("imported-model-code")
    assert clock.record == {"launch_s": 0.0, "imports_s": 100.0}


def test_summary_json_carries_the_phases_so_far_even_when_the_rank_failed(log_lines):
    state = RunState()
    clock = StartupClock("rank0", None, origin=0.0, rank_start=2.0, launcher={"started": 0.0},
                         now=FakeClock(5.0), record=state.startup)
    clock.mark("imported-model-code")
    summary = summarize(state, "failed", None, started=0.0, error="boom").to_dict()
    assert summary["startup"] == {"launch_s": 2.0, "imports_s": 3.0}
    assert list(summary)[-2:] == ["error", "startup"]
    assert "startup" not in summarize(RunState(), "failed", None, started=0.0).to_dict()


def test_the_model_line_says_where_and_how_it_was_built():
    spec = {"model": {"name_or_path": None, "quantization": None}}
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert model_detail(spec, model) == "built on cpu (from config, bf16)"
    quantised = {"model": {"name_or_path": "base",
                           "quantization": {"bits": 4, "quant_type": "nf4"}}}
    assert model_detail(quantised, model) == "built on cpu (from checkpoint, bf16, 4-bit nf4)"
    model.weight.ds_id = 0   # what deepspeed.zero.Init gives a partitioned parameter
    assert model_detail(spec, model).startswith("built partitioned by ZeRO-3 (")
    assert model_detail(spec, torch.nn.ReLU()) == "built (no parameters)"
