"""The machine a launch found: GPUs (through jobspec.hardware's NVML probes), CPU cores and host RAM.

What the launch header reports and the "sized for GPUs" check weighs; probed once, in the launcher.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jobspec import hardware


@dataclass(frozen=True)
class Host:
    gpu_names: tuple = ()         # NVIDIA GPUs NVML sees; empty on a CPU-only host
    gpu_free: int | None = None   # least free bytes among the GPUs the ranks use
    gpu_total: int | None = None  # bytes of one GPU
    cpus: int = 1                 # CPUs this process may run on (its affinity mask)
    ram_total: int | None = None
    ram_available: int | None = None

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_names)


def probe(gpus_per_node: int, gpu_free: int | None = None) -> Host:
    """This host; `gpu_free` when the caller has probed it already (one NVML reading per launch)."""
    import psutil

    names = tuple(name for name in hardware.gpu_names() if name != "cpu")
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    memory = psutil.virtual_memory()
    if names and gpu_free is None:
        gpu_free = hardware.gpu_free_bytes(gpus_per_node)
    return Host(gpu_names=names, gpu_free=gpu_free if names else None,
                gpu_total=hardware.gpu_total_bytes() if names else None,
                cpus=cpus, ram_total=memory.total, ram_available=memory.available)
