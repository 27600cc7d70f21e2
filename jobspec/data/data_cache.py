"""The tokenised-data cache: a dataset's records tokenised once, stored as flat NumPy arrays the ranks
memory-map.

An entry is a directory `<cache>/data/<key>/` (`<cache>`: JOBSPEC_CACHE_DIR, else $XDG_CACHE_HOME/jobspec,
else ~/.cache/jobspec, beside the planner's traces) holding

    input_ids.bin   int32, every sample's token ids one after the other
    labels.bin      int32, their labels (-100 outside the answers)
    offsets.bin     int64, sample i is [offsets[i], offsets[i + 1]) of both (its length: the difference)
    meta.json       the counts (records, samples, tokens, truncated, no_answer, longest) and the arrays' sizes;
                    written last: an entry without it, or whose files disagree with it, is damaged

NumPy memmaps rather than Arrow (docs/benchmarks.md, "Data at scale", `bench/data_prep.py --arrow`):
opening one costs three `mmap` calls and no `datasets` import on the ranks (1.5 s each), a random
sample is two slices (9-14x faster than `datasets`' row read), and the pages a rank reads are shared
with every other rank of the node through the page cache.

The key is a hash of everything that changes the tokens: the source's content (a local file's size,
mtime and a hash of its bytes, sampled above SAMPLE_HASH_LIMIT; a dataset by name or a saved one: the
fingerprint `datasets` gives its Arrow files), the tokenizer (its serialized fast tokenizer and special
tokens), the chat template's text, the record kind and fields, `loss_on`, `max_length`, the split,
and the code (this package's tokenising modules and the versions of transformers and tokenizers).
Padding and packing are applied when the ranks read the entry, so they are no part of the key: another
world size, output directory, padding or packing reuses it.

Entries are written into `.partial-<key>/` renamed into place, so a reader never sees half of one;
a damaged entry is removed and built again. A pass stopped by Ctrl-C keeps its partial directory
(every chunk written up to its last checkpoint), and the next pass of the same key goes on from it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jobspec.units import MiB

# 2: a rendered record is tokenised segment by segment (data/chat_render.py), its prompts as served
CACHE_FORMAT = 2
SAMPLE_HASH_LIMIT = 64 * MiB   # files up to this size are hashed whole; larger ones by SAMPLE_BLOCKS blocks
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK = 1 * MiB
ARRAYS = {"input_ids": np.int32, "labels": np.int32, "offsets": np.int64}
# jobspec/job/'s modules whose bytes are the code version: a change to how records become tokens
CODE_MODULES = ("chat_render.py", "data_prep.py", "record_sources.py", "data_cache.py")
# a pass being written: its parts, appended chunk by chunk, and its last checkpoint
PARTIAL_PREFIX = ".partial-"
PARTS = {"input_ids": np.int32, "labels": np.int32, "lengths": np.int64}
PROGRESS = "progress.json"


def cache_root() -> Path:
    from jobspec.model.planner_trace import default_cache_dir

    return default_cache_dir() / "data"


def file_fingerprint(path: Path) -> dict:
    """Size, mtime and a content hash (the whole file up to SAMPLE_HASH_LIMIT, else evenly spaced blocks)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if stat.st_size <= SAMPLE_HASH_LIMIT:
            for block in iter(functools.partial(fh.read, 4 * MiB), b""):
                digest.update(block)
        else:
            step = (stat.st_size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                fh.seek(i * step)
                digest.update(fh.read(SAMPLE_BLOCK))
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": digest.hexdigest(), "sampled": stat.st_size > SAMPLE_HASH_LIMIT}


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer turns text into: its serialized fast tokenizer (vocabulary, merges,
    normalizer, pre-tokenizer, post-processor that adds BOS), else its vocabulary; and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps({"class": type(tokenizer).__name__, "special": tokenizer.special_tokens_map,
                          "eos": tokenizer.eos_token_id}, sort_keys=True, default=str)
    return hashlib.sha256((body + special).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    from importlib import metadata

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(b"".join((here / name).read_bytes() for name in CODE_MODULES)).hexdigest()[:16]
    versions = {"format": CACHE_FORMAT, "code": digest}
    for dist in ("transformers", "tokenizers", "jinja2"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def entry_key(fields: dict) -> str:
    """The key of an entry from everything that changes its tokens (data_prep.key_fields) and the code."""
    text = json.dumps({"fields": fields, "code": code_version()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class CachedData:
    """An entry opened read-only: its arrays memory-mapped (nothing is read until a sample is)."""

    path: Path
    meta: dict
    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.input_ids[start:end], self.labels[start:end]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return int(self.input_ids.nbytes + self.labels.nbytes + self.offsets.nbytes)


def open_entry(key: str, root: Path | None = None) -> CachedData | None:
    """The entry `key`, memory-mapped; None when there is none. A damaged one (no or unreadable
    meta.json, an array whose size disagrees with it) is removed: the caller builds it again."""
    path = (root or cache_root()) / key
    if not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        arrays = {}
        for name, dtype in ARRAYS.items():
            count = meta["arrays"][name]
            if (path / f"{name}.bin").stat().st_size != count * np.dtype(dtype).itemsize:
                raise ValueError(f"{name}.bin is not {count} elements")
            # np.memmap refuses an empty file: an entry of no tokens is an empty array
            arrays[name] = np.memmap(path / f"{name}.bin", dtype=dtype, mode="r", shape=(count,)) if count \
                else np.zeros(0, dtype=dtype)
        if len(arrays["offsets"]) != meta["samples"] + 1 or int(arrays["offsets"][-1]) != meta["arrays"]["input_ids"]:
            raise ValueError("offsets disagree with the token count")
    except (OSError, ValueError, KeyError, TypeError):
        shutil.rmtree(path, ignore_errors=True)
        return None
    return CachedData(path, meta, arrays["input_ids"], arrays["labels"], arrays["offsets"])


class EntryWriter:
    """Writes an entry into `<root>/.partial-<key>/`, part by part (`append`, then `checkpoint` with
    the pass's state so far); `commit` renames it into place. A pass stopped by Ctrl-C leaves it
    (`keep`): the next writer of the key whose `resume` token matches goes on after its last
    checkpoint (`resumed`: that state), the bytes written after it cut off; any other starts anew.
    One writer per key at a time (data/data_prep's build lock)."""

    def __init__(self, key: str, root: Path | None = None, resume: str = ""):
        self.root = root or cache_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.key, self.token = key, resume
        self.tmp = self.root / f"{PARTIAL_PREFIX}{key}"
        self.resumed = self._resume()
        if self.resumed is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        self.files = {name: open(self.tmp / f"{name}.bin", "ab") for name in PARTS}
        self.tokens = (self.tmp / "input_ids.bin").stat().st_size // 4

    def _resume(self) -> dict | None:
        """The state of the last checkpoint of a kept pass with this token, its files cut to it."""
        try:
            saved = json.loads((self.tmp / PROGRESS).read_text(encoding="utf-8"))
            if saved["token"] != self.token:
                return None
            for name, count in saved["counts"].items():
                with open(self.tmp / f"{name}.bin", "r+b") as fh:
                    fh.truncate(count * np.dtype(PARTS[name]).itemsize)
            return dict(saved["state"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def append(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> None:
        ids.astype(np.int32, copy=False).tofile(self.files["input_ids"])
        labels.astype(np.int32, copy=False).tofile(self.files["labels"])
        lengths.astype(np.int64, copy=False).tofile(self.files["lengths"])
        self.tokens += len(ids)

    def checkpoint(self, state: dict) -> None:
        """What is appended so far is kept, with `state` (the caller's counts) to go on from."""
        for fh in self.files.values():
            fh.flush()
        counts = {name: fh.tell() // np.dtype(PARTS[name]).itemsize
                  for name, fh in self.files.items()}
        saved = {"token": self.token, "counts": counts, "state": state}
        (self.tmp / f"{PROGRESS}.new").write_text(json.dumps(saved), encoding="utf-8")
        os.replace(self.tmp / f"{PROGRESS}.new", self.tmp / PROGRESS)

    def commit(self, meta: dict) -> Path:
        """Close the files, write offsets and meta.json, and rename the directory to its key (an entry
        another process committed meanwhile wins: the same key holds the same tokens)."""
        for fh in self.files.values():
            fh.close()
        lengths = np.fromfile(self.tmp / "lengths.bin", dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        offsets.tofile(self.tmp / "offsets.bin")
        for name in ("lengths.bin", PROGRESS):
            (self.tmp / name).unlink()
        meta = {**meta, "samples": len(lengths),
                "arrays": {"input_ids": self.tokens, "labels": self.tokens, "offsets": len(offsets)}}
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        target = self.root / self.key
        try:
            os.rename(self.tmp, target)
        except OSError:   # committed by another process meanwhile (or a damaged one is in the way)
            if open_entry(self.key, self.root) is None:
                shutil.rmtree(target, ignore_errors=True)
                os.rename(self.tmp, target)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return target

    def keep(self) -> dict | None:
        """Stop here, keeping what the last checkpoint holds for the next writer of the key; returns
        that checkpoint's state as it is on disk (None without one): an interrupt may land between
        a checkpoint and the caller's own count of it, the file cannot."""
        for fh in self.files.values():
            fh.close()
        try:
            return dict(json.loads((self.tmp / PROGRESS).read_text(encoding="utf-8"))["state"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def abort(self) -> None:
        """Stop here, keeping nothing."""
        for fh in self.files.values():
            fh.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
