"""Checkpoints of a running job: save (atomically published), prune, find and load for resume.

A checkpoint is DeepSpeed's own directory `<ckpt_dir>/step<N>/` plus our client state: the
optimizer step, the position in the data (epoch, micro-batches consumed in it), every rank's RNG
states and the job name. `<ckpt_dir>/latest` names the newest COMPLETE checkpoint: DeepSpeed
writes it from rank 0 before the other ranks have finished (and with a plain open/write), so we
save with `save_latest=False` and publish it ourselves after a barrier, with a rename.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from jobspec.errors import spec_error

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
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, capture_rng_state())
    return states


def save(engine, ckpt_dir: str | os.PathLike, *, step: int, epoch: int, batches_in_epoch: int,
         job_name: str, keep_last: int) -> str:
    """Save on every rank (collective); returns the tag. Older checkpoints beyond `keep_last` go."""
    ckpt_dir = str(ckpt_dir)
    tag = tag_for(step)
    client_state = {
        "step": step,
        "epoch": epoch,
        "batches_in_epoch": batches_in_epoch,
        "rng": _all_ranks_rng_states(),
        "job_name": job_name,
    }
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()  # every rank has finished writing its shards
    if dist.get_rank() == 0:
        publish_latest(ckpt_dir, tag)
        prune(ckpt_dir, keep_last)
    dist.barrier()
    return tag


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
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _TAG.match(p.name)))


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
    if path.is_dir() and read_latest(path):
        return str(path), read_latest(path)
    if path.is_dir() and path.parent.is_dir():
        return str(path.parent), path.name
    raise spec_error(f"checkpoint to resume from not found: {resume}", path=("checkpoint", "resume"),
                     hint="use `auto`, `never`, or the path of a checkpoint directory (e.g. .../checkpoints/step100)")


def load(engine, load_dir: str, tag: str) -> dict:
    """Load weights, optimizer and scheduler into `engine`; returns the client state.

    The RNG is not restored here: see `rng_state_of_this_rank` for when to do it.
    """
    load_path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if load_path is None or client_state is None:
        raise spec_error(f"could not load checkpoint {tag!r} from {load_dir}", path=("checkpoint", "resume"),
                         hint="the checkpoint may be incomplete; point `checkpoint.resume` at an older one")
    return client_state


def rng_state_of_this_rank(client_state: dict) -> dict | None:
    """This rank's saved RNG states, to restore with `restore_rng_state` right AFTER creating the
    resumed epoch's DataLoader iterator: `iter()` draws a base seed from the global torch RNG,
    which the uninterrupted run did at the start of the epoch, before the state was saved."""
    states = client_state.get("rng") or []
    rank = dist.get_rank()
    return states[rank] if rank < len(states) else None
