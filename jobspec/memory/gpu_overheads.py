"""What a GPU holds beyond torch's reserved memory: the CUDA context, as measured per GPU and CUDA
version.

NVML's "used" memory of a GPU running one rank is torch's reserved memory plus the CUDA context (the
driver's and runtime's own allocations, the kernels' modules, cuBLAS/cuDNN workspaces) and NCCL's
buffers. That overhead depends on the GPU generation and the CUDA version, so the plan takes a
measured figure (`CONTEXT_READINGS`: NVML used minus `torch.cuda.max_memory_reserved` of the same
run, from bench/calibration/*.json, which tests/memory/test_calibration.py holds equal to this
table) for the GPU the job runs on, and says which figure it used. Without a reading for the GPU, or
when the GPU is unknown (`jobspec plan` on a host without one), the largest reading stands in: a
plan that fits with it fits on every GPU measured.

Pure: names and versions in, bytes out; no torch, no NVML.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from jobspec.units import MiB, fmt_mib_gib


@dataclass(frozen=True)
class ContextReading:
    """NVML used minus torch's max reserved, measured on one GPU model and CUDA major version."""

    gpu: str            # a substring of the device name NVML reports, e.g. "H200"
    cuda_major: int
    bytes: int
    source: str         # the calibration file that holds the readings


CONTEXT_READINGS = (
    ContextReading("H200", 13, 1940 * MiB, "bench/calibration/h200-2026-11-28.json"),
)


@dataclass(frozen=True)
class ContextFigure:
    """The CUDA context a plan adds, and in words where the figure comes from."""

    bytes: int
    source: str


def cuda_context(device_name: str | None, cuda_version: str | None) -> ContextFigure:
    """The context figure for a rank on `device_name` (NVML's name, None: unknown) under CUDA
    `cuda_version` ("13.0"; None: unknown): the reading of that GPU and CUDA major version, else the
    largest reading (see the module docstring)."""
    major = _major(cuda_version)
    for reading in CONTEXT_READINGS:
        if device_name and reading.gpu.lower() in device_name.lower() \
                and reading.cuda_major == major:
            return ContextFigure(reading.bytes,
                                 f"measured on {reading.gpu}, CUDA {reading.cuda_major} "
                                                f"({reading.source})")
    largest = max(CONTEXT_READINGS, key=lambda r: r.bytes)
    what = f"{device_name}, CUDA {cuda_version or '?'}" if device_name else "an unknown GPU"
    return ContextFigure(largest.bytes, f"no reading for {what}: the largest measured, "
                                        f"{fmt_mib_gib(largest.bytes)} on {largest.gpu}, CUDA "
                                        f"{largest.cuda_major}")


def torch_cuda_version() -> str | None:
    """The CUDA version of the installed torch build, from its version's local part ("2.11.0+cu130"
    -> "13.0"), without importing torch; None for a CPU build or an unmarked version."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    match = re.search(r"\+cu(\d+)(\d)$", version)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _major(version: str | None) -> int | None:
    if not version:
        return None
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None
