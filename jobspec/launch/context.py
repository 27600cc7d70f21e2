"""One launch's context: what the command line asked (LaunchOptions) and what the launcher holds and
found while it runs the job (LaunchContext), passed whole through launch/pipeline instead of a
dozen parameters; and the command that continues a job's checkpoints (`resume_hint`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jobspec import status as run_status
from jobspec.hardware import Host
from jobspec.launch import decision, lease, snapshot, supervise
from jobspec.launch.decision import Decision, Lineage
from jobspec.launch.snapshot import CheckpointSnapshot
from jobspec.launch.standby import Standby
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.job.prepare import PreparedJob
    from jobspec.spec.validation import ResolvedSpec


@dataclass(frozen=True)
class LaunchOptions:
    """What the command line asks of a launch (`jobspec launch`'s flags)."""

    dry_run: bool = False
    stop_after_steps: int | None = None
    ignore_preflight: bool = False
    kill_grace_s: float = supervise.KILL_GRACE_S
    verbose: bool = False
    new_run: bool = False
    continue_run: bool = False


@dataclass(frozen=True)
class LaunchContext:
    """One launch from its decision on, while it holds the checkpoint directory's lease: what was
    asked (the job argument, overrides, options), the spec as written, the job prepared for the
    chosen checkpoints, the decision made under the lease and the snapshot it was made from, what
    the launcher holds (the lease, the stop handler) and what it found (host, port)."""

    job: str
    overrides: tuple[str, ...]
    options: LaunchOptions
    as_written: ResolvedSpec          # before memory.fit and the checkpoint directory chosen
    prepared: PreparedJob             # what runs
    decision: Decision                # new, resume or complete: never a refusal
    snapshot: CheckpointSnapshot      # what the decision was made on
    held: lease.Lease
    stops: supervise.HeldStops
    port: int
    found: Host
    style: bool                       # the progress bar's bold labels
    # start-up timestamps, appended as it goes (launcher.log)
    phases: list[tuple[str, float, float]]
    data_how: str | None = None       # the data pass: prepared | cached | None (no data to prepare)
    waiting: Standby | None = None    # a node launcher importing what the ranks import

    @property
    def spec(self) -> JobSpec:
        return self.prepared.resolved.spec

    @property
    def chosen(self) -> Lineage:
        """The checkpoints this launch trains into."""
        assert self.decision.lineage is not None   # a refusal never gets this far
        return self.decision.lineage

    @property
    def gpu_free(self) -> int | None:
        """The free GPU memory the plan was made against (prepare_job's Host:
        JOBSPEC_FAKE_GPU_FREE_BYTES in tests), which the header leaves out where `found` has no
        GPU."""
        return self.prepared.host.gpu_free if self.prepared.host is not None else None

    def resume_hint(self, checkpoint_dir: Path,
                    found: CheckpointSnapshot | None = None) -> str:
        """The command that continues the checkpoints in `checkpoint_dir` (`resume_hint`), judged
        on `found` (else the disk read now)."""
        return resume_hint(self.job, list(self.overrides), self.as_written, self.prepared.derived,
                           checkpoint_dir, found)


def resume_hint(job: str, overrides: list[str], as_written: ResolvedSpec, derived,
                checkpoint_dir: Path,
                found: CheckpointSnapshot | None = None) -> str:
    """The command that continues the checkpoints in `checkpoint_dir`: the launch's own command
    (`checkpoint.resume=auto` added if it was not) when a relaunch of it picks that directory
    (launch/decision.choose: the newest unfinished one of the same spec), else with the directory
    named. `found`: the snapshot of the spec's checkpoint directories to judge on (else read now).
    A `--new-run` flag is never part of it: it would start yet another line of checkpoints."""
    plain = run_status.resume_command(job, overrides, as_written.spec["checkpoint"]["resume"])
    resumed: JobSpec = {**as_written.spec,
                        "checkpoint": {**as_written.spec["checkpoint"], "resume": "auto"}}
    found = found or snapshot.take(resumed, derived.as_dict())
    picked = decision.decide(found, resumed, derived.as_dict()).checkpoint_dir
    if picked is not None and Path(picked).resolve() == Path(checkpoint_dir).resolve():
        return plain
    return run_status.resume_command(job, overrides, as_written.spec["checkpoint"]["resume"],
                                     str(checkpoint_dir))
