"""The checkpoint policy (jobspec/train/checkpointer.py): when a checkpoint is due, and what a save
does around it (the NaN policy's confirmation first, the exporter after). In process: the collective
save itself (checkpoint/save_load.save) is a stand-in here; the slow worker tests save for real."""
from __future__ import annotations

import pytest

from jobspec.checkpoint import save_load
from jobspec.spec.derived import DerivedJob
from jobspec.train.checkpointer import Checkpointer
from jobspec.train.progress import RunState, Window


class Recorder:
    """A checkpointer's NaN policy, exporter and progress: what each was called with."""

    def __init__(self):
        self.calls: list[tuple] = []

    def confirm(self, window):
        self.calls.append(("confirm", window))

    def after_checkpoint(self, engine, state, ckpt_dir):
        self.calls.append(("export", state.last_checkpoint, ckpt_dir))

    def message(self, text):
        self.calls.append(("message", text))


def job(micro: int = 4, sequence_parallel: int = 1) -> DerivedJob:
    return DerivedJob(world_size=2, nodes=1, gpus_per_node=2, micro_batch_size=micro,
                      global_batch_size=16, gradient_accumulation_steps=2, total_steps=10,
                      warmup_steps=0, seq_len=8, precision="fp32", precision_bytes=4, dims=None,
                      num_parameters=None, num_layers=None, checkpointed_layers=0,
                      sequence_parallel=sequence_parallel)


def checkpointer(every, save_final, recorder=None, in_compiled_units=lambda n: n,
                 **job_args) -> Checkpointer:
    recorder = recorder or Recorder()
    section = {"dir": "/ckpt", "every_n_steps": every, "keep_last": 2, "save_final": save_final,
               "resume": "auto"}
    return Checkpointer(section, job(**job_args), job_name="tiny", zero_stage=2, nan=recorder,
                        exporter=recorder, progress=recorder, in_compiled_units=in_compiled_units)


@pytest.mark.parametrize("every, save_final, step, last_step, stopping, due", [
    (2, False, 4, False, False, True),    # the period
    (2, False, 3, False, False, False),
    (0, True, 4, False, False, False),    # no period: only the end and a stop
    (None, True, 4, False, False, False),
    (0, True, 10, True, False, True),     # the last step with save_final
    (0, False, 10, True, False, False),   # ... without it
    (5, False, 10, True, False, True),    # the last step on the period saves all the same
    (0, False, 3, False, True, True),     # a stop saves always
    (2, False, 3, False, True, True),
])
def test_a_checkpoint_is_due_on_the_period_at_a_stop_and_at_the_end_with_save_final(
        every, save_final, step, last_step, stopping, due):
    assert checkpointer(every, save_final).due(step, last_step=last_step, stopping=stopping) is due


def test_a_save_confirms_the_losses_first_records_the_tag_and_hands_it_to_the_exporter(monkeypatch):
    saved = []

    def save(engine, ckpt_dir, **kwargs):
        saved.append((engine, ckpt_dir, kwargs))
        return f"step{kwargs['step']}"
    monkeypatch.setattr(save_load, "save", save)
    recorder = Recorder()
    # after an OOM recovery the position counts halved micro-batches: saved in compiled ones
    policy = checkpointer(2, False, recorder, in_compiled_units=lambda n: n // 2,
                          sequence_parallel=2)
    state, window = RunState(step=4, epoch=1, batches_in_epoch=12), Window()
    assert policy.save("engine", state, window) is True
    (engine, ckpt_dir, kwargs), = saved
    assert (engine, ckpt_dir) == ("engine", "/ckpt")
    assert kwargs == {"step": 4, "epoch": 1, "batches_in_epoch": 6, "job_name": "tiny",
                      "keep_last": 2, "zero_stage": 2, "micro_batch_size": 4,
                      "sequence_parallel": 2}
    assert state.last_checkpoint == "step4"
    assert [call[0] for call in recorder.calls] == ["confirm", "message", "export"]
    assert recorder.calls[0][1] is window and recorder.calls[2][1:] == ("step4", "/ckpt")


def test_a_step_without_a_checkpoint_due_saves_and_confirms_nothing(monkeypatch):
    monkeypatch.setattr(save_load, "save", lambda *args, **kwargs: pytest.fail("saved"))
    recorder = Recorder()
    state = RunState(step=3)
    assert checkpointer(2, True, recorder).save("engine", state, Window()) is False
    assert recorder.calls == [] and state.last_checkpoint is None
