"""bench/packing.py's CPU side: its arguments, the launches' overrides, and --gpu refused without a GPU
(issue 24 items 3 and 9; the GPU run itself is made on a GPU host)."""
from __future__ import annotations

import pytest

from bench import __main__ as driver
from bench import packing
from jobspec.spec.loader import load_spec
from jobspec.spec.overrides import apply_overrides
from jobspec.spec.validation import validate_spec


def test_defaults_on_cpu_and_with_gpu():
    cpu = packing.parse_args([])
    assert (cpu.gpu, cpu.steps, cpu.repeats, cpu.variants) == (False, 16, 2, ["packed", "longest", "max_length"])
    gpu = packing.parse_args(["--gpu"])
    assert (gpu.gpu, gpu.steps, gpu.repeats, gpu.variants) == (True, 40, 1, ["packed", "longest"])
    assert packing.parse_args(["--gpu", "--steps", "8", "--variants", "packed,max_length"]).variants == \
        ["packed", "max_length"]


@pytest.mark.parametrize("argv,message", [
    (["--variants", "packed"], "two or more"),
    (["--variants", "packed,padded"], "not padded"),
    (["--steps", "3"], "at least 4"),
    (["--repeats", "0"], "--repeats"),
    (["--job", "no/such.yaml"], "no job file"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        packing.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_gpu_mode_refuses_cleanly_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(packing, "cuda_device", lambda: None)
    monkeypatch.setattr(packing, "launch", lambda *a: pytest.fail("launched without a GPU"))
    assert driver.main(["packing", "--gpu"]) == 2
    assert "--gpu needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("gpu,variant", [(False, "packed"), (False, "longest"), (False, "max_length"),
                                         (True, "packed"), (True, "longest")])
def test_each_launch_validates_with_its_variant_and_no_checkpoints(gpu, variant, tmp_path):
    """The overrides a launch gets are a valid spec: the variant's packing and padding, the steps,
    nothing saved or logged to MLflow; on CPU the shrunk model, with --gpu the job's own."""
    args = packing.parse_args(["--gpu"] if gpu else [])
    resolved = validate_spec(apply_overrides(load_spec(packing.JOB), packing.overrides(args, variant, tmp_path)))
    s = resolved.spec
    assert (s["data"]["packing"], s["data"]["padding"]) == (variant == "packed", packing.VARIANTS[variant][1])
    assert s["training"]["max_steps"] == args.steps and s["logging"]["every_n_steps"] == args.steps // 8
    assert not s["checkpoint"]["save_final"] and s["checkpoint"]["every_n_steps"] is None
    assert not s["export"]["final"] and not s["logging"]["mlflow"]["enabled"]
    assert s["model"]["config"]["hidden_size"] == (2048 if gpu else 128)
    assert s["memory"]["precision"] == ("bf16" if gpu else "fp32")


def test_render_names_the_ratio_and_the_machine():
    args = packing.parse_args(["--variants", "packed,longest"])
    row = {"tokens_per_s": 100.0, "samples_per_s": 1.0, "final_loss": 7.0, "gpu_peak_mib": None,
           "host_rss_mib": 800.0, "note": "packing: 300 samples in 47 rows of at most 512 tokens (98.4% full)"}
    text = packing.render({"packed": [row], "longest": [{**row, "tokens_per_s": 40.0, "note": None}]}, args, "CPU X")
    assert "packed / longest non-padding tokens/s: 2.50x" in text and "CPU X" in text and "98.4% full" in text
