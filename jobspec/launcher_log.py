"""Lines for launcher.log only: `jobspec launch` keeps them off the terminal unless --verbose
(jobspec/launch/quiet.py). Start-up phase timestamps (`phase`, read by bench/startup.py) and notes
the launch header already tells the user (the ranks' model patch notes)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

LOG_ONLY = "jobspec-log: "


def note(text: str, stream=None) -> None:
    stream = stream or sys.stdout
    stream.write(f"{LOG_ONLY}{text}\n")  # one write: the ranks share the pipe, print() writes twice
    stream.flush()


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (py-cpuinfo, ninja, compilers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def process_start() -> float:
    """When this process started, as a unix time, to about 10 ms: its age read from /proc (its start
    in clock ticks since boot against the uptime). psutil's create_time adds the boot time, which
    Linux gives in whole seconds: up to a second early."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])   # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):   # no /proc: another system
        import psutil
        return psutil.Process().create_time()


def phase(who: str, name: str, at: float | None = None, cpu: float | None = None,
          stream=None) -> None:
    """`jobspec-log: phase <who> <name> <unix time> <CPU seconds so far (cpu_seconds)>`."""
    at = time.time() if at is None else at
    cpu = cpu_seconds() if cpu is None else cpu
    note(f"phase {who} {name} {at:.3f} {cpu:.3f}", stream)
