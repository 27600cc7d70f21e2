"""Every device probe jobspec makes: this host's NVIDIA GPUs through NVML (names, free and used
memory, compute capability), the CUDA device a rank trains on (through torch, rank side only), and
the CPUs this process may use (affinity mask and cgroup CPU quota); `Host`, what they found on the
machine that launches, for the plan and the launch header alike.

NVML is initialised once per process, at the first probe, and shut down at exit. No driver, no
NVML library or no GPU all read as "no GPU": a CPU-only host, whose ranks run on CPU cores.

Test hook: JOBSPEC_FAKE_GPU_FREE_BYTES=N makes this host look like one whose GPUs each have N bytes
free (the fit budget and the memory pre-flight of `jobspec launch`, on a CPU-only machine).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FAKE_FREE_ENV = "JOBSPEC_FAKE_GPU_FREE_BYTES"
# whether the nodes a job is checked for have GPUs, when they are not this host (`runs_elsewhere`)
_ELSEWHERE_GPUS: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "jobspec_elsewhere_gpus", default=None)


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


def ranks_on_cpus() -> bool:
    """Whether a job's ranks here run on CPUs: no NVIDIA GPU, and no GPU memory faked for a test
    (`Host.probe`'s `cpu_ranks`, without reading the rest of the host)."""
    return gpu_count() == 0 and not os.environ.get(FAKE_FREE_ENV)


def gpu_count() -> int:
    """NVIDIA GPUs on this host (0 on a CPU-only one)."""
    return len([name for name in gpu_names() if name != "cpu"])


@contextlib.contextmanager
def runs_elsewhere(*, gpus: bool) -> Iterator[None]:
    """Within: the job being checked runs on other machines, with or without NVIDIA GPUs
    (`jobspec sbatch` on a login node), so a rule that asks whether the job's host has a GPU asks
    that, not this host's devices (`job_host_has_gpu`)."""
    token = _ELSEWHERE_GPUS.set(gpus)
    try:
        yield
    finally:
        _ELSEWHERE_GPUS.reset(token)


def checked_here() -> bool:
    """Whether the job being checked runs on this host (not `runs_elsewhere`)."""
    return _ELSEWHERE_GPUS.get() is None


def job_host_has_gpu() -> bool:
    """Whether the host the job runs on has an NVIDIA GPU: this one, unless `runs_elsewhere`."""
    elsewhere = _ELSEWHERE_GPUS.get()
    return gpu_count() > 0 if elsewhere is None else elsewhere


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
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                   if v.strip()]
        indices = [int(v) for v in visible] if visible and all(v.isdigit() for v in visible) \
            else range(count)
        indices = [i for i in indices if i < count][:max(1, num_devices)]
        free = [nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).free
                for i in indices]
        return min(free) if free else None
    except Exception:
        return None


def gpu_total_bytes(environ=os.environ) -> int | None:
    """Total memory of this host's first GPU (what the header sets the plan against), None without
    GPUs."""
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
    """Compute capability >= 8.0 (Ampere) on GPU 0; True without an NVIDIA GPU (CPU ranks do
    bf16)."""
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
    """Used memory of the physical GPU behind the torch `device`, found by UUID
    (CUDA_VISIBLE_DEVICES renumbers devices, NVML does not); None where NVML is missing or refuses
    (containers, MIG)."""
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


# --- CPUs -----------------------------------------------------------------------------------------

def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"),
                   proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask (what Slurm's --cpus-per-task, taskset and a
    cgroup cpuset set), capped by a cgroup CPU quota (docker --cpus, cpu.max / cfs_quota_us).
    os.cpu_count() sees neither, so ranks sized from it over-subscribe the cores they really
    have."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup"),
                     proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 cpu.max, or v1 cfs_quota_us /
    cfs_period_us), the smallest along the path to the root; None when there is none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            base, read = cgroup_root, _v2_quota
        elif "cpu" in controllers.split(","):
            base = next((cgroup_root / name for name in ("cpu,cpuacct", "cpu")
                         if (cgroup_root / name).is_dir()),
                        cgroup_root / "cpu")
            read = _v1_quota
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            quota = read(directory)
            if quota is not None:
                quotas.append(quota)
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(quotas) if quotas else None


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def threads_per_rank(cpus: int, local_ranks: int) -> int:
    """Intra-op threads for each of `local_ranks` CPU ranks sharing `cpus` CPUs (at least 1)."""
    return max(1, cpus // max(1, local_ranks))


@dataclass(frozen=True)
class Host:
    """What the machine that launches contributes to a job: the least free memory of its GPUs (None
    without GPUs: then only `memory.gpu_memory` is a budget), whether they do bf16, and its RAM (the
    host budget of a one-node job without `resources.host_mem`; None: not this machine's to say);
    for the launch header, the GPUs, cores and RAM found."""

    gpu_free: int | None = None
    bf16_supported: bool = True
    ram_total: int | None = None
    # NVML's name of its GPUs: the plan adds that GPU's measured CUDA context
    gpu_name: str | None = None
    cpu_ranks: bool = False        # its ranks run on CPUs: the plan puts their tensors in host RAM
    gpu_names: tuple[str, ...] = ()  # every NVIDIA GPU NVML sees; empty on a CPU-only host
    gpu_total: int | None = None   # bytes of one GPU
    cpus: int = 1                  # CPUs this process may run on (affinity mask, cgroup quota)
    ram_available: int | None = None

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_names)

    @classmethod
    def probe(cls, gpus_per_node: int, gpu_free: int | None = None) -> Host:
        """This machine (FAKE_FREE_ENV in tests gives it GPU memory to plan GPU ranks against, and
        no GPU names); `gpu_free` when the caller has read it already (one NVML reading a
        launch)."""
        import psutil

        names = tuple(name for name in gpu_names() if name != "cpu")
        free = gpu_free if gpu_free is not None else gpu_free_bytes(gpus_per_node)
        memory = psutil.virtual_memory()
        return cls(free, bf16_supported(), memory.total, gpu_name=names[0] if names else None,
                   cpu_ranks=not names and free is None, gpu_names=names,
                   gpu_total=gpu_total_bytes() if names else None, cpus=available_cpus(),
                   ram_available=memory.available)
