"""How the suite is run: which tests share a pytest-xdist worker and in what order, DeepSpeed's JIT
ops built in the background, and the /dev/shm guard. A pytest plugin (tests/conftest.py registers
it); the shared test helpers stay in conftest.

Under pytest-xdist (`scripts/test.sh` runs `-n 2`) the controller process, which runs no tests,
starts the op prebuild and the /dev/shm guard once for the whole session; the workers do neither.
Every slow test (every real launch) is in one group that a single worker runs, one test at a time,
while the other worker runs the rest: two launches at once would share the 2 cores, the ports and
/dev/shm buffers, the Slurm cluster and the MLflow servers, and miss their timeouts.

The groups: xdist's `--dist loadgroup` takes them from xdist_group marks, which its worker turns
into "@group" node id suffixes by setting Node._nodeid; under pytest 9.2 that has no effect (the
node id comes from Node._id) and the marks are ignored. So each worker writes its {node id: group}
map to the session directory, and the controller schedules with `_GroupScheduling` below (xdist's
LoadGroupScheduling reading that map).

The ops: `jobspec prepare --all` (DeepSpeed's fused Adam, CPU Adam, NVMe I/O) takes minutes on a
fresh machine (CI). Most launches load none of them (torch's AdamW, no offload), so only the modules
with a test marked `jit_ops` wait for the build (from the module's start: a module-scoped fixture
may launch), and they run last in the slow group: the launches that need no op run while the ops
are built instead of after. An unmarked test that loads an op anyway is still correct (torch's lock
file in the op's build directory makes its ranks wait for a build in progress instead of building
it twice); it only risks its own timeout on a fresh machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SLOW_GROUP = "launches"   # the group of every slow test (and of fast ones that share their fixtures)
_SESSION_DIR_ENV = "JOBSPEC_TEST_SESSION_DIR"   # xdist: the controller's, shared with its workers
_PREBUILD = None
_SHM_GUARD = None
_prebuild_waited = False
_groups: dict[str, str] = {}
_op_modules: set[str] = set()   # the modules of the jit_ops tests: they wait for the prebuild


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _is_xdist_controller(config) -> bool:
    return not _is_xdist_worker(config) and getattr(config.option, "dist", "no") != "no" \
        and bool(getattr(config.option, "tx", None))


@pytest.hookimpl(tryfirst=True)   # before xdist's own pytest_configure reads the mode
def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker, in order "
                            "(registered here too for -p no:xdist)")
    config.addinivalue_line("markers", "jit_ops(*builders): the test's ranks load these DeepSpeed JIT ops "
                            "(e.g. CPUAdamBuilder): it waits for `jobspec prepare --all`, and its module runs "
                            "at the end of the slow tests")
    if not _is_xdist_controller(config):
        return   # serial (-n 0, -p no:xdist), or a worker (whose dist is "no")
    dist = config.option.dist
    if dist in ("load", "worksteal"):   # `-n N` alone means "load": the groups below still hold
        config.option.dist = dist = "loadgroup"
    if dist != "loadgroup":
        raise pytest.UsageError(f"--dist {dist}: the slow tests (real launches) must run one at a time; "
                                "use -n N (it schedules with the groups of tests/xdist_schedule.py), or -n 0")
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


def _needs_ops(item) -> bool:
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("jit_ops") is not None


def pytest_collection_modifyitems(session, config, items):
    """Modules without slow tests first, then the slow modules whose tests need no JIT op, then those
    with a test that does (`jit_ops`): the op builds started below (minutes on a fresh machine)
    overlap all the others instead of stalling a launch. A module's tests stay together and in
    order, so module-scoped fixtures are set up once.

    An xdist worker puts the slow group first instead (op users still last within it), so that one
    worker takes it at once (it is the longest part of the run) while the other runs everything
    else, and writes the groups for the controller."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    op_modules = {item.module.__name__ for item in items if _needs_ops(item)}
    _op_modules.update(op_modules)
    items.sort(key=lambda item: (item.module.__name__ in slow_modules, item.module.__name__ in op_modules))
    if not (_is_xdist_worker(config) and os.environ.get(_SESSION_DIR_ENV)):
        return
    groups = _xdist_groups(items)
    items.sort(key=lambda item: groups.get(item) != SLOW_GROUP)   # stable: the order above within each
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
    # `jobspec prepare --all`, as CI images do: the builds overlap the tests that need no op instead
    # of stalling the first launch that does past its timeout
    lock_fd = None
    if lock_path:   # xdist: the build holds this lock until it exits; the worker of a jit_ops test waits on it
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


@pytest.fixture(scope="module", autouse=True)   # autouse: before the module's other fixtures (a launch)
def _ops_built_before_launches_that_load_them(request):
    # a launch has its own timeout: one whose ranks load a JIT op starts once the ops exist
    if request.module.__name__ in _op_modules:
        _wait_for_prebuild()
