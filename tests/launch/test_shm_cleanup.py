"""DeepSpeed's CPU all-reduce buffers in /dev/shm are removed after a job, and only that job's."""
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
