"""DeepSpeed's JIT ops: which a compiled job loads, how a missing one's build is announced, `jobspec
prepare`, and py-cpuinfo's reading shared instead of taken twice per op load on every rank."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from jobspec import ops
from conftest import REPO_ROOT

REPO = REPO_ROOT


def compiled_ops(*overrides: str) -> list[str]:
    from jobspec.launch.job_ops import job_ops
    return job_ops(str(REPO / "jobs" / "quickstart.yaml"), list(overrides))


def test_the_ops_a_job_loads_follow_its_optimizer_and_offload():
    assert compiled_ops() == []   # torch's fused AdamW, no shm all-reduce: nothing to build
    assert compiled_ops("training.optimizer.bias_correction=false") == ["FusedAdamBuilder"]  # only DeepSpeed's Adam
    assert compiled_ops("training.optimizer.implementation=fused") == ["FusedAdamBuilder"]
    assert compiled_ops("memory.zero_stage=2", "memory.offload.optimizer=cpu") == ["CPUAdamBuilder"]
    assert ops.needed_ops({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}) == []
    assert ops.needed_ops({"optimizer": {"type": "Adam"}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}}) == \
        ["CPUAdamBuilder", "AsyncIOBuilder"]
    assert ops.needed_ops({}) == []  # a client optimizer (8-bit AdamW, Adafactor)


def test_an_op_this_machine_cannot_build_is_refused_at_its_field(monkeypatch, tmp_path):
    import shutil

    from jobspec.launch import preflight
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))   # an empty op cache: nothing built
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name.endswith(("++", "c++")) else
                        real_which(name, *a, **k))
    [issue] = preflight.op_build_issues({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}})
    assert issue.path == ("training", "optimizer", "implementation")
    assert "no C++ compiler" in issue.message and "implementation: torch" in issue.message
    assert preflight.op_build_issues({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}) == []


def test_a_missing_op_is_built_with_an_announcement_and_its_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: nothing is built
    state = ops.state("ShareMemCommBuilder")
    assert state.name == "deepspeed_shm_comm" and not state.built and state.build_dir == tmp_path / state.name

    from deepspeed.ops.op_builder.builder import OpBuilder
    loaded = []
    monkeypatch.setattr(OpBuilder, "load", lambda self, verbose=False: loaded.append(self.name))
    said = []
    ops.ensure_built(["ShareMemCommBuilder"], announce=said.append)
    assert loaded == ["deepspeed_shm_comm"]
    assert said[0] == f"building DeepSpeed op shm_comm (first run only, cached in {tmp_path / 'deepspeed_shm_comm'})"
    assert said[1].startswith("built DeepSpeed op shm_comm in ") and said[1].endswith(" s")
    # a library another virtualenv built (its ninja command names other include paths): ninja would
    # rebuild it inside the ranks, so it is built here, announced
    build_dir = tmp_path / "deepspeed_shm_comm"
    build_dir.mkdir(exist_ok=True)  # torch made it when asked for its path
    (build_dir / "deepspeed_shm_comm.so").write_bytes(b"")
    (build_dir / "build.ninja").write_text("cflags = -I/other/venv/site-packages/deepspeed/ops/csrc/includes "
                                           "-isystem /other/venv/site-packages/torch/include\n")
    loaded.clear()
    said.clear()
    assert not ops.state("ShareMemCommBuilder").built
    ops.ensure_built(["ShareMemCommBuilder"], announce=said.append)
    assert loaded == ["deepspeed_shm_comm"] and said[0].startswith("building DeepSpeed op shm_comm")
    # built by this environment (its library newer than its sources): left for DeepSpeed to load, silently
    import deepspeed
    from torch.utils import cpp_extension
    (build_dir / "build.ninja").write_text(f"cflags = -I{os.path.dirname(deepspeed.__file__)}/ops/csrc/includes "
                                           f"-isystem {cpp_extension.include_paths()[0]}\n")
    loaded.clear()
    said.clear()
    assert ops.ensure_built(["ShareMemCommBuilder"], announce=said.append)[0].built
    assert loaded == [] and said == []


def test_prepare_names_a_job_or_all(capsys):
    from jobspec.cli import main
    assert main(["prepare"]) == 2
    assert "name a job to prepare, or pass --all" in capsys.readouterr().err


def test_cpu_info_is_read_once_per_host(tmp_path, monkeypatch):
    import cpuinfo
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]})
    ops.write_cpu_info(tmp_path / "cpu_info.json")
    assert json.loads((tmp_path / "cpu_info.json").read_text())["host"] == socket.gethostname() and calls == [1]

    ops.share_cpu_info(tmp_path / "cpu_info.json")  # a rank on the launching host
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]} == cpuinfo.get_cpu_info()
    assert calls == [1]


@pytest.mark.parametrize("recorded_host", ["another-node", None])
def test_cpu_info_of_another_host_is_not_used(tmp_path, monkeypatch, recorded_host):
    import cpuinfo
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "ARM_8"})
    path = tmp_path / "cpu_info.json"
    if recorded_host:
        path.write_text(json.dumps({"host": recorded_host, "info": {"arch": "X86_64"}}))
    ops.share_cpu_info(path)
    assert cpuinfo.get_cpu_info() == {"arch": "ARM_8"} == cpuinfo.get_cpu_info()
    assert calls == [1]  # read here, once


def test_a_build_says_which_feature_needs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from deepspeed.ops.op_builder.builder import OpBuilder
    monkeypatch.setattr(OpBuilder, "load", lambda self, verbose=False: None)
    said = []
    ops.ensure_built(["CPUAdamBuilder"], announce=said.append)
    assert said[0].startswith("building DeepSpeed op cpu_adam for optimizer offload (DeepSpeed's CPU Adam) "
                              "(first run only")


def _aged(path: Path, seconds: float) -> None:
    import time
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_a_build_lock_left_by_a_dead_process_is_removed_and_said(tmp_path):
    """torch's JIT lock records no owner and its wait has no timeout: a lock and build directory
    untouched for the stale time are a dead process's, removed before DeepSpeed would wait on it."""
    (tmp_path / "op.o").write_bytes(b"")
    (tmp_path / "lock").write_bytes(b"")
    for name in ("op.o", "lock"):
        _aged(tmp_path / name, 400)
    said: list[str] = []
    ops.wait_for_build_lock(tmp_path, "async_io", announce=said.append, stale_after_s=300)
    assert not (tmp_path / "lock").exists()
    assert len(said) == 1 and said[0].startswith("removed a stale build lock of DeepSpeed op async_io")
    said.clear()
    ops.wait_for_build_lock(tmp_path, "async_io", announce=said.append)   # no lock: no word
    assert said == []


def test_a_build_in_progress_is_waited_for_and_its_lock_left_to_it(tmp_path):
    """An old lock beside a freshly written object file is a live build: waited for, not removed."""
    import threading
    (tmp_path / "lock").write_bytes(b"")
    _aged(tmp_path / "lock", 400)
    (tmp_path / "op.o").write_bytes(b"")   # the build wrote just now
    removed_by_builder = threading.Timer(0.3, lambda: (tmp_path / "lock").unlink())
    removed_by_builder.start()
    said: list[str] = []
    ops.wait_for_build_lock(tmp_path, "cpu_adam", announce=said.append, stale_after_s=300,
                            poll_s=0.05)
    removed_by_builder.join()
    assert said == [f"waiting while another process builds or loads DeepSpeed op cpu_adam ({tmp_path / 'lock'})"]
