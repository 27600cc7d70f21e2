"""Every device probe jobspec makes: this host's NVIDIA GPUs through NVML (names, free and used
memory, compute capability), and the CUDA device a rank trains on (through torch, rank side only).

NVML is initialised once per process, at the first probe, and shut down at exit. No driver, no
NVML library or no GPU all read as "no GPU": a CPU-only host, whose ranks run on CPU cores.

Test hook: JOBSPEC_FAKE_GPU_FREE_BYTES=N makes this host look like one whose GPUs each have N bytes
free (the fit budget and the memory pre-flight of `jobspec launch`, on a CPU-only machine).
"""
from __future__ import annotations

import atexit
import os
import threading

FAKE_FREE_ENV = "JOBSPEC_FAKE_GPU_FREE_BYTES"


class Nvml:
    """pynvml, initialised on first use (None when NVML cannot start) and shut down at exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started = False
        self._module = None

    def get(self):
        with self._lock:
            if not self._started:
                self._started = True
                try:
                    import pynvml
                    pynvml.nvmlInit()
                except Exception:  # no library, no driver: a CPU-only host
                    return None
                self._module = pynvml
                atexit.register(self.shutdown)
            return self._module

    def shutdown(self) -> None:
        with self._lock:
            if self._module is not None:
                try:
                    self._module.nvmlShutdown()
                except Exception:  # already gone at interpreter exit: nothing left to release
                    pass
            self._module = None


NVML = Nvml()


def gpu_names() -> list[str]:
    """GPU names from NVML, or ["cpu"] on a machine without NVIDIA GPUs."""
    nvml = NVML.get()
    if nvml is None:
        return ["cpu"]
    try:
        names = []
        for i in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
    except Exception:  # a driver that refuses queries counts as no GPU here
        return ["cpu"]
    return names or ["cpu"]


def gpu_count() -> int:
    """NVIDIA GPUs on this host (0 on a CPU-only one)."""
    return len([name for name in gpu_names() if name != "cpu"])


def gpu_free_bytes(num_devices: int, environ=os.environ) -> int | None:
    """The least free memory among the first `num_devices` GPUs this host's ranks use, or None
    without GPUs. NVML indices follow CUDA_VISIBLE_DEVICES when it lists integers."""
    fake = environ.get(FAKE_FREE_ENV)
    if fake:
        return int(fake)
    nvml = NVML.get()
    if nvml is None:
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        indices = [int(v) for v in visible] if visible and all(v.isdigit() for v in visible) else range(count)
        indices = [i for i in indices if i < count][:max(1, num_devices)]
        free = [nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).free for i in indices]
        return min(free) if free else None
    except Exception:
        return None


def gpu_total_bytes(environ=os.environ) -> int | None:
    """Total memory of this host's first GPU (what the header sets the plan against), None without GPUs."""
    if environ.get(FAKE_FREE_ENV):
        return int(environ[FAKE_FREE_ENV])
    nvml = NVML.get()
    if nvml is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:
        return None


def bf16_supported(environ=os.environ) -> bool:
    """Compute capability >= 8.0 (Ampere) on GPU 0; True without an NVIDIA GPU (CPU ranks do bf16)."""
    if environ.get(FAKE_FREE_ENV):
        return True
    nvml = NVML.get()
    if nvml is None:
        return True
    try:
        major, _ = nvml.nvmlDeviceGetCudaComputeCapability(nvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return True
    return major >= 8


def nvml_used_bytes(device) -> int | None:
    """Used memory of the physical GPU behind the torch `device`, found by UUID (CUDA_VISIBLE_DEVICES
    renumbers devices, NVML does not); None where NVML is missing or refuses (containers, MIG)."""
    nvml = NVML.get()
    if nvml is None:
        return None
    try:
        import torch
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # the reading is optional
        return None


def cuda_device_name() -> str:
    """The name of this rank's CUDA device (e.g. "NVIDIA H100 80GB HBM3"), "cpu" without CUDA."""
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
