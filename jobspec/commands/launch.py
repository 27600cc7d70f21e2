"""Validate, compile and run a job: a new run directory, an MLflow run, and DeepSpeed's runner.

Each launch creates <output_dir>/run-<UTC time>-<hex>/ with the compiled files, launcher.log and
summary.json. The runner runs in its own process group: Ctrl-C / SIGTERM are forwarded (the worker
checkpoints and stops; after a grace period the whole group is killed), SIGUSR1 asks the ranks to
checkpoint and stop (Slurm preemption). Exit status: the runner's (128+N when stopped by signal N).

Checkpoints are owned by one job (checkpoint.dir/jobspec_job.json): another job's checkpoints, or
existing ones with `checkpoint.resume: never`, make the launch refuse (exit 2); `resume: auto`
continues them and the same MLflow run.

Memory (docs/memory-planner.md): `memory.fit: auto` replaces batch split, precision, checkpointing,
optimizer and ZeRO/offload settings by the fastest ones predicted to fit `memory.gpu_memory` (else
the GPUs' free memory) and prints the choice; on a GPU host a plan larger than the free memory
refuses to launch (exit 2). The plan is logged as `plan.*` MLflow params and in launch.json.

`--from-run RUN_ID` launches the spec an MLflow run logged (its resolved.yaml) again, compiled to
the same DeepSpeed config; the new run is tagged `jobspec.parent_run_id` (jobspec/launch/from_run.py).
Model directories the job exported (spec section `export`) are recorded in the MLflow run at the end.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

from jobspec.memory import at_launch as launch_memory

from jobspec.launch import launcher

from jobspec.launch import slurm

from jobspec.tracking import telemetry
from jobspec.errors import spec_error

HELP = "Validate, compile and run a job through DeepSpeed, logging it to MLflow."
log = logging.getLogger("jobspec.launch")


def add_arguments(parser) -> None:
    parser.add_argument("job", metavar="JOB", nargs="?", help="job spec (YAML); omitted with --from-run")
    parser.add_argument("--from-run", metavar="RUN_ID", default=None,
                        help="launch again the spec an MLflow run logged (its resolved.yaml); the new run is "
                             "tagged jobspec.parent_run_id")
    parser.add_argument("--tracking-uri", metavar="URI", default=None,
                        help="tracking store holding --from-run's run (default: MLFLOW_TRACKING_URI, else "
                             "sqlite:///mlflow.db); the new run logs there too")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set training.max_steps=10 (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the DeepSpeed config, notes and exact command; start nothing")
    parser.add_argument("--stop-after-steps", type=int, default=None, metavar="K",
                        help="stop gracefully (checkpoint, status preempted) after K optimizer steps")
    parser.add_argument("--ignore-preflight", action="store_true",
                        help="warn instead of refusing when host checks fail (GPU count, free GPU memory, port in use)")
    parser.add_argument("--kill-grace", type=float, default=launcher.KILL_GRACE_S, metavar="SECONDS",
                        help="after Ctrl-C/SIGTERM, wait this long for a checkpoint before killing the job "
                             f"(default {launcher.KILL_GRACE_S:.0f})")


def resolve(job: str, overrides: list[str]):
    from jobspec.spec.validation import load_and_validate
    return load_and_validate(job, overrides)


def compile_job(resolved, run_dir: Path, master_port: int):
    """Compiled with the same inputs `jobspec compile` uses, so launch runs what compile shows."""
    from jobspec.commands.compile import compile_resolved
    return compile_resolved(resolved, run_dir=str(run_dir), master_port=master_port)


def write_run_dir(resolved, compiled, run_dir: Path) -> None:
    from jobspec.commands.compile import write_run_files
    write_run_files(run_dir, resolved, compiled)


def progress_mode(setting: str, stdout=sys.stdout) -> str:
    if setting != "auto":
        return setting
    return "bar" if stdout.isatty() else "lines"


def child_env(spec: dict, stop_after_steps: int | None) -> dict:
    env = dict(os.environ)
    telemetry.apply_http_env(env)
    env["JOBSPEC_PROGRESS"] = progress_mode(spec["logging"]["progress"])
    env["PYTHONUNBUFFERED"] = "1"  # ranks' output must reach the relay (and launcher.log) as it happens
    if sys.stdout.isatty():  # the bar writes into a pipe: tell it the terminal's width
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    if stop_after_steps is not None:
        env["JOBSPEC_STOP_AFTER_STEPS"] = str(stop_after_steps)
    return env


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="jobspec: %(message)s")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise spec_error("--stop-after-steps must be >= 1", hint="e.g. --stop-after-steps 5")
    from jobspec.launch.from_run import job_argument
    resolved = resolve(job_argument(args), args.overrides)
    # memory.fit: auto rewrites the spec here, so everything below (and resolved.yaml) sees what runs
    resolved, memory = launch_memory.prepare(resolved)
    for line in memory.lines:
        print(f"jobspec: {line}", flush=True)
    spec = resolved.spec
    port = spec["resources"]["master_port"] or launcher.free_port()

    if args.dry_run:  # nothing is created: the run dir in the command is the name it would get
        run_dir = launcher.new_run_dir_path(spec["output_dir"])
        compiled = compile_job(resolved, run_dir, port)
        argv = launcher.resolve_runner(compiled.launch["argv"])
        print(json.dumps(compiled.ds_config, indent=2))
        for note in compiled.notes:
            print(f"note: {note}")
        print(shlex.join(argv))
        return 0

    resume_run_id = launcher.claim_checkpoints(spec)
    run_dir = launcher.create_run_dir(spec["output_dir"])
    try:
        compiled = compile_job(resolved, run_dir, port)
        problems = launcher.preflight_problems(spec, compiled.launch) + launch_memory.preflight_problems(memory, spec)
        compiled.launch.update(launch_memory.plan_record(memory))  # launch.json: `plan` (MiB), `fit`
        if problems and not args.ignore_preflight:
            raise spec_error("; ".join(problems), hint="fix the spec, or pass --ignore-preflight")
        for problem in problems:
            log.warning("preflight (ignored): %s", problem)
        compiled.launch["argv"] = launcher.resolve_runner(compiled.launch["argv"])  # command.txt stays true
        # inside a multi-node Slurm allocation: one runner per node through srun (docs/slurm.md)
        compiled.launch["argv"] = slurm.launch_argv(compiled.launch, run_dir)
        write_run_dir(resolved, compiled, run_dir)
        tracked = start_tracking(resolved, compiled, run_dir, resume_run_id)
        if tracked is not None:  # next to the ranks' measured mem/* series: prediction error per run
            launch_memory.log_params(tracked, launch_memory.mlflow_params(memory, spec["memory"]["fit"]))
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no half-made run behind
        raise
    launcher.write_owner(spec, resolved.source, tracked.run_id if tracked else None)

    print(f"jobspec: run directory {run_dir}", flush=True)
    outcome = launcher.supervise(compiled.launch["argv"], child_env(spec, args.stop_after_steps), run_dir,
                                 kill_grace_s=args.kill_grace)
    launcher.remove_shared_memory_buffers(compiled.launch.get("master_port"))  # every rank is gone now
    status = "FINISHED" if outcome.exit_code == 0 else ("KILLED" if outcome.user_signal else "FAILED")
    if tracked is not None:
        from jobspec.tracking.model_artifacts import log_exported_models
        log_exported_models(tracked, run_dir, spec)
        telemetry.end_run(tracked, run_dir, status=status, exit_code=outcome.exit_code,
                          failure_reason=outcome.reason)
    elif not (run_dir / "summary.json").exists():
        (run_dir / "summary.json").write_text(json.dumps(
            {"status": status.lower(), "exit_code": outcome.exit_code, "written_by": "launcher"}) + "\n")
    print(f"jobspec: {status.lower()} (exit {outcome.exit_code}); run directory {run_dir}", flush=True)
    return outcome.exit_code


def start_tracking(resolved, compiled, run_dir: Path, resume_run_id: str | None):
    """The MLflow run, or None when MLflow is off or (with `required: false`) unreachable."""
    settings = resolved.spec["logging"]["mlflow"]
    if not settings["enabled"]:
        return None
    try:
        telemetry.probe(settings["tracking_uri"])
        return telemetry.start_run(resolved.spec, compiled.launch, compiled.derived, resolved.text, run_dir,
                                   resume_run_id=resume_run_id)
    except telemetry.TrackingUnavailable as err:
        uri = telemetry.mask_secrets(settings["tracking_uri"])
        if settings["required"]:
            raise spec_error(f"MLflow tracking at {uri} is unavailable: {err}",
                             path=("logging", "mlflow", "tracking_uri"),
                             hint="start the server, fix the URI, or set logging.mlflow.required: false "
                                  "to run with metrics kept in metrics.jsonl")
        log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s", uri, err,
                    run_dir / telemetry.METRICS_FILE)
        return None
