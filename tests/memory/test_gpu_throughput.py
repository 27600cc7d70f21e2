"""The step-time model held to measured GPU speed (memory/gpu_throughput.py, memory/fit.step_time):
the table is the calibration files' `throughput` and `matmul` sections, each reading's FLOPs per
token is what the planner traces for its spec, and the model, fed the reading's own spec, predicts
its tokens/s within 5%. A GPU without readings gets the reference formula, and `plan --fit` prints
the chosen configuration's tokens/s and where the figure comes from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import PROFILER, REPO_ROOT

from jobspec.cli import main
from jobspec.memory import gpu_throughput
from jobspec.memory.fit import (
    EFFECTIVE_FLOPS,
    HALF_SATURATION_TOKENS,
    achieved_flops,
    speed_of,
    step_time,
)
from jobspec.memory.gpu_throughput import GPU_READINGS, readings_for
from jobspec.spec.derived import derive
from jobspec.spec.validation import load_and_validate

CALIBRATION = REPO_ROOT / "bench" / "calibration"
TOLERANCE = 0.05


def _runs() -> list[tuple[str, dict, dict]]:
    """(GPU name, the file's matmul section, one throughput entry) of every calibration file."""
    found = []
    for path in sorted(CALIBRATION.glob("*.json")):
        data = json.loads(path.read_text())
        entries = data.get("throughput") or []
        found += [(data["gpu"], data.get("matmul"), entry) for entry in entries]
    return found


def _derived(entry: dict, tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**entry["spec"], "output_dir": str(tmp_path / "out")}))
    spec = load_and_validate(path).spec
    return spec, derive(spec, profiler=PROFILER)


def test_the_table_is_the_calibration_files_readings():
    runs = _runs()
    assert runs, f"no throughput readings in {CALIBRATION}"
    table = {(gpu.gpu, r.job): (gpu, r) for gpu in GPU_READINGS for r in gpu.readings}
    assert len(table) == len(runs)
    for gpu_name, matmul, entry in runs:
        gpu, reading = next(v for (short, job), v in table.items()
                            if short in gpu_name and job == entry["name"])
        measured, spec = entry["readings"], entry["spec"]
        assert gpu.matmul_flops == matmul["tflops"] * 1e12
        assert (reading.tokens_per_s, reading.mfu) == (measured["tokens_per_s"], measured["mfu"])
        tokens = spec["data"]["synthetic"]["seq_len"] * spec["training"]["micro_batch_size"]
        assert (reading.hidden_size, reading.tokens_per_micro_batch) == \
            (spec["model"]["config"]["hidden_size"], tokens)
        # the run's step time and its tokens/s say the same
        assert measured["step_s"] == pytest.approx(tokens / reading.tokens_per_s, rel=0.02)


@pytest.mark.parametrize("gpu_name, entry", [(g, e) for g, _, e in _runs()],
                         ids=[e["name"] for _, _, e in _runs()])
def test_each_reading_is_its_jobs_traced_flops_and_the_model_predicts_it(gpu_name, entry, tmp_path):
    spec, derived = _derived(entry, tmp_path)
    gpu = readings_for(gpu_name)
    assert gpu is not None
    reading = next(r for r in gpu.readings if r.job == entry["name"])
    traced = derived.hardware_flops_per_token
    assert reading.hardware_flops_per_token == pytest.approx(traced, rel=1e-3)
    implied_model_flops = reading.mfu * gpu.peak_flops["bf16"] / reading.tokens_per_s
    assert implied_model_flops == pytest.approx(derived.model_flops_per_token, rel=0.01)
    predicted = speed_of(spec, derived, gpu_name).tokens_per_s
    measured = entry["readings"]["tokens_per_s"]
    assert abs(predicted / measured - 1) <= TOLERANCE, (entry["name"], predicted, measured)


def test_each_readings_half_saturation_is_near_the_gpus():
    """The one curve fits every reading: each one's own K within 10% of the GPU's (their geometric
    mean)."""
    for gpu in GPU_READINGS:
        k = gpu.half_saturation()
        for reading in gpu.readings:
            own = gpu_throughput._reading_k(gpu, reading)
            assert abs(own / k - 1) < 0.10, (gpu.gpu, reading.job, own, k)


def test_an_unknown_gpu_gets_the_reference_formula(tmp_path):
    entry = _runs()[0][2]
    spec, derived = _derived(entry, tmp_path)
    tokens = derived.tokens_per_micro_batch
    formula = EFFECTIVE_FLOPS["bf16"] * tokens / (tokens + HALF_SATURATION_TOKENS)
    for name in (None, "NVIDIA A100-SXM4-80GB", ""):
        assert achieved_flops(spec, derived, readings_for(name)) == formula
        assert step_time(spec, derived, name) == step_time(spec, derived)
    assert "no readings for NVIDIA A100" in speed_of(spec, derived, "NVIDIA A100-SXM4-80GB").source
    assert "reference formula" in speed_of(spec, derived, None).source
    measured = speed_of(spec, derived, "NVIDIA H200")
    assert "measured on H200 (bench/calibration/h200-2026-11-28.json)" == measured.source
    assert measured.step_s != step_time(spec, derived)


def test_other_precisions_scale_the_matmul_ceiling_by_the_datasheet():
    gpu = readings_for("H200")
    assert gpu is not None
    bf16 = gpu.achieved_flops("bf16", 8192, 2048)
    assert gpu.achieved_flops("fp16", 8192, 2048) == bf16
    assert gpu.achieved_flops("fp32", 8192, 2048) == pytest.approx(bf16 * 66.9 / 989.5)
    assert gpu.achieved_flops("tf32", 8192, 2048) == pytest.approx(bf16 * 494.7 / 989.5)
    # more tokens per micro-batch and wider layers run closer to the ceiling, never past it
    longer, wider = gpu.achieved_flops("bf16", 16384, 2048), gpu.achieved_flops("bf16", 16384, 4096)
    assert bf16 < longer < wider < 790e12
    assert gpu_throughput.precision_key("fp32", tf32=True) == "tf32"
    assert gpu_throughput.precision_key("bf16", tf32=True) == "bf16"


def test_plan_fit_prints_the_chosen_configurations_tokens_per_s(capsys):
    job = str(REPO_ROOT / "jobs" / "xlmr-large.yaml")
    args = ["plan", job, "--fit", "--gpu-mem", "139GiB", "--gpu", "H200"]
    assert main([*args, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)["fit"]
    speed = out["speed"]
    assert speed["source"].startswith("measured on H200")
    spec = load_and_validate(job, overrides=out["overrides"]).spec   # the chosen configuration
    derived = derive(spec, profiler=PROFILER)
    assert speed["step_s"] == pytest.approx(step_time(spec, derived, "H200"), abs=1e-4)
    per_step = derived.global_batch_size * derived.seq_len
    assert speed["tokens_per_s"] == pytest.approx(per_step / speed["step_s"], rel=1e-3)
    assert any(note.startswith("model.compile (off) pays when") for note in out["notes"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"fit: est. {speed['tokens_per_s']:,} tokens/s, " in text and "measured on H200" in text
