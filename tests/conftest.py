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

# The planner's trace cache (jobspec/model/trace.py): one per test session, shared by every test and
# the processes they start, so a model is traced once and ~/.cache is left alone.
if not os.environ.get("JOBSPEC_CACHE_DIR"):
    import tempfile

    os.environ["JOBSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="jobspec-test-cache-")


def _profiler():
    from jobspec.model.trace import job_profiler
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
        launch = dict(compiled.launch)
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


@pytest.fixture
def worker_run_dir(tmp_path):
    return lambda overrides=None, name="run": make_run_dir(tmp_path, overrides, name)


# --- DeepSpeed's JIT ops: build them in the background while the fast tests run -----------------

_PREBUILD = None
_SHM_GUARD = None


def pytest_collection_modifyitems(session, config, items):
    """Modules without slow tests first: the op builds started below (minutes on a fresh machine)
    overlap all of them instead of stalling the first slow test early in the alphabet. A module's
    tests stay together and in order, so module-scoped fixtures are set up once."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ in slow_modules)   # stable: order kept within each group


def pytest_collection_finish(session):
    global _PREBUILD, _SHM_GUARD
    if not any(item.get_closest_marker("slow") for item in session.items):
        return  # only a session that will launch ranks needs the ops, or can leak their buffers
    from shm_guard import ShmGuard
    _SHM_GUARD = ShmGuard().start()
    if os.environ.get("JOBSPEC_NO_PREBUILD"):
        return
    log = open(Path(session.config.rootpath) / ".pytest-prebuild-ops.log", "w")  # noqa: SIM115 (lives for the session)
    # `jobspec prepare --all`, as CI images do: the builds overlap the fast tests instead of stalling
    # the first slow test's launch past its timeout (torch's lock makes a launch that needs an op
    # being built wait for it instead of building it twice)
    _PREBUILD = subprocess.Popen([sys.executable, "-m", "jobspec", "prepare", "--all"], cwd=REPO_ROOT,
                                 stdout=log, stderr=subprocess.STDOUT)


def pytest_sessionfinish(session, exitstatus):
    # Never kill it: a build killed mid-way leaves torch's extension lock behind, and every later
    # build (so every later launch) would wait on that lock forever.
    if _PREBUILD is not None:
        _PREBUILD.wait()
    if _SHM_GUARD is not None:
        _SHM_GUARD.stop()
        leaked = _SHM_GUARD.leaks()
        if leaked:  # fail the session loudly, then free the RAM
            total = sum(p.stat().st_size for p in leaked if p.exists())
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            text = (f"/dev/shm LEAK: tests left {len(leaked)} DeepSpeed buffer(s) ({total / 2**20:.0f} MiB) that "
                    f"no process maps any more: {', '.join(p.name for p in leaked)}; remove them with "
                    "jobspec.shm.remove_shared_memory_buffers(MASTER_PORT) where the test runs ranks")
            if reporter is not None:
                reporter.write_sep("!", "/dev/shm leak", red=True, bold=True)
                reporter.write_line(text, red=True)
            else:
                print(text, file=sys.stderr)
            for path in leaked:
                path.unlink(missing_ok=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _ops_built_before_slow_tests(request):
    # a slow test's launch has its own timeout: let it start once the ops exist
    if _PREBUILD is not None and request.node.get_closest_marker("slow") is not None:
        _PREBUILD.wait()
