"""`jobspec launch`, start to end: spec -> memory decisions -> compile -> pre-flight -> run
directory -> header -> supervised DeepSpeed runner, with the MLflow run created meanwhile -> closing
summary.

    prepare        job/prepare.prepare_job, the path `jobspec compile` and `plan` take too:
      resolve        spec/validation.load_and_validate (exit 2 on any problem)
      model.config   job/model_config (through prepare_job's job/checks): a hub id's config, a
                     type outside the table
      data           data/record_checks: every data record (validate), exit 2 at
                     data.train/eval file:line; data/preflight: the tokenizer transformers loads,
                     the chat template on the records
      derive         spec/inputs.derive_job: every derived number, once (config.json, row count
                     read here)
      memory         memory/at_launch.plan_at_launch: `memory.fit: auto` rewrites the spec (every
                     rule runs again on it); the plan
    decide         launch/snapshot.take reads the checkpoint directories once (checkpoints, owner,
                   latest step, lease, the run that wrote them); launch/decision.decide maps that
                   and the spec to new, resume at step K, complete (then nothing starts) or a
                   refusal, exit 2: a changed spec (--continue, --new-run), another job's
                   checkpoints, files no job claims, resume: never over checkpoints, a running
                   launch
    data cache     data/prepare.prepare_data: chat and prompt/completion records tokenised once
    lease          launch/lease.acquire on the chosen directory; under it the snapshot is taken
                   and decided again: a decision for another directory refuses (a launch that ended
                   meanwhile moved the checkpoints on)
    orphans        tracking/orphans: close runs of output_dir whose launcher died without closing
                   them
    run dir        rundir.create_run_dir, then compile/compiler.compile_spec into it
    pre-flight     launch/preflight + memory/at_launch.preflight_problems (--ignore-preflight: warn)
    argv           launch/backends.backend_for: the plan's argv, built once (one node: DeepSpeed's
                   launch.py; several: its runner; inside Slurm: srun, one runner per node)
    write          rundir.write_compiled (spec.yaml ... launch.json, `plan`/`fit` included,
                   command.txt = the argv that runs); launcher.json
    header         launch/console.header_lines: job, model, settings, hardware, memory plan vs
                   device
    supervise      launch/supervise.run: ranks run, output to launcher.log, the terminal gets what
                   launch/quiet.TerminalFilter keeps (all of it with --verbose)
    track          launch/tracking.BackgroundTracking, while the runner starts: the MLflow run
                   (+ plan.*/fit.* params) or None; the checkpoint owner record (with the run id)
    end            shm buffers removed, status.ending (exit code: 0, 75 stopped with a checkpoint,
                   128+N; MLflow status and tags), exported models recorded, the closing summary
                   (printed, in summary.json and as the MLflow run's description), tracking end_run

Anything failing before the runner starts removes the new run directory: no half-made run is left;
a required MLflow run that cannot be created stops the runner and removes it too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from jobspec import hardware, launcher_log, lifeline, ops, rundir, shm
from jobspec import status as run_status
from jobspec.compile.compiler import Compiled
from jobspec.compile.launch_plan import LaunchPlan
from jobspec.data import prepare as data_prep
from jobspec.errors import SpecError, SpecIssue, spec_error
from jobspec.launch import (
    backends,
    console,
    decision,
    hub,
    intent,
    lease,
    preflight,
    quiet,
    runner,
    snapshot,
    standby,
    supervise,
)
from jobspec.launch import tracking as launch_tracking
from jobspec.launch.context import LaunchContext, LaunchOptions
from jobspec.launch.decision import Decision
from jobspec.launch.snapshot import CheckpointSnapshot
from jobspec.memory import at_launch as launch_memory
from jobspec.memory import plan_figures
from jobspec.memory.at_launch import LaunchMemory
from jobspec.memory.planner import ALLOCATOR_VARIABLE, allocator_conf
from jobspec.secrets import mask_secrets
from jobspec.spec.types import JobSpec
from jobspec.tracking import orphans
from jobspec.tracking import run as tracking_run

log = logging.getLogger("jobspec.launch")


def launch(job: str, overrides: list[str], options: LaunchOptions = LaunchOptions()) -> int:
    """Run the job; its exit status (jobspec/status.py: 0 finished, 75 stopped with a checkpoint,
    128+N stopped or killed by signal N, else the ranks')."""
    from jobspec.spec.validation import load_and_validate

    phases = [("start", launcher_log.process_start(), 0.0)]
    resolved = load_and_validate(job, overrides)
    # ranks forked from a node launcher: it imports what they import while this process plans
    waiting = standby.Standby.start(resolved.spec) \
        if not options.dry_run and standby.wanted(resolved.spec) else None
    try:
        return _launch_validated(job, overrides, options, resolved, phases, waiting)
    finally:
        if waiting is not None:
            waiting.abandon()   # unless the runner took it over


def _launch_validated(job: str, overrides: list[str], options: LaunchOptions, resolved,
                      phases: list, waiting: standby.Standby | None) -> int:
    """The launch of a validated spec (see `launch`)."""
    from jobspec.job.prepare import PLANNED, prepare_job

    # memory.fit: auto rewrites the spec (and its derived job) here, so everything below sees what
    # runs; every refusal of preparing it is at its field's line (a fit that finds nothing, a row
    # count)
    prepared = resolved.located(lambda: prepare_job(resolved, how=PLANNED, checks=[launch_checks]))
    assert prepared.memory is not None and prepared.host is not None   # PLANNED decides both
    resolved, derived, memory = prepared.resolved, prepared.derived, prepared.memory
    gpu_free = prepared.host.gpu_free
    for line in memory.lines:
        print(f"jobspec: {line}", flush=True)
    # what this launch does with the checkpoints it finds (exit 2 now when no directory fits: a
    # changed spec; any other refusal once the launch would act on the directory)
    as_written = resolved
    first = _decided(as_written, derived.as_dict(), options)[1]
    if first.checkpoint_dir is None:   # no directory fits: decide's refusal says why
        assert first.refusal is not None
        raise as_written.locate(first.refusal)
    prepared = prepared.in_checkpoint_dir(first.checkpoint_dir)
    resolved, derived = prepared.resolved, prepared.derived
    spec = resolved.spec
    port = spec["resources"]["master_port"] or runner.free_port()
    found = hardware.Host.probe(spec["resources"]["gpus_per_node"], gpu_free)
    style = progress_mode(spec["logging"]["progress"]) == "bar"
    phases.append(("planned", time.time(), launcher_log.cpu_seconds()))
    data_how = _data_pass(resolved, options)
    phases.append(("data", time.time(), launcher_log.cpu_seconds()))

    if options.dry_run:  # nothing is created: the run dir in the command is the name it would get
        return _dry_run(resolved, prepared, first, memory, gpu_free, port, found, style,
                        options)
    resolved.located(rundir.ensure_writable, first.checkpoint_dir, ("checkpoint", "dir"))
    # another job's checkpoints, a running launch, ...: exit 2
    _refuse(resolved, first)
    held = resolved.located(lease.acquire, first.checkpoint_dir, spec["name"])
    try:
        # decided again under the lease: a launch that ended meanwhile may have moved the
        # checkpoints on
        on, again = _decided(as_written, derived.as_dict(), options, holding=held.record["token"])
        _refuse(as_written, again)
        if again.checkpoint_dir != first.checkpoint_dir:
            raise spec_error(f"the checkpoints of {spec['name']!r} changed while this launch "
                             "started",
                             path=("checkpoint", "dir"), hint="run the same command again")
        # a stop signal interrupts the start (nothing half-made is left), and once the ranks run it
        # stops them gracefully (launch/supervise.py); the run's ending is then written whole
        with supervise.HeldStops() as stops:
            return _launch_holding(LaunchContext(
                job=job, overrides=tuple(overrides), options=options, as_written=as_written,
                prepared=prepared, decision=again, snapshot=on, held=held, stops=stops,
                port=port, found=found, style=style, phases=phases, data_how=data_how,
                waiting=waiting))
    finally:
        held.release()


def _data_pass(resolved, options: LaunchOptions) -> str | None:
    """Chat and prompt/completion records tokenised once into the data cache (data/prepare), before
    any rank: every record is checked (a bad one refuses the launch at its file:line); --dry-run
    says whether the cache is warm, else how long building it would take. How the data came:
    prepared, cached, or None (nothing to prepare)."""
    spec = resolved.spec
    built: list[str] = []
    data_lines, _ = resolved.located(lambda: data_prep.prepare_data(
        spec, build=not options.dry_run, show=progress_mode(spec["logging"]["progress"]),
        built=built))
    for line in data_lines:
        print(f"jobspec: {line}", flush=True)
    return "prepared" if built else "cached" if data_prep.cached_splits(spec) else None


def _decided(as_written, derived: dict, options: LaunchOptions,
             holding: str | None = None) -> tuple[CheckpointSnapshot, Decision]:
    """The checkpoint directories read now, and what a launch of the spec as written does with
    them. `holding`: the token of the lease this launch holds."""
    found = snapshot.take(as_written.spec, derived)
    return found, decision.decide(found, as_written.spec, derived, new_run=options.new_run,
                                  continue_run=options.continue_run, holding=holding)


def _refuse(resolved, made: Decision) -> None:
    """A refusing decision's SpecError raised (exit 2) at the spec's lines."""
    if made.refusal is not None:
        raise resolved.locate(made.refusal)


def _launch_holding(ctx: LaunchContext) -> int:
    """The launch, from its decision on, while it holds the checkpoint directory's lease."""
    spec, made = ctx.spec, ctx.decision
    for line in ctx.chosen.lines:
        print(f"jobspec: {line}", flush=True)
    if made.action == "complete":  # training again would only overwrite the finished run's results
        assert made.intent is not None
        unfinished = [(directory, step, ctx.resume_hint(directory, ctx.snapshot))
                      for directory, step in made.unfinished]
        _print_lines(intent.complete_lines(spec, made.intent, unfinished, made.state))
        return 0

    orphans.close_orphans_under(spec["output_dir"])  # runs a SIGKILLed launcher left RUNNING here
    run_dir, compiled, launched = _create_run(ctx)
    ctx.held.update(run_dir=run_dir)
    _print_lines(header(spec, ctx.prepared.derived, ctx.prepared.memory, ctx.found,
                        compiled.patches, ctx.style) +
                 [console.label("run dir", ctx.style) + str(run_dir)])
    return _run(ctx, run_dir, compiled, launched)


def _create_run(ctx: LaunchContext) -> tuple[Path, Compiled, dict]:
    """A new run directory holding what the ranks read, and the launch record (launch.json's launch
    fields: the argv that runs, written to command.txt too). Anything failing removes the
    directory."""
    resolved, memory = ctx.prepared.resolved, ctx.prepared.memory
    assert memory is not None   # PLANNED decides it
    run_dir = rundir.create_run_dir(ctx.spec["output_dir"])
    try:
        # what `jobspec compile` shows, for this run dir and port
        compiled = ctx.prepared.compile(run_dir, ctx.port)
        host_checks(resolved, ctx.prepared.derived, run_dir, memory, ctx.gpu_free, compiled,
                    ctx.options.ignore_preflight)
        # one node: DeepSpeed's launch.py; several: its runner, or inside Slurm one runner per node
        # (docs/slurm.md)
        backend = backends.backend_for(compiled.plan, cpu_ranks=ctx.found.cpu_ranks)
        argv = backend.argv(compiled.plan)
        hostfile = backend.hostfile_text(compiled.plan)
        if hostfile is not None:
            rundir.write_hostfile(run_dir, hostfile)
        launched = _launched(ctx, memory)
        # command.txt: `argv`, what runs
        rundir.write_compiled(run_dir, resolved, compiled, argv, launched)
        # who to ask whether this run still runs
        rundir.write_launcher(run_dir, lifeline.identity())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no half-made run behind
        raise
    return run_dir, compiled, {**compiled.plan.record(argv), **launched}


def _launched(ctx: LaunchContext, memory: LaunchMemory) -> dict:
    """What the launcher adds to launch.json beside the plan: the memory plan (MiB) and fit, whether
    rank 0 waits for an MLflow run, the overrides (the MLflow run's name), a continued run's new
    segment."""
    launched = launch_memory.plan_record(memory)
    if ctx.spec["logging"]["mlflow"]["enabled"]:  # rank 0 waits for the run created meanwhile
        launched["mlflow_run"] = launch_tracking.PENDING
    launched["overrides"] = [mask_secrets(item) for item in ctx.overrides]
    launched["startup"] = startup_record(ctx.phases, ctx.data_how)
    if ctx.chosen.recorded:   # a continued run with a changed spec: a new segment of its MLflow run
        launched["segment"] = {"number": ctx.chosen.segment, "start_step": ctx.decision.step,
                               "changes": [c.describe() for c in ctx.chosen.recorded]}
    return launched


def _run(ctx: LaunchContext, run_dir: Path, compiled: Compiled, launched: dict) -> int:
    """The ranks, supervised, with the MLflow run created meanwhile; then the run's ending, written
    whole."""
    spec, memory, options = ctx.spec, ctx.prepared.memory, ctx.options
    assert memory is not None   # PLANNED decides it
    experiment = spec["logging"]["mlflow"]["experiment"]
    # the ranks' output waits for the header's MLflow lines
    terminal = quiet.HeldOutput(sys.stdout.buffer)

    def announce(info: dict) -> None:
        ctx.held.update(mlflow_run_id=info["run_id"])
        _print_lines(console.tracking_lines(info, experiment, style=ctx.style))

    tracking = launch_tracking.BackgroundTracking(
        ctx.prepared.resolved, compiled, run_dir, ctx.decision.mlflow_run_id,
        launch_memory.mlflow_params(memory, spec["memory"]["fit"]), launch=launched,
        verbose=options.verbose,
        announce=announce, done=terminal.release, lineage=ctx.chosen,
        start_step=ctx.decision.step)
    ctx.phases.append(("runner", time.time(), launcher_log.cpu_seconds()))
    ctx.stops.running(run_dir)
    tracking.start()
    # read once here, while the runner starts, instead of twice per op load on every rank
    threading.Thread(target=ops.write_cpu_info, args=(run_dir / rundir.CPU_INFO,),
                     daemon=True).start()
    outcome = supervise.run(launched["argv"],
                            child_env(spec, compiled.plan, options.stop_after_steps), run_dir,
                            kill_grace_s=options.kill_grace_s, echo=terminal,
                            echo_filter=None if options.verbose else quiet.TerminalFilter(),
                            started=tracking.runner_started, waiting=ctx.waiting)
    shm.remove_shared_memory_buffers(compiled.plan.master_port)  # every rank is gone now
    try:
        tracking.wait()
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # the job was stopped before it trained
        raise
    return _close(ctx, run_dir, launched, outcome, tracking)


def _close(ctx: LaunchContext, run_dir: Path, launched: dict, outcome: supervise.Outcome,
           tracking: launch_tracking.BackgroundTracking) -> int:
    """The run's ending: status files, MLflow status and models, the closing summary and how to go
    on."""
    tracked = tracking.tracked
    spec, stop_after_steps = ctx.spec, ctx.options.stop_after_steps
    end = run_status.ending(outcome.exit_code, outcome.user_signal, outcome.reason,
                            rundir.read_summary(run_dir), stop_after_steps, at_once=outcome.at_once)
    rundir.write_fallback_summary(run_dir, end.status, end.exit_code)
    model_tags = {}
    if tracked is not None:   # before the closing block, which says where MLflow has the models
        from jobspec.export.artifacts import log_exported_models
        model_tags = log_exported_models(tracked, run_dir, spec)
    closing = closing_block(spec, run_dir, launched, outcome, end, tracked, ctx.style, model_tags)
    if tracked is not None:
        launch_tracking.describe_run(tracked, spec["description"], console.plain(closing),
                                     generated=bool(rundir.read_generations(run_dir)))
    # every tracker that started: MLflow's status and tags, TensorBoard's session end
    tracking.end(end)
    rundir.mark_launcher_ended(run_dir, end.status, end.exit_code)
    _write_phases(run_dir, ctx.phases)
    _print_lines(closing)
    if end.label != "finished":   # a stop says it is not done and how to go on; a failure, why
        print(_closing_line(ctx, end, run_dir), flush=True)
    return end.exit_code


def _closing_line(ctx: LaunchContext, end: run_status.Ending, run_dir: Path) -> str:
    """What a run that did not finish says last: the command that resumes it, and the checkpoint
    it would resume from now."""
    checkpoint_dir = Path(ctx.spec["checkpoint"]["dir"])
    derived = ctx.prepared.derived
    found = snapshot.take(ctx.as_written.spec, derived.as_dict())
    resume_from = decision.intent("auto", found.directory(checkpoint_dir).latest, None,
                                  derived.total_steps)
    return run_status.closing_line(end, run_dir, ctx.resume_hint(checkpoint_dir, found),
                                   f"checkpoint {resume_from.checkpoint} (step "
                                   f"{resume_from.step} of {resume_from.total_steps})"
                                   if resume_from.action == "resume" else None)


def host_checks(resolved, derived, run_dir: Path, memory, gpu_free, compiled,
                ignore_preflight: bool) -> None:
    """launch/preflight and the GPU-memory pre-flight: a refusal (exit 2), or with
    --ignore-preflight warnings; an op this machine cannot build is refused either way (the ranks
    would fail on it). `--dry-run` makes the same checks (run_dir is then the name a launch would
    give its directory)."""
    problems = preflight.preflight_issues(resolved.spec, derived, run_dir) + \
        [SpecIssue(("memory",), text)
         for text in launch_memory.preflight_problems(memory, gpu_free)]
    op_problems = preflight.op_build_issues(compiled.ds_config)
    if op_problems:
        raise resolved.locate(SpecError(op_problems))
    if problems and not ignore_preflight:
        raise preflight.refusal(resolved, problems)
    for problem in problems:
        log.warning("preflight (ignored): %s (%s)", problem.message, problem.dotted_path)





def _dry_run(resolved, prepared, made: Decision, memory, gpu_free, port: int, found,
             style: bool, options: LaunchOptions) -> int:
    """`launch --dry-run`: what a launch would refuse, refused; what it would run, printed;
    nothing created (the run dir it names is the one a launch would get)."""
    spec, derived = resolved.spec, prepared.derived
    # another job's checkpoints, a running launch, ...
    _refuse(resolved, made)
    assert made.lineage is not None and made.intent is not None   # no refusal
    run_dir = rundir.new_run_dir_path(spec["output_dir"])
    compiled = prepared.compile(run_dir, port)
    # the host checks a launch makes (port, ranks, disk, GPU memory, ops): refused here as there
    host_checks(resolved, derived, run_dir, memory, gpu_free, compiled,
                options.ignore_preflight)
    # what a launch would run
    argv = backends.backend_for(compiled.plan, cpu_ranks=found.cpu_ranks).argv(compiled.plan)
    _print_lines(header(spec, derived, memory, found, compiled.patches, style))
    for line in made.lineage.lines:
        print(f"jobspec: {line}")
    print(f"jobspec: a launch would {made.intent.describe()}")
    print(json.dumps(compiled.ds_config, indent=2))
    for note in compiled.notes:
        print(f"note: {note}")
    print(shlex.join(argv))
    return 0


def launch_checks(resolved) -> None:
    """What only a launch checks of a valid spec, before prepare_job's model and data checks
    (job/checks, which `plan` and `compile` make too): the hub's reachability, bitsandbytes'
    backend."""
    # no hub: the cache at once, not 25 s of retries per file
    hub.offline_if_unreachable(resolved.spec)
    quantization_check(resolved)


def quantization_check(resolved) -> None:
    """`model.quantization` that bitsandbytes' backend cannot run on this host's CPU ranks:
    validate only sees that the package is installed, and every rank would otherwise find it after
    DeepSpeed started. The same one-block quantisation the ranks try
    (model/quantize.bitsandbytes_problem), made here only where the ranks run on CPU: on a GPU host
    this launcher quantising on the CPU would test another backend, and quantising on a GPU would
    hold a CUDA context beside the ranks'."""
    quant = resolved.spec["model"]["quantization"]
    if not quant or hardware.gpu_names() != ["cpu"]:
        return
    from jobspec.model.quantize import BITSANDBYTES_HINT, bitsandbytes_problem

    # importing bitsandbytes here logs, on a CPU without its optional `kernels` package, a warning
    # about a faster 4-bit kernel it will do without: noise in a quiet terminal (the ranks' copy of
    # it goes to launcher.log through train/library_output)
    bnb_logger = logging.getLogger("bitsandbytes")
    level = bnb_logger.level
    bnb_logger.setLevel(logging.ERROR)
    try:
        problem = bitsandbytes_problem(quant)
    finally:
        bnb_logger.setLevel(level)
    if problem:
        raise SpecError([resolved.issue(("model", "quantization"), problem, BITSANDBYTES_HINT,
                                        code="quantization-backend")])


def header(spec: JobSpec, derived, memory, found, patches, style: bool) -> list[str]:
    """The launch header, and the warning for a GPU-sized job on CPU ranks (before any op is
    built)."""
    from jobspec.memory.fit import cpu_step_time

    lines = console.header_lines(spec, derived, memory, found, patches, style=style)
    warning = console.gpu_sized_warning(spec, derived, memory, found,
                                        None if found.has_gpu
                                        else cpu_step_time(derived, found.cpus))
    return lines + warning


def closing_block(spec: JobSpec, run_dir: Path, launch: dict, outcome, end, tracked, style: bool,
                  model_tags: dict | None = None) -> list[str]:
    """The closing summary; also stored in summary.json as `report` (plain text)."""
    summary = rundir.read_summary(run_dir)
    signal_name = signal.Signals(outcome.user_signal).name if outcome.user_signal else None
    lines = console.closing_lines(summary, launch, job_name=spec["name"], run_dir=run_dir,
                                  checkpoint_dir=spec["checkpoint"]["dir"], exit_code=end.exit_code,
                                  user_signal=signal_name, reason=outcome.reason,
                                  tracking=tracked.as_json() if tracked else None,
                                  experiment=spec["logging"]["mlflow"]["experiment"], style=style,
                                  model_tags=model_tags, model_spec=spec["model"])
    if summary is not None:
        planned = plan_figures.planned(launch.get("plan") or {}) or None
        rundir.write_summary(run_dir, dataclasses.replace(summary, report=console.plain(lines),
                                                          planned_memory=planned))
    return lines


def _print_lines(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def startup_record(phases: list, data_how: str | None) -> dict:
    """launch.json's `startup`: when the command started and its data pass (seconds; prepared,
    cached or None), the launcher's share of the start-up the ranks show (train/startup.py)."""
    at = {name: when for name, when, _ in phases}
    return {"started": at["start"], "data_s": round(at["data"] - at["planned"], 3),
            "data": data_how}


def _write_phases(run_dir: Path, phases: list) -> None:
    """The launcher's start-up timestamps, into launcher.log (bench/startup.py)."""
    import io

    text = io.StringIO()
    for name, at, cpu in phases:
        launcher_log.phase("launcher", name, at, cpu, stream=text)
    with rundir.open_launcher_log(run_dir) as log_file:
        log_file.write(text.getvalue().encode())


def progress_mode(setting: str, stdout=None) -> str:
    if setting != "auto":
        return setting
    return "bar" if (stdout or sys.stdout).isatty() else "lines"


def child_env(spec: JobSpec, plan: LaunchPlan, stop_after_steps: int | None) -> dict:
    """The ranks' environment: the launcher's, the plan's (PYTHONUNBUFFERED: their output reaches
    the relay and launcher.log as it happens), then what this host decides."""
    env = dict(os.environ)
    tracking_run.apply_http_env(env)
    env.update(plan.environment)
    env["JOBSPEC_PROGRESS"] = progress_mode(spec["logging"]["progress"])
    # GPU ranks: PyTorch's allocator with expandable segments unless the user chose (the plan models
    # it)
    env[ALLOCATOR_VARIABLE] = allocator_conf(env)[0]
    if sys.stdout.isatty():  # the bar writes into a pipe: tell it the terminal's width
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    if stop_after_steps is not None:
        env["JOBSPEC_STOP_AFTER_STEPS"] = str(stop_after_steps)
    return env
