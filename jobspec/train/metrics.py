"""Throughput and memory measurements: tokens, peak FLOP/s per device, memory readings.

FLOPs per trained token come from the derived job (jobspec.spec.flops, checked against torch's
FLOP counter); this module holds what needs the running process: token counts, the device's
datasheet peak for MFU, allocator/NVML/RSS memory readings and their cross-rank maximum. torch is
imported inside the functions that need it, so the peak table can be used without it.
"""
from __future__ import annotations

import os
import re

from jobspec import hardware
from jobspec.units import MiB

# Dense peak FLOP/s (no 2:4 sparsity) from NVIDIA's datasheets, per training precision. "fp32" is the
# CUDA-core rate; "tf32" the tensor-core rate when TF32 is allowed. Precisions a chip lacks are absent.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1125e12, "fp32": 75e12},
    "H200": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 SXM": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A40": {"bf16": 149.7e12, "fp16": 149.7e12, "tf32": 74.8e12, "fp32": 37.4e12},
    "RTX A6000": {"bf16": 154.8e12, "fp16": 154.8e12, "tf32": 77.4e12, "fp32": 38.7e12},
    # NVIDIA publishes no A10G sheet; the A10 figures are the usual stand-in.
    "A10G": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    # GeForce cards: tensor-core rate with fp32 accumulation (what mixed-precision training uses).
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "V100 PCIe": {"fp16": 112e12, "fp32": 14e12},
    "V100 SXM": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

# (regex on the lower-cased device name, table row); first match wins, so specific names come first.
# torch.cuda.get_device_name gives e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "Tesla T4".
DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bb200\b", "B200"),
    (r"\bg?h200\b", "H200"),
    (r"\bh100\b.*\bnvl\b", "H100 NVL"),
    (r"\bh100\b.*(pcie|hbm2e)", "H100 PCIe"),
    (r"\bh100\b", "H100 SXM"),
    (r"\bh800\b", "H100 SXM"),
    (r"\ba100\b", "A100"),
    (r"\bl40s\b", "L40S"),
    (r"\bl40\b", "L40"),
    (r"\bl4\b", "L4"),
    (r"\ba40\b", "A40"),
    (r"\ba6000\b", "RTX A6000"),
    (r"\ba10g\b", "A10G"),
    (r"\ba10\b", "A10"),
    (r"\brtx 4090\b", "RTX 4090"),
    (r"\brtx 3090\b", "RTX 3090"),
    (r"\bv100\b.*pcie", "V100 PCIe"),
    (r"\bv100", "V100 SXM"),
    (r"\bt4\b", "T4"),
)


def count_tokens(batch: dict) -> int:
    """Non-padding tokens in a batch (attention-mask sum). Call it on the CPU batch to avoid a GPU sync."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a device for a precision (bf16, fp16, tf32, fp32); None when unknown (CPU)."""
    row = device_row(device_name)
    if row is None:
        return None
    return PEAK_FLOPS[row].get(precision.lower())


def device_row(device_name: str) -> str | None:
    """The PEAK_FLOPS row a device name maps to, by the patterns above; None when no pattern matches."""
    name = (device_name or "").lower()
    for pattern, row in DEVICE_PATTERNS:
        if re.search(pattern, name):
            return row
    return None


class RssReader:
    """This process's resident set size in bytes. On Linux one pread of /proc/self/statm, kept open:
    ~10x cheaper than psutil's reading, which matters at a log step after every training step."""

    def __init__(self):
        self._fd, self._pid = None, None

    def __call__(self) -> int:
        if self._pid != os.getpid():  # first call, or a forked child: /proc/self was the parent
            self._open()
        if self._fd is not None:
            return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
        import psutil
        return psutil.Process().memory_info().rss

    def _open(self) -> None:
        self._pid = os.getpid()
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):  # not Linux
            self._fd = None


_RSS = RssReader()


def memory_snapshot(device, rss: RssReader | None = None) -> dict[str, float]:
    """Memory readings in MiB: peak_allocated_mib / peak_reserved_mib (CUDA caching allocator since
    the last reset_peaks), nvml_used_mib (the whole GPU as the driver sees it, every process), and
    host_rss_mib (this process; pass an RssReader when reading repeatedly). The GPU keys are
    absent when `device` is not a CUDA device."""
    import torch

    snapshot = {"host_rss_mib": (rss or _RSS)() / MiB}
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return snapshot
    snapshot["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MiB
    snapshot["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MiB
    used = hardware.nvml_used_bytes(device)
    if used is not None:
        snapshot["nvml_used_mib"] = used / MiB
    return snapshot


def reset_peaks(device) -> None:
    """Start a new peak-memory window (CUDA only; nothing to do on CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def reduce_max(values: dict[str, float]) -> dict[str, float]:
    """Element-wise MAX of `values` over all ranks; every rank must pass the same keys.

    Returns a copy unchanged when torch.distributed is not initialised (single process).
    """
    import torch
    import torch.distributed as dist

    if not values or not (dist.is_available() and dist.is_initialized()):
        return dict(values)
    keys = sorted(values)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL only reduces GPU tensors
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist()))


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of `group` if it is true on one (one all-reduce MAX): the ranks stop, or
    redo a step, at the same step."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def gather_rows(values) -> list[list[float]]:
    """Every rank's 1-D tensor `values` (same length everywhere), as host lists, in rank order: one
    all-gather, from which sums, maxima and minima are taken on the host (one collective instead of
    one per reduction). One process, or torch.distributed not initialised: just this rank's row."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [values.tolist()]
    if dist.get_backend() == "nccl" and values.device.type != "cuda":  # NCCL only moves GPU tensors
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, values)
    return torch.stack(rows).tolist()
