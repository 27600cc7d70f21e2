"""Host RAM of a job: what one rank holds on its host at its peak, and a node's ranks together.

A rank's host memory has two moments (DeepSpeed's engine moves the built model to its device before
it builds the optimizer, so the two never coincide):

- construction: ZeRO-3 builds the model inside `deepspeed.zero.Init`, each module's parameters
  partitioned as soon as the module is built: this rank's partition (lp·Ψ/N) plus the largest module
  built whole before it is partitioned (a layer, or the embedding when it is larger). ZeRO 0/1/2
  build every parameter on every rank, in the training dtype (on the meta device first, then
  materialised): lp·Ψ. An upper bound on a GPU, where `zero.Init` puts the partitions on the device.
- training: the CPU offload buffers (fp32 master partition, optimizer states, the fp32 gradient
  partition, stage 1/2's 16-bit transfer buffer, the offloaded parameter partition; beside them
  ZeRO-3's 16-bit gradient partition and stage 1/2's gradient buffer of the largest parameter, and
  the power-of-2 rounding of every pinned one: `offload_terms`), the data loader's worker processes
  and the training data's index (`data_bytes`: the records themselves are memory-mapped).

Plus the rank's process itself (Python, torch, transformers, DeepSpeed imported). A node holds
`gpus_per_node` ranks. The budget is the node's RAM: `resources.host_mem`, else the launching host's
RAM when the job runs on it (one node). Pure: bytes in, bytes out; numbers measured by
bench/host_memory.py (docs/memory-planner.md, "Host memory").
"""
from __future__ import annotations

import math

from jobspec.memory.model_profile import Inventory
from jobspec.units import MiB

# A rank's process before any tensor: the interpreter with torch, transformers and DeepSpeed
# imported and, on a GPU, its CUDA context (bench/host_memory.py: 378 MiB RSS with CPU torch 2.13
# here; 802 MiB on an H100 after the context's first cuBLAS kernel, torch 2.11+cu130), rounded up
# for what a training rank adds later (NCCL's host buffers, DeepSpeed's engine).
RUNTIME_BYTES = 1024 * MiB
# One DataLoader worker (a forked copy of the rank: its own pages only, the prefetched batches):
# bench/host_memory.py measured 12 MiB USS per worker after 50 batches of 8 x 512 tokens.
DATALOADER_WORKER_BYTES = 32 * MiB
# The training data a rank holds per sample: the records are memory-mapped from the data cache
# (jobspec/data/cache.py; their pages are file-backed, shared by the node's ranks through the page
# cache and reclaimable, so not counted here), but the sampler's shuffled index list is a Python int
# and a pointer per sample (49 B measured for 10^6 samples, DistributedSampler on 2 ranks), beside
# the entry's offsets (8 B); packing adds the lengths, their sort and the bins (183 B per sample at
# its peak, 10^6 samples of 50-256 tokens into rows of 256).
DATA_BYTES_PER_SAMPLE = 64
PACKING_BYTES_PER_SAMPLE = 192


def construction_bytes(inventory: Inventory, stage: int, world: int, lp: int) -> int:
    """Host bytes of one rank while it builds the model (see the module docstring)."""
    if stage < 3:
        return lp * inventory.total
    largest_tensor = max((math.prod(shape) for _, shape, _ in inventory.tensors), default=0)
    return lp * (math.ceil(inventory.total / world) + max(inventory.layer_params, largest_tensor))


def pinned_bytes(nbytes: int) -> int:
    """What pinning `nbytes` costs on a GPU host: torch's CachingHostAllocator (ATen/core/
    CachingHostAllocator.h, `allocate`) rounds every pinned block up to a power of two
    (c10::llvm::PowerOf2Ceil; `pinned_max_round_threshold` defaults to no limit) and cudaHostAlloc
    page-locks all of it."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def stage3_sub_groups(partitions: list[int], sub_group_size: int) -> list[int]:
    """ZeRO-3's sub-groups of this rank's partition (stage3.py `_create_fp16_sub_groups`):
    parameters taken in order, a sub-group closed as soon as it holds `sub_group_size` elements or
    more."""
    groups, current = [], 0
    for numel in partitions:
        current += numel
        if current >= sub_group_size:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


def offload_terms(stage: int, world: int, lp: int, trainable: int, opt_states: int,
                  largest_param: int,
                  sub_group_size: int, pinned: bool, partitions: list[int] | None = None,
                  accumulation_steps: int = 1) -> dict[str, int]:
    """Host bytes of one rank's CPU optimizer offload, by DeepSpeed 0.19 buffer (bf16/fp16: lp = 2).

    Both stages: the fp32 master partition and the optimizer's states (CPU Adam's
    exp_avg/exp_avg_sq). ZeRO-3 (stage3.py): the fp32 gradient of each sub-group
    (`initialize_optimizer_states`, `subgroup_gradient_buffer`, pinned) and
    `grad_partitions_flat_buffer`, where the reduced 16-bit gradients accumulate before they are
    copied into the fp32 ones: gradient_accumulation_dtype (the engine's `get_data_types`: the model
    dtype, jobspec sets no `data_types`) x the partition, pinned. ZeRO-1/2 (stage_1_and_2.py): the
    fp32 gradient partition (pinned), the 16-bit transfer buffer
    `param_buffer_of_bit16_for_cpu_offload_groups` (pinned), `temp_grad_buffer_for_cpu_offload` (lp
    x the largest parameter, pinned) and, with gradient accumulation, `accumulated_grads_in_cpu` (lp
    x each parameter of the partition). `pinned` (offload `pin_memory` on a GPU host; DeepSpeed's
    CPU accelerator pins nothing) adds `pinned_rounding`: each pinned buffer rounded up to a power
    of two. `partitions`: this rank's share of each trainable parameter in order (ZeRO-3's
    sub-groups); without it, one sub-group per `sub_group_size` elements.
    """
    part = math.ceil(trainable / world)
    terms = {"offload_fp32_master": 4 * part,
             "offload_optimizer_states": math.ceil(opt_states / world)}
    if stage == 3:
        if partitions is not None:
            groups = stage3_sub_groups(partitions, sub_group_size)
        else:   # parameters of unknown sizes: whole sub-groups, then the rest
            whole = part // sub_group_size if sub_group_size > 0 else 0
            rest = part - whole * sub_group_size
            groups = [sub_group_size] * whole + ([rest] if rest else [])
        terms["offload_fp32_gradients"] = 4 * part
        terms["offload_gradient_accumulation"] = lp * part
        pinned_buffers = [4 * g for g in groups] + [lp * part]
    else:
        terms["offload_fp32_gradients"] = 4 * part
        terms["offload_bit16_transfer"] = lp * part
        terms["offload_temp_gradient"] = lp * largest_param
        if accumulation_steps > 1:
            terms["offload_gradient_accumulation"] = lp * part
        # one flat group: the no-decay group (norms, biases) is a few thousandths of the parameters
        pinned_buffers = [4 * part, 4 * part, lp * part, lp * largest_param]
    if pinned:
        terms["pinned_rounding"] = sum(pinned_bytes(b) - b for b in pinned_buffers)
    return terms


def host_peak(host: dict) -> int:
    """A rank's peak host bytes from its components: the process, plus the larger of construction
    and what training keeps (offload buffers, data loader workers)."""
    training = sum(v for k, v in host.items() if k not in ("runtime", "construction"))
    return int(host.get("runtime", 0) + max(host.get("construction", 0), training))


def worker_bytes(num_workers: int) -> int:
    return num_workers * DATALOADER_WORKER_BYTES


def data_bytes(samples: int, packing: bool) -> int:
    """Host bytes of a rank's data index over `samples` training samples (see
    DATA_BYTES_PER_SAMPLE)."""
    return samples * (DATA_BYTES_PER_SAMPLE + (PACKING_BYTES_PER_SAMPLE if packing else 0))
