"""DeepSpeed's CPU all-reduce buffers in /dev/shm: their names and their removal.

Neutral ground: the launcher removes a finished job's buffers and each rank removes its own, and
the rank side must not import the launch side.
"""
from __future__ import annotations

from pathlib import Path

SHM_DIR = Path("/dev/shm")


def buffer_glob(master_port: int | str, local_rank: int | None = None) -> str:
    """The file names DeepSpeed's shm communication op gives a job's buffers (all ranks, or one)."""
    rank = "*" if local_rank is None else int(local_rank)
    return f"deepspeed_allreduce_buffer_*_{int(master_port)}_{rank}"


def remove_shared_memory_buffers(master_port: int | str | None, shm_dir: Path = SHM_DIR,
                                 local_rank: int | None = None) -> int:
    """Delete the CPU accelerator's all-reduce buffers of a finished job; returns how many.

    DeepSpeed's shm communication op leaves a `deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>`
    file of ~66 MB per rank in /dev/shm after every job (it never unlinks them), so a machine that
    runs many jobs fills its RAM-backed /dev/shm until the OOM killer steps in. Once the runner and
    all ranks are gone nothing maps them; the master port names this job's files.
    """
    if not master_port or not shm_dir.is_dir():
        return 0
    removed = 0
    for path in shm_dir.glob(buffer_glob(master_port, local_rank)):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed
