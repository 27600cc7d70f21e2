"""jobspec.hardware: NVML is started once per process whatever is probed, and shut down."""
from __future__ import annotations

import sys
import types

import pytest

from jobspec import hardware


class FakeMemory:
    def __init__(self, free, used):
        self.free, self.used = free, used


def fake_pynvml(calls: list, fail_init: bool = False):
    """A pynvml with two GPUs (free 5 and 3 GiB, compute capability 8.0) that records its calls."""
    gpus = [("NVIDIA A100-SXM4-80GB", 5 * 2**30), ("NVIDIA A100-SXM4-80GB", 3 * 2**30)]

    def record(name, result=None):
        def call(*args):
            calls.append(name)
            if name == "nvmlInit" and fail_init:
                raise RuntimeError("NVML Shared Library Not Found")
            return result(*args) if callable(result) else result
        return call

    return types.SimpleNamespace(
        nvmlInit=record("nvmlInit"), nvmlShutdown=record("nvmlShutdown"),
        nvmlDeviceGetCount=record("count", len(gpus)),
        nvmlDeviceGetHandleByIndex=record("handle", lambda i: i),
        nvmlDeviceGetName=record("name", lambda i: gpus[i][0].encode()),
        nvmlDeviceGetMemoryInfo=record("memory", lambda i: FakeMemory(gpus[i][1], 1)),
        nvmlDeviceGetCudaComputeCapability=record("capability", (8, 0)),
    )


@pytest.fixture
def nvml(monkeypatch):
    """A fresh process-wide NVML handle over the fake library; returns the recorded calls."""
    def install(fail_init: bool = False) -> list:
        calls: list = []
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, fail_init))
        monkeypatch.setattr(hardware, "NVML", hardware.Nvml())
        monkeypatch.delenv(hardware.FAKE_FREE_ENV, raising=False)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        return calls
    return install


def test_every_probe_shares_one_nvml_init_and_shutdown_releases_it(nvml):
    calls = nvml()
    assert hardware.gpu_names() == ["NVIDIA A100-SXM4-80GB"] * 2
    assert hardware.gpu_count() == 2
    assert hardware.gpu_free_bytes(2) == 3 * 2**30
    assert hardware.gpu_free_bytes(1) == 5 * 2**30
    assert hardware.bf16_supported() is True
    assert calls.count("nvmlInit") == 1 and "nvmlShutdown" not in calls
    hardware.NVML.shutdown()
    assert calls.count("nvmlShutdown") == 1
    hardware.NVML.shutdown()  # at exit again: nothing left to shut down
    assert calls.count("nvmlShutdown") == 1


def test_visible_devices_pick_the_gpus_whose_free_memory_counts(nvml, monkeypatch):
    nvml()
    assert hardware.gpu_free_bytes(1, {"CUDA_VISIBLE_DEVICES": "1"}) == 3 * 2**30
    assert hardware.gpu_free_bytes(1, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == 5 * 2**30  # not indices: all


def test_a_host_without_nvml_is_a_cpu_host_and_init_is_not_retried(nvml):
    calls = nvml(fail_init=True)
    assert hardware.gpu_names() == ["cpu"] and hardware.gpu_count() == 0
    assert hardware.gpu_free_bytes(2) is None
    assert hardware.bf16_supported() is True  # CPU ranks run bf16
    assert calls == ["nvmlInit"]


def test_the_fake_free_memory_hook_needs_no_nvml(nvml):
    calls = nvml()
    assert hardware.gpu_free_bytes(2, {hardware.FAKE_FREE_ENV: "1234"}) == 1234
    assert hardware.bf16_supported({hardware.FAKE_FREE_ENV: "1234"}) is True
    assert calls == []
