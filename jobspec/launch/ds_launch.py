"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`), run unchanged as `__main__`, with
DeepSpeed imported through `jobspec.ops.import_deepspeed`: launch.py itself only spawns and watches
the ranks, yet its `import deepspeed` imports MLflow (DeepSpeed's autotuner), ~1.7 s of CPU before
any rank starts. `python -u -m jobspec.launch.ds_launch ARGS` takes exactly launch.py's arguments
(jobspec/launch/runner.py builds them as DeepSpeed's runner would).

Two things differ from running launch.py directly, both at the end of a job: launch.py looks at its
ranks once a second (`time.sleep(1)`, its only sleep), here every POLL_S; and once it exits, this
process leaves without the interpreter's teardown of DeepSpeed and torch (jobspec/quick_exit.py).

Two options of its own, removed before launch.py parses its arguments: `--fork-ranks` (CPU ranks
forked from this process once it has imported what they import: launch/rank_forks.py) and
`--standby` (started before the launch has decided, its arguments read from stdin:
launch/standby.py).
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from typing import SupportsIndex

from jobspec.launch import rank_forks, runner, standby
from jobspec.ops import import_deepspeed
from jobspec.quick_exit import quick_exit

POLL_S = 0.1   # how often the ranks' exits are noticed (launch.py: 1 s)


def _run_launch_py() -> int:
    sleep = time.sleep
    def poll(seconds: float | SupportsIndex) -> None:   # launch.py's watch loop
        sleep(min(float(seconds), POLL_S))

    time.sleep = poll
    try:
        runpy.run_module("deepspeed.launcher.launch", run_name="__main__", alter_sys=True)
    # launch.py ends with sys.exit(code) on a rank's failure or a signal
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


def _fork_ranks_if_asked(preloaded: bool) -> None:
    """With FORK_FLAG (removed from the arguments launch.py parses): unless a standby has done it
    already, the rank module, imported here by the name launch.py runs it by, imports what its
    ranks import (its `preload(spec)`, the run directory's spec); then launch.py's rank processes
    are forked from here (launch/rank_forks.py)."""
    if rank_forks.FORK_FLAG not in sys.argv:
        return
    sys.argv.remove(rank_forks.FORK_FLAG)
    if not preloaded:
        rank_forks.preload(rank_forks.rank_module_name(sys.argv[1:]),
                           rank_forks.spec_of(sys.argv[1:]))
    rank_forks.install()


def _standby_if_asked() -> bool:
    """With STANDBY_FLAG: what the ranks import, imported while the launcher plans, then launch.py's
    arguments and the ranks' environment read from stdin (launch/standby.py); the launch
    abandoned meanwhile (stdin closed): exit at once. Whether it preloaded."""
    if standby.STANDBY_FLAG not in sys.argv:
        return False
    first = standby.read_message()
    if first is None:
        quick_exit(0)
    rank_forks.preload(first.get("module"), first.get("spec"))
    launch = standby.read_message()
    if launch is None:
        quick_exit(0)
    os.environ.clear()
    os.environ.update(launch["env"])
    sys.argv = [sys.argv[0], *launch["args"]]
    rank_forks.show_command([sys.executable, "-u", "-m", runner.NODE_LAUNCHER, *launch["args"]])
    devnull = os.open(os.devnull, os.O_RDONLY)   # the ranks get no stdin, as ever
    os.dup2(devnull, 0)
    os.close(devnull)
    return True


if __name__ == "__main__":
    if standby.STANDBY_FLAG in sys.argv or rank_forks.FORK_FLAG in sys.argv:
        rank_forks.prepare_titles()   # ranks forked from here show their own command lines
        # torch.cuda.is_available() through NVML, not the CUDA driver a fork could not share
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import_deepspeed()
    _fork_ranks_if_asked(preloaded=_standby_if_asked())
    quick_exit(_run_launch_py())
