"""Host RAM of a job: what one rank holds on its host at its peak, and a node's ranks together.

A rank's host memory has two moments (DeepSpeed's engine moves the built model to its device before it
builds the optimizer, so the two never coincide):

- construction: ZeRO-3 builds the model inside `deepspeed.zero.Init`, each module's parameters
  partitioned as soon as the module is built: this rank's partition (lp·Ψ/N) plus the largest module
  built whole before it is partitioned (a layer, or the embedding when it is larger). ZeRO 0/1/2 build
  every parameter on every rank, in the training dtype (on the meta device first, then materialised):
  lp·Ψ. An upper bound on a GPU, where `zero.Init` puts the partitions on the device.
- training: the CPU offload buffers (fp32 master partition, optimizer states, the fp32 gradient
  partition, stage 1/2's 16-bit transfer buffer, the offloaded parameter partition; DeepSpeed pins
  them, which locks the same pages, it does not copy them) and the data loader's worker processes.

Plus the rank's process itself (Python, torch, transformers, DeepSpeed imported). A node holds
`gpus_per_node` ranks. The budget is the node's RAM: `resources.host_mem`, else the launching host's
RAM when the job runs on it (one node). Pure: bytes in, bytes out; numbers measured by
bench/host_memory.py (docs/memory-planner.md, "Host memory").
"""
from __future__ import annotations

import math

from jobspec.spec.model_profile import Inventory
from jobspec.units import MiB

# A rank's process before any tensor: the interpreter with torch, transformers and DeepSpeed imported
# and, on a GPU, its CUDA context (bench/host_memory.py: 378 MiB RSS with CPU torch 2.13 here; 802 MiB on
# an H100 after the context's first cuBLAS kernel, torch 2.11+cu130), rounded up for what a training rank
# adds later (NCCL's host buffers, DeepSpeed's engine).
RUNTIME_BYTES = 1024 * MiB
# One DataLoader worker (a forked copy of the rank: its own pages only, the prefetched batches):
# bench/host_memory.py measured 12 MiB USS per worker after 50 batches of 8 x 512 tokens.
DATALOADER_WORKER_BYTES = 32 * MiB


def construction_bytes(inventory: Inventory, stage: int, world: int, lp: int) -> int:
    """Host bytes of one rank while it builds the model (see the module docstring)."""
    if stage < 3:
        return lp * inventory.total
    largest_tensor = max((math.prod(shape) for _, shape, _ in inventory.tensors), default=0)
    return lp * (math.ceil(inventory.total / world) + max(inventory.layer_params, largest_tensor))


def host_peak(host: dict) -> int:
    """A rank's peak host bytes from its components: the process, plus the larger of construction and
    what training keeps (offload buffers, data loader workers)."""
    training = sum(v for k, v in host.items() if k not in ("runtime", "construction"))
    return host.get("runtime", 0) + max(host.get("construction", 0), training)


def worker_bytes(num_workers: int) -> int:
    return num_workers * DATALOADER_WORKER_BYTES
