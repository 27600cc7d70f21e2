"""Building what a rank trains: the seeded model with its patches, the datasets and the DeepSpeed
engine from the compiled config; loading the checkpoint a run resumes from (and resharding one of
another world size). jobspec.train.oom rebuilds the engine through `build_engine` too.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from jobspec import launcher_log
from jobspec.checkpoint.reshard import ResumeFrom

# the ranks' and the planner's trace's one definition
from jobspec.model.step import loss_of  # noqa: F401
from jobspec.rundir import RunFiles
from jobspec.train.progress import RunState


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from one seed (`torch.manual_seed` seeds every
    device's too), as `transformers.set_seed` does, whose module (transformers.trainer_utils)
    imports PEFT and bitsandbytes: ~2.5 s of CPU per rank (docs/benchmarks.md) for a job without
    adapters."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_engine(files: RunFiles):
    """Seeded model with its patches, the datasets, and the DeepSpeed engine from the compiled
    config."""
    import deepspeed

    from jobspec.data import sample_packing
    from jobspec.data.loaders import build_datasets
    from jobspec.model.build import build_model, build_tokenizer
    from jobspec.train import sequence_parallel
    from jobspec.train.patches import apply_patches, client_optimizer, optimizer_parameters

    spec = files.spec
    rank = f"rank{os.environ.get('RANK', '0')}"
    phase = launcher_log.phase
    phase(rank, "imported-model-code")
    # python, numpy, torch (+cuda): same initial weights on every rank
    seed_everything(spec["training"]["seed"])
    tokenizer = build_tokenizer(spec)
    # training dtype; ZeRO-3: zero.Init (model/construct)
    model = build_model(spec, tokenizer, files.ds_config)
    note_construction(files.ds_config, model)
    # patches.json's patches in the compiler's order: `lora` (PEFT's adapters) after the base's,
    # before torch.compile
    model, patch_notes = apply_patches(model, files.patches)
    # training.optimizer.weight_decay_on: matrices -- the `parameter_groups` patch's groups, for
    # every optimizer
    parameters = optimizer_parameters(model, files.patches) if any(
        p["name"] == "parameter_groups" for p in files.patches) \
            else [p for p in model.parameters() if p.requires_grad]
    # an optimizer DeepSpeed cannot build from its config (training.optimizer): built here, None
    # otherwise
    built = client_optimizer(model, spec["training"]["optimizer"], files.patches)
    # data.packing: the model's side (data/sample_packing.py)
    packing_note = sample_packing.prepare_model(model, spec)
    phase(rank, "model")
    train_ds, eval_ds = build_datasets(spec, tokenizer)
    # data.packing: the rows
    train_ds, eval_ds = sample_packing.pack_datasets(spec, train_ds, eval_ds)
    if packing_note:
        patch_notes = [*patch_notes, packing_note, train_ds.packing.note()]
    phase(rank, "data")
    # memory.sequence_parallel: Ulysses wraps the attention and builds the groups DeepSpeed reduces
    # over
    sp = sequence_parallel.setup(model, spec, files.ds_config["train_micro_batch_size_per_gpu"])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameters,
        optimizer=built, config=files.ds_config, mpu=sp.mpu if sp else None)
    start_schedule(engine)
    phase(rank, "engine")
    return engine, train_ds, eval_ds, patch_notes


def note_construction(ds_config: dict, model) -> None:
    """Each rank's `jobspec-log: construction ...` line: the parameter elements it holds against the
    model's, counted from the partitions (under ZeRO-3 about 1/world), and its peak RSS so far."""
    import resource

    from jobspec.model.construct import construction_for, construction_line, count_partitions

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    launcher_log.note(construction_line(int(os.environ.get("RANK", "0")),
                                        construction_for(ds_config),
                                 count_partitions(model), peak_mib))


def start_schedule(engine) -> None:
    """Put DeepSpeed's warmup schedulers at step 0 without their "before it has started" warning.

    Built with `last_batch_iteration: -1` (their default), WarmupLR / WarmupDecayLR / WarmupCosineLR
    call get_lr() in their constructor, which warns, and the first two optimizer steps both run at
    the warmup's starting lr. The compiler writes `last_batch_iteration: 0`, which skips that call;
    here the optimizer gets the lr of step 0, as the constructor would have set it. A resumed engine
    then loads the scheduler's and the optimizer's state over this."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and getattr(scheduler, "last_batch_iteration", None) == 0 and \
            hasattr(scheduler, "get_lr"):
        from deepspeed.runtime.lr_schedules import update_lr
        scheduler._last_lr = update_lr(scheduler.optimizer.param_groups, scheduler.get_lr())


def resume(engine, ckpt: ResumeFrom, state: RunState, any_rank=lambda flag: flag,
           passed_over: list | None = None) -> dict | None:
    """Load the checkpoint `checkpoint.resume` names into the engine and `state`; this rank's RNG
    state.

    A corrupt newest checkpoint is passed over for the previous one, loudly (`passed_over` gets
    why).
    """
    from jobspec.checkpoint import save_load
    from jobspec.train import adam_replay
    client_state, target, skipped = save_load.load_with_fallback(engine, ckpt["resume"],
                                                                 ckpt["dir"], any_rank)
    for problem in skipped:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"WARNING: checkpoint passed over on resume: {problem}", file=sys.stderr,
                  flush=True)
        if passed_over is not None:
            passed_over.append(problem)
    if target is None:
        return None
    state.step = client_state["step"]
    state.epoch = client_state["epoch"]
    state.batches_in_epoch = client_state["batches_in_epoch"]
    state.resumed_from = str(Path(target[0]) / target[1])
    keep_checkpoint_threads(client_state.get("cpu_threads"))
    adam_replay.replay(engine.optimizer)  # DeepSpeed's CPU Adam: state the checkpoint cannot hold
    return save_load.rng_state_of_this_rank(client_state)


def keep_checkpoint_threads(saved: int | None) -> None:
    """On CPU ranks, continue with the intra-op thread count the checkpoint was trained with, when
    this host allows it: CPU kernels split their reductions by the thread count, so another count
    changes the last bits of every gradient (docs/reliability.md)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    if not saved or get_accelerator().device_name() != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    threads, note = resume_threads(int(saved), torch.get_num_threads())
    torch.set_num_threads(threads)
    if note and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {note}", file=sys.stderr, flush=True)


def resume_threads(saved: int, share: int) -> tuple[int, str | None]:
    """(threads to use, a note or None): the checkpoint's count unless this host's share is
    smaller."""
    if saved == share:
        return share, None
    if saved < share:
        return saved, (f"resumed with {saved} CPU threads per rank as the checkpoint was trained "
                       f"(this host offers {share}), so the losses continue bit-identical; set "
                       "OMP_NUM_THREADS to use all")
    return share, (f"the checkpoint was trained with {saved} CPU threads per rank but this host "
                   f"offers {share}: the losses will differ from an uninterrupted run in the last "
                   "bits")


def reshard_plan(ckpt: ResumeFrom, world_size: int, group, sequence_parallel: int = 1):
    """jobspec.checkpoint.reshard.plan with rank 0's conversion result shared over the gloo
    `group`."""
    import torch.distributed as dist

    from jobspec.checkpoint import reshard

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return reshard.plan(ckpt, world_size, broadcast, sequence_parallel)


def share_cpu_threads() -> int | None:
    """On CPU ranks, split the CPUs this process may use (affinity mask, cgroup quota: what Slurm's
    --cpus-per-task gives) between the ranks of this node: every rank taking all of them makes the
    ranks' OpenMP threads fight for cores (steps become many times slower). The count set, or None
    (GPU ranks, or OMP_NUM_THREADS set by the user)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from jobspec.hardware import available_cpus, threads_per_rank
    if get_accelerator().device_name() != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = threads_per_rank(available_cpus(), local_ranks)
    torch.set_num_threads(threads)
    return threads
