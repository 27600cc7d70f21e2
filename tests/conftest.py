"""Shared test helpers: free ports, run directories for the worker, launching the real runner."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from spec_builder import TINY_JOB as TINY_SPEC
from spec_builder import deep_merge, write_job  # noqa: F401 - tests import deep_merge from conftest

from jobspec.compile.compiler import compile_spec
from jobspec.shm import remove_shared_memory_buffers
from jobspec.spec.derived import derive
from jobspec.spec.validation import load_and_validate

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


def make_run_dir(root: Path, overrides: dict | None = None, name: str = "run") -> Path:
    """A run directory as `jobspec compile --out` writes it: TINY_SPEC with `overrides` merged in, written as
    spec.yaml, resolved by the loader (tests/spec_builder.py; output_dir root/out unless overridden) and
    compiled."""
    run_dir = Path(root) / name
    run_dir.mkdir(parents=True)
    source = write_job(run_dir, TINY_SPEC, "spec.yaml", **{"output_dir": str(Path(root) / "out"), **(overrides or {})})
    spec = load_and_validate(source).spec
    compiled = compile_spec(spec, derive(spec, num_train_samples=spec["data"]["synthetic"]["num_samples"]),
                            run_dir=str(run_dir))
    launch = compiled.plan.record()
    launch.update(derived=compiled.derived.as_dict(), notes=[], source=str(source))
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps(compiled.ds_config, indent=2))
    (run_dir / "patches.json").write_text(json.dumps(compiled.patches))
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
