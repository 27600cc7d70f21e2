"""The end-to-end training matrix: real `jobspec launch` runs on 2 CPU ranks, one per combination.

Not the cross product: every value of every dimension (ZeRO stage, precision, optimizer and
parameter offload, activation checkpointing, gradient accumulation, optimizer) appears in at least
one launch, and the combinations that break most often (bf16 under ZeRO-3, 8-bit AdamW under ZeRO,
activation checkpointing one-in-2 with ZeRO-3 and mid-run checkpoints, NVMe offload) are paired on
purpose. Each launch is a few optimizer steps of a tiny BERT (hidden 32, seq 16). The plain row (ZeRO 0,
fp32, AdamW, no accumulation, no activation checkpointing) is not launched here: it is the job that
tests/launch/test_launch.py::test_real_two_rank_launch_logs_a_finished_mlflow_run launches for real, and
test_the_plain_row_is_the_job_test_launch_launches compiles that job in process against this row's checks.
"""
from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import read_metrics

STEPS = 4
WORLD = 2
MODEL_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                "vocab_size": 128, "max_position_embeddings": 32}


def combo(*, zero: int, precision: str = "fp32", optimizer: str = "adamw", offload_optimizer: str = "none",
          offload_params: str = "none", activation_checkpointing=False, accumulation: int = 1,
          checkpoint_every: int | None = None):
    return dict(zero=zero, precision=precision, optimizer=optimizer, offload_optimizer=offload_optimizer,
                offload_params=offload_params, activation_checkpointing=activation_checkpointing,
                accumulation=accumulation, checkpoint_every=checkpoint_every)


EVERY_2 = {"every_n_layers": 2}
PLAIN = combo(zero=0)   # zero0-fp32-adamw-acc1-actckpt_off: launched by test_launch.py (see the docstring)
MATRIX = [
    pytest.param(combo(zero=1, precision="bf16", activation_checkpointing=True, accumulation=4),
                 id="zero1-bf16-adamw-acc4-actckpt_full"),
    pytest.param(combo(zero=2, precision="bf16", optimizer="adamw_8bit", activation_checkpointing=EVERY_2,
                       accumulation=4), id="zero2-bf16-adamw8bit-acc4-actckpt_every2"),
    pytest.param(combo(zero=2, offload_optimizer="cpu", activation_checkpointing=True),
                 marks=pytest.mark.jit_ops("CPUAdamBuilder"), id="zero2-fp32-offload_opt_cpu-acc1-actckpt_full"),
    pytest.param(combo(zero=3, precision="bf16", offload_optimizer="cpu", offload_params="cpu",
                       activation_checkpointing=EVERY_2, checkpoint_every=2),
                 marks=pytest.mark.jit_ops("CPUAdamBuilder"),
                 id="zero3-bf16-offload_opt_cpu-offload_params_cpu-acc1-actckpt_every2-save_every2"),
    pytest.param(combo(zero=3, offload_optimizer="nvme", offload_params="nvme", accumulation=4),
                 marks=pytest.mark.jit_ops("CPUAdamBuilder", "AsyncIOBuilder"),
                 id="zero3-fp32-offload_opt_nvme-offload_params_nvme-acc4-actckpt_off"),
]
# Every value of every dimension appears above (or in PLAIN) at least once; the full cross product would
# cost CI an hour (a launch is ~30 s here).


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    # one store for the module: creating a SQLite MLflow store (its migrations) costs seconds per launch
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def write_job(tmp_path: Path, case: dict, tracking_uri: str, name: str) -> tuple[Path, dict]:
    micro = 2 if case["accumulation"] > 1 else 4
    global_batch = micro * WORLD * case["accumulation"]
    spec = {
        "name": name,
        "output_dir": "out",
        "model": {"architecture": "bert", "task": "token-classification", "num_labels": 2, "config": MODEL_CONFIG},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 16, "vocab_range": [5, 100], "labels": "learnable"},
                 "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": STEPS, "micro_batch_size": micro, "global_batch_size": global_batch,
                     "optimizer": {"name": case["optimizer"], "lr": 1e-3}},
        "memory": {"precision": case["precision"], "zero_stage": case["zero"],
                   "activation_checkpointing": case["activation_checkpointing"],
                   "offload": {"optimizer": case["offload_optimizer"], "params": case["offload_params"],
                               "pin_memory": False}},
        "checkpoint": {"every_n_steps": case["checkpoint_every"], "resume": "never"},
        "resources": {"gpus_per_node": WORLD},
        "logging": {"every_n_steps": 2, "perf_window_s": 0, "progress": "lines",
                    "mlflow": {"tracking_uri": tracking_uri, "experiment": "matrix"}},
    }
    if "nvme" in (case["offload_optimizer"], case["offload_params"]):
        spec["memory"]["offload"]["nvme_path"] = "nvme"  # relative to the spec: tmp_path/nvme
        # tiny buffers: the model has ~40k parameters, the default 1e8-element buffers would be 2 GB
        spec["memory"]["offload"].update(buffer_count=4, buffer_size=100_000)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, {"micro": micro, "global_batch": global_batch}


def launch(job: Path, cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`jobspec launch JOB`. On a timeout it gets Ctrl-C, as from a user, so that it takes the
    runner and the ranks (their own process group) down with it instead of leaving them behind.
    The first launch on a fresh machine JIT-builds DeepSpeed's ops (cpu_adam, async_io): minutes."""
    argv = [sys.executable, "-m", "jobspec", "launch", str(job)]
    with subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"jobspec launch ran over {timeout:.0f} s:\n{out[-4000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def only_run_dir(tmp_path: Path) -> Path:
    runs = list((tmp_path / "out").glob("run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def check_ds_config(ds_config: dict, case: dict, batch: dict) -> None:
    zero = ds_config["zero_optimization"]
    assert zero["stage"] == case["zero"]
    assert ds_config["bf16"]["enabled"] is (case["precision"] == "bf16")
    assert ds_config["fp16"]["enabled"] is False
    assert (ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"],
            ds_config["gradient_accumulation_steps"]) == (batch["global_batch"], batch["micro"], case["accumulation"])
    for key, device in (("offload_optimizer", case["offload_optimizer"]), ("offload_param", case["offload_params"])):
        if device == "none":
            assert key not in zero
        else:
            assert zero[key]["device"] == device
    if "nvme" in (case["offload_optimizer"], case["offload_params"]):
        assert "aio" in ds_config
    # 8-bit AdamW is a client optimizer: DeepSpeed must not build its own from the config
    assert ("optimizer" in ds_config) is (case["optimizer"] == "adamw")


def check_patches(patches: dict, case: dict) -> None:
    if case["activation_checkpointing"]:
        expected_every = case["activation_checkpointing"]["every_n_layers"] if isinstance(
            case["activation_checkpointing"], dict) else 1
        assert patches["gradient_checkpointing"]["every_n_layers"] == expected_every
    else:
        assert "gradient_checkpointing" not in patches


def test_the_plain_row_is_the_job_test_launch_launches(tmp_path):
    """In process: test_launch's real launch is this matrix's ZeRO 0 row (its DeepSpeed config and
    patches pass the row's checks), so the row needs no launch of its own; if that job changes, this fails."""
    path = Path(__file__).resolve().parent / "launch" / "test_launch.py"
    module_spec = importlib.util.spec_from_file_location("matrix_test_launch_jobs", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    job = module.write_job(tmp_path)
    spec = yaml.safe_load(job.read_text())
    micro, world = spec["training"]["micro_batch_size"], spec["resources"]["gpus_per_node"]
    from jobspec.cli import main
    assert main(["compile", str(job), "--out", str(tmp_path / "compiled")]) == 0
    ds_config = json.loads((tmp_path / "compiled" / "ds_config.json").read_text())
    check_ds_config(ds_config, PLAIN, {"micro": micro, "global_batch": micro * world})
    check_patches({p["name"]: p["args"] for p in json.loads((tmp_path / "compiled" / "patches.json").read_text())},
                  PLAIN)
    assert ds_config["optimizer"]["type"] == "AdamW"


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX)
def test_matrix_launch_trains_and_logs(tmp_path, tracking_uri, case, request):
    if "nvme" in (case["offload_optimizer"], case["offload_params"]):
        from jobspec import ops
        problems = ops.build_problems(["AsyncIOBuilder"])   # the launch would refuse it, exit 2
        if problems:
            pytest.skip(f"{problems[0][1]} (scripts/test.sh installs libaio-dev when it can)")
    name = "m-" + request.node.callspec.id.split("-actckpt")[0].replace("_", "")[:60]
    job, batch = write_job(tmp_path, case, tracking_uri, name)
    proc = launch(job, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = only_run_dir(tmp_path)

    check_ds_config(json.loads((run_dir / "ds_config.json").read_text()), case, batch)
    check_patches({p["name"]: p["args"] for p in json.loads((run_dir / "patches.json").read_text())}, case)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    # samples counted by the ranks themselves: proves the global batch (micro x ranks x accumulation)
    assert (summary["steps"], summary["samples"]) == (STEPS, STEPS * batch["global_batch"])
    assert summary["final_loss"] is not None and math.isfinite(summary["final_loss"])

    from jobspec.tracking import run as tracking
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = tracking.client_for(info["tracking_uri"])
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED"
    samples_per_s = client.get_metric_history(info["run_id"], "perf/samples_per_s")
    assert [m.step for m in samples_per_s] == [2, 4] and all(m.value > 0 for m in samples_per_s)
    losses = client.get_metric_history(info["run_id"], "train/loss")
    assert losses and all(math.isfinite(m.value) for m in losses)

    ckpt_dir = tmp_path / "out" / "checkpoints"
    expected_tags = ["step2", "step4"] if case["checkpoint_every"] else ["step4"]
    assert sorted(p.name for p in ckpt_dir.glob("step*")) == expected_tags
    if case["accumulation"] > 1 and case["zero"] < 3:
        # (was tests/train/test_worker.py's accumulation test) the data position is counted in micro-batches:
        # STEPS x accumulation consumed from this epoch on each rank
        import torch
        state = torch.load(ckpt_dir / "step4" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        assert (state["step"], state["global_steps"], state["batches_in_epoch"]) == \
            (STEPS, STEPS, STEPS * case["accumulation"])
    if case["zero"] == 2:   # ZeRO's optimizer reports the gradient norm at every logged step
        rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
        assert [r["step"] for r in rows] == [2, 4] and all(r["train/grad_norm"] > 0 for r in rows), rows
    if "nvme" in (case["offload_optimizer"], case["offload_params"]):
        assert any((tmp_path / "nvme").rglob("*")), "NVMe offload wrote nothing to nvme_path"
