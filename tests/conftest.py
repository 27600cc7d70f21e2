"""Shared test helpers: free ports, run directories for the worker, launching the real runner."""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobspec.shm import remove_shared_memory_buffers
from jobspec.spec.schema import fill_defaults

REPO_ROOT = Path(__file__).resolve().parent.parent

# How the suite runs (xdist groups and order, DeepSpeed's op prebuild, the /dev/shm guard): its own plugin
pytest_plugins = ["xdist_schedule"]

# The planner's trace cache (jobspec/model/planner_trace.py): one per test session, shared by every test and
# the processes they start, so a model is traced once and ~/.cache is left alone.
if not os.environ.get("JOBSPEC_CACHE_DIR"):
    import tempfile

    os.environ["JOBSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="jobspec-test-cache-")


def _profiler():
    from jobspec.model.planner_trace import job_profiler
    return job_profiler()


PROFILER = _profiler()   # derive(spec, profiler=PROFILER): a job with its measured model, for planning tests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# A model small enough that 2 CPU ranks train it in seconds; dropout stays on so that
# resume tests also check the RNG restore. Token classification over 64 ids (label: which half
# of the range) is learnable within a dozen steps.
TINY_SPEC = {
    "name": "tiny",
    "model": {"architecture": "bert", "task": "token-classification", "num_labels": 2,
              "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64}},
    "data": {"synthetic": {"num_samples": 128, "eval_samples": 16, "seq_len": 16, "vocab_range": [5, 69],
                           "labels": "learnable"},
             "num_workers": 0, "pin_memory": False},
    "training": {"max_steps": 8, "micro_batch_size": 4, "seed": 7,
                 "optimizer": {"lr": 2e-3}, "scheduler": {"name": "linear", "warmup_steps": 2}},
    "logging": {"every_n_steps": 1, "mlflow": {"enabled": False}, "progress": "lines"},
    "resources": {"gpus_per_node": 2},
}


def _hand_written_ds_config(spec: dict, derived: dict) -> dict:
    training = spec["training"]
    opt = training["optimizer"]
    return {
        "train_batch_size": derived["global_batch_size"],
        "train_micro_batch_size_per_gpu": derived["micro_batch_size"],
        "gradient_accumulation_steps": derived["gradient_accumulation_steps"],
        "gradient_clipping": training["gradient_clipping"],
        "optimizer": {"type": "AdamW", "params": {"lr": opt["lr"], "betas": opt["betas"], "eps": opt["eps"],
                                                  "weight_decay": opt["weight_decay"], "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": opt["lr"], "warmup_num_steps": derived["warmup_steps"],
            "total_num_steps": derived["total_steps"], "warmup_type": "linear"}},
        "zero_optimization": {"stage": spec["memory"]["zero_stage"]},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_run_dir(root: Path, overrides: dict | None = None, name: str = "run") -> Path:
    """A run directory as `jobspec compile --out` writes it (compiler used when it exists)."""
    run_dir = Path(root) / name
    run_dir.mkdir(parents=True)
    spec = fill_defaults(deep_merge(TINY_SPEC, overrides or {}))
    spec["output_dir"] = spec["output_dir"] or str(Path(root) / "out")
    spec["checkpoint"]["dir"] = spec["checkpoint"]["dir"] or str(Path(spec["output_dir"]) / "checkpoints")
    world = spec["resources"]["nodes"] * spec["resources"]["gpus_per_node"]
    num_samples = spec["data"]["synthetic"]["num_samples"]
    try:
        from jobspec.compile.compiler import compile_spec
    except ImportError:
        compile_spec = None
    if compile_spec is not None:
        from jobspec.spec.derived import derive
        compiled = compile_spec(spec, derive(spec, num_train_samples=num_samples), run_dir=str(run_dir))
        ds_config, patches, derived = compiled.ds_config, compiled.patches, compiled.derived.as_dict()
        launch = compiled.plan.record()
    else:
        training = spec["training"]
        micro = training["micro_batch_size"]
        global_batch = training["global_batch_size"] or micro * world
        derived = {"micro_batch_size": micro, "global_batch_size": global_batch, "world_size": world,
                   "gradient_accumulation_steps": global_batch // (micro * world),
                   "total_steps": training["max_steps"],
                   "warmup_steps": training["scheduler"]["warmup_steps"]}
        ds_config, patches, launch = _hand_written_ds_config(spec, derived), [], {"world_size": world}
    launch.update(derived=derived, notes=[], source=str(run_dir / "spec.yaml"))
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    (run_dir / "patches.json").write_text(json.dumps(patches))
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    return run_dir


def worker_argv(run_dir: Path, num_ranks: int = 2) -> list[str]:
    """The command `jobspec launch` runs: the real deepspeed runner starting jobspec.train.worker ranks."""
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    return [deepspeed, "--num_gpus", str(num_ranks), "--master_port", str(free_port()),
            "--module", "jobspec.train.worker", "--run-dir", str(run_dir)]


def worker_env(env: dict | None = None) -> dict:
    return {**os.environ, "JOBSPEC_PROGRESS": "lines", **(env or {})}


def run_worker(run_dir: Path, *, num_ranks: int = 2, env: dict | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the worker ranks to the end through the real deepspeed runner."""
    argv = worker_argv(run_dir, num_ranks)
    try:
        return subprocess.run(argv, cwd=run_dir, env=worker_env(env), capture_output=True, text=True,
                              timeout=timeout)
    finally:  # what `jobspec launch` does after the runner: a rank that died leaves its buffer behind
        remove_shared_memory_buffers(argv[argv.index("--master_port") + 1])


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows flattened to {"step": N, name: value, ...}."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({"step": row["step"], **row.get("metrics", {}),
                         **{k: v for k, v in row.items() if k not in ("metrics", "step")}})
    return rows


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, its tables made once: a new store runs MLflow's alembic migrations
    (2-6 s, most of a small tracking test's time). Tests copy it (`fresh_store`), so each still starts
    from an empty store of its own, byte for byte what MLflow would have made."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    assert not list(path.parent.glob("*-wal")), "the store is not one file"
    return path


def fresh_store(empty_store: Path, path: Path) -> str:
    """A copy of `empty_store` at `path`; its tracking URI."""
    shutil.copyfile(empty_store, path)
    return f"sqlite:///{path}"


@pytest.fixture
def worker_run_dir(tmp_path):
    return lambda overrides=None, name="run": make_run_dir(tmp_path, overrides, name)


@pytest.fixture(autouse=True)
def _no_stale_deepspeed_groups():
    """A test that runs DeepSpeed on a process group of this process and destroys it leaves DeepSpeed's
    module globals (world and data-parallel groups, an mpu) pointing at the dead group: the next engine
    built in this worker would broadcast over it ("Group ... is not registered"). Forget them after each
    test once no process group is alive."""
    yield
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    import torch.distributed as dist
    if not dist.is_initialized():   # as tests/train/split_runs.forget_deepspeed_groups
        groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        groups.mpu = groups.mesh_device = None
