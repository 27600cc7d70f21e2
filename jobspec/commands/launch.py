"""Validate, compile and run a job: a new run directory, an MLflow run, and DeepSpeed's runner.

The terminal shows a header before anything starts (job, model, settings, hardware, the memory plan
against the device's memory, the MLflow run and how to open it; a warning when a job sized for GPUs
runs on CPU ranks), the progress, and a closing summary (also in summary.json and as the MLflow
run's description). DeepSpeed's, torch's and MLflow's own log lines go to launcher.log only, and the
libraries' warnings in the launcher's own process (its checks, the planner's trace) to
~/.cache/jobspec/logs/launch.log; --verbose shows them. A job whose checkpoints already reach its
last step is not launched again: the launch says so and how to train again; --dry-run says whether a
launch would start fresh, resume at step K, or do nothing.

Each launch creates <output_dir>/run-<UTC time>-<hex>/ with the compiled files, launcher.log and
summary.json. The runner runs in its own process group: Ctrl-C / SIGTERM are forwarded (the worker
checkpoints and stops; after a grace period the whole group is killed), SIGUSR1 asks the ranks to
checkpoint and stop (Slurm preemption). Exit status: 0 finished; 75 stopped with a checkpoint (the
same command resumes it; MLflow KILLED, tag jobspec.status=preempted); 128+N stopped before a
checkpoint, or a rank killed, by signal N; else the ranks' (1 runtime failure, 2 bad input).

Checkpoints are owned by one job (checkpoint.dir/jobspec_job.json): another job's checkpoints, or
existing ones with `checkpoint.resume: never`, make the launch refuse (exit 2); `resume: auto`
continues them and the same MLflow run. One launch at a time holds them (a lease with a heartbeat,
checkpoint.dir/jobspec_lease.json): a second launch of the job refuses (exit 2) naming the running
one; a lease left by a dead launcher is taken over. The checkpoints remember what they were trained
under (a fingerprint: model, data and its content, task, optimizer, schedule, batch, precision,
seed): a changed spec is refused (exit 2) with every changed field, unless `--continue` (more steps,
other eval data; recorded in the MLflow run as a new segment) or `--new-run` (fresh checkpoints in
<checkpoint.dir>-N beside the old ones; a later launch of the same spec resumes them).

Memory (docs/memory-planner.md): `memory.fit: auto` replaces batch split, precision, checkpointing,
optimizer and ZeRO/offload settings by the fastest ones predicted to fit `memory.gpu_memory` (else
the GPUs' free memory) and prints the choice; on a GPU host a plan larger than the free memory
refuses to launch (exit 2). The plan is logged as `plan.*` MLflow params and in launch.json.

`--from-run RUN_ID` launches the spec an MLflow run logged (its resolved.yaml) again, compiled to
the same DeepSpeed config; the new run is tagged `jobspec.parent_run_id`
(jobspec/launch/from_run.py). Model directories the job exported (spec section `export`) are
recorded in the MLflow run at the end.
"""
from __future__ import annotations

from jobspec import library_log
from jobspec.commands import add_set_argument
from jobspec.errors import spec_error
from jobspec.launch.supervise import KILL_GRACE_S


def add_arguments(parser) -> None:
    parser.add_argument("job", metavar="JOB", nargs="?",
                        help="job spec (YAML); omitted with --from-run")
    parser.add_argument("--from-run", metavar="RUN_ID", default=None,
                        help="launch again the spec an MLflow run logged (its resolved.yaml); the "
                             "new run is tagged jobspec.parent_run_id")
    parser.add_argument("--tracking-uri", metavar="URI", default=None,
                        help="tracking store holding --from-run's run (default: "
                             "MLFLOW_TRACKING_URI, else sqlite:///mlflow.db); the new run logs "
                             "there too")
    add_set_argument(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the DeepSpeed config, notes and exact command; start nothing")
    changed = parser.add_mutually_exclusive_group()
    changed.add_argument("--new-run", action="store_true",
                         help="train from scratch in a new checkpoint directory beside the job's "
                              "earlier checkpoints (<checkpoint.dir>-2, -3, ...), which stay "
                              "untouched")
    changed.add_argument("--continue", dest="continue_run", action="store_true",
                         help="go on from the job's checkpoints with a spec changed in ways that "
                              "are safe to continue (more steps or epochs, other eval data); the "
                              "changes are recorded in the MLflow run with the step they took "
                              "effect")
    parser.add_argument("--stop-after-steps", type=int, default=None, metavar="K",
                        help="stop gracefully after K optimizer steps (checkpoint, status "
                             "preempted, exit 75)")
    parser.add_argument("--ignore-preflight", action="store_true",
                        help="warn instead of refusing when host checks fail (GPU count, free GPU "
                             "memory, port in use)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show DeepSpeed's, torch's and MLflow's own log lines too "
                             "(launcher.log always has them) and the libraries' warnings (else in "
                             f"{library_log.log_path('launch')})")
    parser.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, metavar="SECONDS",
                        help="after Ctrl-C/SIGTERM, wait this long for a checkpoint before killing "
                             f"the job (default {KILL_GRACE_S:.0f})")


def run(args) -> int:
    import logging

    from jobspec.launch import pipeline
    from jobspec.launch.context import LaunchOptions
    from jobspec.launch.from_run import job_argument

    logging.basicConfig(level=logging.INFO, format="jobspec: %(message)s")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise spec_error("--stop-after-steps must be >= 1", hint="e.g. --stop-after-steps 5")
    return pipeline.launch(job_argument(args), args.overrides, LaunchOptions(
        dry_run=args.dry_run, stop_after_steps=args.stop_after_steps,
        ignore_preflight=args.ignore_preflight,
        kill_grace_s=args.kill_grace, verbose=args.verbose, new_run=args.new_run,
        continue_run=args.continue_run))
