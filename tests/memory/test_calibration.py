"""The planner held to real GPU readings (bench/calibration/*.json, written by `python -m bench
gpu-calibrate` on a lent GPU): every job's planned peak allocated within 5% of the measured
`torch.cuda.max_memory_allocated`, and the NVML total within 5% where NVML was read. A change that
breaks the planner fails here, on a machine without a GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobspec.memory.gpu_overheads import CONTEXT_READINGS
from jobspec.units import MiB

CALIBRATION = Path(__file__).resolve().parents[2] / "bench" / "calibration"
TOLERANCE = 0.05
GiB = 1024 ** 3


def _files() -> list[Path]:
    return sorted(CALIBRATION.glob("*.json"))


def _jobs() -> list[tuple[str, dict]]:
    return [(f"{path.stem}:{job['name']}", job) for path in _files()
            for job in json.loads(path.read_text())["jobs"]]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


def _plan(job: dict, directory: Path, cache_dir: Path, monkeypatch):
    from jobspec.hardware import Host
    from jobspec.job.prepare import AS_WRITTEN, prepare_job

    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(cache_dir))
    path = directory / "job.yaml"
    spec = dict(job["spec"], output_dir=str(directory / "out"))
    path.write_text(yaml.safe_dump(spec))
    prepared = prepare_job(path, [], Host(gpu_free=None), AS_WRITTEN)
    assert prepared.memory is not None and prepared.memory.plan is not None, prepared.memory
    return prepared.memory.plan


def test_there_is_calibration_data():
    assert _files(), f"no GPU readings in {CALIBRATION}"
    assert all(job["readings"]["max_memory_allocated_gib"] for _, job in _jobs())


@pytest.mark.parametrize("label,job", _jobs(), ids=[label for label, _ in _jobs()])
def test_plan_within_five_percent_of_the_gpu(label, job, tmp_path, cache_dir, monkeypatch):
    plan = _plan(job, tmp_path, cache_dir, monkeypatch)
    readings = job["readings"]
    measured = readings["max_memory_allocated_gib"] * GiB
    ratio = plan.peak_allocated / measured
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{label}: planned peak allocated {plan.peak_allocated / GiB:.2f} GiB, measured "
        f"{measured / GiB:.2f} GiB ({ratio:.3f}); the plan's terms: "
        f"{ {k: round(v / GiB, 3) for k, v in plan.breakdown.items() if v} }")
    if readings.get("nvml_used_gib"):
        nvml = plan.nvml_total / (readings["nvml_used_gib"] * GiB)
        assert abs(nvml - 1) <= TOLERANCE, f"{label}: NVML total planned / measured = {nvml:.3f}"


def test_the_context_table_is_the_measured_one():
    """memory/gpu_overheads.CONTEXT_READINGS is the median NVML-minus-reserved reading of each
    calibration file's GPU and CUDA version."""
    measured = {}
    for path in _files():
        data = json.loads(path.read_text())
        gaps = sorted(r["nvml_mib"] - r["reserved_mib"] for r in data.get("context", []))
        gaps += sorted(round((j["readings"]["nvml_used_gib"] - j["readings"]["max_memory_reserved_gib"]) * 1024)
                       for j in data["jobs"] if j["readings"].get("nvml_used_gib")
                       and j["readings"].get("max_memory_reserved_gib"))
        if gaps:
            key = (data["gpu"], int(data["versions"]["cuda"].split(".")[0]))
            measured[key] = sorted(gaps)[len(gaps) // 2] * MiB
    table = {(r.gpu, r.cuda_major): r.bytes for r in CONTEXT_READINGS}
    for (gpu, cuda), value in measured.items():
        found = [v for (name, major), v in table.items() if name in gpu and major == cuda]
        assert found == [value], f"{gpu} CUDA {cuda}: measured {value / MiB:.0f} MiB, table {found}"
