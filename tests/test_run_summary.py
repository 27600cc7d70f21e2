"""summary.json as `rundir.RunSummary`: the ranks' record and the launcher's fallback keep the file format
they always had, read back typed; keys of another jobspec version survive a read and a write."""
from __future__ import annotations

import json

from jobspec import rundir
from jobspec import status as run_status
from jobspec.rundir import RunSummary
from jobspec.train.progress import RunState, summarize

# a rank 0 summary.json as jobspec wrote it before RunSummary (keys and order)
RANK_FILE = {"status": "preempted", "steps": 12, "total_steps": 40, "samples": 384, "final_loss": 0.25,
             "eval_loss": None, "eval_metrics": {"eval/accuracy": 0.5}, "samples_per_s": 30.5,
             "tokens_per_s": 1952.0, "tflops_per_device": None, "mfu": None,
             "peak_memory": {"mem/host_rss_mib_max": 600.0}, "elapsed_s": 12.5, "resumed_from": None,
             "checkpoint": "step12", "exports": {}, "parameters": {"trainable": 10, "total": 100}}


def write_raw(run_dir, record: dict) -> None:
    (run_dir / rundir.SUMMARY).write_text(json.dumps(record))


def test_the_ranks_summary_round_trips_key_for_key(tmp_path):
    write_raw(tmp_path, RANK_FILE)
    summary = rundir.read_summary(tmp_path)
    assert summary is not None and summary.steps == 12 and summary.checkpoint == "step12" and summary.done
    assert summary.eval_metrics == {"eval/accuracy": 0.5} and summary.parameters["trainable"] == 10
    rundir.write_summary(tmp_path, summary)
    assert list(json.loads((tmp_path / rundir.SUMMARY).read_text()).items()) == list(RANK_FILE.items())


def test_summarize_writes_every_key_the_ranks_always_wrote_and_the_error_only_when_failed(tmp_path):
    state = RunState(step=3, samples=96, last_loss=0.5, samples_per_s=[1.0, 2.0], last_checkpoint="step3",
                     run_perf={"perf/run_samples_per_s": 2.0})
    rundir.write_summary(tmp_path, summarize(state, "finished", 3, started=0.0))
    written = json.loads((tmp_path / rundir.SUMMARY).read_text())
    assert list(written) == list(RANK_FILE) and written["samples_per_s"] == 2.0 and written["eval_loss"] is None
    rundir.write_summary(tmp_path, summarize(state, "failed", None, started=0.0, error="disk full"))
    written = json.loads((tmp_path / rundir.SUMMARY).read_text())
    assert list(written) == [*RANK_FILE, "error"] and written["error"] == "disk full"


def test_the_launchers_fallback_keeps_its_three_keys_and_never_replaces_the_ranks(tmp_path):
    rundir.write_fallback_summary(tmp_path, "FAILED", 137)
    assert json.loads((tmp_path / rundir.SUMMARY).read_text()) == \
        {"status": "failed", "exit_code": 137, "written_by": "launcher"}
    fallback = rundir.read_summary(tmp_path)
    assert fallback is not None and fallback.written_by == rundir.LAUNCHER_WRITER and not fallback.done
    ending = run_status.from_summary(fallback)
    assert ending is not None and (ending.label, ending.exit_code, ending.reason) == ("failed", 137, "failed")
    write_raw(tmp_path, RANK_FILE)
    rundir.write_fallback_summary(tmp_path, "FAILED", 1)
    assert json.loads((tmp_path / rundir.SUMMARY).read_text()) == RANK_FILE


def test_an_older_or_newer_file_loads_and_its_unknown_keys_are_written_back(tmp_path):
    # an older run: no eval_metrics, parameters or exports; a newer one: a key this version does not know
    write_raw(tmp_path, {"status": "finished", "steps": 3, "exports": None, "future_key": {"a": 1}})
    summary = rundir.read_summary(tmp_path)
    assert summary is not None and summary.exports == {} and summary.eval_metrics == {} and summary.parameters == {}
    assert summary.extra == {"future_key": {"a": 1}}
    rundir.write_summary(tmp_path, summary)
    assert json.loads((tmp_path / rundir.SUMMARY).read_text())["future_key"] == {"a": 1}
    write_raw(tmp_path, ["not", "a", "mapping"])
    assert rundir.read_summary(tmp_path) is None and not rundir.summary_says_done(tmp_path)


def test_a_stop_with_a_checkpoint_is_read_from_the_typed_summary():
    summary = RunSummary.from_dict(RANK_FILE)
    ending = run_status.ending(0, None, None, summary, stop_after_steps=12)
    assert ending.label == "preempted" and ending.exit_code == run_status.EXIT_PREEMPTED
    assert ending.reason == "stopped by --stop-after-steps 12 at step 12 of 40; checkpoint step12"
    failed = RunSummary(status="failed", steps=4, error="CUDA out of memory")
    assert run_status.ending(1, None, None, failed).reason == "CUDA out of memory"


def test_a_stop_that_comes_after_the_ranks_finished_is_a_finished_run():
    import signal
    done = RunSummary(status="finished", steps=12, total_steps=12, checkpoint="step12")
    for code, sig, at_once in ((128 + signal.SIGTERM, signal.SIGTERM, False), (130, signal.SIGINT, True)):
        ending = run_status.ending(code, sig, None, done, at_once=at_once)
        assert (ending.status, ending.label, ending.exit_code, ending.reason) == ("FINISHED", "finished", 0, None)
    # the same signal before the ranks finished still says it stopped them
    running = RunSummary(status="running", steps=3, total_steps=12)
    assert run_status.ending(143, signal.SIGTERM, None, running).label == "killed"
