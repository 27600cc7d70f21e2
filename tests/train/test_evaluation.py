"""The evaluation policy (jobspec/train/evaluation.py): when an evaluation runs and what it does
without eval data. `evaluate` itself is checked on a one-rank process group in
tests/train/test_task_metrics.py and over the ranks in tests/train/test_split_equivalence.py."""
from __future__ import annotations

import pytest

from jobspec.train.evaluation import Evaluator
from jobspec.train.generation import NoGeneration
from jobspec.train.progress import RunState


class Generator:
    def __init__(self):
        self.steps: list[int] = []

    def run(self, engine, state):
        self.steps.append(state.step)


def unused(*args, **kwargs):
    pytest.fail("called without eval data")


def evaluator(eval_every, eval_ds=None, generator=None) -> Evaluator:
    return Evaluator({"eval_every": eval_every}, eval_ds, unused, reporter=None, exporter=None,
                     generator=generator or NoGeneration())


@pytest.mark.parametrize("eval_every, step, last_step, runs", [
    (5, 10, False, True), (5, 7, False, False), (5, 7, True, True),
    (0, 10, False, False), (None, 10, False, False), (None, 12, True, True),
])
def test_an_evaluation_runs_every_eval_every_steps_and_at_the_last(eval_every, step, last_step,
                                                                    runs):
    assert evaluator(eval_every).should_run(step, last_step=last_step) is runs


def test_without_eval_data_an_evaluation_is_the_generation_alone():
    generator = Generator()
    state = RunState(step=6)
    evaluator(3, generator=generator).run("engine", state, loader_args={})
    assert generator.steps == [6] and state.eval_loss is None and state.eval_metrics == {}


def test_no_generation_generates_nothing():
    assert NoGeneration().run("engine", RunState(step=1)) is None
