"""`jobspec launch`, start to end: spec -> memory decisions -> compile -> pre-flight -> run directory
-> MLflow run -> supervised DeepSpeed runner -> final status.

    resolve        spec/validation.load_and_validate (exit 2 on any problem)
    prepare        memory/at_launch.prepare: `memory.fit: auto` rewrites the spec; the plan
    claim          launch/ownership.claim_checkpoints: refuse another job's checkpoints; resume id
    derive         spec/inputs.derive_job: every derived number, once (config.json, row count read here)
    run dir        rundir.create_run_dir, then compile/compiler.compile_spec into it
    pre-flight     launch/preflight + memory/at_launch.preflight_problems (--ignore-preflight: warn)
    argv           launch/runner.resolve_runner, launch/slurm.launch_argv (srun per node in Slurm)
    write          rundir.write_compiled (spec.yaml ... launch.json, `plan`/`fit` included)
    track          launch/tracking_start: the reachability probe now; the MLflow run (+ plan.*/fit.*
                   params) and launch/ownership.write_owner (with its run id, for a resume) in a
                   thread while the runner starts; the ranks wait for tracking.json
    supervise      launch/supervise.run: ranks run, output to launcher.log
    end            shm buffers removed, fallback summary.json, tracking end_run with the status

Anything failing before the runner starts removes the new run directory: no half-made run is left.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

from jobspec import hardware, rundir, shm
from jobspec.errors import spec_error
from jobspec.launch import ownership, preflight, runner, slurm, supervise, tracking_start
from jobspec.memory import at_launch as launch_memory
from jobspec.tracking import telemetry

log = logging.getLogger("jobspec.launch")


def launch(job: str, overrides: list[str], *, dry_run: bool = False, stop_after_steps: int | None = None,
           ignore_preflight: bool = False, kill_grace_s: float = supervise.KILL_GRACE_S) -> int:
    """Run the job; the runner's exit status (128+N when stopped by signal N)."""
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(job, overrides)
    # memory.fit: auto rewrites the spec (and its derived job) here, so everything below sees what runs
    gpu_free = hardware.gpu_free_bytes(resolved.spec["resources"]["gpus_per_node"])
    resolved, derived, memory = launch_memory.prepare(resolved, derive_job(resolved.spec), gpu_free,
                                                      bf16_supported=hardware.bf16_supported())
    for line in memory.lines:
        print(f"jobspec: {line}", flush=True)
    spec = resolved.spec
    port = spec["resources"]["master_port"] or runner.free_port()

    if dry_run:  # nothing is created: the run dir in the command is the name it would get
        run_dir = rundir.new_run_dir_path(spec["output_dir"])
        compiled = compile_job(resolved, derived, run_dir, port)
        argv = runner.resolve_runner(compiled.launch["argv"])
        print(json.dumps(compiled.ds_config, indent=2))
        for note in compiled.notes:
            print(f"note: {note}")
        print(shlex.join(argv))
        return 0

    resume_run_id = ownership.claim_checkpoints(spec)
    run_dir = rundir.create_run_dir(spec["output_dir"])
    try:
        compiled = compile_job(resolved, derived, run_dir, port)
        problems = preflight.preflight_problems(spec, derived) + \
            launch_memory.preflight_problems(memory, gpu_free)
        compiled.launch.update(launch_memory.plan_record(memory))  # launch.json: `plan` (MiB), `fit`
        if problems and not ignore_preflight:
            raise spec_error("; ".join(problems), hint="fix the spec, or pass --ignore-preflight")
        for problem in problems:
            log.warning("preflight (ignored): %s", problem)
        compiled.launch["argv"] = runner.resolve_runner(compiled.launch["argv"])  # command.txt stays true
        # inside a multi-node Slurm allocation: one runner per node through srun (docs/slurm.md)
        compiled.launch["argv"] = slurm.launch_argv(compiled.launch, run_dir)
        rundir.write_compiled(run_dir, resolved, compiled)
        track = tracking_start.probe(spec, run_dir)  # quick: an unreachable required server fails here
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no half-made run behind
        raise
    env = child_env(spec, stop_after_steps)
    tracking = None
    if track:  # the MLflow run is made while the runner and ranks start (jobspec/launch/tracking_start.py)
        env[tracking_start.PENDING_ENV] = "1"
        tracking = tracking_start.TrackingStart(  # + the plan's params: prediction error per run in MLflow
            resolved, compiled, run_dir, resume_run_id, launch_memory.mlflow_params(memory, spec["memory"]["fit"]),
            on_done=lambda run: ownership.write_owner(spec, resolved.source, run.run_id if run else None))
    else:
        ownership.write_owner(spec, resolved.source, None)

    print(f"jobspec: run directory {run_dir}", flush=True)
    outcome = supervise.run(compiled.launch["argv"], env, run_dir, kill_grace_s=kill_grace_s)
    shm.remove_shared_memory_buffers(compiled.launch.get("master_port"))  # every rank is gone now
    status = "FINISHED" if outcome.exit_code == 0 else ("KILLED" if outcome.user_signal else "FAILED")
    rundir.write_fallback_summary(run_dir, status, outcome.exit_code)
    tracked = tracking.result() if tracking else None  # RunFailure: required, not made (the ranks stopped)
    if tracked is not None:
        telemetry.end_run(tracked, run_dir, status=status, exit_code=outcome.exit_code,
                          failure_reason=outcome.reason)
    print(f"jobspec: {status.lower()} (exit {outcome.exit_code}); run directory {run_dir}", flush=True)
    return outcome.exit_code


def compile_job(resolved, derived, run_dir: Path, master_port: int):
    """Compiled from the same derived job `jobspec compile` uses, so launch runs what compile shows."""
    from jobspec.compile.compiler import compile_spec
    return compile_spec(resolved.spec, derived, run_dir=str(run_dir), master_port=master_port)


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
