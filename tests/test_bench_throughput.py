"""`python -m bench gpu-throughput` without a GPU (bench/gpu_throughput.py): the dry run validates
every job and variant and prints what a GPU run measures, a variant whose field the schema lacks is
skipped with a note, and the pieces that read a run and judge its losses work on made-up runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import gpu_throughput
from jobspec import rundir
from jobspec.spec.schema import load_schema

REPO = Path(__file__).resolve().parent.parent


def schema_has(dotted: str) -> bool:
    node = load_schema()
    for key in dotted.split("."):
        node = node.get("properties", {}).get(key)
        if node is None:
            return False
    return True


def test_the_runs_are_the_jobs_times_the_variants_with_mlflow_off():
    runs = gpu_throughput.runs()
    jobs = gpu_throughput.JOBS
    assert [(r.job, r.variant.name) for r in runs[:2]] == [(job, "baseline") for job in jobs]
    assert len(runs) == len(gpu_throughput.JOBS) * len(gpu_throughput.VARIANTS)
    for run in runs:
        assert run.spec["logging"]["mlflow"]["enabled"] is False
        steps = run.spec["training"]["max_steps"]
        assert steps == gpu_throughput.STEPS >= gpu_throughput.LOSS_STEPS
        memory, model = run.spec["memory"], run.spec["model"]
        setting = (memory["zero_stage"], memory["precision"], model["attention"])
        assert setting == (0, "bf16", "sdpa")
        assert run.spec["resources"]["gpus_per_node"] == 1
        assert bool(model.get("compile")) == ("compile" in run.variant.name)
        assert (model.get("kernels") == "liger") == ("liger" in run.variant.name)
    shapes = {(r.spec["data"]["synthetic"]["seq_len"], r.spec["training"]["micro_batch_size"])
              for r in runs}
    assert shapes == {(2048, 4), (512, 32)}


def test_dry_run_validates_each_variant_and_prints_what_it_measures(tmp_path):
    code = ("import runpy, sys\n"
            "sys.argv = ['bench', 'gpu-throughput', '--dry-run', '--work', sys.argv[1]]\n"
            "try:\n    runpy.run_module('bench', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "assert 'deepspeed' not in sys.modules and 'torch' not in sys.modules, 'imported'\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tokens/s, MFU, peak allocated memory" in out
    assert f"first {gpu_throughput.LOSS_STEPS} steps' losses" in out
    calibration = json.loads(gpu_throughput.CALIBRATION.read_text())
    before = {e["name"]: e["readings"] for e in calibration["throughput"]}
    for run in gpu_throughput.runs():
        line = next(x for x in out.splitlines() if x.startswith(f"- {run.name}: "))
        if "liger" in run.variant.name and run.spec["model"]["architecture"] == "xlm-roberta":
            assert "skipped: model.kernels: liger has no fused modules for model type" in line, line
        else:
            assert "valid (" in line, line
            if "liger" in run.variant.name and not gpu_throughput._has_gpu():
                assert line.endswith("valid on a GPU host with `jobspec[gpu]` (this one lacks the "
                                     "GPU or Triton)"), line
            assert f"{before[run.job]['tokens_per_s']:,} tokens/s" in line, line
            assert f"target {gpu_throughput.TARGET_MFU[run.job]:.0%} MFU" in line
            assert (tmp_path / run.name / "job.yaml").is_file()


def test_a_refused_variant_fails_the_dry_run(tmp_path, monkeypatch, capsys):
    broken = gpu_throughput.Variant("zero3-compile",
                                    {"model": {"compile": True}, "memory": {"zero_stage": 3}})
    monkeypatch.setattr(gpu_throughput, "VARIANTS", (gpu_throughput.VARIANTS[0], broken))
    assert gpu_throughput.main(["--dry-run", "--work", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "-zero3-compile: REFUSED" in out
    assert "regional compilation cannot run under ZeRO stage 3" in out


def made_up_run(tmp_path: Path, losses: list[float], output: str) -> dict:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i + 1, "timestamp": 0, "train/loss": v} for i, v in enumerate(losses)]
    (run_dir / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / rundir.SUMMARY).write_text(json.dumps({
        "status": "finished", "steps": len(losses), "tokens_per_s": 40000.0, "mfu": 0.31,
        "peak_memory": {"mem/peak_allocated_mib_max": 30720.0}}))
    derived = {"global_batch_size": 4, "seq_len": 2048}
    (run_dir / rundir.LAUNCH).write_text(json.dumps({"derived": derived}))
    return gpu_throughput.read_run(run_dir, output, 0)


def test_a_runs_readings_and_its_losses_against_the_baseline(tmp_path):
    output = ("jobspec-log: phase rank0 sink 100.000 5.0\n"
              "jobspec-log: torch.compile: 41.5 s for 4 compilations, inside the first step\n"
              "jobspec-log: phase rank0 compiled 144.000 50.0\n"
              "jobspec-log: phase rank0 first-step 145.500 51.0\n")
    base_losses = [10.4 - 0.01 * i for i in range(25)]
    readings = made_up_run(tmp_path, base_losses, output)
    assert readings["tokens_per_s"] == 40000.0 and readings["mfu"] == 0.31
    assert readings["step_s"] == 4 * 2048 / 40000.0 and readings["peak_allocated_gib"] == 30.0
    assert (readings["first_step_s"], readings["compile_s"]) == (45.5, 41.5)
    assert readings["losses"] == base_losses[:gpu_throughput.LOSS_STEPS]
    job = gpu_throughput.JOBS[0]
    baseline = gpu_throughput.Run(job, gpu_throughput.VARIANTS[0], {}, 0.2, readings=readings)
    close = [v * (1 + gpu_throughput.LOSS_TOLERANCE / 2) for v in readings["losses"]]
    far = [*close[:-1], close[-1] * (1 + 2 * gpu_throughput.LOSS_TOLERANCE)]
    compiled = gpu_throughput.VARIANTS[1]
    runs = [baseline] + [gpu_throughput.Run(job, compiled, {}, 0.2,
                                            readings={**readings, "losses": losses})
                         for losses in (close, far)]
    assert gpu_throughput.loss_check(runs[1], baseline)[1] is True
    assert gpu_throughput.loss_check(runs[2], baseline)[1] is False
    assert gpu_throughput.loss_check(baseline, baseline) == (None, None)
    skipped = gpu_throughput.Run(job, gpu_throughput.VARIANTS[2], {}, 0.2,
                                 skipped="skipped: model.kernels is ...")
    table = gpu_throughput.render([*runs, skipped], 790.0, "NVIDIA H200").splitlines()
    rows = [line for line in table if line.startswith(f"| {job} |")]
    assert "| 40,000 | 31.0% (45% missed) | 30.00 | 45.5 | 41.5 | baseline |" in rows[0]
    assert "within bf16 tolerance" in rows[1] and "OVER bf16 tolerance" in rows[2]
    assert "skipped: model.kernels is ..." in rows[3]
    assert table[0].startswith("bf16 8192^3 matmul: 790 TFLOP/s")
