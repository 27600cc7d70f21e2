"""A rank's training assembled from its run files (worker.train): the engine built and resumed
(`build_and_resume`), rank 0's outputs (`RankOutputs`: progress, the metric sink, MLflow's system
metrics) and the Trainer with its policies (`trainer_for`), each policy given its own section of the
spec and the derived job launch.json holds, read once by the worker.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from jobspec import launcher_log, rundir
from jobspec.checkpoint.reshard import Reshard, replace_ds_config
from jobspec.rundir import RunFiles
from jobspec.spec.derived import DerivedJob
from jobspec.spec.types import JobSpec, JobSpecLogging
from jobspec.train.checkpointer import Checkpointer
from jobspec.train.engine import build_engine, reshard_plan, resume
from jobspec.train.evaluation import Evaluator
from jobspec.train.faults import NanGuard
from jobspec.train.metrics import any_rank
from jobspec.train.oom import OomGuard
from jobspec.train.progress import RunState, StepReporter
from jobspec.train.startup import StartupClock
from jobspec.train.stopping import StopVote
from jobspec.train.trainer import Policies, Trainer

TRACKING_WAIT_S = 120.0  # then metrics.jsonl only (`jobspec sync` uploads it later)


@dataclass
class Built:
    """The rank's engine and data, resumed from the checkpoint `checkpoint.resume` names, if any."""

    engine: Any
    train_ds: Any
    eval_ds: Any
    patch_notes: list
    pending_rng: dict | None   # the checkpoint's random state of this rank, for its loader's start
    reshard: Reshard | None    # a checkpoint of another world size
    passed_over: list = field(default_factory=list)   # corrupt checkpoints skipped on resume


def build_and_resume(files: RunFiles, job: DerivedJob, state: RunState, startup: StartupClock,
                     control) -> Built:
    """The engine (train/engine.build_engine) and the checkpoint it resumes from, loaded into it
    and `state`. Collective."""
    import torch.distributed as dist

    from jobspec.train import lora_adapters
    spec = files.spec
    # a checkpoint of another world size: converted (rank 0), loaded in DeepSpeed's universal format
    reshard = reshard_plan(spec["checkpoint"], dist.get_world_size(), control,
                           spec["memory"]["sequence_parallel"])
    engine, train_ds, eval_ds, notes = build_engine(replace_ds_config(files, reshard), startup)
    state.parameters = lora_adapters.parameter_counts(engine.module)   # summary.json, MLflow
    built = Built(engine, train_ds, eval_ds, notes, None, reshard)
    section = reshard.checkpoint_section if reshard else spec["checkpoint"]
    built.pending_rng = resume(engine, section, state, lambda flag: any_rank(flag, control),
                               built.passed_over)
    if reshard is not None:
        built.pending_rng = reshard.adjust(state, job.micro_batch_size, spec["training"]["seed"],
                                           dist.get_rank())
    startup.mark("resumed", f"from {state.resumed_from}" if state.resumed_from else "")
    return built


@dataclass
class RankOutputs:
    """What a rank reports through: the progress (rank 0's bar or lines; nothing elsewhere), rank
    0's metric sink, and MLflow's system-metrics monitor of each node's local rank 0."""

    progress: Any
    sink: Any | None
    system_metrics: Any | None

    @classmethod
    def open(cls, run_dir: Path, files: RunFiles, job: DerivedJob, built: Built, state: RunState,
             startup: StartupClock, rank: int) -> "RankOutputs":
        """The outputs started; rank 0's sink holds the run's parameters and data (MLflow's)."""
        from jobspec.data.loaders import data_params
        from jobspec.train import lora_adapters
        from jobspec.train.progress import NullProgress, Progress
        assert job.total_steps is not None   # rundir.read_run_files made sure of it
        progress = Progress(job.total_steps, state.step) if rank == 0 else NullProgress()
        sink = _open_sink(run_dir, files.spec, files.launch) if rank == 0 else None
        startup.report_to(progress.message, sink)
        if sink is not None:
            sink.log_params(lora_adapters.params_for_mlflow(files.spec, state.parameters))
            # data.<split>.records, tokens, ... (the data cache)
            state.data = data_params(built.train_ds, built.eval_ds) or None
            sink.log_params(state.data or {})
        system_metrics = _start_system_metrics(run_dir, files.spec["logging"], files.launch, job,
                                               rank)
        startup.mark("sink")
        return cls(progress, sink, system_metrics)

    def close(self) -> None:
        self.progress.close()
        if self.system_metrics is not None:
            self.system_metrics.stop()
        if self.sink is not None:
            self.sink.close(timeout=30)


def announce(built: Built, state: RunState, outputs: RankOutputs, rank: int) -> None:
    """What the start-up found: the patches' notes to launcher.log (the launch header lists the
    patches), a reshard or a resume, and the corrupt checkpoints a resume passed over (a tag)."""
    sink, progress = outputs.sink, outputs.progress
    for note in built.patch_notes if rank == 0 else []:
        launcher_log.note(note)
    if built.reshard is not None:
        progress.message(built.reshard.message(state.step))
    if state.resumed_from:
        progress.message(f"resumed from {state.resumed_from} at step {state.step}")
    if built.passed_over and sink is not None:
        passed = " | ".join(built.passed_over)
        sink.set_tags({"jobspec.resume_fallback":
                       f"resumed from {state.resumed_from}; passed over: {passed}"})


def trainer_for(files: RunFiles, job: DerivedJob, built: Built, outputs: RankOutputs,
                state: RunState, *, run_dir: Path, stop: StopVote, control=None,
                startup: StartupClock | None = None, environ=os.environ) -> Trainer:
    """The Trainer of `built`'s engine with the job's policies. `control`: the gloo group of the
    ranks' votes and counts (None: the default group); `environ`: the OOM policy's test hooks."""
    import torch.distributed as dist

    from jobspec.export.exporter import ModelExporter
    from jobspec.train.generation import EvalGenerator
    from jobspec.train.task_metrics import counter_for
    spec, progress, sink = files.spec, outputs.progress, outputs.sink
    rank, world = dist.get_rank(), dist.get_world_size()
    zero_stage = files.ds_config.get("zero_optimization", {}).get("stage", 0)
    label_names = getattr(built.train_ds, "label_names", None)
    reporter = StepReporter(built.engine, spec["logging"], job, sink, progress, rank, state)
    nan = NanGuard(spec["training"]["on_nan"], lambda flag: any_rank(flag, control), sink, rank)
    oom = OomGuard(spec["training"], job, run_dir=run_dir, rank=rank, group=control,
                   progress=progress, sink=sink, environ=environ)
    exporter = ModelExporter(spec, job, run_dir, rank, control, progress, label_names=label_names)
    exporter.check_writable()
    # training.eval_generate: answers to fixed prompts at every evaluation (train/generation.py)
    generator = EvalGenerator.for_job(spec, batch_size=job.micro_batch_size, zero3=zero_stage == 3,
                                      run_dir=run_dir, rank=rank, world_size=world, group=control,
                                      sink=sink, progress=progress)
    evaluator = Evaluator(spec["training"], built.eval_ds,
                          partial(counter_for, spec, label_names=label_names),
                          reporter=reporter, exporter=exporter, generator=generator)
    checkpointer = Checkpointer(spec["checkpoint"], job, job_name=spec["name"],
                                zero_stage=zero_stage, nan=nan, exporter=exporter,
                                progress=progress, in_compiled_units=oom.batches_in_compiled_units)
    policies = Policies(stop=stop, oom=oom, nan=nan, reporter=reporter, evaluator=evaluator,
                        checkpointer=checkpointer, exporter=exporter,
                        startup=startup or StartupClock.log_only())
    # this module's build_engine, looked up now: the first engine's and a rebuild's are the same
    return Trainer(built.engine, files, job, built.train_ds, state, policies, progress=progress,
                   count_groups=(control,), pending_rng=built.pending_rng, build=build_engine)


def _open_sink(run_dir: Path, spec: JobSpec, launch: dict):
    """metrics.jsonl and a writer for each tracker the spec enables (tracking/trackers.py)."""
    from jobspec.tracking.sink import MetricSink
    _wait_for_the_mlflow_run(run_dir, launch)
    return MetricSink.open(run_dir, spec)


def _wait_for_the_mlflow_run(run_dir: Path, launch: dict) -> None:
    if launch.get("mlflow_run") == "pending":  # the launcher creates the run while the ranks start
        rundir.wait_for_tracking(run_dir, timeout_s=TRACKING_WAIT_S)


def _start_system_metrics(run_dir: Path, logging: JobSpecLogging, launch: dict, job: DerivedJob,
                          rank: int):
    """MLflow's system-metrics monitor in each node's local rank 0 (`logging.system_metrics`)."""
    if not logging["system_metrics"] or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    # rank 0 waited already; another node's leader may not have
    _wait_for_the_mlflow_run(run_dir, launch)
    from jobspec.tracking.system import SystemMetrics
    return SystemMetrics.start(run_dir, node_index=rank // job.gpus_per_node, nodes=job.nodes)
