"""The bench driver's pieces: the HF Trainer baseline's TrainingArguments match the compiled job
(batch, accumulation, precision, optimizer, checkpointing, DeepSpeed config), the job lists, the
steady-state windows and the markdown table. No training here."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from bench import __main__ as driver
from bench import trainer_baseline as baseline
from jobspec.cli import main

REPO = Path(__file__).resolve().parent.parent
BENCH_JOBS = sorted((REPO / "bench" / "jobs").glob("cpu-*.yaml"))


def compiled(tmp_path: Path, job: Path, *sets: str):
    out = tmp_path / "run"
    assert main(["compile", str(job), "--out", str(out), *[x for s in sets for x in ("--set", s)]]) == 0
    return baseline.read_run_dir(out)


def training_arguments(kwargs: dict):
    from transformers import TrainingArguments
    return TrainingArguments(**kwargs)


def test_bench_jobs_are_listed_without_bases_and_compile(tmp_path):
    listed = driver.job_files([driver.CPU_JOBS])
    assert [p.name for p in listed] == [p.name for p in BENCH_JOBS] and len(listed) >= 3
    assert all(not p.name.startswith("_") for p in listed)
    full = driver.job_files(driver.FULL_JOBS)
    assert {p.name for p in full} >= {"xlmr-base-1-bs8-fp32.yaml", "xlmr-large-3-bs8-fp16-ckpt.yaml"}
    assert not any("common" in p.name for p in full)
    for job in listed:
        spec, _, _ = compiled(tmp_path / job.stem, job)
        assert spec["resources"]["gpus_per_node"] == 1 and spec["data"]["synthetic"]["seq_len"] == 128


@pytest.mark.parametrize("sets, optim, fp16, bf16", [
    ((), "adamw_torch_fused", False, False),
    (("training.optimizer.name=adamw_8bit", "memory.precision=fp16"), "adamw_bnb_8bit", True, False),
    (("training.optimizer.name=adafactor", "memory.precision=bf16"), "adafactor", False, True),
])
def test_arguments_match_the_job(tmp_path, sets, optim, fp16, bf16):
    job = REPO / "bench" / "jobs" / "cpu-2-accum-ckpt.yaml"
    spec, ds_config, derived = compiled(tmp_path, job, "training.max_steps=17", *sets)
    kwargs = baseline.training_arguments_kwargs(spec, derived, ds_config, tmp_path / "trainer")
    assert "deepspeed" not in kwargs  # ZeRO 0: the Trainer's own loop, as the guide measures it
    args = training_arguments(kwargs)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == \
        (derived["micro_batch_size"], derived["gradient_accumulation_steps"], 17) == (8, 2, 17)
    assert args.optim.value == optim and (args.fp16, args.bf16) == (fp16, bf16)
    assert args.gradient_checkpointing is True  # set through the new or the old name: both read it
    assert args.learning_rate == spec["training"]["optimizer"]["lr"] and args.max_grad_norm == 1.0
    assert args.seed == spec["training"]["seed"] and args.dataloader_drop_last


def test_zero_jobs_pass_the_compiled_config_and_agree_with_it(tmp_path):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    spec, ds_config, derived = compiled(tmp_path, REPO / "bench" / "jobs" / "cpu-3-zero2.yaml",
                                        "training.global_batch_size=32", "training.scheduler.warmup_steps=0")
    kwargs = baseline.training_arguments_kwargs(spec, derived, ds_config, tmp_path / "trainer")
    assert kwargs["deepspeed"] == ds_config and kwargs["gradient_accumulation_steps"] == 2
    assert kwargs["warmup_steps"] == ds_config["scheduler"]["params"]["warmup_num_steps"] == 1
    assert baseline.checkpointing_arg_names()[0] in kwargs and not any(
        v is True for k, v in kwargs.items() if "checkpointing" in k)
    # the Trainer's own consistency check of a DeepSpeed config against its arguments
    # (run here without the distributed setup TrainingArguments(deepspeed=...) would start)
    args = training_arguments({k: v for k, v in kwargs.items() if k != "deepspeed"})
    hf_config = HfTrainerDeepSpeedConfig(copy.deepcopy(ds_config))
    hf_config.trainer_config_process(args)
    assert hf_config.mismatches == []
    assert args.get_warmup_steps(derived["total_steps"]) == ds_config["scheduler"]["params"]["warmup_num_steps"]
    # a mismatch is caught (the check can fail)
    wrong = HfTrainerDeepSpeedConfig(copy.deepcopy(ds_config))
    wrong.trainer_config_process(training_arguments({**kwargs, "deepspeed": None, "learning_rate": 1.0}))
    assert any("learning_rate" in m for m in wrong.mismatches)


def test_steady_windows_leave_out_warm_up():
    ends = [10.0, 11.0, 12.0, 13.0, 14.0, 15.5]   # started at 0: the first 2-step window took 11 s
    assert baseline.steady_windows(ends, 0.0, 2) == [2.0, 2.5]
    assert baseline.steady_windows([3.0], 0.0, 1) == [3.0]   # one window: it is all there is


def test_table_has_medians_and_ratios():
    rows = {"job-a": {
        "jobspec": [{"perf/samples_per_s": 90.0, "mem/host_rss_mib_max": 500.0, "predicted_mib": 50.0},
                    {"perf/samples_per_s": 110.0, "mem/host_rss_mib_max": 520.0, "predicted_mib": 50.0}],
        "trainer": [{"perf/samples_per_s": 50.0, "mem/host_rss_mib_max": 400.0},
                    {"perf/samples_per_s": 50.0, "mem/host_rss_mib_max": 400.0}]}}
    table = driver.render(rows, 2).splitlines()
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    jobspec_row = [c.strip() for c in table[2].split("|")[1:-1]]
    trainer_row = [c.strip() for c in table[3].split("|")[1:-1]]
    assert jobspec_row[:3] == ["job-a", "jobspec", "100.0 (90.0-110.0)"]
    assert jobspec_row[-2:] == ["2.00 (1.80, 2.20)", "1.27 (RSS)"]  # 100/50 (per repeat); 510/400 (RSS)
    assert jobspec_row[6] == "-" and jobspec_row[9] == "50"  # peak allocated absent on CPU; prediction
    assert trainer_row[1] == "HF Trainer" and trainer_row[-2:] == ["", ""]


def test_gpu_suite_dry_run_prints_the_predictions_and_exits_0(tmp_path):
    """CI's run of the GPU acceptance suite: `python -m bench gpu --dry-run` needs no GPU: the planner
    traces the models with torch's fake tensors on the CPU, and nothing starts CUDA or DeepSpeed."""
    import subprocess
    import sys

    out = tmp_path / "gpu.md"
    code = ("import runpy, sys; sys.argv = ['bench', 'gpu', '--dry-run', '--out', sys.argv[1]]\n"
            "try:\n    runpy.run_module('bench', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "assert 'deepspeed' not in sys.modules, 'the dry run imported deepspeed'\n"
            "assert 'torch' not in sys.modules or not sys.modules['torch'].cuda.is_initialized()\n")
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text in done.stdout
    planner = text.split("## Planner accuracy")[1].split("##")[0]
    rows = [line for line in planner.splitlines() if line.startswith("| ") and "predicted" not in line]
    assert len(rows) >= 15 and all(line.split("|")[3].strip() == "-" for line in rows)  # nothing measured
    # the XLM-R rows' FLOPs are the derived job's (checkpointing adds the recompute to hardware FLOPs only)
    from bench import gpu
    for label, job, sets in gpu.LAUNCH_ROWS[:2]:
        derived = gpu.derived_of(job, sets)[1]
        line = next(x for x in text.splitlines() if x.startswith(f"| {label} | ") and "GFLOP" not in x)
        assert f"{derived.model_flops_per_token / 1e9:.3f} / {derived.hardware_flops_per_token / 1e9:.3f}" in line
    assert "23.5 GB" in text and "11.8 GB" in text and "jobspec launch jobs/xlmr-large.yaml" in done.stdout


def test_gpu_suite_mfu_uses_model_flops_and_the_datasheet_peak():
    from bench import gpu
    derived = {"seq_len": 512, "world_size": 1, "precision": "bf16",
               "model_flops_per_token": 1.963e9, "hardware_flops_per_token": 2.617e9}
    got = gpu.flops_of(derived, 20.0, "NVIDIA H100 80GB HBM3")  # 20 samples/s = 10240 tokens/s
    # at most four float64 products and quotients on each side: 8 roundings of 2**-53 between them
    assert got["tflops"] == pytest.approx(2.617e9 * 10240 / 1e12, rel=8 * 2**-53)
    assert got["mfu"] == pytest.approx(1.963e9 * 10240 / 989.5e12, rel=8 * 2**-53)
    assert gpu.flops_of(derived, 20.0, "cpu")["mfu"] is None


def test_gpu_suite_tables_from_measured_rows():
    """The non-dry rendering: ratios, MFU from the derived job, the seed rows next to the measured ones."""
    from bench import gpu
    planner = [{"label": label, "predicted_allocated": 10 * 2**30, "predicted_nvml": 11 * 2**30,
                "measured_allocated": 8 * 2**30, "nvml_used": 12 * 2**30}
               for label in [row[2] for row in gpu.SEED_ROWS] + ["bert-large 128 8 fp32 False adamw 0 none"]]
    derived = {"seq_len": 512, "world_size": 1, "precision": "bf16",
               "model_flops_per_token": 1.963e9, "hardware_flops_per_token": 2.617e9}
    launches = {label: {"derived": derived, "samples_per_s": 40.0, "peak_allocated_mib": 10240.0,
                        "nvml_used_mib": 12288.0, "predicted_allocated_mib": 10000.0, "predicted_nvml_mib": 11000.0}
                for label, _, _ in gpu.LAUNCH_ROWS}
    trainers = {label: {"derived": derived, "samples_per_s": 32.0, "peak_allocated_mib": 15360.0,
                        "nvml_used_mib": 16384.0} for label, _, _ in gpu.LAUNCH_ROWS}
    text = gpu.render(planner, launches, trainers, "NVIDIA H100 80GB HBM3", dry_run=False)
    assert "median |error| of peak allocated: 25.0% over 3 rows" in text      # 10 GiB predicted, 8 measured
    mfu = f"{1.963e9 * 40 * 512 / 989.5e12:.1%}"
    assert f"| 1.25 | {mfu} | {1.963e9 * 32 * 512 / 989.5e12:.1%} |" in text  # 40 / 32 samples/s
    seed = next(line for line in text.splitlines() if line.startswith("| XLM-R Large 1"))
    assert "23.5 GB" in seed and "| 8.0 / 12.0 |" in seed and "| 10.0 / 12.0 |" in seed and seed.endswith("| 16.0 |")
    assert "Dry run" not in text


def test_planner_activations_match_torch_memtracker_on_a_tiny_model(capsys):
    """`bench/planner_accuracy.py --memtracker --quick`: the planner's activation peak (composed, and
    extrapolated to micro-batch 3) against torch's MemTracker over one forward + backward of the whole
    model (fake tensors, one-in-2 checkpointing)."""
    from bench import planner_accuracy

    assert planner_accuracy.main(["--memtracker", "--quick"]) == 0   # 0: every row within 5%
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama-tiny")]
    assert len(rows) == 1
    planner_mib, memtracker_mib, error = (rows[0].split("|")[i].strip() for i in (2, 3, 4))
    # A model against an independent measurement, not arithmetic. Traced at their own micro-batch the two
    # agree exactly (docs/benchmarks.md: 12 of 12 real-size rows at 0.00%; fake tensors, so deterministic);
    # here the planner extrapolates micro-batch 3 linearly from its traces at 1 and 2 while MemTracker
    # traces 3, so the gap is what is not affine in the batch: measured +0.09% (2026-11-27). The bench's own
    # line (its exit code) stays 5%; this row is held to 1% (was 5%): the last real error the comparison
    # found was 5.45% (a head's gradient in flight), and one of the 6 layers' activations left out is ~1/6
    assert float(memtracker_mib) > 1 and abs(float(error.rstrip("%"))) <= 1.0
    # the MiB columns are printed to 0.1 MiB: their ratio carries up to 2 x 0.05 MiB of display rounding
    assert abs(float(planner_mib) / float(memtracker_mib) - 1) <= 0.01 + 0.1 / float(memtracker_mib)
