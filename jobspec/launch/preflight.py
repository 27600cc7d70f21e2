"""Host checks before a launch starts anything: the rendezvous port, enough GPUs (or CPU cores) for
`resources.gpus_per_node`, and disk space for one checkpoint. `--ignore-preflight` turns them into
warnings, because they can be wrong (under Slurm, the launching host is not the training host).
The GPU memory check is memory/at_launch.py's (`preflight_problems`). Each problem is a SpecIssue
at the field it concerns, so the refusal points at the line to change."""
from __future__ import annotations

import shutil
from pathlib import Path

from jobspec import hardware
from jobspec.errors import SpecError, SpecIssue
from jobspec.launch.runner import port_in_use

IGNORE_HINT = "or pass --ignore-preflight"
UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """`512 bytes`, `3.2 KiB`, `4.0 MiB`, `1.5 GiB`: the unit that keeps the number below 1024."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} bytes" if unit == 0 else f"{value:.1f} {UNITS[unit]}"


def preflight_issues(spec: dict, derived) -> list[SpecIssue]:
    """Every failed host check (empty when all pass)."""
    issues = []
    res = spec["resources"]
    if res["master_port"] is not None and derived.nodes == 1 and port_in_use(res["master_port"]):
        issues.append(SpecIssue(("resources", "master_port"),
                                f"port {res['master_port']} is already in use on this host",
                                "set it to null to pick a free port"))
    if derived.nodes == 1:
        gpus = hardware.gpu_count()
        available, kind = (gpus, "GPUs") if gpus else (hardware.available_cpus(), "CPUs available to this process")
        if derived.gpus_per_node > available:
            issues.append(SpecIssue(("resources", "gpus_per_node"),
                                    f"{derived.gpus_per_node} ranks per node but this host has {available} {kind}",
                                    f"set it to at most {available}"))
    space = checkpoint_space_issue(spec, derived)
    if space is not None:
        issues.append(space)
    return issues


def checkpoint_space_issue(spec: dict, derived) -> SpecIssue | None:
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
    return SpecIssue(("checkpoint", "dir"),
                     f"{ckpt['dir']} has {human_bytes(free)} free but one checkpoint needs about "
                     f"{human_bytes(needed)} (parameters x weights + fp32 master + optimizer state)",
                     "free space or point checkpoint.dir at a larger disk")


def refusal(resolved, issues: list[SpecIssue]) -> SpecError:
    """The launch's refusal: every issue at its field's line in the spec, with the way out."""
    hinted = [SpecIssue(i.path, i.message, f"{i.hint}; {IGNORE_HINT}" if i.hint else IGNORE_HINT)
              for i in issues]
    return resolved.locate(SpecError(hinted))
