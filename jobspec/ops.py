"""DeepSpeed's JIT-compiled ops: which ones a job loads, whether they are built, and building them
with the build announced.

DeepSpeed compiles some C++/CUDA ops the first time a process loads them (torch.utils.cpp_extension,
cached in TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python>_<cpu|cuXYZ>/<op>/). A build
takes 15 s to minutes, and a rank that builds in silence looks hung; so the worker builds the ops a
job needs before DeepSpeed asks for them, saying so (`announce`), and `jobspec prepare` does the
same ahead of time for CI and images. Both go through `ensure_built`: one mechanism. Ranks that load
the same op at once are serialised by torch's lock file in the build directory: one builds, the
others wait and load the result.

`needed_ops` is pure (the compiled ds_config in, builder names out); the rest imports DeepSpeed.

DeepSpeed's CPU op builders (fused and CPU Adam on CPU ranks, CPU Adam for optimizer offload) pick
their compiler flags from py-cpuinfo at every load, cached op or not, and py-cpuinfo answers by
starting a Python interpreter: twice per load, about 1 s each, on every rank, before the first
step. `share_cpu_info` answers those calls from one reading per host, which the launcher takes
while the runner starts (`write_cpu_info`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")   # DeepSpeed colours its warnings
# Every op a jobspec job can load (`jobspec prepare --all`): the fused and CPU Adam kernels and NVMe
# I/O. (DeepSpeed's pin_memory op is loaded only with DS_PIN_MEMORY_BACKEND=native, which jobspec
# never sets.)
ALL_OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
# DeepSpeed 0.19's TorchBackend builds and loads this on every CPU rank, but only its
# `inference_all_reduce` (tensor-parallel inference) uses it: training's all-reduces go through the
# process group (gloo) either way (bench/optimizer_kernels.py --comm measures the step with and
# without it). The worker turns it off (`skip_unused_ops`): no build, no /dev/shm buffers.
UNUSED_IN_TRAINING = ("ShareMemCommBuilder",)
# torch's build lock untouched for this long is left by a dead process (`wait_for_build_lock`): a
# build writes an object file at least every minute or two, even on 2 loaded cores
STALE_LOCK_S = 300.0


def needed_ops(ds_config: dict) -> list[str]:
    """The op builders DeepSpeed loads for this config (which exist depends on the accelerator).

    Follows DeepSpeed 0.19: `engine.get_optimizer_configuration` builds Adam from torch
    (`torch_adam`: nothing to build), DeepSpeedCPUAdam (optimizer offload) or FusedAdam; ZeRO's
    swappers load AsyncIO for NVMe offload.
    """
    ops: list[str] = []
    zero = ds_config.get("zero_optimization") or {}
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload_params = (zero.get("offload_param") or {}).get("device", "none")
    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw") and \
            not (optimizer.get("params") or {}).get("torch_adam", False):
        ops.append("CPUAdamBuilder" if offload_optimizer in ("cpu", "nvme") else "FusedAdamBuilder")
    if "nvme" in (offload_optimizer, offload_params):
        ops.append("AsyncIOBuilder")
    return ops


@dataclass
class OpState:
    builder_name: str
    # the extension's name (deepspeed_shm_comm); None: not on this accelerator
    name: str | None
    build_dir: Path | None
    built: bool               # a library newer than every source is in build_dir: loading is quick
    # not compatible here (missing compiler, library, ISA), with DeepSpeed's words
    why_not: str | None = None

    @property
    def short(self) -> str:
        return (self.name or self.builder_name).removeprefix("deepspeed_")


def state(builder_name: str) -> OpState:
    """Whether `builder_name` exists on this accelerator, can be built here, and is built
    already."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None:
        return OpState(builder_name, None, None, built=True, why_not="not used on this accelerator")
    if not _compatible(builder):
        reason = "; ".join(str(e) for e in getattr(builder, "error_log", None) or []) \
            or "not compatible"
        return OpState(builder_name, builder.name, None, built=False, why_not=reason)
    build_dir = _build_dir(builder.name)
    return OpState(builder_name, builder.name, build_dir, built=_is_built(builder, build_dir))


def ensure_built(builder_names, announce=print) -> list[OpState]:
    """Build the ops not built yet (loading them into this process), announcing each build and its
    time.

    `announce(text)` gets one line before a build and one after; built ops are left for DeepSpeed to
    load. An op that cannot be built here is skipped: DeepSpeed reports it, with its reason, where
    it is really needed. Raises what DeepSpeed raises when a compatible op fails to build.
    """
    from deepspeed.accelerator import get_accelerator

    states = []
    for builder_name in dict.fromkeys(builder_names):
        op = state(builder_name)
        states.append(op)
        if op.name is None or op.why_not:
            continue
        if op.build_dir is not None:
            wait_for_build_lock(op.build_dir, op.short, announce)
        if not op.built:
            reason = f" for {OP_REASONS[builder_name]}" if builder_name in OP_REASONS else ""
            announce(f"building DeepSpeed op {op.short}{reason} (first run only, cached in "
                     f"{home_relative(op.build_dir)})")
            started = time.monotonic()
            get_accelerator().create_op_builder(builder_name).load(verbose=False)
            announce(f"built DeepSpeed op {op.short} in {time.monotonic() - started:.1f} s")
            op.built = True
    return states


def wait_for_build_lock(build_dir: Path, short: str, announce=print,
                        stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Wait while another process builds or loads the op, and remove a lock nobody holds.

    torch's JIT build lock (`<build_dir>/lock`) is a bare file created exclusively: it records no
    owner, and `FileBaton.wait` has no timeout, so a process killed while holding it (a stopped
    launch whose rank was building, a killed test) makes every later load of the op wait forever,
    inside DeepSpeed. A lock is taken as stale when neither it nor anything in the build directory
    changed for `stale_after_s`: a live build writes object files as it goes, and a load of a built
    op holds the lock for about a second."""
    lock = build_dir / "lock"
    said = False
    while True:
        try:
            idle = time.time() - _newest_change(build_dir, lock)
        except FileNotFoundError:
            return   # no lock: nothing to wait for
        if idle >= stale_after_s:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            announce(f"removed a stale build lock of DeepSpeed op {short} "
                     f"({home_relative(lock)}, untouched for {idle:.0f} s: left by a process "
                     "stopped while it built or loaded the op)")
            return
        if not said:
            announce(f"waiting while another process builds or loads DeepSpeed op {short} "
                     f"({home_relative(lock)})")
            said = True
        time.sleep(poll_s)


def _newest_change(build_dir: Path, lock: Path) -> float:
    """The latest mtime of the lock and the build directory's files; FileNotFoundError when there
    is no lock."""
    newest = lock.stat().st_mtime
    for entry in build_dir.iterdir():
        with contextlib.suppress(OSError):
            newest = max(newest, entry.stat().st_mtime)
    return newest


# Why a job needs each op: said when the op is built.
OP_REASONS = {"FusedAdamBuilder": "DeepSpeed's FusedAdam (training.optimizer: bias_correction "
                                  "false or implementation fused)",
              "CPUAdamBuilder": "optimizer offload (DeepSpeed's CPU Adam)",
              "AsyncIOBuilder": "NVMe offload"}
# What each op needs to be built, for the refusal before any rank starts (`build_problems`).
INSTALL_HINTS = {
    "FusedAdamBuilder": "or set training.optimizer.implementation: torch (torch's fused AdamW "
                        "needs no build)",
    "CPUAdamBuilder": "or run without optimizer offload (memory.offload.optimizer: none)",
    "AsyncIOBuilder": "install libaio (Debian/Ubuntu: apt install libaio-dev), or offload to cpu "
                      "instead of nvme",
}


def build_problems(builder_names) -> list[tuple[str, str]]:
    """(builder, why) for each op this job needs that is not built and cannot be built on this
    machine: no C++ compiler, no nvcc for a CUDA op (a pip-installed torch ships the CUDA runtime,
    not the toolkit), a missing library. Empty when everything needed is built or buildable."""
    import shutil

    from deepspeed.accelerator import get_accelerator

    problems = []
    for builder_name in dict.fromkeys(builder_names):
        op = state(builder_name)
        if op.name is None or op.built:
            continue
        hint = INSTALL_HINTS.get(builder_name, "")
        if op.why_not:
            problems.append((builder_name,
                             f"DeepSpeed's {op.short} op cannot be built here: {op.why_not}"
                             + (f"; {hint}" if hint else "")))
        elif not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
            problems.append((builder_name,
                             f"DeepSpeed's {op.short} op must be compiled on first use and this "
                             "machine has no C++ compiler: install one (Debian/Ubuntu: apt install "
                             "g++)"
                             + (f", {hint}" if hint else "")))
        elif get_accelerator().device_name() == "cuda" and builder_name == "FusedAdamBuilder":
            from torch.utils.cpp_extension import CUDA_HOME
            if CUDA_HOME is None:
                problems.append((builder_name,
                                 "DeepSpeed's FusedAdam must be compiled with nvcc and CUDA_HOME "
                                 "does not exist (no CUDA toolkit): install the toolkit matching "
                                 "torch's CUDA, "
                                 + hint))
    return problems


def skip_unused_ops() -> None:
    """Mark the ops DeepSpeed would load but training never uses as unavailable, before
    `deepspeed.init_distributed` (DeepSpeed's own compatibility table is what it consults)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    table = getattr(deepspeed.ops, "__compatible_ops__", None)
    if table is None:
        return
    for builder_name in UNUSED_IN_TRAINING:
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is not None:
            table[builder.NAME] = False


def _compatible(builder) -> bool:
    import deepspeed.ops

    # DeepSpeed's own table, from the same check at import (build_shm_op, for one, trusts it)
    listed = getattr(deepspeed.ops, "__compatible_ops__", {}).get(builder.NAME, True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # with verbose=True DeepSpeed prints why not
            compatible = bool(builder.is_compatible(verbose=True)) and listed
    except Exception as err:  # a probe that fails (missing headers) means "cannot build here"
        compatible, said = False, io.StringIO(f"compatibility check failed: {err}")
    if not compatible:
        words = [ANSI.sub("", line).replace("[WARNING]", "").strip()
                 for line in said.getvalue().splitlines()]
        builder.error_log = [" ".join(w for w in words if w)] if any(words) else builder.error_log
    return compatible


def _build_dir(name: str) -> Path:
    from torch.utils import cpp_extension

    try:  # torch's own rule (TORCH_EXTENSIONS_DIR, python and CUDA/ROCm version folders)
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except AttributeError:
        return Path(cpp_extension.get_default_build_root()) / name


def _is_built(builder, build_dir: Path) -> bool:
    """The op's library exists, was built against this environment's torch and DeepSpeed, and is
    newer than its sources: otherwise torch's JIT (ninja) rebuilds it on load."""
    library = build_dir / f"{builder.name}.so"
    try:
        built_at = library.stat().st_mtime
    except OSError:
        return False
    if not _built_here(build_dir):
        return False
    for source in builder.sources():
        try:
            if os.stat(builder.deepspeed_src_path(source)).st_mtime > built_at:
                return False
        except OSError:
            continue
    return True


def _built_here(build_dir: Path) -> bool:
    """Whether the op's build.ninja compiled against this interpreter's torch and DeepSpeed. The
    build cache is keyed by op name only: another virtualenv (CI's, a user's second one) that built
    the op leaves a library whose ninja command names other include paths, so ninja rebuilds it,
    silently, inside the ranks."""
    import deepspeed
    from torch.utils import cpp_extension

    try:
        ninja = (build_dir / "build.ninja").read_text(errors="replace")
    except OSError:
        return False
    return cpp_extension.include_paths()[0] in ninja \
        and os.path.dirname(deepspeed.__file__) in ninja


def import_deepspeed(without_mlflow: bool = True):
    """`import deepspeed`, by default without the `import mlflow` its autotuner makes when MLflow is
    installed.

    jobspec never runs DeepSpeed's autotuner, and importing MLflow costs ~1.7 s of CPU per process
    (docs/benchmarks.md), paid by DeepSpeed's launch.py and by every rank before its first step. A
    `None` in sys.modules makes that one import fail (the autotuner then sets `has_mlflow = False`);
    it is removed at once, so MLflow stays importable. A node's local rank 0 imports it with
    DeepSpeed (`without_mlflow=False`): it needs MLflow anyway (system metrics, rank 0's metric
    sink), and importing it there beside the model build would only move the cost. Nothing changes
    when DeepSpeed or MLflow is already imported."""
    import sys

    if not without_mlflow or "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    # `import mlflow` then raises ImportError
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]
    return deepspeed


def home_relative(path: Path | None) -> str:
    """`~/...` for a path under the home directory (shorter, and the same on every user's
    screen)."""
    text = str(path)
    home = os.path.expanduser("~")
    return "~" + text[len(home):] if home != "/" and text.startswith(home + os.sep) else text


def write_cpu_info(path: Path) -> None:
    """py-cpuinfo's reading of this host, for the ranks on it (run in a thread by the launcher)."""
    try:
        import cpuinfo
        info = cpuinfo.get_cpu_info()
    except Exception:  # noqa: BLE001 -- an optimisation: the ranks read it themselves
        return
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps({"host": socket.gethostname(), "info": info}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # the run directory is gone (a launch that stopped at once): nobody needs it
        pass


def share_cpu_info(path: Path | None = None) -> None:
    """Answer py-cpuinfo's `get_cpu_info` from one reading per process: `path` (write_cpu_info's,
    when it is there and from this host), else the first call's."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "jobspec_shared", False):
        return
    known = None
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
        # another node may have other flags
        if record and record.get("host") == socket.gethostname():
            known = record["info"]
    except (OSError, ValueError, KeyError):
        known = None
    original = cpuinfo.get_cpu_info

    def get_cpu_info():
        nonlocal known
        if known is None:
            known = original()
        return dict(known)

    # marks the patch (a function attribute mypy cannot see)
    setattr(get_cpu_info, "jobspec_shared", True)
    cpuinfo.get_cpu_info = get_cpu_info
