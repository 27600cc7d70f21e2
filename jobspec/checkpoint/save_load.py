"""Checkpoints of a running job: save (atomically published), prune, find and load for resume.

A checkpoint is DeepSpeed's own directory `<ckpt_dir>/step<N>/` plus our client state: the
optimizer step, the position in the data (epoch, micro-batches consumed in it), every rank's RNG
states and the job name. `<ckpt_dir>/latest` names the newest COMPLETE checkpoint: DeepSpeed
writes it from rank 0 before the other ranks have finished (and with a plain open/write), so we
save with `save_latest=False` and publish it ourselves after a barrier, with a rename. Before
publishing, rank 0 writes `<tag>/jobspec_manifest.json` (every file's size): resuming checks it
and, with `resume: auto`, falls back to the previous complete checkpoint when a file is truncated.
The client state and the manifest also record the world size, ZeRO stage and micro-batch size, so
that a resume on another world size can be detected before the engine exists
(jobspec/checkpoint/reshard.py).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from jobspec.errors import RunFailure, first_line, spec_error

LATEST = "latest"
_TAG = re.compile(r"^step(\d+)$")


def tag_for(step: int) -> str:
    return f"step{step}"


def capture_rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_ranks_rng_states() -> list[dict]:
    # DeepSpeed stores client_state from data-parallel rank 0 only, so each rank's RNG
    # (dropout differs per rank) travels inside rank 0's copy.
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, capture_rng_state())
    return states


def save(engine, ckpt_dir: str | os.PathLike, *, step: int, epoch: int, batches_in_epoch: int,
         job_name: str, keep_last: int, zero_stage: int | None = None,
         micro_batch_size: int | None = None, sequence_parallel: int = 1) -> str:
    """Save on every rank (collective); returns the tag. Older checkpoints beyond `keep_last` go.

    `micro_batch_size` is the unit `batches_in_epoch` counts in; `sequence_parallel` the size of the
    rank's sequence-parallel group (its ranks read the same samples: checkpoint/reshard counts world
    / N). A write the OS refuses (disk full,
    permissions) on any rank: every rank raises the same one-line RunFailure naming the directory
    and the OS error, the incomplete `step<N>` is removed and `latest` keeps naming the previous
    one."""
    ckpt_dir = str(ckpt_dir)
    tag = tag_for(step)
    layout = {"world_size": dist.get_world_size(), "zero_stage": zero_stage,
              "micro_batch_size": micro_batch_size, "sequence_parallel": sequence_parallel}
    client_state = {
        **layout,
        "step": step,
        "epoch": epoch,
        "batches_in_epoch": batches_in_epoch,
        "rng": _all_ranks_rng_states(),
        "job_name": job_name,
        # resume with the same count: reductions split by it
        "cpu_threads": torch.get_num_threads(),
    }
    failure = WriteFailure()
    with guarded_writes(engine, failure):
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state, save_latest=False)
    # DeepSpeed's last barrier has passed: every rank has written, or failed to write, its shards
    _raise_if_failed(_gather(failure.describe()), ckpt_dir, tag)
    if dist.get_rank() == 0:
        try:
            write_manifest(ckpt_dir, tag, layout)
            publish_latest(ckpt_dir, tag)
        except OSError as err:
            failure.record(Path(ckpt_dir) / tag, err)
        else:
            prune(ckpt_dir, keep_last)
    _raise_if_failed(_gather(failure.describe()), ckpt_dir, tag)
    return tag


class WriteFailure:
    """The first write this rank could not make during a save."""

    def __init__(self):
        self.path: str | None = None
        self.error: BaseException | None = None

    def record(self, path, error: BaseException) -> None:
        if self.error is None:
            self.path, self.error = str(path), error

    def describe(self) -> str | None:
        if self.error is None:
            return None
        err: BaseException = self.error
        while not isinstance(err, OSError) \
                and (cause := err.__cause__ or err.__context__) is not None:
            err = cause  # torch's zip writer wraps the OSError of the write
        if not isinstance(err, OSError):
            err = self.error
        if isinstance(err, OSError) and err.strerror:
            reason = err.strerror
        # torch's direct writes (legacy format) raise
        # "write(): fd 7 failed with No space left on device"
        else:
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            reason = (re.search(r"failed with (.+)$", reason) or [reason, reason])[1]
        return f"{reason} (writing {self.path} on rank {dist.get_rank()})"


@contextmanager
def guarded_writes(engine, failure: WriteFailure):
    """Route DeepSpeed's checkpoint writes through guards that record a failed write instead of
    raising.

    A rank that raised out of `save_checkpoint` would leave the others waiting in its barriers until
    the collective timeout; recording keeps every rank on the same path to the vote after it. Files
    are written through a Python file object: the OS error (ENOSPC, EACCES) then surfaces as itself,
    where torch's own writer reports `basic_ios::clear: iostream error` or `unexpected pos`."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None:
        yield
        return
    original_save = checkpoint_engine.save
    original_makedirs = checkpoint_engine.makedirs
    # called only when not None
    original_script: Any = getattr(engine, "_copy_recovery_script", None)
    native = type(checkpoint_engine).__name__ == "TorchCheckpointEngine"

    def save(state_dict, path):
        if failure.error is not None:
            return  # the disk already refused a file: the directory is removed after the vote
        try:
            if native:
                with open(path, "wb") as fh:
                    zipfile = checkpoint_engine.zipfile_serialization
                    torch.save(state_dict, fh, _use_new_zipfile_serialization=zipfile)
            else:
                original_save(state_dict, path)
        # OSError above all; any other failure must not split the ranks either
        except Exception as err:
            failure.record(path, err)

    def makedirs(path, exist_ok=False):
        try:
            original_makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            failure.record(path, err)

    def copy_script(save_path):
        try:
            original_script(save_path)
        except OSError as err:
            failure.record(save_path, err)

    checkpoint_engine.save, checkpoint_engine.makedirs = save, makedirs
    if original_script is not None:
        engine._copy_recovery_script = copy_script
    try:
        yield
    finally:
        checkpoint_engine.save, checkpoint_engine.makedirs = original_save, original_makedirs
        if original_script is not None:
            engine._copy_recovery_script = original_script


def _gather(item):
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


def _raise_if_failed(problems: list, ckpt_dir: str, tag: str) -> None:
    problem = next((p for p in problems if p), None)
    if problem is None:
        return
    latest = read_latest(ckpt_dir)
    if dist.get_rank() == 0:
        if latest != tag:
            shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
        for tmp in Path(ckpt_dir).glob(f".{LATEST}.tmp-*"):
            tmp.unlink(missing_ok=True)
    dist.barrier()  # the directory is gone before any rank reports it gone
    raise RunFailure(f"checkpoint {tag} could not be saved to {ckpt_dir}: {problem}; the "
                     f"incomplete {tag} was removed and `latest` still names "
                     f"{latest or 'no checkpoint'}: free space, or set checkpoint.dir to a disk "
                     "with room", collective=True)


def publish_latest(ckpt_dir: str | os.PathLike, tag: str) -> None:
    path = Path(ckpt_dir) / LATEST
    tmp = path.with_name(f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the old tag or the new one, never half a file


def completed_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """Steps of the `step<N>` directories, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir()
                  and (m := _TAG.match(p.name)))


def prune(ckpt_dir: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete the oldest checkpoints so that `keep_last` remain; never the one `latest` names."""
    root = Path(ckpt_dir)
    latest = read_latest(root)
    removed = []
    steps = completed_steps(root)
    for step in steps[:max(0, len(steps) - keep_last)]:
        if tag_for(step) == latest:
            continue
        shutil.rmtree(root / tag_for(step), ignore_errors=True)
        # its conversion (reshard.py)
        shutil.rmtree(root / f"{tag_for(step)}_universal", ignore_errors=True)
        removed.append(tag_for(step))
    return removed


def read_latest(ckpt_dir: str | os.PathLike) -> str | None:
    path = Path(ckpt_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text(encoding="utf-8").strip()
    return tag or None


def resume_target(resume: str, ckpt_dir: str | os.PathLike) -> tuple[str, str] | None:
    """Where to resume from, as (load_dir, tag), or None to start fresh.

    `auto`: the checkpoint `ckpt_dir/latest` names, if any; `never`: none; anything else is a
    path to a checkpoint: a directory holding a `latest` file, or one `step<N>` directory.
    """
    if resume == "never":
        return None
    if resume == "auto":
        tag = read_latest(ckpt_dir)
        return (str(ckpt_dir), tag) if tag else None
    path = Path(resume)
    if path.is_dir() and (tag := read_latest(path)):
        return str(path), tag
    if path.is_dir() and path.parent.is_dir():
        return str(path.parent), path.name
    raise spec_error(f"checkpoint to resume from not found: {resume}",
                     path=("checkpoint", "resume"),
                     hint="use `auto`, `never`, or the path of a checkpoint directory (e.g. "
                          ".../checkpoints/step100)")


# --- integrity: a manifest of file sizes, written once every rank has finished its shards ---------

MANIFEST = "jobspec_manifest.json"


def write_manifest(ckpt_dir: str | os.PathLike, tag: str, layout: dict | None = None) -> None:
    """`<tag>/jobspec_manifest.json`: every file's size (and the `layout` it was saved with);
    its presence means the save completed."""
    root = Path(ckpt_dir) / tag
    sizes = {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*"))
             if f.is_file() and f.name != MANIFEST}
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"tag": tag, "files": sizes, "layout": layout}, indent=1),
                   encoding="utf-8")
    os.replace(tmp, root / MANIFEST)


def verify(load_dir: str | os.PathLike, tag: str) -> str | None:
    """Why the checkpoint `tag` cannot be trusted (missing, truncated or extra-short files), or
    None."""
    root = Path(load_dir) / tag
    try:
        files = json.loads((root / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"{root} has no {MANIFEST} (the save did not complete)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{root / MANIFEST} is unreadable ({err})"
    for name, size in files.items():
        try:
            actual = (root / name).stat().st_size
        except OSError:
            return f"{root / name} is missing"
        if actual != size:
            return f"{root / name} is {actual} bytes, {size} were written"
    return None


def resume_candidates(resume: str, ckpt_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """Checkpoints to try, best first: for `auto`, the one `latest` names, then older complete
    ones."""
    target = resume_target(resume, ckpt_dir)
    if target is None:
        return []
    if resume != "auto":
        return [target]
    match = _TAG.match(target[1])
    newest = int(match.group(1)) if match else None
    older = [s for s in reversed(completed_steps(ckpt_dir)) if newest is None or s < newest]
    return [target] + [(str(ckpt_dir), tag_for(s)) for s in older]


def load_with_fallback(engine, resume: str, ckpt_dir: str | os.PathLike, any_rank) -> tuple:
    """(client_state, (load_dir, tag), [why each newer candidate was passed over]), or (None, None,
    [...]).

    With `auto`, a checkpoint that fails verification or loading on any rank (`any_rank`: a vote
    across ranks) is passed over for the next older one. An explicit path is never replaced.
    """
    passed_over = []
    for load_dir, tag in resume_candidates(resume, ckpt_dir):
        has_manifest = (Path(load_dir) / tag / MANIFEST).is_file()
        problem = verify(load_dir, tag) if (resume == "auto" or has_manifest) else None
        if any_rank(problem is not None):
            passed_over.append(problem or f"{tag}: failed verification on another rank")
            continue
        try:
            client_state, error = load(engine, load_dir, tag), None
        except Exception as err:  # a corrupt shard: torch.load / DeepSpeed raise all sorts
            detail = first_line(err, limit=200) if str(err).strip() else ""
            client_state = None
            error = f"{Path(load_dir) / tag} could not be loaded ({type(err).__name__}: {detail})"
        if any_rank(error is not None):
            passed_over.append(error or f"{tag}: failed to load on another rank")
            if resume != "auto":
                break
            continue
        return client_state, (load_dir, tag), passed_over
    if passed_over:
        raise spec_error(f"no usable checkpoint to resume from: {'; '.join(passed_over)}",
                         path=("checkpoint", "resume"),
                         hint="set checkpoint.resume to `never` with a new checkpoint.dir to start "
                              "over")
    return None, None, passed_over


def load(engine, load_dir: str, tag: str) -> dict:
    """Load weights, optimizer and scheduler into `engine`; returns the client state.

    The RNG is not restored here: see `rng_state_of_this_rank` for when to do it.
    """
    load_path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if load_path is None or client_state is None:
        raise spec_error(f"could not load checkpoint {tag!r} from {load_dir}",
                         path=("checkpoint", "resume"),
                         hint="the checkpoint may be incomplete; point `checkpoint.resume` at an "
                              "older one")
    return client_state


def rng_state_of_this_rank(client_state: dict) -> dict | None:
    """This rank's saved RNG states, to restore with `restore_rng_state` right AFTER creating the
    resumed epoch's DataLoader iterator: `iter()` draws a base seed from the global torch RNG,
    which the uninterrupted run did at the start of the epoch, before the state was saved."""
    states = client_state.get("rng") or []
    rank = dist.get_rank()
    return states[rank] if rank < len(states) else None
