"""The derived job: every number computed from a resolved spec, computed once and passed on.

World size, batch split, sequence length, bytes per precision, model dimensions, total/warmup steps
and the model's measured profile (parameters, activations, FLOPs per token) are derived here and
nowhere else. The compiler, the memory planner and its fit search, the launcher, the pre-flight
checks, the rank-side worker, the progress lines, the report and the commands all take a
`DerivedJob`; the run directory carries it (`launch.json` -> "derived"), so the ranks read it
instead of recomputing it.

Pure: no torch, no I/O. What a derivation needs from disk (a local checkpoint's config.json, the
training file's row count) is read at the edge by `jobspec.spec.inputs.derive_job` and passed in;
the model's profile comes from a `profiler` passed in the same way
(`jobspec.model.planner_trace.job_profiler`: the model built and traced under fake tensors, cached),
which `jobspec validate` does not use.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from jobspec.errors import SpecError, spec_error
from jobspec.memory.model_profile import ModelProfile
from jobspec.spec.model_dims import ModelDims, model_dims
from jobspec.spec.types import (
    JobSpec,
    JobSpecMemoryActivationCheckpointing,
    JobSpecMemoryZero,
    JobSpecTraining,
    JobSpecTrainingScheduler,
)

# Bytes per element of the training precision: parameters, gradients and activations of a
# mixed-precision run are 16-bit; fp32 master weights and optimizer states are counted separately.
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# DeepSpeed's ZeRO defaults (deepspeed/runtime/zero/config.py), used when the hidden size is
# unknown.
DS_REDUCE_BUCKET_SIZE = 500_000_000
DS_ALLGATHER_BUCKET_SIZE = 500_000_000
DS_STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
DS_STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class DerivedJob:
    world_size: int
    nodes: int
    gpus_per_node: int
    micro_batch_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    # None: epochs over file data whose rows were not counted (validate)
    total_steps: int | None
    warmup_steps: int | None
    seq_len: int
    precision: str
    precision_bytes: int
    dims: ModelDims | None
    num_parameters: int | None
    num_layers: int | None
    checkpointed_layers: int
    num_train_samples: int | None = None
    model_flops_per_token: float | None = None
    hardware_flops_per_token: float | None = None
    notes: tuple = ()
    profile: ModelProfile | None = field(default=None, repr=False, compare=False)
    # why there is no profile when a profiler was given (the plan command raises it, a launch says
    # it)
    profile_error: SpecError | None = field(default=None, repr=False, compare=False)
    # what the derivation read at the edge, kept so a changed spec (the fit search's candidates)
    # is derived by this same function from the same inputs
    config_json: dict | None = field(default=None, repr=False, compare=False)
    profiler: Callable | None = field(default=None, repr=False, compare=False)
    # `memory.sequence_parallel`: ranks that share each sequence (Ulysses); 1 is off
    sequence_parallel: int = 1

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different samples: the world over `sequence_parallel` (an SP group's
        N ranks hold one micro-batch's sequences between them, so they count once in the batch
        split, the sampler and the samples and tokens a step consumes)."""
        return self.world_size // self.sequence_parallel

    def with_spec(self, spec: JobSpec) -> "DerivedJob":
        """The derived job of another version of the same spec (same model files, same data)."""
        return derive(spec, config_json=self.config_json, num_train_samples=self.num_train_samples,
                      profiler=self.profiler)

    def as_dict(self) -> dict:
        """JSON for launch.json's "derived": the ranks read it back with `from_dict`
        (rundir.RunFiles.derived is this dict), and the on_oom guard rewrites its batch split
        there."""
        skip = {"config_json", "profiler", "profile_error"}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in skip}
        out["dims"] = dataclasses.asdict(self.dims) if self.dims else None
        out["profile"] = self.profile.as_dict() if self.profile else None
        out["notes"] = list(self.notes)
        return out


    @classmethod
    def from_dict(cls, d: dict) -> "DerivedJob":
        """The derived job launch.json carries (`as_dict`), read back
        (`DerivedJob.from_dict(files.derived)`).

        Every number round-trips; the model's profile stays with the launcher (launch.json keeps its
        summary for the record, and nothing on the ranks plans memory)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"profile", "profile_error",
                                                             "config_json", "profiler"}
        values = {name: d[name] for name in names if name in d}
        values["dims"] = ModelDims(**d["dims"]) if d.get("dims") else None
        values["notes"] = tuple(d.get("notes") or ())
        return cls(**values)


def derive(spec: JobSpec, *, config_json: dict | None = None, num_train_samples: int | None = None,
           profiler: Callable | None = None) -> DerivedJob:
    """Every derived number of a resolved spec (defaults filled); SpecError on inconsistent batches.

    Without `num_train_samples`, a job that trains for epochs over file data gets total_steps None;
    the compiler refuses that (it needs the step count for the schedule), validation does not.
    `profiler(spec, seq_len) -> ModelProfile` measures the model (parameters, activations, FLOPs);
    without one (validate, compile) those numbers are None. A profiler's SpecError is kept as
    `profile_error`.
    """
    training, memory, resources = spec["training"], spec["memory"], spec["resources"]
    notes: list[str] = []
    nodes, gpus_per_node = resources["nodes"], resources["gpus_per_node"]
    world = nodes * gpus_per_node
    sequence_parallel = memory["sequence_parallel"]
    data_parallel = _data_parallel_size(world, sequence_parallel)
    micro = training["micro_batch_size"]
    global_batch, accumulation = _batch_split(micro, training["global_batch_size"], data_parallel,
                                              sequence_parallel)
    synthetic = spec["data"].get("synthetic")
    if synthetic:
        num_train_samples = synthetic["num_samples"]
    total = _total_steps(training, global_batch, num_train_samples, notes)
    warmup = None if total is None else _warmup_steps(training["scheduler"], total)
    dims = model_dims(spec, config_json)
    seq_len = synthetic["seq_len"] if synthetic else spec["data"]["max_length"]
    precision = memory["precision"]
    profile, profile_error = None, None
    if profiler is not None:
        try:
            profile = _profile(profiler, spec, seq_len, sequence_parallel)
        except SpecError as err:
            profile_error = err
    num_layers = profile.inventory.num_layers if profile else (dims.num_layers if dims else None)
    return DerivedJob(
        world_size=world, nodes=nodes, gpus_per_node=gpus_per_node,
        micro_batch_size=micro, global_batch_size=global_batch,
        gradient_accumulation_steps=accumulation,
        total_steps=total, warmup_steps=warmup, seq_len=seq_len,
        precision=precision, precision_bytes=PRECISION_BYTES[precision],
        dims=dims, num_parameters=profile.inventory.total if profile else None,
        num_layers=num_layers,
        checkpointed_layers=checkpointed_layers(num_layers or 0,
                                                memory["activation_checkpointing"]),
        num_train_samples=num_train_samples,
        model_flops_per_token=profile.model_flops_per_token if profile else None,
        hardware_flops_per_token=profile.hardware_flops_per_token if profile else None,
        notes=tuple(notes), profile=profile, profile_error=profile_error, config_json=config_json,
        profiler=profiler, sequence_parallel=sequence_parallel,
    )


def _profile(profiler: Callable[[JobSpec, int], ModelProfile], spec: JobSpec, seq_len: int,
             sequence_parallel: int) -> ModelProfile:
    """The model's profile at the job's setting. With sequence parallelism a rank holds 1/N of each
    sequence outside attention (memory/ulysses_buffers.py): its activations are the trace at
    seq_len / N, while a token's FLOPs are the whole sequence's (each rank attends over all of it,
    for heads / N heads), which MFU counts."""
    if sequence_parallel == 1:
        return profiler(spec, seq_len)
    tokens = math.ceil(seq_len / sequence_parallel)
    shard, whole = profiler(spec, tokens), profiler(spec, seq_len)
    return dataclasses.replace(
        shard, model_flops_per_token=whole.model_flops_per_token,
        hardware_flops_per_token=whole.hardware_flops_per_token,
        notes=(*shard.notes,
               f"activations traced per rank: 1/{sequence_parallel} of the sequence ({tokens} "
               "tokens)"))


def _data_parallel_size(world: int, sequence_parallel: int) -> int:
    """world / sequence_parallel; refused (at the field) when N does not divide the world."""
    if world % sequence_parallel:
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        raise spec_error(
            f"sequence_parallel {sequence_parallel} does not divide the world size {world} "
            "(resources.nodes x gpus_per_node): every rank must belong to one sequence-parallel "
            "group",
            path=("memory", "sequence_parallel"),
            hint=f"use one of {', '.join(map(str, divisors))}, or change resources",
            code="sequence-parallel-world")
    return world // sequence_parallel


def checkpointed_layers(num_layers: int,
                        setting: bool | JobSpecMemoryActivationCheckpointing | None) -> int:
    """Layers whose forward is recomputed in backward: all, one in k (layers i % k == 0), or
    none."""
    if setting is None or setting is False:
        return 0
    every = setting["every_n_layers"] if isinstance(setting, dict) else 1
    return math.ceil(num_layers / every)


def zero_bucket_sizes(zero: JobSpecMemoryZero, hidden_size: int | None) -> dict[str, int]:
    """The ZeRO sizes of `memory.zero` as DeepSpeed gets them (the compiler) and as the planner
    counts them.

    A value the spec sets is kept, 0 included (`stage3_prefetch_bucket_size: 0` turns prefetching
    off); an unset (null) one is the HF Trainer's derivation from the hidden size h (reduce bucket
    h², stage-3 prefetch 0.9·h², persistence threshold 10·h), or DeepSpeed's default when h is
    unknown. The HF Trainer derives no allgather size, so a null one is DeepSpeed's default.
    """
    def sized(value: int | None, from_hidden: Callable[[int], float], ds_default: int) -> int:
        if value is not None:
            return value
        return int(from_hidden(hidden_size)) if hidden_size else ds_default

    allgather = zero["allgather_bucket_size"]
    return {
        "reduce_bucket_size": sized(zero["reduce_bucket_size"], lambda h: h * h,
                                    DS_REDUCE_BUCKET_SIZE),
        "allgather_bucket_size": allgather if allgather is not None else DS_ALLGATHER_BUCKET_SIZE,
        "stage3_prefetch_bucket_size": sized(zero["stage3_prefetch_bucket_size"],
                                             lambda h: 0.9 * h * h, DS_STAGE3_PREFETCH_BUCKET_SIZE),
        "stage3_param_persistence_threshold": sized(zero["stage3_param_persistence_threshold"],
                                                    lambda h: 10 * h,
                                                    DS_STAGE3_PARAM_PERSISTENCE_THRESHOLD),
    }


def _batch_split(micro: int, global_batch: int | None, world: int,
                 sequence_parallel: int = 1) -> tuple[int, int]:
    """(global batch, accumulation) over `world` data-parallel ranks (the world over
    sequence_parallel)."""
    per_pass = micro * world
    global_batch = global_batch or per_pass
    if global_batch % per_pass:
        lower, upper = (global_batch // per_pass) * per_pass, (global_batch // per_pass
                                                               + 1) * per_pass
        ranks = "world size" if sequence_parallel == 1 else \
            f"data-parallel ranks (world size / sequence_parallel {sequence_parallel})"
        raise spec_error(
            f"{global_batch} is not a multiple of micro_batch_size x {ranks} = {micro} x {world} = "
            f"{per_pass}",
            path=("training", "global_batch_size"),
            hint=f"nearest valid global_batch_size: {f'{lower} or {upper}' if lower else upper}")
    return global_batch, global_batch // per_pass


def _total_steps(training: JobSpecTraining, global_batch: int, samples: int | None,
                 notes: list[str]) -> int | None:
    if samples is not None and samples < global_batch:
        # the loader trains whole global batches only (jobspec/data/loaders.py epoch_samples)
        explicit = training["global_batch_size"] is not None
        raise spec_error(f"{samples} training samples do not fill one global batch of "
                         f"{global_batch}",
                         path=("training", "global_batch_size" if explicit else "micro_batch_size"),
                         hint="use more data, or a smaller "
                              + ("training.global_batch_size" if explicit else
                                 "training.micro_batch_size or fewer ranks"))
    if training["max_steps"] is not None:
        return training["max_steps"]
    epochs = training["epochs"]
    if epochs is None:
        epochs = 1
        notes.append("neither training.max_steps nor training.epochs is set: training for 1 epoch")
    if samples is None:
        return None
    # Count as the loader runs: an epoch is the whole global batches of the shuffled samples, the
    # same for every split of the global batch (data/loaders.epoch_samples; the tail of each epoch's
    # order is left out). This module is pure, so the count is written here rather than imported.
    steps_per_epoch = samples // global_batch
    return max(1, math.ceil(epochs * steps_per_epoch))


def _warmup_steps(scheduler: JobSpecTrainingScheduler, total_steps: int) -> int:
    if scheduler["warmup_steps"]:
        return scheduler["warmup_steps"]
    return math.ceil(scheduler["warmup_ratio"] * total_steps)
