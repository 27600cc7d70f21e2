"""The training worker: one process per rank, started by the deepspeed runner.

    deepspeed --num_gpus N --master_port P --module jobspec.train.worker --run-dir DIR

It reads only the run directory (resolved.yaml, ds_config.json, patches.json, launch.json) and
the environment the runner sets; builds tokenizer, model, patches and data (jobspec.train.engine); trains for
`derived.total_steps` optimizer steps through `deepspeed.initialize`; logs metrics (rank 0, via
MetricSink), saves checkpoints, resumes from them, and stops cleanly on SIGUSR1/SIGTERM.
Rank 0 writes `summary.json`. Env: JOBSPEC_PROGRESS=bar|lines|none, JOBSPEC_STOP_AFTER_STEPS=K
(behave as if signalled after K steps: for tests and debugging), JOBSPEC_INJECT_NAN_AT_STEP=K
(a NaN loss in step K, to test `training.on_nan`: see jobspec/train/faults.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from jobspec import launcher_log, lifeline, rundir
from jobspec.checkpoint.reshard import replace_ds_config
from jobspec.errors import EXIT_INVALID, EXIT_RUN_FAILED, RunFailure, SpecError
from jobspec.export.hf_dir import ExportFailed
from jobspec.model.padding_mask import model_inputs
from jobspec.rundir import RunFiles
from jobspec.spec.derived import DerivedJob
from jobspec.train import library_output
from jobspec.train.engine import build_engine, reshard_plan, resume, share_cpu_threads
from jobspec.train.faults import NanGuard, NonFiniteLoss
from jobspec.train.metrics import any_rank
from jobspec.train.oom import OomGuard
from jobspec.train.progress import RunState, StepReporter, Window, summarize
from jobspec.train.startup import StartupClock
from jobspec.train.stopping import StopFlag, StopVote

TRACKING_WAIT_S = 120.0  # then metrics.jsonl only (`jobspec sync` uploads it later)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobspec.train.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory written by compile/launch")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
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
        if not (err.collective or isinstance(err, ExportFailed)) or int(os.environ.get("RANK", "0")) == 0:
            print(f"ERROR: {err.reason}", file=sys.stderr, flush=True)
        return EXIT_RUN_FAILED
    except NonFiniteLoss as err:  # training.on_nan: stop -- a clear failure, not a traceback
        if err.step:  # found at a log/checkpoint boundary: the good steps end before the bad one
            state.step = min(state.step, err.step - 1)
        _write_failure(run_dir, state, started, str(err))
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        return 1
    except BaseException as err:
        _write_failure(run_dir, state, started, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    finally:
        _destroy_process_group()


def train(run_dir: Path, state: RunState, started: float) -> int:
    files = rundir.read_run_files(run_dir)
    stop = StopFlag()
    stop.install()
    # a SIGKILLed launcher cannot end us: we end the job ourselves once it is gone
    lifeline.watch_launcher(lambda record: lifeline.end_orphaned_job(record, os.environ.get("MASTER_PORT")))
    startup = StartupClock.for_rank(files.spec, files.launch, state.startup, started)

    import torch.distributed as dist

    from jobspec import ops
    # without MLflow (DeepSpeed's autotuner imports it) on the ranks that never log to it
    deepspeed = ops.import_deepspeed(without_mlflow=int(os.environ.get("LOCAL_RANK", "0")) != 0)
    from jobspec.export.exporter import ModelExporter
    from jobspec.train import lora_adapters
    from jobspec.train.generation import EvalGenerator
    from jobspec.train.progress import NullProgress, Progress

    # the libraries' records and bars to launcher.log (the quiet terminal): before they load anything
    library_output.route_library_logs(int(os.environ.get("RANK", "0")),
                                      transformers=files.spec["model"]["architecture"] != "mlp",
                                      datasets=bool(files.spec["data"]["train"]))
    startup.mark("imported")
    ops.share_cpu_info(run_dir / rundir.CPU_INFO)
    # first-run op compiles happen here, announced, instead of in silence inside DeepSpeed
    ops.ensure_built(ops.needed_ops(files.ds_config), announce=_node_leader_says)
    ops.skip_unused_ops()   # DeepSpeed's shm all-reduce op: built and loaded for nothing in training
    startup.mark("ops")
    deepspeed.init_distributed()
    startup.mark("distributed")
    share_cpu_threads()
    # Stop votes go over gloo on the host: an NCCL vote would sync the GPU at every step.
    control = dist.new_group(backend="gloo")
    # a checkpoint of another world size: converted (rank 0) and loaded via DeepSpeed's universal format
    reshard = reshard_plan(files.spec["checkpoint"], dist.get_world_size(), control,
                           files.spec["memory"]["sequence_parallel"])
    engine, train_ds, eval_ds, patch_notes = build_engine(replace_ds_config(files, reshard),
                                                          startup)
    state.parameters = lora_adapters.parameter_counts(engine.module)   # summary.json, MLflow: LoRA's share
    passed_over: list[str] = []  # corrupt checkpoints skipped on resume (reported below and as a tag)
    pending_rng = resume(engine, reshard.checkpoint_section if reshard else files.spec["checkpoint"], state,
                         lambda flag: any_rank(flag, control), passed_over)
    job = DerivedJob.from_dict(files.derived)   # launch.json's derived job, typed
    rank, total_steps = dist.get_rank(), job.total_steps
    assert total_steps is not None   # rundir.read_run_files refuses a launch.json without it
    if reshard is not None:
        pending_rng = reshard.adjust(state, job.micro_batch_size, files.spec["training"]["seed"], rank)
    startup.mark("resumed", f"from {state.resumed_from}" if state.resumed_from else "")
    progress = Progress(total_steps, state.step) if rank == 0 else NullProgress()
    sink = _open_sink(run_dir, files) if rank == 0 else None
    startup.report_to(progress.message, sink)
    if sink is not None:
        sink.log_params(lora_adapters.params_for_mlflow(files.spec, state.parameters))
        from jobspec.data.loaders import data_params
        state.data = data_params(train_ds, eval_ds) or None   # data.<split>.records, tokens, ... (the data cache)
        sink.log_params(state.data or {})
    system_metrics = _start_system_metrics(run_dir, files, rank)
    startup.mark("sink")
    try:
        for note in patch_notes:  # the launch header lists the patches; the details go to launcher.log
            if rank == 0:
                launcher_log.note(note)
        if reshard is not None:
            progress.message(reshard.message(state.step))
        if state.resumed_from:
            progress.message(f"resumed from {state.resumed_from} at step {state.step}")
        if passed_over and sink is not None:
            sink.set_tags({"jobspec.resume_fallback": f"resumed from {state.resumed_from}; passed over: "
                                                      + " | ".join(passed_over)})
        nan_guard = NanGuard(files.spec["training"]["on_nan"], lambda flag: any_rank(flag, control),
                             sink, rank)
        telemetry = StepReporter(engine, files.spec, job, files.patches, sink, progress, rank, state)
        oom_guard = OomGuard(files, run_dir=run_dir, rank=rank, control_group=control, build_engine=build_engine,
                             progress=progress, sink=sink, telemetry=telemetry)
        exporter = ModelExporter(files, run_dir, rank, control, progress,
                                 label_names=getattr(train_ds, "label_names", None))
        exporter.check_writable()
        # training.eval_generate: answers to fixed prompts at every evaluation (train/generation.py)
        generator = EvalGenerator.for_job(files, run_dir, rank, dist.get_world_size(), control, sink, progress)
        startup.mark("loop")
        del engine  # train_loop holds the only reference: an OOM recovery (jobspec.train.oom) must free it
        vote = StopVote(stop, control, dist.get_world_size())
        try:
            status = train_loop(telemetry.engine, files, train_ds, eval_ds, state, telemetry, progress,
                                stop=vote, pending_rng=pending_rng, nan_guard=nan_guard, oom_guard=oom_guard,
                                exporter=exporter, generator=generator, count_groups=(control,),
                                startup=startup)
        finally:
            vote.close()
        telemetry.finish(state.step)   # the launch's throughput, as summary.json states it
        if status == "finished":  # after the final checkpoint: a failed export loses no training
            exporter.final(telemetry.engine, state)
        if rank == 0:
            rundir.write_summary(run_dir, summarize(state, status, total_steps, started))
    finally:
        startup.stop()
        progress.close()
        if system_metrics is not None:
            system_metrics.stop()
        if sink is not None:
            sink.close(timeout=30)
    return 0


def train_loop(engine, files: RunFiles, train_ds, eval_ds, state: RunState, telemetry: "StepReporter", progress,
               *, stop, pending_rng: dict | None, nan_guard: NanGuard | None = None,
               oom_guard: OomGuard | None = None, exporter=None, generator=None, count_groups=(),
               startup: StartupClock | None = None) -> str:
    """Optimizer steps until `derived.total_steps` ("finished") or an agreed stop ("preempted").

    Each step takes its micro-batches first and back-propagates their summed loss over the labelled
    tokens of the whole global batch, counted over `count_groups` (none: every rank; the worker passes
    its gloo control group, so the count never syncs a GPU): jobspec.train.token_loss.

    `stop(step)` is asked after every optimizer step (jobspec.train.stopping.StopVote). Per
    micro-batch the loop does only host-side bookkeeping (counts, the loss appended to the window):
    what needs the device's values is read at log and checkpoint steps."""
    from functools import partial

    import torch.distributed as dist

    from jobspec import tasks
    from jobspec.checkpoint import save_load
    from jobspec.data.loaders import make_loader
    from jobspec.train import sequence_parallel, token_loss
    from jobspec.train.step_batches import StepBatches
    from jobspec.train.task_metrics import counter_for

    spec, derived = files.spec, DerivedJob.from_dict(files.derived)
    training, data, ckpt = spec["training"], spec["data"], spec["checkpoint"]
    total_steps, every_log, every_ckpt = derived.total_steps, spec["logging"]["every_n_steps"], ckpt["every_n_steps"]
    assert total_steps is not None   # rundir.read_run_files refuses a launch.json without it
    # memory.sequence_parallel: the N ranks of a group load the same micro-batches (train/sequence_parallel)
    sp = sequence_parallel.active()
    # make_loader's keywords of this run (an OOM retry halves micro_batch_size in place: OomGuard.rebuild)
    loader_args: dict[str, Any] = dict(
        micro_batch_size=derived.micro_batch_size, rank=sp.data_rank if sp else dist.get_rank(),
        world_size=sp.data_world if sp else dist.get_world_size(), seed=training["seed"],
        num_workers=data["num_workers"], pin_memory=data["pin_memory"])

    def save_checkpoint():
        if nan_guard:
            nan_guard.confirm(window)  # never save a state that followed a non-finite loss
        state.last_checkpoint = save_load.save(
            engine, ckpt["dir"], step=state.step, epoch=state.epoch,
            batches_in_epoch=oom_guard.batches_in_compiled_units(state.batches_in_epoch) if oom_guard
            else state.batches_in_epoch,
            job_name=spec["name"], keep_last=ckpt["keep_last"],
            zero_stage=files.ds_config.get("zero_optimization", {}).get("stage", 0),
            micro_batch_size=derived.micro_batch_size, sequence_parallel=sp.size if sp else 1)
        progress.message(f"checkpoint {state.last_checkpoint} saved to {ckpt['dir']}")
        if exporter is not None:
            exporter.after_checkpoint(engine, state, ckpt["dir"])

    def run_eval():
        if eval_ds is not None:
            loader = make_loader(eval_ds, epoch=0, shuffle=False, skip_batches=0, **loader_args)
            counter = counter_for(spec, getattr(engine.module, "config", None),
                                  getattr(train_ds, "label_names", None))
            state.eval_loss, state.eval_metrics = evaluate(engine, loader, counter)
            telemetry.log_eval(state.step, state.eval_loss, state.eval_metrics)
            if exporter is not None:
                exporter.after_eval(engine, state)
        if generator is not None:   # at every evaluation, with or without eval data
            generator.run(engine, state)

    engine.train()
    window = Window()
    first_step = state.step + 1  # its end is the start-up's end (train/startup.py)
    startup = startup or StartupClock.log_only()
    task = tasks.of(spec)

    def step_batches(rng: dict | None) -> StepBatches:   # from the run's data position (after an OOM: rewound)
        # an epoch: whole global batches of the shuffled order, the same samples on every split
        return StepBatches(lambda epoch, skip: make_loader(train_ds, epoch=epoch, shuffle=data["shuffle"],
                                                           skip_batches=skip, **loader_args,
                                                           global_batch_size=derived.global_batch_size),
                           state.epoch, state.batches_in_epoch,
                           # after iter(): see checkpointing.rng_state_of_this_rank
                           after_first_iter=None if rng is None else partial(save_load.restore_rng_state, rng))
    stream = step_batches(pending_rng)
    while state.step < total_steps:
        if oom_guard:
            oom_guard.mark(state, window)  # where this optimizer step began, to redo it after an OOM
        # the step's micro-batches and their labelled tokens over every rank, before its first forward
        micro_batches = stream.take(engine.gradient_accumulation_steps())
        parts = [_loss_inputs(task, sp, micro.batch) for micro in micro_batches]
        step_tokens = token_loss.global_count(sum(token_loss.labelled_count(task, labels, shift)
                                                  for _, labels, shift in parts), count_groups)
        # DeepSpeed averages the gradients over the data-parallel ranks: under Ulysses world / N (its
        # engine.dp_world_size is None then; the N ranks of a group are summed)
        scale = token_loss.backward_scale(step_tokens, engine.dp_world_size if sp is None else sp.averaged_over(engine))
        for micro, (inputs, labels, shift) in zip(micro_batches, parts):
            if sp is None or sp.counts_data:   # a sequence-parallel group's samples count once
                window.tokens += telemetry.count_tokens(micro.batch)  # on the host batch: no device sync
                window.samples += int(micro.batch["input_ids"].shape[0])
            inputs = {k: v.to(engine.device, non_blocking=True) for k, v in inputs.items()}
            labels = labels.to(engine.device, non_blocking=True)
            boundary = engine.is_gradient_accumulation_boundary()  # ask before step() advances it
            if boundary:   # the rate this step runs at (step() moves the schedule on)
                window.lr = float(engine.get_lr()[0])
            summed = partial(token_loss.summed_loss, task, labels=labels, shift=shift)
            if oom_guard is None:
                loss = summed(engine(**inputs))
            elif (loss := oom_guard.forward(engine, inputs, state.step + 1, summed)) is None:
                break  # out of memory on some rank: every rank redoes the step below, micro-batch halved
            if nan_guard:   # a test's injected NaN, where a real one would come from
                loss = nan_guard.inject(loss, state.step + 1)
            reported = loss.detach() / step_tokens if step_tokens else loss.detach() * 0.0
            loss, nonfinite = nan_guard.check(loss * scale, state.step + 1) if nan_guard else (loss * scale, False)
            if oom_guard is None:
                token_loss.backward(engine, loss)
            elif not oom_guard.backward(engine, loss, state.step + 1):
                break  # as above
            nan_guard.step(engine, boundary, state.step + 1) if nan_guard else engine.step()
            state.epoch, state.batches_in_epoch = micro.epoch, micro.batches_in_epoch
            if not nonfinite:  # a skipped micro-batch has no loss to report
                window.add_loss(reported, state.step + 1)   # its share of the step's token mean
        if oom_guard and oom_guard.pending:  # every rank agreed on an OOM in this optimizer step
            saved = oom_guard.save_and_release(engine, state)
            engine = inputs = labels = loss = None  # the old engine's last references: free its memory first
            engine, window = oom_guard.rebuild(saved, state, loader_args)
            sp = sequence_parallel.active()   # registered again by the rebuilt engine
            stream = step_batches(None)
            continue
        state.step += 1
        window.steps += 1
        if state.step == first_step:
            startup.first_step(state.step)
            if state.step < total_steps:   # throughput counts from here (docs/architecture.md, "Throughput")
                window.start_timing()
        progress.update(state.step)
        last = state.step >= total_steps
        if (state.step % every_log == 0 or last) and window.micro_batches:
            # also where training.on_nan: stop finds a non-finite loss of the window (any rank)
            window = telemetry.log_window(state.step, window, nan_guard, final=last)
        if (training["eval_every"] and state.step % training["eval_every"] == 0) or last:
            with window.paused():
                run_eval()
        if last:
            if ckpt["save_final"] or (every_ckpt and state.step % every_ckpt == 0):
                save_checkpoint()
            return "finished"
        if stop(state.step):
            if window.steps and window.micro_batches:
                window = telemetry.log_window(state.step, window, nan_guard, final=True)
            save_checkpoint()
            return "preempted"
        if every_ckpt and state.step % every_ckpt == 0:
            with window.paused():
                save_checkpoint()
    return "finished"  # resumed from a checkpoint of the last step: nothing left to do


def _loss_inputs(task, sp, batch: dict):
    """(the model's inputs, the labels its summed loss is taken against, their shift) of one host
    micro-batch; under sequence parallelism this rank's 1/N of the sequence and its next-token labels
    (shifted already: jobspec.train.sequence_parallel)."""
    if sp is not None:
        inputs, next_labels = sp.shard(batch)
        return inputs, next_labels, 0
    return model_inputs(batch, causal=task.shift > 0), batch["labels"], task.shift


def evaluate(engine, loader, counter=None, task=None) -> tuple[float, dict]:
    """(the eval loss: per labelled token over every rank's batches, the task metrics of `counter` by name).

    The loss is the summed per-token loss of every rank's batches over their labelled tokens
    (jobspec.train.token_loss: the training loss's definition), so a perplexity is exp of it whatever
    the eval micro-batch and the ranks. The metrics come from counts summed over the ranks
    (jobspec.train.task_metrics), never from a mean of the ranks' own metrics. With sequence
    parallelism the group's ranks evaluate the same batches, each its shard of the tokens (counted
    once in the loss; the task metrics count the group's batch once, by its rank 0)."""
    import torch
    import torch.distributed as dist

    from jobspec import tasks
    from jobspec.train import sequence_parallel, token_loss
    from jobspec.train.task_metrics import logits_of, perplexity
    sp = sequence_parallel.active()
    task = tasks.get(counter.task if counter is not None else task)
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)   # summed loss, labelled tokens
    engine.eval()
    with torch.no_grad():
        for batch in loader:
            inputs, labels, shift = _loss_inputs(task, sp, batch)
            count = token_loss.labelled_count(task, labels, shift)
            inputs = {k: v.to(engine.device, non_blocking=True) for k, v in inputs.items()}
            outputs = engine(**inputs)
            summed = token_loss.summed_loss(task, outputs, labels.to(engine.device, non_blocking=True), shift)
            totals += torch.stack([summed.double(), torch.tensor(float(count), dtype=torch.float64,
                                                                 device=engine.device)])
            if counter is not None and (sp is None or sp.counts_data):
                # a shard's logits are not the batch's: under sequence parallelism only the loss counts
                mean = summed / count if count else summed
                counter.update(mean, logits_of(outputs) if sp is None else None,
                               batch["labels"].to(engine.device, non_blocking=True))
    engine.train()
    dist.all_reduce(totals)
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    if counter is None:
        return loss, {}
    counts = counter.vector(engine.device)
    dist.all_reduce(counts)
    metrics = counter.finish(counts.tolist())
    if "perplexity" in metrics:   # exp(eval/loss) exactly: the same sums (the counter's come back from means)
        metrics.update(perplexity(float(totals[0]), float(totals[1])))
    return loss, metrics


def _write_failure(run_dir: Path, state: RunState, started: float, error: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    try:
        rundir.write_summary(run_dir, summarize(state, "failed", None, started, error=error))
    except OSError:
        pass  # the original error matters more than a summary we cannot write


def _print_spec_error(text: str) -> None:
    """Bad input (a data row, a checkpoint to resume) is found alike by every rank, which read the same
    files: rank 0 prints it; the others write theirs to launcher.log only (`jobspec-log:` lines, kept off
    the terminal), where it still shows should some rank fail alone."""
    rank = int(os.environ.get("RANK", "0"))
    # one write each: the ranks share the pipe, and print()'s separate "\n" let another rank's line in
    # before it (rank 0's last line and rank 1's log-only line then reached the terminal as one line)
    if rank == 0:
        sys.stderr.write(text.rstrip("\n") + "\n")
    else:
        sys.stderr.write("".join(f"{launcher_log.LOG_ONLY}rank {rank}: {line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def _node_leader_says(text: str) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node, not once per rank
        sys.stdout.write(f"jobspec: {text}\n")  # one write: the node's ranks share the pipe
        sys.stdout.flush()


def _open_sink(run_dir: Path, files: RunFiles):
    """metrics.jsonl and a writer for each tracker the spec enables (jobspec/tracking/trackers.py)."""
    from jobspec.tracking.sink import MetricSink
    _wait_for_the_mlflow_run(run_dir, files.launch)
    return MetricSink.open(run_dir, files.spec)


def _wait_for_the_mlflow_run(run_dir: Path, launch: dict) -> None:
    if launch.get("mlflow_run") == "pending":  # the launcher creates the run while the ranks start
        rundir.wait_for_tracking(run_dir, timeout_s=TRACKING_WAIT_S)


def _start_system_metrics(run_dir: Path, files: RunFiles, rank: int):
    """MLflow's system-metrics monitor in each node's local rank 0, with `logging.system_metrics`."""
    if not files.spec["logging"]["system_metrics"] or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    _wait_for_the_mlflow_run(run_dir, files.launch)  # rank 0 waited already; another node's leader may not have
    from jobspec.tracking.system import SystemMetrics
    derived = DerivedJob.from_dict(files.derived)
    return SystemMetrics.start(run_dir, node_index=rank // derived.gpus_per_node, nodes=derived.nodes)


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
    raise SystemExit(main())
