"""The plan cache: what planning a job measured, kept on disk by everything that changes it, so that
`jobspec plan` and `jobspec launch` (dry or not) of an unchanged spec neither trace the model nor
import torch or transformers.

`CachedProfiler` stands in front of `model/planner_trace.job_profiler` as the `profiler` that
`spec/derived.derive` calls: the profile (`memory/model_profile.ModelProfile`: the parameter
inventory, the composed activation trace, the FLOPs per token) is looked up before the tracer is
asked. The memory plan itself is not stored: `memory/planner.plan_memory` computes it from the
profile in milliseconds, so `plan`, `plan --fit` (each candidate's profile is kept the same way)
and a launch print the same numbers cold and warm, from the same code.

The key (`profile_key`) is a hash of
- the resolved spec, less what changes neither a trace nor a check (`relevant_spec`: the name,
  description, logging, output and checkpoint directories, exports, step counts, the schedule,
  evaluation, the seed, the learning rate), and the sequence length the trace runs at;
- the local files the model build reads: the tokenizer directory (its special tokens' ids go into
  the model's config) and, through `planner_trace.model_key` (the trace cache's own key: the model
  section, the attention mask, a local checkpoint's config.json, torch's and transformers'
  versions), planner_trace.TRACE_VERSION;
- the environment (`environment`): the installed versions of the libraries the trace and the checks
  run (`DISTRIBUTIONS`), PLAN_CACHE_VERSION, and the bytes of every module of the jobspec package:
  any change of jobspec's code is a miss (a stale plan is worse than a slow one; the trace cache
  still holds the unit traces, so the profile is composed again without tracing).
A file's state (`path_state`) is its size, its mtime and, up to HASH_LIMIT bytes, a hash of its
content (larger files, a checkpoint's weights say, by size and mtime).

Under `<cache>/plans/` (`<cache>`: planner_trace.default_cache_dir(), JOBSPEC_CACHE_DIR honoured):
`<key>.json` a profile without its inventory, `inventories/<hash of its content>.json` the
inventory (a --fit search keeps a profile per candidate, all of one model); `checks/` the marks that
a spec's model and data checks passed (job/checks.checks_key: `spec_digest` with the record files);
`tokenizers/` and `estimates/` the facts of the tokenizer and the data pass that `plan` prints the
data lines from (data/prepare). Entries are written to a temporary file renamed into place, so
concurrent launches never read half a file; one that does not parse, or belongs to another key, is
computed again and rewritten. A profile that would not read back equal to itself is not stored.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jobspec.data.tokenizer_files import tokenizer_name
from jobspec.memory.model_profile import Inventory, ModelProfile, UnitTrace
from jobspec.spec.types import JobSpec

PLAN_CACHE_VERSION = 1   # bump when what an entry holds changes
IGNORED = frozenset({"name", "description", "extends", "output_dir", "logging", "checkpoint",
                     "export"})
IGNORED_TRAINING = frozenset({"max_steps", "epochs", "scheduler", "seed", "eval_every",
                              "eval_generate", "on_nan", "gradient_clipping"})
# the libraries whose code builds, traces or checks the model and its data
DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "peft", "deepspeed", "bitsandbytes",
                 "accelerate", "jinja2")
HASH_LIMIT = 64 * 1024 * 1024   # files up to this size are hashed; larger ones by size and mtime

Profiler = Callable[[JobSpec, int], ModelProfile]


class CachedProfiler:
    """`profiler(spec, seq_len) -> ModelProfile` for `derive`: the plan cache, else the tracer
    (`planner_trace.job_profiler`, whose unit traces have a cache of their own); each key once
    per process."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        from jobspec.model.planner_trace import default_cache_dir

        self.cache_dir = cache_dir or default_cache_dir()
        self.directory = self.cache_dir / "plans"
        self._known: dict[str, ModelProfile] = {}
        self._inventories: dict[str, Inventory] = {}
        self._tracer: Profiler | None = None

    def __call__(self, spec: JobSpec, seq_len: int) -> ModelProfile:
        key = profile_key(spec, seq_len)
        if key not in self._known:
            profile = self._load(key)
            if profile is None:
                profile = self._trace(spec, seq_len)
                self._store(key, profile)
            self._known[key] = profile
        return self._known[key]

    def _trace(self, spec: JobSpec, seq_len: int) -> ModelProfile:
        if self._tracer is None:
            from jobspec.model.planner_trace import job_profiler

            self._tracer = job_profiler(self.cache_dir)
        return self._tracer(spec, seq_len)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def _load(self, key: str) -> ModelProfile | None:
        entry = read_entry(self._path(key))
        if entry is None or entry.get("key") != key:
            return None
        try:
            inventory = self._inventory(str(entry["inventory"]))
            return None if inventory is None else _with_inventory(entry["profile"], inventory)
        except Exception:  # noqa: BLE001 - another layout, or damaged: traced again, rewritten
            return None

    def _inventory(self, name: str) -> Inventory | None:
        """The inventory kept under the hash of its content; None when absent or damaged."""
        if name not in self._inventories:
            stored = read_entry(self._path(f"inventories/{name}"))
            if stored is None or _content_name(stored) != name:
                return None
            self._inventories[name] = Inventory.from_dict(stored)
        return self._inventories[name]

    def _store(self, key: str, profile: ModelProfile) -> None:
        """The profile, if it reads back equal to itself (else it is traced again next time);
        its inventory once per content (a --fit search keeps a profile per candidate)."""
        stored = profile_as_dict(profile)
        try:
            exact = profile_from_dict(json.loads(json.dumps(stored))) == profile
        except Exception:  # noqa: BLE001 - a profile that does not read back is not stored
            exact = False
        if not exact:
            return
        inventory = stored.pop("inventory")
        name = _content_name(inventory)
        if self._inventory(name) is None:   # absent or damaged
            write_entry(self._path(f"inventories/{name}"), inventory)
        write_entry(self._path(key), {"key": key, "inventory": name, "profile": stored})


def profile_as_dict(profile: ModelProfile) -> dict[str, Any]:
    """Everything a ModelProfile holds, the inventory's tensor list included
    (`ModelProfile.as_dict` is launch.json's summary without it)."""
    return {"inventory": profile.inventory.as_dict(), "activations": profile.activations.as_dict(),
            "model_flops_per_token": profile.model_flops_per_token,
            "hardware_flops_per_token": profile.hardware_flops_per_token,
            "method": profile.method, "notes": list(profile.notes)}


def profile_from_dict(d: Mapping[str, Any]) -> ModelProfile:
    """`profile_as_dict` read back."""
    return _with_inventory(d, Inventory.from_dict(d["inventory"]))


def _with_inventory(d: Mapping[str, Any], inventory: Inventory) -> ModelProfile:
    return ModelProfile(inventory=inventory, activations=UnitTrace.from_dict(d["activations"]),
                        model_flops_per_token=float(d["model_flops_per_token"]),
                        hardware_flops_per_token=float(d["hardware_flops_per_token"]),
                        method=str(d["method"]), notes=tuple(d["notes"]))


def _content_name(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


def profile_key(spec: JobSpec, seq_len: int) -> str:
    """The key of the profile `derive` asks for at `seq_len` (see the module's docstring)."""
    from jobspec.model.planner_trace import TRACE_VERSION, model_key

    tokenizer = tokenizer_name(spec)
    return spec_digest(spec, seq_len=seq_len, trace=model_key(spec), tracer=TRACE_VERSION,
                       tokenizer=path_state(tokenizer) if tokenizer else None)


def spec_digest(spec: JobSpec, **extra: Any) -> str:
    """A hash of the spec's relevant part, `extra` and the environment."""
    return digest({"spec": relevant_spec(spec), "extra": extra})


def digest(value: Any) -> str:
    """A hash of `value` (as JSON) and the environment (library versions, jobspec's code)."""
    text = json.dumps({"value": value, "environment": environment()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def relevant_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec without the fields that change neither the model's trace nor its checks."""
    out = {name: value for name, value in spec.items() if name not in IGNORED}
    training = {name: value for name, value in (spec.get("training") or {}).items()
                if name not in IGNORED_TRAINING}
    if isinstance(training.get("optimizer"), dict):
        training["optimizer"] = {name: value for name, value in training["optimizer"].items()
                                 if name != "lr"}
    out["training"] = training
    return out


def path_state(name: str) -> Any:
    """What a key records of a local path: a file's state, a directory's files' (not recursive),
    or the name alone when there is no such path (a hub id, a dataset by name)."""
    path = Path(name)
    if path.is_file():
        return file_state(path)
    if path.is_dir():
        return {child.name: file_state(child) for child in sorted(path.iterdir())
                if child.is_file()}
    return name


def file_state(path: Path) -> list[Any]:
    """[size, mtime in ns, sha256 of the content up to HASH_LIMIT bytes, else None]."""
    stat = path.stat()
    content = _content_hash(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return [stat.st_size, stat.st_mtime_ns, content]


@functools.lru_cache(maxsize=4096)
def _content_hash(path: str, size: int, mtime_ns: int) -> str | None:
    """Once per process for a file that did not change (a --fit search keys many candidates)."""
    if size > HASH_LIMIT:
        return None
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 4 * 1024 * 1024), b""):
            hasher.update(block)
    return hasher.hexdigest()


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """The libraries' versions (their metadata: nothing imported) and the hash of jobspec's code."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"format": PLAN_CACHE_VERSION, "versions": versions, "code": _code_digest()}


def _code_digest() -> str:
    """A hash of every module of the jobspec package (~1 MB, ~10 ms)."""
    root = Path(__file__).resolve().parent.parent
    hasher = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        hasher.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return hasher.hexdigest()


def read_entry(path: Path | None) -> dict[str, Any] | None:
    """A cache entry (a JSON object); None when there is none or it does not parse."""
    if path is None:
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_entry(path: Path, value: Mapping[str, Any]) -> None:
    """Atomic: a temporary file renamed into place. A read-only or full cache only costs speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
