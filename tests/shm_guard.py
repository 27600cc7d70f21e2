"""Session guard: nothing the test suite starts may leave DeepSpeed's buffers in /dev/shm.

DeepSpeed's CPU all-reduce op creates a ~66 MB `deepspeed_allreduce_buffer_*` file per rank in the
RAM-backed /dev/shm and never unlinks it (jobspec/shm.py); a test that runs ranks without going
through the code that removes them leaks RAM on every run of the suite.

Other sessions on the same machine (other developers' suites, running jobs) create such files
too, so "new since the session started" is not proof of a leak. The guard attributes a file to
this session by watching which files this session's own descendants map while they run (sampled
each second: a rank lives far longer), and reports those still present once nothing maps them.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_"


def mapped_files(pid: int, shm_dir: Path, prefix: str) -> set[str]:
    """Paths under `shm_dir` starting with `prefix` that process `pid` maps or holds open."""
    found = set()
    start = str(shm_dir / prefix)
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) == 6 and parts[5].startswith(start):
                    found.add(parts[5].removesuffix(" (deleted)"))
    except OSError:  # the process is gone, or not ours to read
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(start):
                found.add(target.removesuffix(" (deleted)"))
    except OSError:
        pass
    return found


class ShmGuard:
    """Samples the files this process's descendants map; `leaks()` lists the ones left behind."""

    def __init__(self, shm_dir: Path = SHM_DIR, prefix: str = PREFIX, interval_s: float = 1.0):
        self.shm_dir, self.prefix, self.interval_s = Path(shm_dir), prefix, interval_s
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shm-guard", daemon=True)

    def start(self) -> "ShmGuard":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            self.seen |= mapped_files(child.pid, self.shm_dir, self.prefix)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.sample()

    def leaks(self, grace_s: float = 10.0) -> list[Path]:
        """Files our descendants mapped that still exist with no process mapping them.

        A job that has just ended may still be about to remove its buffers (its launcher does it
        after the ranks exit): a file counts as leaked only if it is still there after `grace_s`."""
        deadline = time.monotonic() + grace_s
        while True:
            candidates = [Path(p) for p in sorted(self.seen) if os.path.exists(p)]
            if candidates:
                in_use = set()
                for proc in psutil.process_iter():
                    in_use |= mapped_files(proc.pid, self.shm_dir, self.prefix)
                candidates = [p for p in candidates if str(p) not in in_use]
            if not candidates or time.monotonic() >= deadline:
                return candidates
            time.sleep(0.5)
