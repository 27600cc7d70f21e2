"""Lines for launcher.log only: `jobspec launch` keeps them off the terminal unless --verbose
(jobspec/launch/quiet.py). Start-up phase timestamps (`phase`, read by bench/startup.py) and notes
the launch header already tells the user (the ranks' model patch notes)."""
from __future__ import annotations

import os
import sys
import time

LOG_ONLY = "jobspec-log: "


def note(text: str, stream=None) -> None:
    stream = stream or sys.stdout
    stream.write(f"{LOG_ONLY}{text}\n")  # one write: the ranks share the pipe, print() writes twice
    stream.flush()


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (py-cpuinfo, ninja, compilers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def phase(who: str, name: str, at: float | None = None, cpu: float | None = None,
          stream=None) -> None:
    """`jobspec-log: phase <who> <name> <unix time> <CPU seconds so far (cpu_seconds)>`."""
    at = time.time() if at is None else at
    cpu = cpu_seconds() if cpu is None else cpu
    note(f"phase {who} {name} {at:.3f} {cpu:.3f}", stream)
