"""The CUDA context figure a plan adds (jobspec/memory/gpu_overheads.py): measured per GPU and CUDA."""
from __future__ import annotations

from importlib import metadata

from jobspec.memory import gpu_overheads
from jobspec.memory.gpu_overheads import CONTEXT_READINGS, cuda_context, torch_cuda_version
from jobspec.units import MiB


def test_a_measured_gpu_and_cuda_version_get_their_reading():
    figure = cuda_context("NVIDIA H200", "13.0")
    assert figure.bytes == 1940 * MiB
    assert "measured on H200, CUDA 13" in figure.source


def test_an_unmeasured_or_unknown_gpu_gets_the_largest_reading_and_says_so():
    largest = max(r.bytes for r in CONTEXT_READINGS)
    for name, cuda in (("NVIDIA A100-SXM4-80GB", "12.4"), ("NVIDIA H200", "12.8"), (None, None)):
        figure = cuda_context(name, cuda)
        assert figure.bytes == largest
        assert "no reading for" in figure.source and "largest measured" in figure.source


def test_the_cuda_version_comes_from_torchs_version_without_importing_torch(monkeypatch):
    versions = {"2.11.0+cu130": "13.0", "2.6.0+cu124": "12.4", "2.13.0+cpu": None, "2.13.0": None}
    for version, cuda in versions.items():
        monkeypatch.setattr(gpu_overheads.metadata, "version", lambda _name, v=version: v)
        assert torch_cuda_version() == cuda, version

    def missing(_name):
        raise metadata.PackageNotFoundError("torch")

    monkeypatch.setattr(gpu_overheads.metadata, "version", missing)
    assert torch_cuda_version() is None


def test_the_launch_plans_with_this_hosts_gpu_and_records_the_figure(tmp_path, monkeypatch):
    """`jobspec launch` probes the GPU's name (NVML): its plan adds that GPU's measured context, and
    launch.json's plan says how much it added."""
    from jobspec.hardware import Host
    from jobspec.job.prepare import AS_WRITTEN, prepare_job
    from jobspec.memory.at_launch import plan_record
    from tests.spec_builder import write_job

    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_overheads, "torch_cuda_version", lambda: "13.0")
    job = write_job(tmp_path)
    plans = {}
    for name in ("NVIDIA H200", None):
        prepared = prepare_job(job, host=Host(gpu_free=None, gpu_name=name), how=AS_WRITTEN)
        plans[name] = prepared.memory.plan
    h200 = plans["NVIDIA H200"]
    assert "measured on H200, CUDA 13" in h200.settings["cuda_context"]
    assert h200.nvml_total - h200.peak_reserved == 1940 * MiB
    assert "unknown GPU" in plans[None].settings["cuda_context"]
    record = plan_record(type("Memory", (), {"plan": h200, "host_budget": None, "budget": None,
                                             "fit": None})())
    assert record["plan"]["cuda_context_mib"] == 1940.0
