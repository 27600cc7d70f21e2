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


# --- CPUs: what a CPU rank may use (issue 13: `os.cpu_count() // ranks` over-subscribed Slurm tasks) ---

def fake_cgroups(tmp_path, v1_quota: int | None = None, v2_max: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    lines = []
    if v2_max is not None:
        (tmp_path / "slurm" / "job_1").mkdir(parents=True)
        (tmp_path / "slurm" / "cpu.max").write_text("max 100000\n")
        (tmp_path / "slurm" / "job_1" / "cpu.max").write_text(v2_max + "\n")
        lines.append("0::/slurm/job_1")
    if v1_quota is not None:
        (tmp_path / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
        (tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text(f"{v1_quota}\n")
        (tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
        lines.append("4:cpu,cpuacct:/docker/abc")
    proc.write_text("\n".join(lines + ["9:memory:/x"]) + "\n")
    return {"cgroup_root": tmp_path, "proc_cgroup": proc}


def test_available_cpus_is_the_affinity_mask_capped_by_a_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(8)))  # --cpus-per-task=8
    assert hardware.available_cpus(**fake_cgroups(tmp_path / "none")) == 8
    assert hardware.available_cpus(**fake_cgroups(tmp_path / "v2", v2_max="300000 100000")) == 3
    assert hardware.available_cpus(**fake_cgroups(tmp_path / "v1", v1_quota=250000)) == 2   # 2.5 CPUs
    assert hardware.available_cpus(**fake_cgroups(tmp_path / "unlimited", v1_quota=-1, v2_max="max 100000")) == 8
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {5})
    assert hardware.available_cpus(**fake_cgroups(tmp_path / "one")) == 1


@pytest.mark.parametrize("cpus, ranks, threads", [(8, 2, 4), (3, 2, 1), (1, 4, 1), (16, 1, 16)])
def test_threads_per_rank(cpus, ranks, threads):
    assert hardware.threads_per_rank(cpus, ranks) == threads


def test_cpu_ranks_take_their_share_of_the_affinity_mask_not_of_the_machine(monkeypatch):
    import torch

    from jobspec.train import engine
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda *a: None)
    before = torch.get_num_threads()
    try:
        assert engine.share_cpu_threads() == 3 and torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting wins
        assert engine.share_cpu_threads() is None
    finally:
        torch.set_num_threads(before)


def test_a_resume_keeps_the_checkpoints_thread_count_when_the_host_allows():
    from jobspec.train.engine import resume_threads
    assert resume_threads(4, 4) == (4, None)
    threads, note = resume_threads(2, 8)   # requeued onto a bigger node: stay exact
    assert threads == 2 and "bit-identical" in note and "OMP_NUM_THREADS" in note
    threads, note = resume_threads(8, 2)   # onto a smaller one: no over-subscription, say what it costs
    assert threads == 2 and "last bits" in note


def test_a_host_probe_is_what_the_plan_and_the_header_read(nvml, monkeypatch):
    """One `Host`: the GPUs' names, least free memory, one GPU's total and bf16 for the plan and the
    header; without NVML a CPU host whose ranks run on CPUs; the test hook plans GPU ranks there."""
    nvml()
    host = hardware.Host.probe(2)
    assert host.has_gpu and host.gpu_names == ("NVIDIA A100-SXM4-80GB",) * 2
    assert host.gpu_name == "NVIDIA A100-SXM4-80GB" and host.gpu_free == 3 * 2**30
    assert host.cpus >= 1 and host.ram_total and not host.cpu_ranks
    assert hardware.Host.probe(2, gpu_free=2**30).gpu_free == 2**30   # read once by the caller
    nvml(fail_init=True)
    cpu = hardware.Host.probe(2)
    assert not cpu.has_gpu and cpu.gpu_free is None and cpu.cpu_ranks and cpu.gpu_total is None
    monkeypatch.setenv(hardware.FAKE_FREE_ENV, "1234")
    planned = hardware.Host.probe(2)
    assert planned.gpu_free == 1234 and not planned.cpu_ranks and not planned.has_gpu
