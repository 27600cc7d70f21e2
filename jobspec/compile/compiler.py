"""Resolved spec -> the complete DeepSpeed config, the model patches and the launch plan.

Pure: no I/O, no torch. Every value DeepSpeed reads is written out explicitly (never "auto"), so
`ds_config.json` is the whole truth about a run. DeepSpeed knobs whose defaults are worth knowing:
ZeRO buckets default to 5e8 elements (`deepspeed/runtime/zero/config.py`), stage-3 prefetch to 5e7
and persistence to 1e5; schedulers warm up logarithmically unless told `warmup_type: linear`
(`deepspeed/runtime/lr_schedules.py`).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from jobspec import optimizers, techniques
from jobspec.compile.launch_plan import DEFAULT_MASTER_PORT, LaunchPlan
from jobspec.errors import spec_error
from jobspec.spec.derived import DerivedJob, zero_bucket_sizes
from jobspec.spec.model_dims import ModelDims
from jobspec.spec.types import (
    JobSpec,
    JobSpecMemory,
    JobSpecMemoryOffload,
    JobSpecMemoryOffloadAio,
    JobSpecResources,
    JobSpecTrainingOptimizer,
    JobSpecTrainingScheduler,
)

STEPS_PER_PRINT = 1_000_000_000  # jobspec logs progress itself; keep DeepSpeed's own prints quiet

SCHEDULERS = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
# Batch fields are derived from `training`; overriding them would desynchronise `derived`.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class Compiled:
    ds_config: dict
    patches: list[dict]
    # what runs: the ranks, their environment, the run directory (compile/launch_plan)
    plan: LaunchPlan
    derived: DerivedJob
    notes: list[str] = field(default_factory=list)


def compile_spec(spec: JobSpec, job: DerivedJob, *, run_dir: str = "RUN_DIR",
                 master_port: int | None = None) -> Compiled:
    """Compile a resolved spec (all defaults filled) and its derived job into a DeepSpeed config,
    patches and launch plan."""
    notes: list[str] = list(job.notes)
    training, memory, resources = spec["training"], spec["memory"], spec["resources"]
    if job.total_steps is None:
        raise spec_error(
            "training.epochs needs the number of training samples, which is unknown here",
            path=("training", "epochs"),
            hint="derive the job with its data (jobspec.spec.inputs.derive_job counts the rows of "
                 "data.train), or set training.max_steps")

    ds_config: dict[str, Any] = {
        **batch_block(job.global_batch_size, job.micro_batch_size, job.gradient_accumulation_steps),
        "gradient_clipping": training["gradient_clipping"],
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    optimizer = training["optimizer"]
    if optimizers.get(optimizer["name"]).built_by_deepspeed:
        ds_config["optimizer"] = optimizer_block(optimizer, memory["offload"]["optimizer"])
    ds_config["scheduler"] = scheduler_block(training["scheduler"], optimizer["lr"], job, notes)
    ds_config.update(precision_blocks(memory))
    ds_config["zero_optimization"] = zero_block(memory, job.dims,
                                                gather_16bit=exports_during_training(spec))
    # each technique's own fields (Ulysses' sequence_parallel_size), in the registry's order
    ds_config.update(techniques.ds_config(spec, job))
    if "nvme" in (memory["offload"]["optimizer"], memory["offload"]["params"]):
        ds_config["aio"] = aio_block(memory["offload"]["aio"])
    chosen = optimizers.get(optimizer["name"])
    if memory["zero_stage"] >= 1 and not chosen.zero_tested:
        # DeepSpeed refuses optimizers outside its tested list under ZeRO unless told otherwise.
        ds_config["zero_allow_untested_optimizer"] = True
    slow_step = chosen.offload_step(optimizer) if memory["offload"]["optimizer"] != "none" else None
    if slow_step:
        ds_config["zero_force_ds_cpu_optimizer"] = False
        notes.append(f"{slow_step} runs its step on the CPU with offload (no DeepSpeedCPUAdam): "
                     "slow")

    ds_config = apply_overrides(ds_config, spec["deepspeed"], notes)
    assert_no_auto(ds_config)
    assert_deepspeed_accepts(ds_config)
    return Compiled(
        ds_config=ds_config,
        patches=compile_patches(spec),
        plan=launch_plan(resources, job, run_dir, master_port),
        derived=job,
        notes=notes,
    )


def optimizer_block(optimizer: JobSpecTrainingOptimizer, offload_optimizer: str = "none") -> dict:
    """ds_config["optimizer"] of an optimizer DeepSpeed builds (jobspec/optimizers: its module's
    `deepspeed_block`)."""
    block = optimizers.get(optimizer["name"]).deepspeed_block
    if block is None:
        raise TypeError(f"optimizer {optimizer['name']} is not built by DeepSpeed")
    return block(optimizer, offload_optimizer)


def batch_block(global_batch_size: int, micro_batch_size: int,
                gradient_accumulation_steps: int) -> dict:
    """DeepSpeed's batch keys (BATCH_KEYS): the global batch, the micro-batch per GPU and the
    accumulation steps between optimizer steps. The one writer of them: compile_spec, and the ranks
    through `rebatched` (training.on_oom: halve_micro_batch), never by hand."""
    return {"train_batch_size": global_batch_size,
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps}


def rebatched(ds_config: dict, micro_batch_size: int, gradient_accumulation_steps: int) -> dict:
    """A copy of a compiled config with another split of the same global batch (train/oom)."""
    return {**copy.deepcopy(ds_config),
            **batch_block(ds_config["train_batch_size"], micro_batch_size,
                          gradient_accumulation_steps)}


def with_universal_load(ds_config: dict) -> dict:
    """A copy of a compiled config that loads DeepSpeed's universal checkpoint format
    (checkpoint/reshard: a checkpoint saved at another world size)."""
    out = copy.deepcopy(ds_config)
    out["checkpoint"] = {**out.get("checkpoint", {}), "load_universal": True}
    return out


def scheduler_block(scheduler: JobSpecTrainingScheduler, lr: float, job: DerivedJob,
                    notes: list[str]) -> dict:
    """DeepSpeed's scheduler for the spec's schedule, started at iteration 0
    (`last_batch_iteration`): from its default -1 the constructor warns and the first two steps
    share the starting lr. The worker sets the optimizer to the step-0 lr
    (jobspec/train/engine.start_schedule)."""
    block = _scheduler_block(scheduler, lr, job, notes)
    block["params"]["last_batch_iteration"] = 0
    return block


def _scheduler_block(scheduler: JobSpecTrainingScheduler, lr: float, job: DerivedJob,
                     notes: list[str]) -> dict:
    name = scheduler["name"]
    warmup = job.warmup_steps
    total = job.total_steps
    if warmup is None or total is None:
        # compile_spec refuses such a job first
        raise ValueError("a scheduler needs the job's total steps")
    # DeepSpeed rejects warmup_num_steps 0 and warms up over at least 2 steps.
    warmup_num_steps = max(1, warmup)
    if name == "constant":
        # No warmup: start at lr, or DeepSpeed's minimum 2-step warmup would begin at 0.
        return {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0 if warmup else lr, "warmup_max_lr": lr,
            "warmup_num_steps": warmup_num_steps, "warmup_type": "linear"}}
    if name == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total, "warmup_num_steps": warmup_num_steps,
            "warmup_min_ratio": 0.0 if warmup else 1.0, "cos_min_ratio": scheduler["min_lr_ratio"],
            "warmup_type": "linear"}}
    # WarmupDecayLR decays to the same floor its warmup starts from.
    min_lr = scheduler["min_lr_ratio"] * lr
    if min_lr and warmup:
        notes.append(f"linear schedule: warmup starts at min_lr {min_lr:g} (DeepSpeed's "
                     "WarmupDecayLR uses one floor for warmup start and decay end)")
    if not warmup:
        notes.append("linear schedule without warmup: DeepSpeed's WarmupDecayLR still ramps over "
                     "its first 2 steps")
    return {"type": "WarmupDecayLR", "params": {
        "total_num_steps": total, "warmup_min_lr": min_lr, "warmup_max_lr": lr,
        "warmup_num_steps": warmup_num_steps, "warmup_type": "linear"}}


def precision_blocks(memory: JobSpecMemory) -> dict:
    precision = memory["precision"]
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update({k: memory["fp16"][k] for k in
                     ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                      "min_loss_scale", "auto_cast") if k in memory["fp16"]})
    return {"fp16": fp16, "bf16": {"enabled": precision == "bf16"}}


def zero_block(memory: JobSpecMemory, dims: ModelDims | None, gather_16bit: bool = False) -> dict:
    stage = memory["zero_stage"]
    # its rules (spec/rules/offload) hold: validated, again after memory.fit
    offload = memory["offload"]
    if stage == 0:
        return {"stage": 0}
    zero = memory["zero"]
    # what the planner counts too
    sizes = zero_bucket_sizes(zero, dims.hidden_size if dims else None)

    block: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": zero["overlap_comm"] if zero["overlap_comm"] is not None else stage >= 2,
        "contiguous_gradients": zero["contiguous_gradients"],
        "reduce_bucket_size": sizes["reduce_bucket_size"],
    }
    if stage in (1, 2):
        block["reduce_scatter"] = zero["reduce_scatter"]
        block["allgather_bucket_size"] = sizes["allgather_bucket_size"]
        block["round_robin_gradients"] = zero["round_robin_gradients"]
    else:
        block["stage3_prefetch_bucket_size"] = sizes["stage3_prefetch_bucket_size"]
        block["stage3_param_persistence_threshold"] = sizes["stage3_param_persistence_threshold"]
        block["stage3_max_live_parameters"] = zero["stage3_max_live_parameters"]
        block["stage3_max_reuse_distance"] = zero["stage3_max_reuse_distance"]
        block["sub_group_size"] = zero["sub_group_size"]
        # what DeepSpeed's save_16bit_model (and the HF Trainer) require to consolidate the
        # partitioned weights for a model save; jobspec's export gathers them the same way
        block["stage3_gather_16bit_weights_on_model_save"] = gather_16bit
    if offload["optimizer"] != "none":
        block["offload_optimizer"] = _offload_block(offload, offload["optimizer"], params=False)
    if offload["params"] != "none":
        block["offload_param"] = _offload_block(offload, offload["params"], params=True)
    return block


def _offload_block(offload: JobSpecMemoryOffload, device: str, *, params: bool) -> dict:
    block: dict[str, Any] = {"device": device, "pin_memory": offload["pin_memory"]}
    if device == "nvme":   # nvme_path is set: spec/rules/offload
        block["nvme_path"] = offload["nvme_path"]
        if params:
            block["buffer_count"] = offload["buffer_count"]
            block["buffer_size"] = offload["buffer_size"]
    return block


def aio_block(aio: JobSpecMemoryOffloadAio) -> dict:
    # DeepSpeed 0.19 calls the thread count `intra_op_parallelism`; `thread_count` would be ignored.
    return {"block_size": aio["block_size"], "queue_depth": aio["queue_depth"],
            "intra_op_parallelism": aio["thread_count"], "single_submit": aio["single_submit"],
            "overlap_events": aio["overlap_events"]}


def exports_during_training(spec: JobSpec) -> bool:
    """Whether rank 0 writes a Hugging Face model directory while the job runs (`export`
    section)."""
    export = spec["export"]
    return bool(export["final"] or export["at_checkpoints"] or export["best_eval"])


def compile_patches(spec: JobSpec) -> list[dict]:
    """Model changes the worker applies in order (DeepSpeed's config cannot express them for HF
    models): each technique's (jobspec/techniques), in the registry's order."""
    return techniques.patches(spec)


def assert_deepspeed_accepts(ds_config: dict) -> None:
    """The whole compiled config against DeepSpeed's own schema
    (schemas/deepspeed-config.schema.json): a value the spec's schema lets through but DeepSpeed's
    config classes refuse fails here, at compile time, not inside the ranks after launch."""
    from jobspec.spec.freeform import deepspeed_problems
    problems = deepspeed_problems(ds_config, owned=False)
    if problems:
        path, message, hint = problems[0][:3]
        dotted = ".".join(str(p) for p in path)
        raise spec_error(f"the compiled DeepSpeed config is refused at `{dotted}`: {message}",
                         path=("deepspeed",), hint=hint or "change the spec field that sets it")


def launch_plan(resources: JobSpecResources, job: DerivedJob, run_dir: str,
                master_port: int | None) -> LaunchPlan:
    """The ranks of the job: `master_port` (the launcher's free port), else the spec's, else the
    default."""
    return LaunchPlan(nodes=job.nodes, gpus_per_node=job.gpus_per_node, world_size=job.world_size,
                      master_port=master_port or resources["master_port"] or DEFAULT_MASTER_PORT,
                      run_dir=str(run_dir), master_addr=resources["master_addr"] or None)


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def apply_overrides(compiled: dict, overrides: dict, notes: list[str],
                    _path: tuple = ("deepspeed",)) -> dict:
    """`compiled` with `overrides` deep-merged over it; a note for each compiled value replaced."""
    merged = copy.deepcopy(compiled)
    for key, value in overrides.items():
        path = _path + (key,)
        dotted = ".".join(map(str, path))
        if len(path) == 2 and key in BATCH_KEYS:
            raise spec_error(f"{dotted} cannot be overridden: jobspec derives the batch sizes",
                             path=path,
                             hint="set training.micro_batch_size / training.global_batch_size")
        if key in merged and isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key] = apply_overrides(merged[key], value, notes, path)
            continue
        if key in merged:
            old = merged[key]
            # PyYAML reads `5e8` (no dot) as a string; DeepSpeed wants the number.
            if isinstance(value, str) and _NUMBER.match(value) and isinstance(old, (int, float)) \
                    and not isinstance(old, bool):
                number = float(value)
                value = int(number) if number.is_integer() else number
            if value != old:
                notes.append(f"{dotted} overrides compiled {old!r} -> {value!r}")
        else:
            notes.append(f"{dotted} adds {value!r} (not compiled by jobspec)")
        merged[key] = copy.deepcopy(value)
    return merged


def find_auto(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every "auto" string in a config (DeepSpeed resolves none of them outside HF
    Trainer)."""
    if isinstance(value, str):
        return [path] if value.strip().lower() == "auto" else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in find_auto(v, path + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in find_auto(v, path + (i,))]
    return []


def assert_no_auto(ds_config: dict) -> None:
    found = find_auto(ds_config)
    if found:
        where = ", ".join(".".join(map(str, p)) for p in found)
        raise spec_error(
            f'"auto" in the DeepSpeed config at {where}: only the HF Trainer resolves "auto"; '
            'plain '
            "DeepSpeed would silently fall back to its own defaults",
            path=("deepspeed",) + found[0], hint="write the value itself, or remove the override")


def patch_text(patch: dict) -> str:
    """A compiled patch in a few words (the launch header's and `jobspec compile`'s patch lines)."""
    return techniques.patch_text(patch)
