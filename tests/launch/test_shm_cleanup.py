"""DeepSpeed's CPU all-reduce buffers in /dev/shm are removed after a job, and only that job's; the test
session's guard (tests/shm_guard.py) catches any that a test leaves behind."""
import os
import subprocess
import sys
import time

from shm_guard import ShmGuard

from jobspec.shm import remove_shared_memory_buffers


def test_only_the_finished_jobs_buffers_are_removed(tmp_path):
    mine = [tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_29611_{rank}" for rank in (0, 1)]
    other = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_29612_0"
    unrelated = tmp_path / "some_other_segment_29611_0"
    for path in (*mine, other, unrelated):
        path.write_bytes(b"x")
    assert remove_shared_memory_buffers(29611, shm_dir=tmp_path) == 2
    assert not any(p.exists() for p in mine)
    assert other.exists() and unrelated.exists()


def test_no_port_or_no_shm_dir_removes_nothing(tmp_path):
    assert remove_shared_memory_buffers(None, shm_dir=tmp_path) == 0
    assert remove_shared_memory_buffers(29611, shm_dir=tmp_path / "absent") == 0


def test_a_rank_removes_only_its_own_buffer(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_29611_{rank}").write_bytes(b"x")
    assert remove_shared_memory_buffers("29611", shm_dir=tmp_path, local_rank="1") == 1
    assert [p.name[-1] for p in tmp_path.iterdir()] == ["0"]


# --- the session guard (tests/shm_guard.py, run by conftest over every session that launches ranks) ---

CHILD = """
import mmap, os, sys, time
path, mode = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_CREAT | os.O_RDWR)
os.write(fd, b"x" * 4096)
buffer = mmap.mmap(fd, 4096)
open(path + ".ready", "w").close()
time.sleep(60 if mode == "stay" else 1.5)  # "leak": exit without unlinking, as DeepSpeed's ranks do
"""


def test_the_session_guard_reports_a_buffer_left_by_a_child_and_not_one_still_in_use(tmp_path):
    guard = ShmGuard(shm_dir=tmp_path, interval_s=0.2).start()
    leaked, in_use = tmp_path / "deepspeed_leaked_0", tmp_path / "deepspeed_in_use_0"
    quitter = subprocess.Popen([sys.executable, "-c", CHILD, str(leaked), "leak"])
    stayer = subprocess.Popen([sys.executable, "-c", CHILD, str(in_use), "stay"])
    try:
        deadline = time.monotonic() + 30
        while not (leaked.with_name(leaked.name + ".ready").exists() and in_use.with_name(in_use.name + ".ready")
                   .exists()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        quitter.wait(timeout=30)
        guard.stop()
        assert {leaked.name, in_use.name} <= {os.path.basename(p) for p in guard.seen}
        assert guard.leaks(grace_s=0.5) == [leaked]  # the live child still maps its file
    finally:
        stayer.kill()
        stayer.wait()
    (tmp_path / "unrelated_deepspeed_0").write_bytes(b"x")  # never mapped by a child: not ours
    assert guard.leaks(grace_s=0) == [in_use, leaked]
