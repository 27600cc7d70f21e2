"""`python -m bench gpu-calibrate` without a GPU: its jobs are valid specs, its dry run plans them as
`jobspec plan` does and writes the calibration file's format, and the peak breakdown
(bench/peak_snapshot.py) reads an allocator history right."""
from __future__ import annotations

import json

import pytest

from bench import gpu_calibrate
from bench.peak_snapshot import ACTIVATIONS, BEFORE, TensorRanges, breakdown

MiB = 2**20
CHEAP = ["tinyllama-bf16-sdpa-b2-s2048", "mistral-0.5b-fp32-eager-b4-s1024"]   # one job of the first file, one new


def test_jobs_cover_the_brief_and_every_spec_validates(tmp_path):
    """Each job's spec, as it runs (RUN_SETTINGS in), passes `jobspec validate`'s machinery without a warning."""
    from jobspec.spec.derived import derive
    from jobspec.spec.validation import load_and_validate

    jobs = gpu_calibrate.all_jobs()
    names = [j.name for j in jobs]
    assert len(names) == len(set(names)) >= 12 and all(j.spec["name"] == j.name for j in jobs)
    first = json.loads(gpu_calibrate.FIRST_CALIBRATION.read_text())["jobs"]
    assert names[:len(first)] == [j["name"] for j in first]   # the first calibration's jobs, first
    specs = [gpu_calibrate.run_spec(j) for j in jobs]
    assert {s["model"]["architecture"] for s in specs} >= {"bert", "xlm-roberta", "llama", "qwen2", "gpt2", "gemma2",
                                                          "mistral"}
    assert {s["memory"]["precision"] for s in specs} == {"fp32", "fp16", "bf16"}
    assert {s["model"]["attention"] for s in specs} == {"eager", "sdpa"}
    assert any(s["model"].get("quantization") for s in specs) and any(s["model"].get("lora") for s in specs)
    assert any(s["memory"]["zero_stage"] == 3 for s in specs)
    assert any(s["memory"].get("tiled_mlp") and s["data"]["synthetic"]["seq_len"] >= 16384 for s in specs)
    for job in jobs:
        resolved = load_and_validate(gpu_calibrate.write_job_file(job, tmp_path))
        assert resolved.warnings == [], (job.name, [w.render() for w in resolved.warnings])
        assert resolved.spec["checkpoint"]["save_final"] is False and resolved.spec["export"]["final"] is False
        assert derive(resolved.spec).total_steps == gpu_calibrate.STEPS


def test_dry_run_plans_as_jobspec_plan_and_writes_the_calibration_format(tmp_path, capsys):
    from jobspec.cli import main as jobspec_main

    out = tmp_path / "cal.json"
    code = gpu_calibrate.main(["--dry-run", "--jobs", ",".join(CHEAP), "--out", str(out),
                               "--work", str(tmp_path / "w")])
    printed = capsys.readouterr().out
    assert code == 0
    written = json.loads(out.read_text())
    first = json.loads(gpu_calibrate.FIRST_CALIBRATION.read_text())
    assert set(written) == set(first) and [j["name"] for j in written["jobs"]] == CHEAP
    rows = {line.split(" | ")[0].strip("| "): line for line in printed.splitlines() if line.startswith("| ")}
    for job in written["jobs"]:
        assert set(job) == set(first["jobs"][0]) and job["readings"] == gpu_calibrate.readings(None)
        plan = job["plan_when_measured"]
        assert set(plan) == {"peak_allocated_gib", "peak_reserved_gib", "nvml_total_gib"}
        assert 1 < plan["peak_allocated_gib"] < plan["peak_reserved_gib"] < plan["nvml_total_gib"] < 40
        assert rows[job["name"]].startswith(f"| {job['name']} | {plan['peak_allocated_gib']:.2f} | ")
        # the same numbers as `jobspec plan` on the spec that was written and run
        job_file = tmp_path / "w" / job["name"] / "job.yaml"
        assert jobspec_main(["plan", str(job_file), "--format", "json"]) == 0
        planned = json.loads(capsys.readouterr().out)["plan"]
        assert round(planned["peak_allocated"] / 2**30, 2) == plan["peak_allocated_gib"]
        assert (job_file.parent / "run" / "ds_config.json").is_file()   # compiled as a launch compiles it
    # the first calibration's reading beside its plan: 23.25 GiB measured on the H200
    assert " | 23.25 | " in rows["tinyllama-bf16-sdpa-b2-s2048"]
    assert "estimated on one H200:" in printed and "- mistral-0.5b-fp32-eager-b4-s1024: mistral" in printed


def test_an_unknown_job_is_refused():
    with pytest.raises(SystemExit, match="no job nope"):
        gpu_calibrate.select(gpu_calibrate.all_jobs(), "nope")


def test_default_out_never_overwrites_a_calibration(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_calibrate, "CALIBRATION_DIR", tmp_path)
    assert gpu_calibrate.default_out("NVIDIA H100 80GB HBM3", "2026-12-01").name == "h100-80gb-hbm3-2026-12-01.json"
    (tmp_path / "h200-2026-11-28.json").write_text("{}")
    assert gpu_calibrate.default_out("NVIDIA H200", "2026-11-28").name == "h200-2026-11-28-2.json"
    assert gpu_calibrate.peaks_path(tmp_path / "h200.json") == tmp_path / "peaks" / "h200.json"


def _frame(path: str, name: str) -> dict:
    return {"filename": path, "line": 1, "name": name}


FORWARD = [_frame("/usr/lib/python3/site-packages/torch/nn/functional.py", "linear"),
           _frame("/usr/lib/python3/site-packages/transformers/models/llama/modeling_llama.py", "forward")]
BACKWARD = [_frame("/usr/lib/python3/site-packages/torch/autograd/__init__.py", "backward"),
            _frame("/usr/lib/python3/site-packages/deepspeed/runtime/engine.py", "backward")]


def test_breakdown_finds_the_peak_and_names_what_was_live():
    """Live at the end: a parameter, an optimizer state (both from before recording) and one backward
    block. Replayed: 100 + 200 + 40 (freed during the step) MiB at the start, a 300 MiB forward block
    and the backward block make the peak (690 MiB); frees and a small block come after."""
    block = lambda address, size: {"address": address, "size": size + 512, "requested_size": size,  # noqa: E731
                                   "state": "active_allocated", "frames": []}
    snapshot = {"segments": [{"blocks": [block(0x1000 * MiB, 100 * MiB), block(0x2000 * MiB, 200 * MiB),
                                         {**block(0x3000 * MiB, 50 * MiB), "frames": BACKWARD},
                                         {**block(0x7000 * MiB, 999 * MiB), "state": "inactive"}]}],
                "device_traces": [[
                    {"action": "alloc", "addr": 0x4000 * MiB, "size": 300 * MiB, "frames": FORWARD},
                    {"action": "alloc", "addr": 0x3000 * MiB, "size": 50 * MiB, "frames": BACKWARD},
                    {"action": "free_requested", "addr": 0x4000 * MiB, "size": 300 * MiB, "frames": []},
                    {"action": "alloc", "addr": 0x5000 * MiB, "size": 10 * MiB, "frames": FORWARD},
                    # allocated bytes fall at the request (the completion waits for other streams)
                    {"action": "free_completed", "addr": 0x4000 * MiB, "size": 300 * MiB, "frames": []},
                    {"action": "free_requested", "addr": 0x6000 * MiB, "size": 40 * MiB, "frames": []},
                    {"action": "free_requested", "addr": 0x5000 * MiB, "size": 10 * MiB, "frames": []}]]}
    ranges = TensorRanges()
    ranges.add(0x2000 * MiB + 4096, 8, "optimizer_states", "AdamW exp_avg")   # a storage inside the block
    ranges.add(0x1000 * MiB, 100 * MiB, "parameters", "model.embed_tokens.weight")
    out = breakdown(snapshot, ranges, top=3)
    assert out["peak_requested_gib"] == round(690 / 1024, 3) and out["trace_events"] == 7
    assert out["terms_gib"] == {ACTIVATIONS: round(350 / 1024, 3), "optimizer_states": round(200 / 1024, 3),
                                "parameters": round(100 / 1024, 3), BEFORE: round(40 / 1024, 3)}
    assert out["activations_by_site_gib"] == {
        "forward: transformers/models/llama/modeling_llama.py:forward": round(300 / 1024, 3),
        "backward: deepspeed/runtime/engine.py:backward": round(50 / 1024, 3)}
    largest = out["largest"]
    assert [(r["mib"], r["term"]) for r in largest] == [(300, ACTIVATIONS), (200, "optimizer_states"),
                                                        (100, "parameters")]
    assert largest[0]["frames"] == ["torch/nn/functional.py:1:linear",
                                    "transformers/models/llama/modeling_llama.py:1:forward"]
    assert largest[1]["what"] == "AdamW exp_avg"
