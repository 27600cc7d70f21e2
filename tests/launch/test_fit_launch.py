"""`jobspec launch` and memory: `memory.fit: auto`, the GPU pre-flight (through the
JOBSPEC_FAKE_GPU_FREE_BYTES hook), and the plan recorded in launch.json and MLflow (`plan.*`, `fit.*`).

The runner is the fake one of test_launch.py: these tests check what launch decides and writes.
"""
from __future__ import annotations

from conftest import PROFILER, fresh_store

import json
from pathlib import Path

import pytest
import yaml

from jobspec import hardware

from jobspec.launch import supervise as supervision

from jobspec.cli import main
from jobspec.spec.derived import derive
from jobspec.memory.gpu_overheads import cuda_context
from jobspec.memory.planner import MiB, parse_bytes, plan_memory
from jobspec.units import fmt_mib_gib
from test_launch import fake_runner, mlflow_run_of, only_run_dir, use_fake_runner  # noqa: F401, F811 (a fixture)

# Activations matter for this model (seq 256, micro 16), so a budget a little under its plan (1,986 MiB
# as written, 1,966 MiB in bf16, 1,940 of them the CUDA context a plan adds for a GPU it does not know)
# needs a smaller micro-batch, not only bf16.
FIT_BUDGET = f"{cuda_context(None, None).bytes // MiB + 10}MiB"


def write_fit_job(tmp_path: Path, memory: dict | None = None) -> Path:
    spec = {
        "name": "fit-launch",
        "model": {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                     "num_attention_heads": 2, "intermediate_size": 256,
                                                     "vocab_size": 512, "max_position_embeddings": 512}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 256}, "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": 4, "micro_batch_size": 16},
        "memory": memory or {},
        "resources": {"gpus_per_node": 2},
        "output_dir": "out",
        "logging": {"progress": "lines", "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                    "experiment": "fit-launch-tests"}},
    }
    path = tmp_path / "fit-launch.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def written_spec(job: Path) -> dict:
    from jobspec.spec.validation import load_and_validate
    return load_and_validate(job).spec


@pytest.fixture(autouse=True)
def store_of_the_job(tmp_path, empty_store):
    """write_fit_job's tracking_uri, an empty store of this test's own (a copy)."""
    fresh_store(empty_store, tmp_path / "mlflow.db")


@pytest.fixture(autouse=True)
def no_fake_gpu(monkeypatch):
    monkeypatch.delenv(hardware.FAKE_FREE_ENV, raising=False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """This host's GPUs have SIZE free (the documented test hook)."""
    return lambda size: monkeypatch.setenv(hardware.FAKE_FREE_ENV, str(parse_bytes(size)))


# ----------------------------------------------------------------------------- memory.fit: auto

def test_fit_auto_rewrites_the_spec_that_runs_and_records_why(tmp_path, fake_runner, monkeypatch, capsys,
                                                              fake_gpu):
    fake_gpu("80GiB")   # GPU ranks, whose plan records the GPU figures (the budget is gpu_memory's)
    job = write_fit_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET})
    original = written_spec(job)
    budget = parse_bytes(FIT_BUDGET)
    assert not plan_memory(original, derive(original, profiler=PROFILER), budget=budget).fits  # as written it does not fit
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    out = capsys.readouterr().out
    assert "jobspec: fit: " in out and "--set training.micro_batch_size=" in out

    run_dir = only_run_dir(tmp_path)
    ran = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["fit"]["budget_source"] == "memory.gpu_memory"
    for dotted, value in record["fit"]["changes"].items():
        node = ran
        for key in dotted.split("."):
            node = node[key]
        # a value the fit writes (`{every_n_layers: 2}`) is part of what the filled spec holds
        assert node == value or (isinstance(value, dict) and value.items() <= node.items()), dotted
    assert ran["training"]["micro_batch_size"] < original["training"]["micro_batch_size"]
    assert plan_memory(ran, derive(ran, profiler=PROFILER), budget=budget).fits
    # what DeepSpeed gets follows the fitted spec; the global batch (the trajectory) does not change
    assert ds_config["train_micro_batch_size_per_gpu"] == ran["training"]["micro_batch_size"]
    assert ds_config["train_batch_size"] == original["training"]["micro_batch_size"] * 2
    assert ds_config["gradient_accumulation_steps"] * ds_config["train_micro_batch_size_per_gpu"] * 2 == \
        ds_config["train_batch_size"]
    assert record["plan"]["nvml_total_mib"] <= budget / MiB

    _, run = mlflow_run_of(run_dir)
    params = run.data.params
    assert params["fit.applied"] == "true" and json.loads(params["fit.changes"]) == record["fit"]["changes"]
    assert params["training.micro_batch_size"] == str(ran["training"]["micro_batch_size"])
    assert float(params["plan.peak_allocated_mib"]) == record["plan"]["peak_allocated_mib"]


def test_fit_auto_dry_run_shows_the_fitted_config_and_creates_nothing(tmp_path, monkeypatch, capsys):
    job = write_fit_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET})
    monkeypatch.setattr(supervision, "run", lambda *a, **k: pytest.fail("dry run started the runner"))
    assert main(["launch", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "jobspec: fit: micro-batch" in out
    assert '"train_micro_batch_size_per_gpu": 16' not in out and '"train_batch_size": 32' in out
    assert not (tmp_path / "out").exists()


def test_nothing_fits_is_a_clean_exit_2_with_the_smallest_plan(tmp_path, fake_runner, monkeypatch, capsys):
    job = write_fit_job(tmp_path, {"fit": "auto", "gpu_memory": "100MiB"})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 2
    err = capsys.readouterr().err
    assert "memory.fit" in err and "nothing fits in 100.0 MiB" in err and "needs" in err
    assert "Traceback" not in err
    assert not list((tmp_path / "out").glob("run-*"))


def test_fit_auto_without_gpu_or_budget_runs_as_written(tmp_path, fake_runner, monkeypatch, capsys):
    job = write_fit_job(tmp_path, {"fit": "auto"})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    assert "fit: skipped" in capsys.readouterr().out
    run_dir = only_run_dir(tmp_path)
    assert yaml.safe_load((run_dir / "resolved.yaml").read_text()) == written_spec(job)
    assert "fit" not in json.loads((run_dir / "launch.json").read_text())
    _, run = mlflow_run_of(run_dir)
    assert run.data.params["fit.applied"] == "false"


def test_fit_auto_uses_the_free_gpu_memory_without_a_budget(tmp_path, fake_runner, monkeypatch, fake_gpu, capsys):
    fake_gpu(FIT_BUDGET)
    job = write_fit_job(tmp_path, {"fit": "auto"})
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    assert "from free GPU memory" in capsys.readouterr().out
    record = json.loads((only_run_dir(tmp_path) / "launch.json").read_text())
    assert record["fit"]["budget_source"] == "free GPU memory" and record["fit"]["budget_mib"] == parse_bytes(FIT_BUDGET) / MiB
    assert record["fit"]["changes"]["training.micro_batch_size"] < 16


# ----------------------------------------------------------------------------- pre-flight

def test_preflight_refuses_a_plan_larger_than_the_free_gpu_memory(tmp_path, fake_runner, monkeypatch, fake_gpu,
                                                                  capsys, caplog):
    fake_gpu("300MiB")
    job = write_fit_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 2
    err = capsys.readouterr().err
    expected = plan_memory(written_spec(job), derive(written_spec(job), profiler=PROFILER))
    assert f"{fmt_mib_gib(expected.nvml_total)} per GPU" in err and "300.0 MiB free" in err
    assert "jobspec plan JOB --fit --gpu-mem 300MiB" in err and "--ignore-preflight" in err
    assert not list((tmp_path / "out").glob("run-*"))

    assert main(["launch", str(job), "--ignore-preflight"]) == 0
    assert "preflight (ignored): the plan predicts" in caplog.text


def test_preflight_passes_when_the_plan_fits_and_on_cpu_hosts(tmp_path, fake_runner, monkeypatch, fake_gpu):
    job = write_fit_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0  # no GPU: nothing to check against
    fake_gpu("80GiB")
    assert main(["launch", str(job)]) == 0


# ----------------------------------------------------------------------------- plan params

def test_plain_launch_records_the_plan_in_launch_json_and_mlflow(tmp_path, fake_runner, monkeypatch,
                                                                 fake_gpu):
    fake_gpu("80GiB")   # GPU ranks (a CPU rank's plan has no GPU figure: the test below)
    job = write_fit_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    run_dir = only_run_dir(tmp_path)
    spec = written_spec(job)
    expected = plan_memory(spec, derive(spec, profiler=PROFILER))
    record = json.loads((run_dir / "launch.json").read_text())["plan"]
    assert record["peak_allocated_mib"] == round(expected.peak_allocated / MiB, 1)
    assert record["parameters_mib"] == round(expected.breakdown["parameters"] / MiB, 1)
    _, run = mlflow_run_of(run_dir)
    params = run.data.params
    assert params["plan.nvml_total_mib"] == f"{expected.nvml_total / MiB:.1f}"
    assert {f"plan.{k}_mib" for k in expected.breakdown} <= set(params)
    assert not [k for k in params if k.startswith("fit.")]  # memory.fit is off


def test_a_launch_on_cpu_ranks_records_their_host_ram_with_the_tensors_and_no_gpu_figure(
        tmp_path, fake_runner, monkeypatch):
    job = write_fit_job(tmp_path)
    use_fake_runner(monkeypatch, fake_runner, "quick")
    assert main(["launch", str(job)]) == 0
    run_dir = only_run_dir(tmp_path)
    spec = written_spec(job)
    expected = plan_memory(spec, derive(spec, profiler=PROFILER), cpu_ranks=True)
    assert expected.host["tensors"] == expected.peak_allocated > 0
    record = json.loads((run_dir / "launch.json").read_text())["plan"]
    assert record["host_total_mib"] == round(expected.host_total / MiB, 1)
    assert record["host_tensors_mib"] == round(expected.peak_allocated / MiB, 1)
    gpu_figures = {"peak_allocated_mib", "peak_reserved_mib", "nvml_total_mib", "cuda_context_mib"}
    assert not gpu_figures & set(record)
    _, run = mlflow_run_of(run_dir)
    assert run.data.params["plan.host_total_mib"] == f"{expected.host_total / MiB:.1f}"
    assert not {f"plan.{key}" for key in gpu_figures} & set(run.data.params)


def test_gpu_free_bytes_hook_and_cpu_hosts():
    assert hardware.gpu_free_bytes(2, {hardware.FAKE_FREE_ENV: "1234"}) == 1234
    if hardware.gpu_names() == ["cpu"]:
        assert hardware.gpu_free_bytes(2, {}) is None and hardware.gpu_count() == 0
