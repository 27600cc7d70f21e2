"""The Trainer (jobspec/train/trainer.py): the policies' turns after each optimizer step, and an OOM
recovery that rebuilds the engine through the Trainer. In process with stand-ins for the engine and
the policies; the real loop runs in tests/train/test_split_equivalence.py (one rank, in process) and
the worker tests (2 ranks)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import make_run_dir

from jobspec.rundir import read_run_files
from jobspec.spec.derived import DerivedJob
from jobspec.train.progress import RunState, Window
from jobspec.train.trainer import FINISHED, PREEMPTED, Policies, Trainer


class Calls(list):
    """Every policy call, in order: (policy, what, step, details)."""


class Reporter:
    def __init__(self, calls: Calls):
        self.calls, self.engine = calls, None

    def should_log(self, step, window, *, last_step):
        return True

    def log_window(self, step, window, nan, final=False):
        self.calls.append(("log", step, final))
        return Window()


class Evaluator:
    def __init__(self, calls: Calls, every: int):
        self.calls, self.every = calls, every

    def should_run(self, step, *, last_step):
        return step % self.every == 0 or last_step

    def run(self, engine, state, loader_args):
        self.calls.append(("eval", state.step, loader_args["micro_batch_size"]))


class Checkpointer:
    def __init__(self, calls: Calls):
        self.calls = calls

    def save(self, engine, state, window, *, last_step=False, stopping=False):
        self.calls.append(("save", state.step, last_step, stopping))
        return True


class Stop:
    def __init__(self, calls: Calls, at: int | None):
        self.calls, self.at = calls, at

    def __call__(self, step):
        self.calls.append(("stop?", step))
        return step == self.at


def trainer(tmp_path, calls: Calls, *, stop_at=None, oom=None, build=None) -> Trainer:
    files = read_run_files(make_run_dir(tmp_path, {"training": {"max_steps": 4}}))
    policies = Policies(stop=Stop(calls, stop_at), oom=oom, nan=None, reporter=Reporter(calls),
                        evaluator=Evaluator(calls, every=2), checkpointer=Checkpointer(calls),
                        exporter=None, startup=None)
    made = Trainer("engine", files, DerivedJob.from_dict(files.derived), None, RunState(), policies,
                   progress=None, build=build)
    made._loader_args = lambda: {"micro_batch_size": made.job.micro_batch_size}
    return made


def after(made: Trainer, step: int):
    made.state.step = step
    return made._after_step()


def test_each_policy_takes_its_turn_and_the_last_step_asks_no_stop(tmp_path):
    calls = Calls()
    made = trainer(tmp_path, calls)
    assert made.policies.reporter.engine == "engine"   # the Trainer's engine, the reporter's too
    assert [after(made, step) for step in (1, 2, 3, 4)] == [None, None, None, FINISHED]
    assert calls == [("log", 1, False), ("stop?", 1), ("save", 1, False, False),
                     ("log", 2, False), ("eval", 2, 4), ("stop?", 2), ("save", 2, False, False),
                     ("log", 3, False), ("stop?", 3), ("save", 3, False, False),
                     ("log", 4, True), ("eval", 4, 4), ("save", 4, True, False)]


def test_an_agreed_stop_logs_the_open_window_and_saves_before_it_ends(tmp_path):
    calls = Calls()
    made = trainer(tmp_path, calls, stop_at=2)
    made.policies.reporter.should_log = lambda step, window, *, last_step: last_step   # no period
    assert after(made, 2) == PREEMPTED
    assert calls == [("eval", 2, 4), ("stop?", 2), ("log", 2, True), ("save", 2, False, True)]


def test_an_oom_recovery_rebuilds_the_engine_through_the_trainer(tmp_path):
    restored_window = Window(samples=8)
    events = []
    oom = SimpleNamespace(
        save_and_release=lambda engine, state: events.append(("saved", engine)) or {"saved": True},
        next_split=lambda: events.append(("split", made.engine)) or (2, 4),
        restore=lambda engine, saved, state: events.append(("restored", engine, saved))
        or restored_window)

    def build(files):
        events.append(("built", files.ds_config["train_micro_batch_size_per_gpu"],
                       files.ds_config["gradient_accumulation_steps"]))
        return "new engine", None, None, []
    made = trainer(tmp_path, Calls(), oom=oom, build=build)
    made._step_batches = lambda rng: ("stream", rng)
    made._rebuild_after_oom()
    # the old engine saved, then let go everywhere (the reporter too) before the new one is built
    assert events == [("saved", "engine"), ("split", None), ("built", 2, 4),
                      ("restored", "new engine", {"saved": True})]
    assert made.engine == made.policies.reporter.engine == "new engine"
    assert (made.job.micro_batch_size, made.job.gradient_accumulation_steps) == (2, 4)
    assert made.files.spec["training"]["micro_batch_size"] == 2
    # the data rewound, no checkpoint's random state to restore
    assert made.window is restored_window and made.stream == ("stream", None)


def test_a_derived_job_without_total_steps_is_refused(tmp_path):
    files = read_run_files(make_run_dir(tmp_path))
    job = DerivedJob.from_dict({**files.derived, "total_steps": None})
    with pytest.raises(ValueError, match="total_steps"):
        Trainer("engine", files, job, None, RunState(), Policies(*[None] * 8), progress=None)
