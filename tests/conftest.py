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


# --- DeepSpeed's JIT ops: build them in the background while the fast tests run -----------------
#
# Under pytest-xdist (`scripts/test.sh` runs `-n 2`) the controller process, which runs no tests,
# starts the op prebuild and the /dev/shm guard once for the whole session; the workers do neither.
# Every slow test (every real launch) is in one group that a single worker runs, one test at a time,
# while the other worker runs the rest: two launches at once would share the 2 cores, the ports and
# /dev/shm buffers, the Slurm cluster and the MLflow servers, and miss their timeouts.
#
# The groups: xdist's `--dist loadgroup` takes them from xdist_group marks, which its worker turns
# into "@group" node id suffixes by setting Node._nodeid; under pytest 9.2 that has no effect (the
# node id comes from Node._id) and the marks are ignored. So each worker writes its {node id: group}
# map to the session directory, and the controller schedules with `_GroupScheduling` below (xdist's
# LoadGroupScheduling reading that map).

_PREBUILD = None
_SHM_GUARD = None
SLOW_GROUP = "launches"   # the group of every slow test (and of fast ones that share their fixtures)
_SESSION_DIR_ENV = "JOBSPEC_TEST_SESSION_DIR"   # xdist: the controller's, shared with its workers
_prebuild_waited = False
_groups: dict[str, str] = {}


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _is_xdist_controller(config) -> bool:
    return not _is_xdist_worker(config) and getattr(config.option, "dist", "no") != "no" \
        and bool(getattr(config.option, "tx", None))


@pytest.hookimpl(tryfirst=True)   # before xdist's own pytest_configure reads the mode
def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker, in order "
                            "(registered here too for -p no:xdist)")
    if not _is_xdist_controller(config):
        return   # serial (-n 0, -p no:xdist), or a worker (whose dist is "no")
    dist = config.option.dist
    if dist in ("load", "worksteal"):   # `-n N` alone means "load": the groups below still hold
        config.option.dist = dist = "loadgroup"
    if dist != "loadgroup":
        raise pytest.UsageError(f"--dist {dist}: the slow tests (real launches) must run one at a time; "
                                "use -n N (it schedules with the groups of tests/conftest.py), or -n 0")
    config.option.loadscopereorder = False   # the slow group first, in collection order (see below)
    import tempfile
    os.environ[_SESSION_DIR_ENV] = tempfile.mkdtemp(prefix="jobspec-test-")   # before the workers start


def _module_fixture_users(items) -> dict:
    """item -> names of the module- (or wider-) scoped fixtures of the test files that it uses."""
    used = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = {name for name, defs in (info.name2fixturedefs.items() if info else ())
                 if defs and defs[-1].scope != "function" and defs[-1].baseid}   # baseid "": pytest's own
        if names:
            used[item] = names
    return used


def _xdist_groups(items) -> dict:
    """item -> its group: SLOW_GROUP for every slow test and every fast one sharing a module-scoped
    fixture with one, the module for the other users of a module-scoped fixture (built once), the
    name given by an `xdist_group` mark (tests sharing an in-process cache: tests/model/test_trace.py)."""
    groups = {item: SLOW_GROUP for item in items if item.get_closest_marker("slow")}
    used = _module_fixture_users(items)
    slow_fixtures = {(item.module.__name__, name) for item in groups for name in used.get(item, ())}
    for item, names in used.items():
        if item not in groups:
            shared = any((item.module.__name__, name) in slow_fixtures for name in names)
            groups[item] = SLOW_GROUP if shared else item.module.__name__
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and item not in groups:
            groups[item] = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return groups


def pytest_collection_modifyitems(session, config, items):
    """Modules without slow tests first: the op builds started below (minutes on a fresh machine)
    overlap all of them instead of stalling the first slow test early in the alphabet. A module's
    tests stay together and in order, so module-scoped fixtures are set up once.

    An xdist worker puts the slow group first instead, so that one worker takes it at once (it is
    the longest part of the run) while the other runs everything else, and writes the groups for
    the controller."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ in slow_modules)   # stable: order kept within each group
    if not (_is_xdist_worker(config) and os.environ.get(_SESSION_DIR_ENV)):
        return
    groups = _xdist_groups(items)
    items.sort(key=lambda item: groups.get(item) != SLOW_GROUP)
    path = Path(os.environ[_SESSION_DIR_ENV]) / f"groups-{config.workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({item.nodeid: group for item, group in groups.items()}))
    tmp.replace(path)   # read by the controller once this worker reports its collection


def _read_groups(node) -> dict:
    path = Path(os.environ[_SESSION_DIR_ENV]) / f"groups-{node.workerinput['workerid']}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadGroupScheduling

    class _GroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _groups.get(nodeid) or super()._split_scope(nodeid)

    return _GroupScheduling(config, log)


def _start_session_helpers(rootpath: Path, lock_path: str | None = None) -> None:
    """The /dev/shm guard and `jobspec prepare --all`, once per session that launches ranks."""
    global _PREBUILD, _SHM_GUARD
    from shm_guard import ShmGuard
    _SHM_GUARD = ShmGuard().start()   # it watches this process's descendants: under xdist, the workers' too
    if os.environ.get("JOBSPEC_NO_PREBUILD"):
        return
    log = open(rootpath / ".pytest-prebuild-ops.log", "w")  # noqa: SIM115 (lives for the session)
    # `jobspec prepare --all`, as CI images do: the builds overlap the fast tests instead of stalling
    # the first slow test's launch past its timeout (torch's lock makes a launch that needs an op
    # being built wait for it instead of building it twice)
    lock_fd = None
    if lock_path:   # xdist: the build holds this lock until it exits; the slow tests' worker waits on it
        import fcntl
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        _PREBUILD = subprocess.Popen([sys.executable, "-m", "jobspec", "prepare", "--all"], cwd=REPO_ROOT,
                                     stdout=log, stderr=subprocess.STDOUT,
                                     pass_fds=(lock_fd,) if lock_fd is not None else ())
    finally:
        if lock_fd is not None:
            os.close(lock_fd)   # the child's copy keeps the lock


def pytest_collection_finish(session):
    if _is_xdist_worker(session.config):
        return   # the controller starts them (below)
    if not any(item.get_closest_marker("slow") for item in session.items):
        return  # only a session that will launch ranks needs the ops, or can leak their buffers
    _start_session_helpers(Path(session.config.rootpath))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist's controller (which collects nothing itself): a worker has collected. The first to
    report gives the groups and, if there are slow tests, starts the helpers, before any test is
    handed out."""
    if not _groups:
        _groups.update(_read_groups(node))
        if SLOW_GROUP in _groups.values():
            lock = Path(os.environ[_SESSION_DIR_ENV]) / "prebuild.lock"
            _start_session_helpers(Path(node.config.rootpath), str(lock))


def _wait_for_prebuild() -> None:
    global _prebuild_waited
    if _PREBUILD is not None:
        _PREBUILD.wait()
    elif not _prebuild_waited and os.environ.get(_SESSION_DIR_ENV):   # an xdist worker
        import fcntl
        try:
            fd = os.open(Path(os.environ[_SESSION_DIR_ENV]) / "prebuild.lock", os.O_RDONLY)
        except FileNotFoundError:   # no prebuild in this session (JOBSPEC_NO_PREBUILD)
            pass
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)   # granted once the build has exited
            finally:
                os.close(fd)
        _prebuild_waited = True


def pytest_sessionfinish(session, exitstatus):
    # Never kill it: a build killed mid-way leaves torch's extension lock behind, and every later
    # build (so every later launch) would wait on that lock forever.
    if _PREBUILD is not None:
        _PREBUILD.wait()
    if _is_xdist_controller(session.config) and os.environ.get(_SESSION_DIR_ENV):
        shutil.rmtree(os.environ[_SESSION_DIR_ENV], ignore_errors=True)
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
    if request.node.get_closest_marker("slow") is not None:
        _wait_for_prebuild()


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
