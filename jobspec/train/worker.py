"""The training worker: one process per rank, started by the deepspeed runner.

    deepspeed --num_gpus N --master_port P --module jobspec.train.worker --run-dir DIR

It reads only the run directory (resolved.yaml, ds_config.json, patches.json, launch.json) and
the environment the runner sets. This module is the process: the stop flag (SIGUSR1/SIGTERM), the
launcher watch, the process group, and the failure summary and exit code of a run that fails; what
the rank trains is assembled by jobspec.train.assembly (the engine resumed, rank 0's outputs) and
trained by jobspec.train.trainer.Trainer for `derived.total_steps` optimizer steps with its policies
(logging, evaluation, checkpoints, export, stop, OOM, NaN). Rank 0 writes `summary.json`.
`preload(run_dir)` imports what a rank of the run imports, for a node launcher that forks its ranks
(jobspec/train/preload.py, jobspec/launch/rank_forks.py).

Env: JOBSPEC_PROGRESS=bar|lines|none, JOBSPEC_STOP_AFTER_STEPS=K (behave as if signalled after K
steps: for tests and debugging), JOBSPEC_INJECT_NAN_AT_STEP=K (a NaN loss in step K, to test
`training.on_nan`: see jobspec/train/faults.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from jobspec import launcher_log, lifeline, rundir
from jobspec.errors import EXIT_INVALID, EXIT_RUN_FAILED, RunFailure, SpecError
from jobspec.export.hf_dir import ExportFailed
from jobspec.quick_exit import quick_exit
from jobspec.rundir import RunFiles
from jobspec.spec.derived import DerivedJob
from jobspec.train import assembly, library_output
from jobspec.train.engine import share_cpu_threads
from jobspec.train.faults import NonFiniteLoss
from jobspec.train.preload import rank_imports as preload  # noqa: F401 -- the node launcher's hook
from jobspec.train.progress import RunState, summarize
from jobspec.train.startup import StartupClock
from jobspec.train.stopping import StopFlag, StopVote


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobspec.train.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path,
                        help="run directory written by compile/launch")
    parser.add_argument("--local_rank", "--local-rank", type=int,
                        default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed runner")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    library_output.before_imports(int(os.environ.get("RANK", "0")))  # before transformers & co.
    started = time.time()
    state = RunState()
    try:
        return train(run_dir, state, started)  # the engine picks its device from LOCAL_RANK
    except SpecError as err:
        _write_failure(run_dir, state, started, err.render())
        _print_spec_error(err.render())
        return EXIT_INVALID
    except RunFailure as err:  # the spec was fine; the run was not: one line, exit 1
        _write_failure(run_dir, state, started, err.reason)
        # a failure every rank shares (an export's broadcast error) is printed once
        if not (err.collective or isinstance(err, ExportFailed)) \
                or int(os.environ.get("RANK", "0")) == 0:
            print(f"ERROR: {err.reason}", file=sys.stderr, flush=True)
        return EXIT_RUN_FAILED
    except NonFiniteLoss as err:  # training.on_nan: stop -- a clear failure, not a traceback
        if err.step:  # found at a log/checkpoint boundary: the good steps end before the bad one
            state.step = min(state.step, err.step - 1)
        _write_failure(run_dir, state, started, str(err))
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        return 1
    except BaseException as err:
        _write_failure(run_dir, state, started,
                       f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    finally:
        _destroy_process_group()


def train(run_dir: Path, state: RunState, started: float) -> int:
    """This rank's run: the process group, the engine resumed, the outputs, and the Trainer's steps
    (jobspec.train.assembly, jobspec.train.trainer); rank 0 writes summary.json."""
    files = rundir.read_run_files(run_dir)
    stop = StopFlag()
    stop.install()
    # a SIGKILLed launcher cannot end us: we end the job ourselves once it is gone
    lifeline.watch_launcher(lambda record: lifeline.end_orphaned_job(record,
                                                                     os.environ.get("MASTER_PORT")))
    startup = StartupClock.for_rank(files.spec, files.launch, state.startup, started)
    control = _start_process_group(run_dir, files, startup)
    import torch.distributed as dist
    rank = dist.get_rank()
    job = DerivedJob.from_dict(files.derived)   # launch.json's derived job: read once, passed on
    built = assembly.build_and_resume(files, job, state, startup, control)
    outputs = assembly.RankOutputs.open(run_dir, files, job, built, state, startup, rank)
    try:
        assembly.announce(built, state, outputs, rank)
        vote = StopVote(stop, control, dist.get_world_size())   # every rank stops at the same step
        trainer = assembly.trainer_for(files, job, built, outputs, state, run_dir=run_dir,
                                       stop=vote, control=control, startup=startup)
        startup.mark("loop")
        del built   # the Trainer holds the engine's only reference: an OOM recovery must free it
        status = trainer.train()
        if rank == 0:
            rundir.write_summary(run_dir, summarize(state, status, job.total_steps, started))
    finally:
        startup.stop()
        outputs.close()
    return 0


def _start_process_group(run_dir: Path, files: RunFiles, startup: StartupClock):
    """The gloo control group of the ranks' votes and counts, once DeepSpeed is imported, the
    libraries' output routed, the ops built, the process group started and the CPU threads shared
    between the node's ranks."""
    import torch.distributed as dist

    from jobspec import ops
    # without MLflow (DeepSpeed's autotuner imports it) on the ranks that never log to it
    deepspeed = ops.import_deepspeed(without_mlflow=int(os.environ.get("LOCAL_RANK", "0")) != 0)
    # the libraries' records and bars to launcher.log (the quiet terminal), before they load a thing
    library_output.route_library_logs(int(os.environ.get("RANK", "0")),
                                      transformers=files.spec["model"]["architecture"] != "mlp",
                                      datasets=bool(files.spec["data"]["train"]))
    startup.mark("imported")
    ops.share_cpu_info(run_dir / rundir.CPU_INFO)
    # first-run op compiles happen here, announced, instead of in silence inside DeepSpeed
    ops.ensure_built(ops.needed_ops(files.ds_config), announce=_node_leader_says)
    ops.skip_unused_ops()   # DeepSpeed's shm all-reduce op: built and loaded for nothing here
    startup.mark("ops")
    deepspeed.init_distributed()
    startup.mark("distributed")
    share_cpu_threads()
    # Stop votes go over gloo on the host: an NCCL vote would sync the GPU at every step.
    return dist.new_group(backend="gloo")


def _write_failure(run_dir: Path, state: RunState, started: float, error: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    try:
        rundir.write_summary(run_dir, summarize(state, "failed", None, started, error=error))
    except OSError:
        pass  # the original error matters more than a summary we cannot write


def _print_spec_error(text: str) -> None:
    """Bad input (a data row, a checkpoint to resume) is found alike by every rank, which read the
    same files: rank 0 prints it; the others write theirs to launcher.log only (`jobspec-log:`
    lines, kept off the terminal), where it still shows should some rank fail alone."""
    rank = int(os.environ.get("RANK", "0"))
    # one write each: the ranks share the pipe, and print()'s separate "\n" let another rank's line
    # in before it (rank 0's last line and rank 1's log-only line then reached the terminal as one
    # line)
    if rank == 0:
        sys.stderr.write(text.rstrip("\n") + "\n")
    else:
        sys.stderr.write("".join(f"{launcher_log.LOG_ONLY}rank {rank}: {line}\n"
                                 for line in text.splitlines()))
    sys.stderr.flush()


def _node_leader_says(text: str) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node, not once per rank
        sys.stdout.write(f"jobspec: {text}\n")  # one write: the node's ranks share the pipe
        sys.stdout.flush()


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # this rank's /dev/shm all-reduce buffer (CPU accelerator): DeepSpeed never unlinks it, and
        # unlinking is safe while a peer still maps it
        from jobspec.shm import remove_shared_memory_buffers
        remove_shared_memory_buffers(os.environ.get("MASTER_PORT"),
                                     local_rank=int(os.environ.get("LOCAL_RANK", 0)))


if __name__ == "__main__":
    # every file written and tracker closed by now: skip the interpreter's teardown
    quick_exit(main())
