"""What determines training, as a fingerprint stored with the checkpoints.

A relaunch compares the fingerprint of the spec it would run with the one its checkpoints were
trained under (launch/decision.py). Equal: resume, or nothing to do. Different: refused, unless
every difference is one that is safe to continue (`--continue`) or the user asks for a new run
beside the old checkpoints (`--new-run`).

The fingerprint is the whole resolved spec minus the fields that do not change what is trained
(FREE: memory techniques, resources, logging, checkpoint and export settings, names), so a field
added to the schema later is part of it until someone decides otherwise: forgetting a field makes
a resume refuse, never silently go on under a different spec. Data files add their content (a hash,
or size + mtime for large ones), a local model directory its config.json, and the derived job its
batch arithmetic and step count.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from jobspec.secrets import mask_tree
from jobspec.spec.loader import dotted_leaves
from jobspec.spec.types import JobSpec

# Fields (dotted prefixes) that do not change what is trained: never in the fingerprint. A change to
# them is still recorded when a run continues (the lineage's `recorded` changes, a new segment of
# launch/ownership.write_owner), as is every other change.
FREE = (
    "name", "description", "extends", "output_dir",
    "model.attention", "model.compile",                      # kernels, not math
    "data.num_workers", "data.pin_memory",
    # the global batch is what counts (below)
    "training.micro_batch_size",
    "training.optimizer.implementation", "training.on_oom", "training.on_nan",
    "training.eval_every",
    # training is bit-identical with it (train/generation)
    "training.eval_generate",
    "memory", "resources", "logging", "checkpoint", "export",
)
# ... except these, which change the numbers a step computes.
NOT_FREE = ("memory.precision",)

# Changes that are safe to continue a run with (`--continue`): more steps, other eval data. A
# smaller step count is not (the schedule already went past it).
CONTINUABLE = ("training.max_steps", "training.epochs", "derived.total_steps",
               "data.eval", "data.synthetic.eval_samples")

# larger files are fingerprinted by size and mtime (hashing costs ~1 s/GB)
HASH_LIMIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Change:
    field: str
    old: str | None      # canonical JSON text; None: the field is new
    new: str | None      # None: the field is gone
    continuable: bool

    def describe(self, width: int = 60) -> str:
        return f"{self.field}: {_short(self.old, width)} -> {_short(self.new, width)}"


def fingerprint(spec: JobSpec, derived: dict) -> dict[str, str]:
    """{dotted field: canonical JSON text} of everything that determines training. Reads the data
    files' content (or size + mtime) and a local model directory's config.json."""
    # masked like every other record jobspec writes: the owner record sits beside the checkpoints
    prints = {k: v for k, v in flat(mask_tree(spec)).items() if _counts(k)}
    for field in ("global_batch_size", "total_steps"):
        prints[f"derived.{field}"] = _canon(derived.get(field))
    for field, path in (("train", spec["data"]["train"]), ("eval", spec["data"]["eval"])):
        if path:
            prints[f"data.{field}.content"] = _canon(content_digest(Path(path)))
    model_dir = spec["model"]["name_or_path"]
    if model_dir and (Path(model_dir) / "config.json").is_file():
        prints["model.config.json"] = _canon(content_digest(Path(model_dir) / "config.json"))
    return prints


def compare(old: dict[str, str], new: dict[str, str]) -> list[Change]:
    """Every field whose fingerprint differs, in field order."""
    changes = []
    for field in sorted(set(old) | set(new)):
        if old.get(field) != new.get(field):
            changes.append(Change(field, old.get(field), new.get(field),
                                  _continuable(field, old, new)))
    return changes


def diff_specs(old: dict[str, str], new: dict[str, str]) -> list[Change]:
    """Every difference between two flattened resolved specs (what a continued run records)."""
    return [Change(f, old.get(f), new.get(f), True) for f in sorted(set(old) | set(new))
            if old.get(f) != new.get(f)]


def flat(value, prefix: str = "") -> dict[str, str]:
    """{dotted key: canonical JSON} of a nested dict; lists and scalars are leaves."""
    return {key: _canon(leaf) for key, leaf in dotted_leaves(value, prefix).items()}


def content_digest(path: Path) -> str:
    """`sha256:<hex>` of a file (of a directory's files, by name), or `size=N mtime=T` beyond
    HASH_LIMIT_BYTES."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    try:
        total = sum(p.stat().st_size for p in files)
        if total > HASH_LIMIT_BYTES:
            latest = max((p.stat().st_mtime_ns for p in files), default=0)
            return f"size={total} mtime_ns={latest}"
        digest = hashlib.sha256()
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else "").encode() + b"\0")
            with open(file, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"
    # the pre-flight data check reports unreadable files; here it is only a difference
    except OSError as err:
        return f"unreadable ({os.strerror(err.errno) if err.errno else err})"


def _counts(field: str) -> bool:
    if any(field == p or field.startswith(p + ".") for p in NOT_FREE):
        return True
    return not any(field == p or field.startswith(p + ".") for p in FREE)


def _continuable(field: str, old: dict[str, str], new: dict[str, str]) -> bool:
    if not any(field == p or field.startswith(p + ".") for p in CONTINUABLE):
        return False
    if field in ("training.max_steps", "training.epochs", "derived.total_steps"):
        before, after = _number(old.get(field)), _number(new.get(field))
        # null -> a number (or back) switches between epochs and steps: the total decides
        # (derived.total_steps)
        return before is None or after is None or after >= before
    return True


def _number(text: str | None) -> float | None:
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _short(text: str | None, width: int) -> str:
    if text is None:
        return "(unset)"
    return text if len(text) <= width else text[:width - 3] + "..."
