"""`jobspec launch`, start to end: spec -> memory decisions -> compile -> pre-flight -> run directory
-> MLflow run -> supervised DeepSpeed runner -> final status.

    resolve        spec/validation.load_and_validate (exit 2 on any problem)
    model.config   launch/model_config: an architecture outside the shipped table, against transformers
    data           datacheck.preflight_issues: the data files' first rows (exit 2, at data.train/eval)
    prepare        memory/at_launch.prepare: `memory.fit: auto` rewrites the spec; the plan
    orphans        launch/orphans: close runs of output_dir whose launcher died without closing them
    claim          launch/ownership.claim_checkpoints: refuse another job's checkpoints; resume id
    derive         spec/inputs.derive_job: every derived number, once (config.json, row count read here)
    run dir        rundir.create_run_dir, then compile/compiler.compile_spec into it
    pre-flight     launch/preflight + memory/at_launch.preflight_problems (--ignore-preflight: warn)
    argv           launch/runner.resolve_runner, launch/slurm.launch_argv (srun per node in Slurm)
    write          rundir.write_compiled (spec.yaml ... launch.json, `plan`/`fit` included)
    track          tracking/run.start_run (+ plan.*/fit.* params), or None
    own            launch/ownership.write_owner (with the MLflow run id, for a resume)
    supervise      launch/supervise.run: ranks run, output to launcher.log (launcher.json: who runs it)
    end            shm buffers removed, status.ending (exit code, MLflow status and tags, last line)

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

from jobspec import hardware, lifeline, rundir, shm
from jobspec import status as run_status
from jobspec.errors import RunFailure, SpecError, SpecIssue
from jobspec.launch import orphans, ownership, preflight, runner, slurm, supervise
from jobspec.spec import datacheck
from jobspec.memory import at_launch as launch_memory
from jobspec.secrets import mask_secrets
from jobspec.tracking import run as tracking

log = logging.getLogger("jobspec.launch")


def launch(job: str, overrides: list[str], *, dry_run: bool = False, stop_after_steps: int | None = None,
           ignore_preflight: bool = False, kill_grace_s: float = supervise.KILL_GRACE_S) -> int:
    """Run the job; its exit status (jobspec/status.py: 0 finished, 75 stopped with a checkpoint,
    128+N stopped or killed by signal N, else the ranks')."""
    from jobspec.launch.model_config import launch_model_config_issues
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(job, overrides)
    # `model.config` of an architecture outside the shipped table: checked against transformers now,
    # before anything starts, with the same positioned errors validate gives for the others
    model_config_problems = launch_model_config_issues(resolved)
    if model_config_problems:
        raise SpecError(model_config_problems)
    data_issues = datacheck.preflight_issues(resolved.spec)  # before any rank (or row count) reads them
    if data_issues:
        raise resolved.locate(SpecError(data_issues))
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

    orphans.close_orphans_under(spec["output_dir"])  # runs a SIGKILLed launcher left RUNNING here
    resume_run_id = ownership.claim_checkpoints(spec)
    run_dir = rundir.create_run_dir(spec["output_dir"])
    try:
        compiled = compile_job(resolved, derived, run_dir, port)
        problems = preflight.preflight_issues(spec, derived) + \
            [SpecIssue(("memory",), text) for text in launch_memory.preflight_problems(memory, gpu_free)]
        compiled.launch.update(launch_memory.plan_record(memory))  # launch.json: `plan` (MiB), `fit`
        if problems and not ignore_preflight:
            raise preflight.refusal(resolved, problems)
        for problem in problems:
            log.warning("preflight (ignored): %s (%s)", problem.message, problem.dotted_path)
        compiled.launch["argv"] = runner.resolve_runner(compiled.launch["argv"])  # command.txt stays true
        # inside a multi-node Slurm allocation: one runner per node through srun (docs/slurm.md)
        compiled.launch["argv"] = slurm.launch_argv(compiled.launch, run_dir)
        rundir.write_compiled(run_dir, resolved, compiled)
        rundir.write_launcher(run_dir, lifeline.identity())  # who to ask whether this run still runs
        tracked = start_tracking(resolved, compiled, run_dir, resume_run_id)
        if tracked is not None:  # next to the ranks' measured mem/* series: prediction error per run
            orphans.tag_run(tracked, run_dir)
            tracking.log_params(tracked, launch_memory.mlflow_params(memory, spec["memory"]["fit"]))
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no half-made run behind
        raise
    ownership.write_owner(spec, resolved.source, tracked.run_id if tracked else None)

    print(f"jobspec: run directory {run_dir}", flush=True)
    outcome = supervise.run(compiled.launch["argv"], child_env(spec, stop_after_steps), run_dir,
                            kill_grace_s=kill_grace_s)
    shm.remove_shared_memory_buffers(compiled.launch.get("master_port"))  # every rank is gone now
    end = run_status.ending(outcome.exit_code, outcome.user_signal, outcome.reason, rundir.read_summary(run_dir),
                            stop_after_steps)
    rundir.write_fallback_summary(run_dir, end.status, end.exit_code)
    if tracked is not None:
        from jobspec.tracking.model_artifacts import log_exported_models
        log_exported_models(tracked, run_dir, spec)
        tracking.end_run(tracked, run_dir, status=end.status, exit_code=end.exit_code, tags=end.tags())
    rundir.mark_launcher_ended(run_dir, end.status, end.exit_code)
    print(run_status.closing_line(end, run_dir, run_status.resume_command(job, overrides, spec["checkpoint"]["resume"])),
          flush=True)
    return end.exit_code


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
    tracking.apply_http_env(env)
    env["JOBSPEC_PROGRESS"] = progress_mode(spec["logging"]["progress"])
    env["PYTHONUNBUFFERED"] = "1"  # ranks' output must reach the relay (and launcher.log) as it happens
    if sys.stdout.isatty():  # the bar writes into a pipe: tell it the terminal's width
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    if stop_after_steps is not None:
        env["JOBSPEC_STOP_AFTER_STEPS"] = str(stop_after_steps)
    return env


def start_tracking(resolved, compiled, run_dir: Path, resume_run_id: str | None):
    """The MLflow run, or None when MLflow is off or (with `required: false`) unreachable."""
    settings = resolved.spec["logging"]["mlflow"]
    if not settings["enabled"]:
        return None
    try:
        tracking.probe(settings["tracking_uri"])
        return tracking.start_run(resolved.spec, compiled.launch, compiled.derived.as_dict(), resolved.text, run_dir,
                                  resume_run_id=resume_run_id)
    except tracking.TrackingUnavailable as err:
        uri = mask_secrets(settings["tracking_uri"])
        if settings["required"]:
            raise RunFailure(f"MLflow tracking at {uri} is unavailable: {err}; start the server, fix "
                             "logging.mlflow.tracking_uri, or set logging.mlflow.required: false to run with "
                             "metrics kept in metrics.jsonl")
        log.warning("MLflow tracking at %s is unavailable (%s); continuing, metrics go to %s", uri, err,
                    run_dir / rundir.METRICS)
        return None
