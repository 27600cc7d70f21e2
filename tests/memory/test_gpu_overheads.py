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
