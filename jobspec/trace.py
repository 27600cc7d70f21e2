"""Lines for launcher.log only: `jobspec launch` keeps them off the terminal unless --verbose
(jobspec/launch/quiet.py). Start-up phase timestamps (`phase`, read by bench/startup.py) and notes
the launch header already tells the user (the ranks' model patch notes)."""
from __future__ import annotations

import sys
import time

LOG_ONLY = "jobspec-log: "


def note(text: str, stream=None) -> None:
    print(f"{LOG_ONLY}{text}", file=stream or sys.stdout, flush=True)


def phase(who: str, name: str, at: float | None = None, cpu: float | None = None, stream=None) -> None:
    """`jobspec-log: phase <who> <name> <unix time> <CPU seconds of this process so far>`."""
    at = time.time() if at is None else at
    cpu = time.process_time() if cpu is None else cpu
    note(f"phase {who} {name} {at:.3f} {cpu:.3f}", stream)
