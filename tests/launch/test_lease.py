"""One live launch per checkpoint directory (jobspec/launch/lease.py), in-process: a live holder
refuses, a dead, silent or damaged one is taken over, racing takers get exactly one lease, a
requeued Slurm job waits for its previous incarnation instead of refusing."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

from jobspec.errors import SpecError
from jobspec.launch import lease


def write_lease(directory, **record) -> None:
    base = {"host": "vm", "pid": 1, "started": 0.0, "job": "job", "token": "other", "heartbeat": time.time()}
    (directory / lease.LEASE_FILE).write_text(json.dumps({**base, **record}))


@pytest.fixture
def live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def local_identity(proc) -> dict:
    import socket
    return {"host": socket.gethostname(), "pid": proc.pid, "started": psutil.Process(proc.pid).create_time()}


def test_a_live_holder_refuses_with_exit_2_naming_it_and_nothing_changes(tmp_path, live_process):
    write_lease(tmp_path, **local_identity(live_process), mlflow_run_id="abc123", run_dir="/runs/r1")
    before = (tmp_path / lease.LEASE_FILE).read_text()
    for attempt in (lambda: lease.check(tmp_path, "job"), lambda: lease.acquire(tmp_path, "job")):
        with pytest.raises(SpecError) as err:
            attempt()
        text = str(err.value)
        assert f"pid {live_process.pid}" in text and "MLflow run abc123" in text and "run dir /runs/r1" in text
        assert "already being launched" in text and err.value.issues[0].path == ("checkpoint", "dir")
    assert (tmp_path / lease.LEASE_FILE).read_text() == before


def test_a_dead_launchers_lease_is_taken_over_and_said(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = local_identity(proc)
    proc.wait()
    write_lease(tmp_path, **identity)
    said = []
    held = lease.acquire(tmp_path, "job", say=said.append, run_dir=tmp_path / "run")
    try:
        assert len(said) == 1 and "took over the lease" in said[0] and f"pid {proc.pid}" in said[0]
        assert "its process is gone" in said[0]
        record = json.loads((tmp_path / lease.LEASE_FILE).read_text())
        assert record["token"] == held.record["token"] and record["run_dir"] == str(tmp_path / "run")
    finally:
        held.release()
    assert not (tmp_path / lease.LEASE_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == []   # no temporary or set-aside files left


def test_another_hosts_lease_lives_by_its_heartbeat(tmp_path):
    write_lease(tmp_path, host="node-17", pid=4242)
    with pytest.raises(SpecError, match="host node-17, pid 4242"):
        lease.acquire(tmp_path, "job")
    write_lease(tmp_path, host="node-17", pid=4242, heartbeat=time.time() - lease.STALE_AFTER_S - 1)
    said = []
    lease.acquire(tmp_path, "job", say=said.append).release()
    assert "no heartbeat for over" in said[0]


def test_a_damaged_lease_is_taken_over(tmp_path):
    (tmp_path / lease.LEASE_FILE).write_text("{not json")
    said = []
    lease.acquire(tmp_path, "job", say=said.append).release()
    assert "unreadable" in said[0]


def test_racing_launches_get_exactly_one_lease(tmp_path):
    results, barrier = [], threading.Barrier(8)

    def take():
        barrier.wait()
        try:
            results.append(lease.acquire(tmp_path, "job"))
        except SpecError as err:
            results.append(err)
    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [r for r in results if isinstance(r, lease.Lease)]
    assert len(held) == 1 and len(results) == 8
    held[0].release()


def test_the_heartbeat_is_refreshed_and_a_taken_over_lease_is_never_clobbered(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    held = lease.acquire(tmp_path, "job")
    first = held.record["heartbeat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / lease.LEASE_FILE).read_text())["heartbeat"] > first
    write_lease(tmp_path, token="newcomer")   # as if this launcher had been frozen and taken over
    time.sleep(0.3)
    held.update(mlflow_run_id="late")
    held.release()
    assert json.loads((tmp_path / lease.LEASE_FILE).read_text())["token"] == "newcomer"


def test_a_requeued_slurm_job_waits_for_its_previous_incarnation(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.1)
    # still beating when the wait ends: refused like any live launch
    write_lease(tmp_path, host="node-3", slurm_job_id="77", slurm_restart_count=None)
    said = []
    with pytest.raises(SpecError, match="already being launched"):
        lease.acquire(tmp_path, "job", say=said.append, wait_for_requeue_s=0.3)
    assert "waiting for the lease" in said[0]
    lease.check(tmp_path, "job")   # --dry-run: a launch would wait, not refuse
    # its heartbeat stops during the wait: taken over
    monkeypatch.setattr(lease, "STALE_AFTER_S", 0.5)
    write_lease(tmp_path, host="node-3", slurm_job_id="77", slurm_restart_count=None)
    said.clear()
    lease.acquire(tmp_path, "job", say=said.append, wait_for_requeue_s=5).release()
    assert "waiting" in said[0] and "took over" in said[1]
