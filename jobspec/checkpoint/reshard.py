"""Resuming on a different world size (a Slurm requeue onto fewer or more nodes).

A checkpoint records the world size, ZeRO stage and micro-batch size it was saved with (client
state and `jobspec_manifest.json`). Before `deepspeed.initialize`, the worker compares them with
the current world size:
- same world size: nothing here applies; the usual resume path runs unchanged;
- different, optimizer state partitioned over ranks (ZeRO >= 1, or any `*optim_states.pt` shard):
  rank 0 converts the checkpoint to DeepSpeed's universal format next to it
  (`<ckpt_dir>/step<N>_universal`, built in a temp dir and renamed; reused when already there),
  and the engine is built with `"checkpoint": {"load_universal": true}` to load it;
- different, optimizer state unpartitioned (ZeRO-0 in fp32): DeepSpeed loads it directly.

Data position: the checkpoint counts micro-batches consumed per rank. It becomes global samples
(batches x micro x W1) and is skipped at W2 in whole micro-batches of every rank. Every rank's
shard of an epoch is a stride over ONE permutation fixed by (seed, epoch), so the first G samples
consumed at W1 are the first G of the permutation, and W2 skips exactly those: no sample of the
epoch is repeated or lost when G is a multiple of micro x W2 (always true when the global batch
is unchanged). Otherwise the remainder (< micro x W2 samples) is trained a second time. The sample
ORDER after a reshard differs from an uninterrupted W2 run (another stride over the permutation).
An epoch's samples do not depend on the world size: whole global batches of the permutation
(jobspec.data.loaders.epoch_samples).

RNG: per-rank states cannot map onto another number of ranks, so every rank is reseeded from
(seed, step, rank): dropout masks after a reshard are deterministic but not those of any
uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from jobspec.compile.compiler import with_universal_load
from jobspec.errors import spec_error

UNIVERSAL_SUFFIX = "_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
CONVERTER = "deepspeed.checkpoint.ds_to_universal"


# --- pure arithmetic and decisions ----------------------------------------------------------------

def global_samples_consumed(batches_per_rank: int, micro_batch_size: int, world_size: int) -> int:
    return batches_per_rank * micro_batch_size * world_size


def batches_to_skip(samples: int, micro_batch_size: int, world_size: int) -> tuple[int, int]:
    """(micro-batches each rank skips, samples trained again because they do not fill one)."""
    per_round = micro_batch_size * world_size
    return samples // per_round, samples % per_round


def resume_mode(saved_world_size: int | None, current_world_size: int,
                optimizer_partitioned: bool) -> str:
    """`same` (today's path), `universal` (convert first) or `direct` (DeepSpeed loads it as it
    is)."""
    if saved_world_size is None or saved_world_size == current_world_size:
        return "same"
    return "universal" if optimizer_partitioned else "direct"


def universal_tag(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def reseed_value(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"jobspec-reshard:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# --- reading what a checkpoint was saved with -----------------------------------------------------

def saved_layout(load_dir: str | os.PathLike, tag: str) -> dict:
    """{"world_size", "zero_stage", "micro_batch_size", "optimizer_partitioned"} of a checkpoint.

    From the manifest when jobspec wrote it; else from DeepSpeed's own model-states file
    (memory-mapped: its weights are not read). Unknown values are None.
    """
    root = Path(load_dir) / tag
    layout: dict[str, Any] = {"world_size": None, "zero_stage": None, "micro_batch_size": None}
    try:
        manifest = json.loads((root / "jobspec_manifest.json").read_text(encoding="utf-8"))
        layout.update(manifest.get("layout") or {})
    except (OSError, ValueError, AttributeError):
        pass
    if layout["world_size"] is None and (root / MODEL_STATES).is_file():
        layout.update(_layout_from_model_states(root / MODEL_STATES))
    layout["optimizer_partitioned"] = bool(glob.glob(str(root / "*optim_states.pt"))) \
        or bool(layout["zero_stage"])
    return layout


def _layout_from_model_states(path: Path) -> dict:
    import torch
    try:
        states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    # unreadable: the usual resume path reports it, with its fallback
    except Exception:  # noqa: BLE001
        return {}
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    return {"world_size": states.get("world_size", states.get("dp_world_size")),
            "zero_stage": states.get("zero_stage", zero.get("stage")),
            "micro_batch_size": states.get("micro_batch_size")}


# --- the plan the worker follows ------------------------------------------------------------------

class ResumeFrom(TypedDict):
    """What a resume reads of the `checkpoint` section: the spec's JobSpecCheckpoint is one (it has
    these keys, of these types), and so is a Reshard's `checkpoint_section`."""
    resume: str
    dir: str


@dataclass
class Reshard:
    mode: str                 # `universal` or `direct`
    load_dir: str
    tag: str                  # the checkpoint saved at the old world size
    saved_world_size: int
    world_size: int
    saved_micro_batch_size: int | None
    # memory.sequence_parallel then and now: the data-parallel ranks, which the data position
    # counts, are the world over it (the N ranks of a group read the same samples)
    saved_sequence_parallel: int = 1
    sequence_parallel: int = 1

    @property
    def checkpoint_section(self) -> ResumeFrom:
        """`checkpoint` spec section pointing the resume at what to load (an explicit path: no
        fallback)."""
        loaded = universal_tag(self.tag) if self.mode == "universal" else self.tag
        return {"resume": str(Path(self.load_dir) / loaded), "dir": self.load_dir}

    def ds_config(self, ds_config: dict) -> dict:
        if self.mode != "universal":
            return ds_config
        return with_universal_load(ds_config)

    def message(self, step: int) -> str:
        how = "via universal checkpoint" if self.mode == "universal" \
            else "directly (unpartitioned optimizer state)"
        if self.saved_world_size == self.world_size:
            how = "directly (the same ZeRO partitions)"
        split = "" if self.saved_sequence_parallel == self.sequence_parallel == 1 else \
            f" (sequence_parallel {self.saved_sequence_parallel} -> {self.sequence_parallel})"
        return (f"resuming step {step} from world size {self.saved_world_size} on "
                f"{self.world_size}{split} {how}")

    def adjust(self, state, micro_batch_size: int, seed: int, rank: int) -> dict:
        """Move `state` to the data position at this world size; this rank's reseeded RNG state."""
        # the data-parallel ranks
        saved_ranks = self.saved_world_size // self.saved_sequence_parallel
        ranks = self.world_size // self.sequence_parallel
        samples = global_samples_consumed(state.batches_in_epoch,
                                          self.saved_micro_batch_size or micro_batch_size,
                                          saved_ranks)
        state.batches_in_epoch, repeated = batches_to_skip(samples, micro_batch_size, ranks)
        if repeated and rank == 0:
            print(f"WARNING: {samples} samples of epoch {state.epoch} were consumed by "
                  f"{saved_ranks} data-parallel ranks, not a multiple of {micro_batch_size} x "
                  f"{ranks}: the last {repeated} of them are trained again", file=sys.stderr,
                  flush=True)
        state.resumed_from = str(Path(self.load_dir) / self.tag)
        return reseeded_rng_state(reseed_value(seed, state.step, rank))


def plan(ckpt: ResumeFrom, world_size: int, broadcast,
         sequence_parallel: int = 1) -> Reshard | None:
    """None when the resume (if any) is at the same world size and `sequence_parallel`; else what to
    do, conversion done.

    Collective: every rank calls it; `broadcast(obj)` returns rank 0's `obj` on every rank.
    """
    from jobspec.checkpoint import save_load
    target = _first_usable(save_load, ckpt)
    if target is None:
        return None
    layout = saved_layout(*target)
    saved_sp = int(layout.get("sequence_parallel") or 1)
    mode = resume_mode(layout["world_size"], world_size, layout["optimizer_partitioned"])
    if mode == "same":
        if saved_sp == sequence_parallel:
            return None
        # DeepSpeed's partitions span the whole world either way; only the data split moved
        mode = "direct"
    if mode == "universal" and max(saved_sp, sequence_parallel) > 1:
        # DeepSpeed's converter reads the Ulysses ranks' files as tensor-parallel slices: not
        # converted here
        raise spec_error("a ZeRO checkpoint cannot move between world sizes with sequence "
                         f"parallelism (saved on {layout['world_size']} ranks with "
                         f"sequence_parallel {saved_sp}, resumed on {world_size} with "
                         f"{sequence_parallel})", path=("checkpoint", "resume"),
                         hint=f"resume on {layout['world_size']} ranks (resources.nodes x "
                              "resources.gpus_per_node), or start fresh (`checkpoint.resume: "
                              "never`)")
    reshard = Reshard(mode, target[0], target[1], int(layout["world_size"]), world_size,
                      layout["micro_batch_size"],
                      saved_sequence_parallel=saved_sp, sequence_parallel=sequence_parallel)
    if mode == "universal":
        error = None
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                convert_to_universal(*target)
            except Exception as err:  # noqa: BLE001 -- reported on every rank as one clear error
                error = str(err)
        error = broadcast(error)
        if error:
            raise spec_error(error, path=("checkpoint", "resume"),
                             hint="resume with the world size it was saved with "
                                  f"({reshard.saved_world_size} ranks: resources.nodes x "
                                  "resources.gpus_per_node), or convert it by hand with `python "
                                  f"-m {CONVERTER} --inject_missing_state`")
    return reshard


def _first_usable(save_load, ckpt: ResumeFrom) -> tuple[str, str] | None:
    # the checkpoint the usual path would load first: the newest that passes verification
    candidates = save_load.resume_candidates(ckpt["resume"], ckpt["dir"])
    for load_dir, tag in candidates:
        has_manifest = (Path(load_dir) / tag / save_load.MANIFEST).is_file()
        if (ckpt["resume"] != "auto" and not has_manifest) \
                or save_load.verify(load_dir, tag) is None:
            return load_dir, tag
    return None


def convert_to_universal(load_dir: str | os.PathLike, tag: str) -> Path:
    """`<load_dir>/<tag>_universal`, converted now or reused; the source checkpoint is never
    touched.

    Built in a temp dir and renamed into place, with a manifest: a crash mid-way leaves no
    half-converted directory that a later resume would trust.
    """
    from jobspec.checkpoint import save_load
    root, name = Path(load_dir), universal_tag(tag)
    final = root / name
    if final.is_dir() and save_load.verify(root, name) is None:
        return final
    scratch = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    # the converter writes `latest_universal` next to its output: inside the scratch dir, not the
    # checkpoint dir
    argv = [sys.executable, "-m", CONVERTER, "--input_folder", str(root / tag), "--output_folder",
            str(scratch / name),
            # HF models carry no universal_checkpoint_info; plain data parallel needs none
            "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            reason = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"converting checkpoint {root / tag} to the universal format failed "
                               f"(`{CONVERTER}` exit {done.returncode}): {reason}")
        save_load.write_manifest(scratch, name)
        if final.exists():  # an unverifiable leftover of an earlier conversion: ours replaces it
            shutil.rmtree(final)
        os.replace(scratch / name, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def reseeded_rng_state(value: int) -> dict:
    """The RNG states `restore_rng_state` takes, seeded from `value`; the current states are
    kept."""
    import numpy as np
    import torch

    from jobspec.checkpoint import save_load
    current = save_load.capture_rng_state()
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    seeded = save_load.capture_rng_state()
    save_load.restore_rng_state(current)
    return seeded


def replace_ds_config(files, reshard: Reshard | None):
    """`files` with the ds_config the first engine is built from (later rebuilds keep the
    original)."""
    return files if reshard is None \
        else dataclasses.replace(files, ds_config=reshard.ds_config(files.ds_config))
