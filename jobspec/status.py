"""How a run ended, told truthfully: MLflow status, `jobspec.status` tag, exit code, reason, CLI
line.

    ended                      exit code        MLflow     jobspec.status   reason tag
    finished                   0                FINISHED   finished         (both cleared)
    stopped with a checkpoint  75 (EX_TEMPFAIL) KILLED     preempted        jobspec.stop_reason
      (SIGUSR1, SIGTERM/SIGINT/SIGHUP to the launcher or to every process of the job,
       --stop-after-steps; the printed command resumes it)
    ended at once (a second   130              KILLED     killed           jobspec.stop_reason
      Ctrl-C), no checkpoint
    stopped before one         128+N (signal N) KILLED     killed           jobspec.stop_reason
    failed                     the ranks' (a    FAILED     failed           jobspec.failure_reason
                               rank killed by
                               signal N: 128+N)

A run resumed from a checkpoint continues the same MLflow run; its end replaces the tags of the
earlier end (a finished run keeps no stale failure or stop reason). launch.sh requeues a Slurm job
that exits 75 after its SIGUSR1. The worker itself exits 0 when it stops with a checkpoint
(DeepSpeed's launch.py would kill the other ranks mid-shutdown on a non-zero exit): the launcher
reads the stop from summary.json.
"""
from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobspec.rundir import RunSummary

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "try again later" -- here, resume from the checkpoint
STATUS_TAG = "jobspec.status"
STOP_TAG = "jobspec.stop_reason"
FAILURE_TAG = "jobspec.failure_reason"


@dataclass
class Ending:
    status: str              # MLflow run status: FINISHED | KILLED | FAILED
    label: str               # jobspec.status tag: finished | preempted | killed | failed
    exit_code: int
    reason: str | None = None

    def tags(self) -> tuple[dict, tuple]:
        """(tags to set, tags to delete): this ending's reason replaces any earlier one."""
        tags = {STATUS_TAG: self.label}
        if self.label == "failed":
            tags[FAILURE_TAG] = self.reason or "failed"
        elif self.label != "finished":
            tags[STOP_TAG] = self.reason or self.label
        return tags, tuple(t for t in (STOP_TAG, FAILURE_TAG) if t not in tags)


def ending(exit_code: int, user_signal: int | None, reason: str | None, summary: RunSummary | None,
           stop_after_steps: int | None = None, at_once: bool = False) -> Ending:
    """The run's ending from the runner's outcome and rank 0's summary.json. `at_once`: a second
    Ctrl-C ended the job without waiting (a checkpoint the ranks finished first still counts)."""
    status = summary.status if summary else None
    stopped_codes = (0, 128 + (user_signal or 0), 128 + signal.SIGINT if at_once else 0)
    if summary and status == "preempted" and summary.checkpoint and exit_code in stopped_codes:
        return Ending("KILLED", "preempted", EXIT_PREEMPTED,
                      stop_reason(summary, user_signal, stop_after_steps))
    if summary and status == "finished" and (user_signal or at_once):
        # rank 0 writes "finished" after the last step, its checkpoint and the export: a stop that
        # came later ended only the processes' teardown, so the run is what it says
        return Ending("FINISHED", "finished", 0)
    if at_once:
        return Ending("KILLED", "killed", exit_code, "ended at once by a second SIGINT (Ctrl-C), "
                                                     "without waiting for the checkpoint")
    if user_signal:
        return Ending("KILLED", "killed", exit_code,
                      f"stopped by {signal_words(user_signal)} before a checkpoint was saved")
    if exit_code == 0:
        return Ending("FINISHED", "finished", 0)
    error = summary.error if summary and status == "failed" else None
    return Ending("FAILED", "failed", exit_code,
                  error or reason or f"runner exited with code {exit_code}")


def from_summary(summary: RunSummary | None) -> Ending | None:
    """The ending summary.json records, for a run closed without its launcher (`jobspec sync`)."""
    if summary is None:
        return None
    status = summary.status
    if status == "finished":
        return Ending("FINISHED", "finished", 0)
    if status == "preempted":
        return Ending("KILLED", "preempted", EXIT_PREEMPTED, stop_reason(summary, None, None))
    if status == "failed":
        return Ending("FAILED", "failed", int(summary.exit_code or 1), summary.error or "failed")
    return None


def stop_reason(summary: RunSummary, user_signal: int | None, stop_after_steps: int | None) -> str:
    if user_signal:
        why = signal_words(user_signal)
    elif stop_after_steps and (summary.steps or 0) >= stop_after_steps:
        why = f"--stop-after-steps {stop_after_steps}"
    else:
        why = "SIGUSR1 (Slurm's time-limit warning or a preemption)"
    return (f"stopped by {why} at step {summary.steps} of {summary.total_steps}; "
            f"checkpoint {summary.checkpoint}")


def signal_words(sig: int) -> str:
    """A stop signal and where it usually comes from, for the run's record."""
    name = signal.Signals(sig).name
    return {signal.SIGINT: f"{name} (Ctrl-C)", signal.SIGHUP: f"{name} (the terminal hung up)"}.get(
        signal.Signals(sig), f"{name} from the user")


def resume_command(job: str, overrides: list[str], resume_setting: str,
                   checkpoint_dir: str | None = None) -> str:
    """The command that continues a stopped run: the same one, `checkpoint.resume=auto` if it was
    not, and `checkpoint.dir=DIR` when a plain relaunch would pick another of the spec's checkpoint
    directories (`checkpoint_dir`: the one to continue; launch/decision.choose decides which)."""
    kept = [o for o in overrides if resume_setting == "auto"
            or not o.startswith("checkpoint.resume=")]
    if resume_setting != "auto":
        kept.append("checkpoint.resume=auto")
    if checkpoint_dir is not None:
        kept = [o for o in kept if not o.startswith("checkpoint.dir=")] \
            + [f"checkpoint.dir={checkpoint_dir}"]
    return shlex.join(["jobspec", "launch", job, *[a for o in kept for a in ("--set", o)]])


def closing_line(end: Ending, run_dir, resume: str, resumes_from: str | None = None) -> str:
    """The launcher's last lines. `resumes_from`: what `resume` would start from now ("checkpoint
    DIR/stepK (step K of N)", or None: no checkpoint of this run exists, it starts at step 0)."""
    if end.label == "preempted":
        return (f"jobspec: stopped, not finished (exit {end.exit_code}): {end.reason}; run "
                f"directory {run_dir}\njobspec: resume with: {resume}")
    text = f"jobspec: {end.label} (exit {end.exit_code}); run directory {run_dir}"
    if end.reason and end.label != "finished":
        text += f"\njobspec: {end.reason.strip().splitlines()[0]}"
    # stopped by the user before a checkpoint: say plainly what a relaunch does
    if end.label == "killed":
        text += ("\njobspec: no checkpoint was saved by this stop; " +
                 (f"{resume} resumes from the last one saved before it, {resumes_from}"
                  if resumes_from
                  else f"no checkpoint of this run exists, so {resume} starts it again from step "
                       "0"))
    return text
