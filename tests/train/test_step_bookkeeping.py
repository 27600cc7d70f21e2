"""The worker's per-step bookkeeping: the pipelined stop vote, the loss window, the log step's single
reduction and the `on_nan: stop` check it carries. In process, one rank; the two-rank behaviour is
checked in tests/test_metrics.py's spawned gloo ranks."""
from __future__ import annotations

import io
import json
import math

import pytest
import torch

from jobspec.spec.derived import DerivedJob
from jobspec.train.faults import NanGuard, NonFiniteLoss
from jobspec.train.progress import Progress, RunState, StepReporter, Window, summarize
from jobspec.train.stopping import STOP_AFTER_ENV, StopFlag, StopVote

# the rates and times are sums of at most 3 window times and one division, each from exact clock
# readings: 4 float64 roundings, 8 allowed (was pytest.approx's default rel 1e-6); a window counted twice or
# a pause not left out is off by a factor
FEW_ROUNDINGS = 8 * 2**-53


def test_one_rank_stops_on_its_own_flag_without_a_collective():
    flag = StopFlag()
    vote = StopVote(flag, group=None, world_size=1, environ={})
    assert not vote(1) and not vote(2)
    flag.requested = True
    assert vote(3)  # at once: nothing to agree on
    vote.close()


def test_stop_after_steps_needs_no_vote_and_is_exact():
    vote = StopVote(StopFlag(), group=object(), world_size=4, environ={STOP_AFTER_ENV: "3"})
    assert vote(3) and vote(7)  # a collective on `object()` would raise: none is started


def test_window_keeps_losses_without_reducing_them_and_finds_the_first_bad_step():
    window = Window()
    for step, value in [(1, 0.5), (1, 0.7), (2, float("nan")), (3, float("inf"))]:
        window.add_loss(torch.tensor(value, requires_grad=True) * 1.0, step)
    assert window.micro_batches == 4 and window.loss_steps == [1, 1, 2, 3]
    assert not any(t.requires_grad for t in window.losses)
    assert window.first_nonfinite_step() == 2
    assert Window().first_nonfinite_step() == 0


def test_a_window_copy_rewinds_the_shared_loss_list():
    import dataclasses
    window = Window()
    window.add_loss(torch.tensor(1.0), 1)
    start = dataclasses.replace(window)      # what jobspec.train.oom keeps at a step's start
    window.add_loss(torch.tensor(2.0), 2)    # the interrupted step's micro-batch
    assert start.rewind().losses == [torch.tensor(1.0)] and start.loss_steps == [1]


class FakeEngine:
    device = torch.device("cpu")

    def get_lr(self):
        return [0.25]

    def get_global_grad_norm(self):
        return torch.tensor(3.0)


class Sink:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))


def reporter(tmp_path, sink, perf_window_s=0.0):
    logging = {"perf_window_s": perf_window_s, "every_n_steps": 1}
    derived = DerivedJob(world_size=1, nodes=1, gpus_per_node=1, micro_batch_size=1, global_batch_size=1,
                         gradient_accumulation_steps=1, total_steps=10, warmup_steps=0, seq_len=8, precision="fp32",
                         precision_bytes=4, dims=None, num_parameters=None, num_layers=None, checkpointed_layers=0,
                         model_flops_per_token=1e6, hardware_flops_per_token=1e6)
    progress = Progress(10, mode="none")
    return StepReporter(FakeEngine(), logging, derived, sink, progress, 0, RunState())


def test_log_window_reduces_once_and_logs_the_shared_metrics(tmp_path):
    sink = Sink()
    steps = reporter(tmp_path, sink)
    window = Window(samples=32, tokens=2048, steps=2)
    for step, value in [(1, 1.0), (1, 2.0), (2, 3.0), (2, 6.0)]:
        window.add_loss(torch.tensor(value), step)
    guard = NanGuard("stop", vote=lambda flag: flag)
    fresh = steps.log_window(2, window, guard)
    assert fresh.micro_batches == 0 and fresh.losses == []
    (step, metrics), = sink.logged
    # each loss is a micro-batch's share of its step's token-weighted loss (jobspec.train.token_loss):
    # steps of 1 + 2 and 3 + 6, logged as their mean
    assert step == 2 and metrics["train/loss"] == 6.0 and metrics["train/lr"] == 0.25
    assert metrics["train/grad_norm"] == 3.0 and metrics["mem/host_rss_mib_max"] > 0
    assert metrics["perf/samples_per_s"] > 0 and "perf/mfu" not in metrics  # no peak FLOP/s on a CPU
    assert steps.state.samples == 32 and steps.state.last_loss == 6.0
    json.dumps(metrics)  # plain floats


def test_perf_and_memory_points_cover_perf_window_s_and_the_final_window_logs_them(tmp_path, monkeypatch):
    from jobspec.train import progress
    log_times = iter([100.4, 100.9, 102.6, 102.8])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(log_times))
    sink = Sink()
    steps = reporter(tmp_path, sink, perf_window_s=1.0)
    readings = iter([300.0, 500.0, 400.0, 350.0])
    steps._rss = lambda: next(readings) * 2**20
    windows = [(100.0, 10, False), (100.5, 30, False), (101.0, 8, False), (102.6, 4, True)]
    for step, (started, samples, final) in enumerate(windows, start=1):
        window = Window(samples=samples, tokens=samples * 10, steps=1, started=started)
        window.add_loss(torch.tensor(float(step)), step)
        steps.log_window(step, window, final=final)
    logged = [metrics for _, metrics in sink.logged]
    assert [m["train/loss"] for m in logged] == [1.0, 2.0, 3.0, 4.0]  # loss and lr: every log step
    # windows of 0.4 s and 0.4 s: under 1 s, carried on; the third (1.6 s) makes 2.4 s and logs them
    assert not any(k.startswith(("perf/", "mem/")) for m in logged[:2] for k in m)
    assert logged[2]["perf/samples_per_s"] == pytest.approx(48 / 2.4, rel=FEW_ROUNDINGS)
    assert logged[2]["perf/step_time_s"] == pytest.approx(0.8, rel=FEW_ROUNDINGS)
    assert logged[2]["perf/tokens_per_s"] == pytest.approx(200, rel=FEW_ROUNDINGS)
    assert logged[2]["mem/host_rss_mib_max"] == 500.0  # the maximum of the three windows, not the last reading
    # the last window is 0.2 s, but the run ends there: its own rates and memory
    assert logged[3]["perf/samples_per_s"] == pytest.approx(20, rel=FEW_ROUNDINGS)
    assert logged[3]["mem/host_rss_mib_max"] == 350.0
    assert steps.state.samples_per_s == [pytest.approx(20.0, rel=FEW_ROUNDINGS)] * 2 and steps.state.samples == 52


def test_time_paused_in_a_window_is_left_out_of_its_rates(tmp_path, monkeypatch):
    from jobspec.train import progress
    clock = iter([10.0, 40.0, 41.0])  # pause from 10 s to 40 s (an evaluation), logged at 41 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    sink = Sink()
    window = Window(samples=20, tokens=200, steps=2, started=9.0)
    window.add_loss(torch.tensor(1.0), 2)
    with window.paused():
        pass
    reporter(tmp_path, sink).log_window(2, window)
    (_, metrics), = sink.logged
    assert metrics["perf/samples_per_s"] == pytest.approx(20 / 2.0, rel=FEW_ROUNDINGS)  # 2 s of training, not 32 s
    assert metrics["perf/step_time_s"] == pytest.approx(1.0, rel=FEW_ROUNDINGS)


def test_a_line_between_perf_points_shows_the_last_rate():
    stream = io.StringIO()
    progress = Progress(10, mode="lines", stream=stream)
    progress.log(1, {"train/loss": 1.0, "perf/samples_per_s": 12.5})
    progress.log(2, {"train/loss": 0.9})
    assert stream.getvalue().splitlines()[1].startswith("step 2/10 loss 0.9000 12.5 samples/s")


@pytest.mark.parametrize("policy, raises", [("stop", True), ("skip", False)])
def test_log_window_raises_for_a_non_finite_loss_under_stop_before_logging(tmp_path, policy, raises):
    sink = Sink()
    steps = reporter(tmp_path, sink)
    window = Window(samples=48, tokens=100, steps=3)
    for step, value in [(4, 1.0), (5, math.nan), (6, 1.0)]:
        window.add_loss(torch.tensor(value), step)
    guard = NanGuard(policy, vote=lambda flag: flag)
    if raises:
        with pytest.raises(NonFiniteLoss, match="at optimizer step 5") as err:
            steps.log_window(6, window, guard)
        assert err.value.step == 5 and sink.logged == []
    else:  # skip never puts a bad loss in the window; a NaN there is reported, not raised
        steps.log_window(6, window, guard)
        assert math.isnan(sink.logged[0][1]["train/loss"])


def test_stop_policy_adds_no_work_per_micro_batch_and_confirm_votes_once():
    votes = []
    guard = NanGuard("stop", vote=lambda flag: votes.append(flag) or flag)
    loss = torch.tensor(0.5)
    assert guard.check(loss, 1) == (loss, False) and votes == []
    window = Window()
    window.add_loss(loss, 1)
    guard.confirm(window)
    assert votes == [False]
    window.add_loss(torch.tensor(math.inf), 2)
    with pytest.raises(NonFiniteLoss, match="at optimizer step 2"):
        guard.confirm(window)
    other = NanGuard("stop", vote=lambda flag: True)  # another rank saw it
    with pytest.raises(NonFiniteLoss, match="on another rank"):
        other.confirm(Window())


def test_the_run_average_is_the_training_samples_over_the_training_time_without_the_first_step(tmp_path,
                                                                                                  monkeypatch):
    """One definition of throughput (docs/architecture.md, "Throughput"): samples (tokens) trained after the launch's first
    step over the time of those steps, evaluation left out; the same number as perf/run_* in MLflow
    (finish) and in summary.json (summarize). The reference is the arithmetic by hand: exact, the
    floats divided once each in the same order."""
    from jobspec.train import progress
    # start_timing, window 1's log, an evaluation's pause (10 s), window 2's log
    clock = iter([105.0, 106.0, 107.0, 117.0, 118.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    sink = Sink()
    steps = reporter(tmp_path, sink)
    first = Window(samples=8, tokens=80, steps=1, started=100.0)   # step 1: 5 s of start-up
    first.add_loss(torch.tensor(1.0), 1)
    first.start_timing()
    first.samples, first.tokens, first.steps = 16, 160, 2          # step 2: 1 s, 8 samples
    first.add_loss(torch.tensor(1.0), 2)
    steps.log_window(2, first)
    second = Window(samples=24, tokens=240, steps=2, started=106.0)   # steps 3-4: 2 s of 12 s, 24 samples
    second.add_loss(torch.tensor(1.0), 4)
    with second.paused():
        pass
    steps.log_window(4, second)
    assert [m["perf/samples_per_s"] for _, m in sink.logged] == [8.0, 12.0]
    run = steps.finish(4)
    assert run == {"perf/run_samples_per_s": 32 / 3, "perf/run_tokens_per_s": 320 / 3}
    assert sink.logged[-1] == (4, run)   # MLflow's run average, at the last step
    assert steps.state.samples == 40     # every sample trained, the first step's included
    summary = summarize(steps.state, "finished", 4, started=0.0)
    assert (summary.samples_per_s, summary.tokens_per_s) == (32 / 3, 320 / 3)
