"""Host checks before a launch starts anything: the rendezvous port, enough GPUs (or CPU cores) for
`resources.gpus_per_node`, and disk space for one checkpoint and one exported model.
`--ignore-preflight` turns them into warnings, because they can be wrong (under Slurm, the launching
host is not the training host).
The GPU memory check is memory/at_launch.py's (`preflight_problems`). Each problem is a SpecIssue
at the field it concerns, so the refusal points at the line to change."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from jobspec import hardware, rundir
from jobspec.errors import SpecError, SpecIssue
from jobspec.export.rules import resolve_dtype
from jobspec.launch.runner import port_in_use
from jobspec.spec.types import JobSpec, JobSpecExport
from jobspec.units import fmt_bytes_any_unit

IGNORE_HINT = "or pass --ignore-preflight"


def preflight_issues(spec: JobSpec, derived, run_dir: Path) -> list[SpecIssue]:
    """Every failed host check (empty when all pass)."""
    issues = []
    res = spec["resources"]
    if res["master_port"] is not None and derived.nodes == 1 and port_in_use(res["master_port"]):
        issues.append(SpecIssue(("resources", "master_port"),
                                f"port {res['master_port']} is already in use on this host",
                                "set it to null to pick a free port"))
    if derived.nodes == 1:
        gpus = hardware.gpu_count()
        available, kind = (gpus, "GPUs") if gpus \
            else (hardware.available_cpus(), "CPUs available to this process")
        if derived.gpus_per_node > available:
            issues.append(SpecIssue(("resources", "gpus_per_node"),
                                    f"{derived.gpus_per_node} ranks per node but this host has "
                                    f"{available} {kind}",
                                    f"set it to at most {available}"))
    return issues + disk_space_issues(spec, derived, run_dir)


# The spec field that made a job need each op: where a refusal to build it points.
OP_FIELDS = {"FusedAdamBuilder": ("training", "optimizer", "implementation"),
             "CPUAdamBuilder": ("memory", "offload", "optimizer"),
             "AsyncIOBuilder": ("memory", "offload", "nvme_path")}


def op_build_issues(ds_config: dict) -> list[SpecIssue]:
    """The DeepSpeed ops this job needs that this machine cannot build (no compiler, no nvcc, no
    libaio), at the field that asked for them; a job that needs none imports no DeepSpeed here."""
    from jobspec import ops

    needed = ops.needed_ops(ds_config)
    if not needed:
        return []
    return [SpecIssue(OP_FIELDS.get(builder, ()), text)
            for builder, text in ops.build_problems(needed)]


def disk_space_issues(spec: JobSpec, derived, run_dir: Path) -> list[SpecIssue]:
    """Refuse before training when a disk cannot hold what the job first writes there: one
    checkpoint (`checkpoint.dir`) and one exported model (`export.dir`, else the run directory), the
    two added up when they share a disk. The sizes are estimates: DeepSpeed and safetensors add a
    little."""
    from jobspec.memory.planner import checkpoint_bytes, export_bytes

    ckpt, export = spec["checkpoint"], spec["export"]
    needs = []  # (field, directory, bytes, what is written there, what those bytes are)
    if ckpt["save_final"] or ckpt["every_n_steps"]:
        needs.append((("checkpoint", "dir"), Path(ckpt["dir"]), checkpoint_bytes(spec, derived),
                      "one checkpoint", "parameters x weights + fp32 master + optimizer state"))
    if export["final"] or export["at_checkpoints"] or export["best_eval"]:
        needs.append((("export", "dir"), rundir.export_dir(spec, run_dir),
                      export_bytes(spec, derived),
                      "the exported model", f"parameters x {resolve_dtype(spec)} weights"))
    by_disk: dict[int, tuple[int, list]] = {}
    for need in needs:
        if need[2] is None:
            continue
        disk = disk_of(need[1])
        if disk is not None:
            by_disk.setdefault(disk[0], (disk[1], []))[1].append(need)
    issues = []
    for free, on_disk in by_disk.values():
        total = sum(need[2] for need in on_disk)
        if free >= total:
            continue
        if len(on_disk) == 1:
            field, directory, size, what, made_of = on_disk[0]
            issues.append(SpecIssue(field,
                                    f"{directory} has {fmt_bytes_any_unit(free)} free but {what} "
                                    f"needs about {fmt_bytes_any_unit(size)} ({made_of})",
                                    _space_hint(field, export)))
        else:
            issues.append(SpecIssue(
                on_disk[0][0],
                " and ".join(str(need[1]) for need in on_disk)
                + f" share a disk with {fmt_bytes_any_unit(free)} free but "
                + " and ".join(f"{need[3]} ({fmt_bytes_any_unit(need[2])})" for need in on_disk)
                + f" need about {fmt_bytes_any_unit(total)}",
                "free space, point checkpoint.dir or export.dir at another disk, or "
                + _no_export_hint(export)))
    return issues


def _space_hint(field: tuple, export: JobSpecExport) -> str:
    if field == ("checkpoint", "dir"):
        return "free space or point checkpoint.dir at a larger disk"
    return "free space, point export.dir at a larger disk, or " + _no_export_hint(export)


def _no_export_hint(export: JobSpecExport) -> str:
    """How to export nothing: turn off each export setting that is on (`final` is on by default)."""
    settings = (("final", export["final"]), ("at_checkpoints", export["at_checkpoints"]),
                ("best_eval", export["best_eval"]))
    on = [f"export.{key}: false" for key, value in settings if value]
    return "set " + " and ".join(on)


def disk_of(directory: Path) -> tuple[int, int] | None:
    """(device id, free bytes) of the disk `directory` will be made on (its nearest existing
    parent)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        return os.stat(directory).st_dev, shutil.disk_usage(directory).free
    except OSError:
        return None


def refusal(resolved, issues: list[SpecIssue]) -> SpecError:
    """The launch's refusal: every issue at its field's line in the spec, with the way out."""
    hinted = [SpecIssue(i.path, i.message, f"{i.hint}; {IGNORE_HINT}" if i.hint else IGNORE_HINT)
              for i in issues]
    return resolved.locate(SpecError(hinted))
