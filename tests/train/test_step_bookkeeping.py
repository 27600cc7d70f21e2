"""The worker's per-step bookkeeping: the pipelined stop vote, the loss window, the log step's single
reduction and the `on_nan: stop` check it carries. In process, one rank; the two-rank behaviour is
checked in tests/test_metrics.py's spawned gloo ranks."""
from __future__ import annotations

import json
import math

import pytest
import torch

from jobspec.train.faults import NanGuard, NonFiniteLoss
from jobspec.train.progress import Progress, RunState, StepReporter, Window
from jobspec.train.stopping import STOP_AFTER_ENV, StopFlag, StopVote


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


def reporter(tmp_path, sink):
    spec = {"memory": {"precision": "fp32"}}
    derived = {"world_size": 1, "model_flops_per_token": 1e6, "hardware_flops_per_token": 1e6}
    progress = Progress(10, mode="none")
    return StepReporter(FakeEngine(), spec, derived, [], sink, progress, 0, RunState())


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
    assert step == 2 and metrics["train/loss"] == 3.0 and metrics["train/lr"] == 0.25
    assert metrics["train/grad_norm"] == 3.0 and metrics["mem/host_rss_mib_max"] > 0
    assert metrics["perf/samples_per_s"] > 0 and "perf/mfu" not in metrics  # no peak FLOP/s on a CPU
    assert steps.state.samples == 32 and steps.state.last_loss == 3.0
    json.dumps(metrics)  # plain floats


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
