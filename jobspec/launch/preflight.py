"""Host checks before a launch starts anything: the rendezvous port, enough GPUs (or CPU cores) for
`resources.gpus_per_node`, and disk space for one checkpoint. `--ignore-preflight` turns them into
warnings, because they can be wrong (under Slurm, the launching host is not the training host).
The GPU memory check is memory/at_launch.py's (`preflight_problems`)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from jobspec import hardware
from jobspec.launch.runner import port_in_use


def preflight_problems(spec: dict, derived) -> list[str]:
    """Every failed host check, as one sentence each (empty when all pass)."""
    problems = []
    res = spec["resources"]
    if res["master_port"] is not None and derived.nodes == 1 and port_in_use(res["master_port"]):
        problems.append(f"resources.master_port {res['master_port']} is already in use on this host "
                        "(set it to null to pick a free port)")
    if derived.nodes == 1:
        gpus = hardware.gpu_count()
        available, kind = (gpus, "GPUs") if gpus else (os.cpu_count() or 1, "CPU cores")
        if derived.gpus_per_node > available:
            problems.append(f"resources.gpus_per_node is {derived.gpus_per_node} but this host has "
                            f"{available} {kind}")
    space_problem = checkpoint_space_problem(spec, derived)
    if space_problem:
        problems.append(space_problem)
    return problems


def checkpoint_space_problem(spec: dict, derived) -> str | None:
    """Refuse before training when the checkpoint directory's disk cannot hold even one checkpoint."""
    from jobspec.memory.planner import checkpoint_bytes

    ckpt = spec["checkpoint"]
    if not (ckpt["save_final"] or ckpt["every_n_steps"]):
        return None
    needed = checkpoint_bytes(spec, derived)
    directory = Path(ckpt["dir"])
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if needed is None or free >= needed:
        return None
    return (f"checkpoint.dir {ckpt['dir']} has {free / 2**30:.1f} GiB free but one checkpoint needs about "
            f"{needed / 2**30:.1f} GiB (parameters x weights + fp32 master + optimizer state); free space "
            "or point checkpoint.dir at a larger disk")
