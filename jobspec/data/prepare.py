"""The data preparation pass: chat and prompt/completion records tokenised once, in parallel, into
the tokenised-data cache (jobspec/data/cache.py), which the ranks memory-map.

`jobspec launch` runs it before any rank starts (`jobspec prepare JOB` ahead of time); a rank that
finds no entry (a worker started by hand) builds it under a file lock while the other ranks wait.
The pass is also the full data check: every record is read, checked (its fields, the chat messages'
shape: its record kind's check, data/records/), rendered with the chat template and tokenised; every
bad record is reported at its file:line (MAX_REPORTED of them, then a count), exit 2, before any
rank starts and before anything is written into the cache.

The work is split into chunks (the source format's `records`, data/formats/: byte ranges of a jsonl
file, read and parsed by the worker; row ranges of a table `datasets` loads: csv, parquet, `hf:`
names, saved datasets) over `data.num_proc` forked processes (default: the CPUs this process may
use); each renders its records and tokenises them in one batched call of the fast tokenizer. The
parent writes the chunks' arrays in order.

Records longer than `max_length` are truncated (one line: how many, and the longest). Every record
stays a sample (the derived job counts a file's rows as its samples):
those with no answer token left within `max_length` are counted (`no_answer`: they add no loss).
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobspec.data import cache as data_cache
from jobspec.data import chat_render, record_checks
from jobspec.data.chat_render import RecordText, chat_template, check_template, encode
from jobspec.data.formats import split_format, split_source
from jobspec.data.formats.base import RecordSource
from jobspec.data.records import RECORD_KINDS, Columns, record_kind
from jobspec.data.records.base import RecordError
from jobspec.data.tokenizer_files import tokenizer_name
from jobspec.errors import SpecError, SpecIssue, spec_error
from jobspec.memory.plan_cache import digest, path_state, read_entry, write_entry
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.units import MiB

MAX_REPORTED = 20
ESTIMATE_RECORDS = 200   # records tokenised to estimate a cold pass (`--dry-run`)
PROMPT_CHECK_RECORDS = 8   # records whose answers are checked against the prompts they are served


def cached_kind(spec: JobSpec, split: str) -> str | None:
    """The record kind's name when `data.<split>` goes through the cache (a kind that is `rendered`:
    chat, prompt/completion); None otherwise (synthetic data, text corpora, text records: tokenised
    by the ranks, data/loaders.py)."""
    data = spec["data"]
    if data.get("synthetic") is not None or not data.get(split) \
            or spec["model"]["task"] != "causal-lm":
        return None
    try:
        fmt = split_format(data, split)
    except SpecError:
        return None
    if not fmt.holds_records:
        return None
    if data["records"] != "auto":
        kind = RECORD_KINDS[data["records"]]
    else:
        fields = records_of(spec, split).fields()
        if fields is None:
            return None
        kind = record_kind(spec, fields)
    return kind.name if kind.rendered else None


def records_of(spec: JobSpec, split: str) -> RecordSource:
    """Where the pass reads `data.<split>`'s records: its format's chunks of work."""
    return split_format(spec["data"],
                        split).records(spec, split, lambda: record_checks.load_dataset(spec, split))


def cached_splits(spec: JobSpec) -> list[str]:
    return [split for split in record_checks.SPLITS if cached_kind(spec, split)]


@dataclass
class Entry:
    """A split's cache entry: its key, the entry when it is built, and where its records come
    from."""

    split: str
    kind: str
    key: str
    source: RecordSource
    data: data_cache.CachedData | None
    built: bool = False   # tokenised by this process (prepare_split), not found in the cache


def find(spec: JobSpec, split: str, tokenizer) -> Entry:
    """The split's cache key and its entry if built (nothing is tokenised)."""
    fingerprint = data_cache.tokenizer_fingerprint(tokenizer)
    return locate(spec, split, fingerprint, chat_template(spec, tokenizer))


def locate(spec: JobSpec, split: str, tokenizer_fingerprint: str, template: str | None) -> Entry:
    """`find` from what the key needs of the tokenizer: its fingerprint and the chat template."""
    kind = cached_kind(spec, split)
    if kind is None:
        raise ValueError(f"data.{split} does not go through the data cache")
    records = RECORD_KINDS[kind]
    if records.needs_template and template is None:
        raise spec_error(f"{records.described} records need a chat template, and the tokenizer has "
                         "none",
                         path=("data", "chat_template"),
                         hint="set data.chat_template to a Jinja template file, or use a tokenizer "
                              "with one")
    if template is not None:
        check_template(spec, template)
    source = records_of(spec, split)
    data = spec["data"]
    fields = {"source": source.fingerprint(), "tokenizer": tokenizer_fingerprint,
              "template": template, "kind": kind, "loss_on": data["loss_on"],
              "max_length": data["max_length"], "fields": list(records.fields(Columns.of(spec)))}
    key = data_cache.entry_key(fields)
    return Entry(split, kind, key, source, data_cache.open_entry(key))


def prepare_split(spec: JobSpec, split: str, tokenizer, *, num_proc: int | None = None,
                  show: str | None = None) -> Entry:
    """The split's entry, built when there is none (under a lock: one builder per key on this host).
    `show`: "bar" (a progress bar), "lines" (a line every few seconds) or None (quiet)."""
    entry = find(spec, split, tokenizer)
    if entry.data is not None:
        return entry
    try:
        with _build_lock(entry.key):
            # built by another process while this one waited
            entry.data = data_cache.open_entry(entry.key)
            if entry.data is None:
                entry.data = _build(spec, entry, tokenizer, num_proc or default_num_proc(spec),
                                    show)
                entry.built = True
    except OSError as err:   # a read-only or full cache directory: the tokens have nowhere to go
        raise spec_error(f"cannot write the tokenised data of data.{split} into "
                         f"{data_cache.cache_root()}: {err.strerror or err}", path=("data", split),
                         hint="set JOBSPEC_CACHE_DIR to a writable directory with room for it "
                              "(`jobspec plan` says how big it is)") from None
    return entry


def default_num_proc(spec: JobSpec) -> int:
    from jobspec import hardware

    return spec["data"]["num_proc"] or hardware.available_cpus()


@contextmanager
def _build_lock(key: str):
    root = data_cache.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".lock-{key}", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---- the pass -----------------------------------------------------------------------------------

@dataclass
class _Chunk:
    """What a worker hands back for one chunk."""

    ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    records: int = 0
    truncated: int = 0
    no_answer: int = 0
    longest: tuple = (0, "")     # (tokens before truncation, where)
    errors: list = field(default_factory=list)   # (where, message, hint), at most MAX_REPORTED
    bad: int = 0


_WORK: dict = {}   # the forked workers' state, set before the pool forks


def _encode_chunk(chunk) -> _Chunk:
    source, record_text, tokenizer = _WORK["source"], _WORK["record_text"], _WORK["tokenizer"]
    max_length, all_tokens = _WORK["max_length"], _WORK["all_tokens"]
    texts, places, result = [], [], _Chunk(np.zeros(0, np.int32), np.zeros(0, np.int32),
                                           np.zeros(0, np.int64))
    for where, record in source.read(chunk):
        result.records += 1
        try:
            if isinstance(record, RecordError):
                raise record
            texts.append(record_text(record, where))
            places.append(where)
        except RecordError as err:
            result.bad += 1
            if len(result.errors) < MAX_REPORTED:
                result.errors.append((where, err.message, err.hint))
    if result.bad:
        return result   # nothing of a chunk with a bad record is kept: the pass refuses the data
    ids_out, labels_out, lengths = [], [], []
    for where, (ids, labels) in zip(places, encode(tokenizer, texts, all_tokens)):
        if len(ids) > result.longest[0]:
            result.longest = (len(ids), where)
        if len(ids) > max_length:
            result.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if not all_tokens and bool((labels == IGNORE_INDEX).all()):
            result.no_answer += 1
        ids_out.append(ids)
        labels_out.append(labels)
        lengths.append(len(ids))
    if ids_out:
        result.ids, result.labels = np.concatenate(ids_out), np.concatenate(labels_out)
        result.lengths = np.asarray(lengths, dtype=np.int64)
    return result


def _build(spec: JobSpec, entry: Entry, tokenizer, num_proc: int,
           show: str | None) -> data_cache.CachedData:
    data = spec["data"]
    template = chat_template(spec, tokenizer)
    record_text = RecordText(spec, tokenizer, entry.kind, template, entry.split)
    note = check_prompts(entry, record_text, tokenizer)
    _WORK.update(source=entry.source, record_text=record_text,
                 tokenizer=tokenizer, max_length=data["max_length"],
                 all_tokens=data["loss_on"] == "all")
    chunks = entry.source.chunks()
    # the chunks are the key's (the source's content): a kept pass of the same ones goes on
    writer = data_cache.EntryWriter(entry.key, resume=_chunking(chunks))
    done, totals = _restored(writer.resumed)
    progress = Progress(f"data.{entry.split}", entry.source.total(), show, kept=totals.records)
    started, cpu_started = time.time(), _cpu_seconds()
    try:
        with _results(chunks[done:], num_proc) as results:
            for result in results:
                progress.update(result.records)
                _add(totals, result)
                if not totals.bad:
                    with _ctrl_c_waits():
                        writer.append(result.ids, result.labels, result.lengths)
                        done += 1
                        writer.checkpoint({"chunks": done, "totals": _counts(totals)})
        progress.close()
        if totals.bad:
            raise SpecError(_bad_record_issues(totals, entry.split))
        meta = {"split": entry.split, "kind": entry.kind, "source": split_source(data, entry.split),
                "records": totals.records,
                "tokens": writer.tokens, "truncated": totals.truncated,
                "no_answer": totals.no_answer,
                "longest": totals.longest[0], "longest_where": totals.longest[1],
                "max_length": data["max_length"], "seconds": round(time.time() - started, 2),
                "cpu_seconds": round(_cpu_seconds() - cpu_started, 2),
                "num_proc": min(num_proc, len(chunks)) or 1, "prompt_note": note}
        path = writer.commit(meta)
    except KeyboardInterrupt:
        saved = writer.keep()
        progress.stopped(saved["totals"]["records"] if saved else 0)
        raise
    except BaseException:
        writer.abort()
        raise
    finally:
        _WORK.clear()
    opened = data_cache.open_entry(path.name, path.parent)
    assert opened is not None
    return opened


def _chunking(chunks: list) -> str:
    """The resume token of a pass: its chunks, as the source cut them."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(chunks, default=str).encode()).hexdigest()[:32]


def _counts(totals: _Chunk) -> dict:
    """A pass's counts so far, as a checkpoint keeps them (a bad record ends the pass)."""
    return {"records": totals.records, "truncated": totals.truncated, "no_answer": totals.no_answer,
            "longest": list(totals.longest)}


def _restored(state: dict | None) -> tuple[int, _Chunk]:
    """(chunks done, the counts so far) of a kept pass's checkpoint; (0, nothing) without one."""
    totals = _Chunk(np.zeros(0), np.zeros(0), np.zeros(0))
    if not state:
        return 0, totals
    counts = state["totals"]
    totals.records, totals.truncated = counts["records"], counts["truncated"]
    totals.no_answer, totals.longest = counts["no_answer"], tuple(counts["longest"])
    return int(state["chunks"]), totals


def check_prompts(entry: Entry, record_text: RecordText, tokenizer) -> str | None:
    """The first PROMPT_CHECK_RECORDS records' assistant turns against the prompts the model is
    served (chat_render.prompt_check), returning a note or None. The first answer's prompt is the
    served one by construction: ids that differ there refuse the data, naming the record. A later
    answer's served prompt holds the earlier answers, which training tokenised as answers: a
    tokenizer that splits the text at the cut one way where an answer ends and another where the
    conversation goes on cannot give both (GPT-2's pre-tokenizer before a blank line), and a
    template that renders earlier turns differently cannot either: a note, saying which."""
    if record_text.renderer is None:
        return None
    issues, note = [], None
    for where, record in entry.source.read(entry.source.head(PROMPT_CHECK_RECORDS)):
        try:
            text = record_text(record, where)
        except RecordError:
            continue   # the pass names it
        segments = chat_render.segment_ids(tokenizer, [text.segments()])[0]
        messages = record_text.messages(record)
        first = next((i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        for difference in chat_render.prompt_check(tokenizer, record_text.renderer.template,
                                                   messages, text, segments):
            if difference.turn != first and not difference.rewritten:
                note = note or (
                    f"data.{entry.split}: the tokenizer splits the text after an answer one way "
                    f"where the answer ends and another where the conversation goes on ({where}, "
                    f"message {difference.turn}: {difference.message}); answers after the first "
                    "are trained after the earlier answers as trained, which a served "
                    "conversation tokenises otherwise (a pre-tokenizer that splits both alike, as "
                    "Llama 3's, avoids it)")
                continue
            if difference.rewritten:
                note = note or (
                    f"data.{entry.split}: the chat template renders the turns before an answer "
                    f"differently inside the whole conversation ({where}, message "
                    f"{difference.turn}: {difference.message}); such answers are trained after the "
                    f"whole conversation's rendering, not after the prompt the model is served")
                continue
            issues.append(SpecIssue(
                ("data", entry.split),
                f"{where}: message {difference.turn}: the ids training puts before this answer are "
                f"not the prompt the model is served (the turns before it rendered with "
                f"add_generation_prompt=True, tokenised): {difference.message}",
                "the tokenizer splits the text before an earlier answer one way where a prompt "
                "ends there and another where the answer follows it (its pre-tokenizer): use one "
                "that splits both alike, as Llama 3's does, or give each answer its own record"))
            break   # a record's first such turn: the later ones hold the same text
    if issues:
        raise SpecError(issues)
    return note


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children waited for (the pool's workers, once it
    closed)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextmanager
def _results(chunks: list, num_proc: int):
    """The chunks' results in order: in this process, or over `num_proc` forked workers."""
    if num_proc <= 1 or len(chunks) <= 1:
        yield (_encode_chunk(chunk) for chunk in chunks)
        return
    import multiprocessing

    # tokenizers' own thread pool must not be live across the fork (it warns and deadlocks
    # otherwise); each worker encodes its batches on one core, the workers fill the others
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with multiprocessing.get_context("fork").Pool(min(num_proc, len(chunks)),
                                                      initializer=_leave_ctrl_c_to_the_parent
                                                      ) as pool:
            yield pool.imap(_encode_chunk, chunks)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


@contextmanager
def _ctrl_c_waits():
    """A Ctrl-C in the block is raised when it ends: a chunk is appended and checkpointed whole,
    and the KeyboardInterrupt is not raised inside numpy (whose `tofile` can turn one into a
    TypeError). Only where Python's own handler is set, in the main thread (a background job's
    ignored SIGINT stays ignored)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda sig, _frame: pressed.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _leave_ctrl_c_to_the_parent() -> None:
    """A pool worker ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the
    parent alone stops the pass (keeping what is done) and ends its workers, which would otherwise
    each print a KeyboardInterrupt traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _add(totals: _Chunk, result: _Chunk) -> None:
    totals.records += result.records
    totals.truncated += result.truncated
    totals.no_answer += result.no_answer
    totals.bad += result.bad
    totals.errors += result.errors[:MAX_REPORTED - len(totals.errors)]
    if result.longest[0] > totals.longest[0]:
        totals.longest = result.longest


def _bad_record_issues(totals: _Chunk, split: str) -> list[SpecIssue]:
    issues = [SpecIssue(("data", split), f"{where}: {message}", hint)
              for where, message, hint in totals.errors]
    if totals.bad > len(totals.errors):
        issues.append(SpecIssue(("data", split),
                                f"... and {totals.bad - len(totals.errors)} more bad records "
                                f"({totals.bad} of {totals.records})",
                                "fix the records above and run again"))
    return issues


# ---- the launcher's side -------------------------------------------------------------------

def prepare_data(spec: JobSpec, *, build: bool, show: str | None = None,
                 num_proc: int | None = None, built: list[str] | None = None) -> tuple[list, dict]:
    """The tokenised-data cache of the spec's chat and prompt/completion records (this module):
    built now with `build` (the full data check: a bad record refuses the launch, exit 2, before any
    rank starts), else (`--dry-run`, `plan`) whether it is built and how long building it would
    take. Returns the lines to print and the counts (data.<split>.records, tokens, ...) for
    launch.json and MLflow; `built` gets the splits this pass tokenised (the others were cached)."""
    splits = cached_splits(spec)
    if not splits:
        return [], {}
    if not build:
        remembered = dry_lines(spec, splits, None, num_proc)
        if remembered is not None:   # the tokenizer's facts were remembered: no transformers
            return remembered
    from jobspec.model.build import build_tokenizer

    tokenizer = build_tokenizer(spec)
    if not build:
        found = dry_lines(spec, splits, tokenizer, num_proc)
        assert found is not None   # with the tokenizer every line can be made
        return found
    lines, entries = [], []
    for split in splits:
        entry = prepare_split(spec, split, tokenizer, num_proc=num_proc, show=show)
        entries.append(entry)
        if entry.built and built is not None:
            built.append(split)
        lines.append(summary_line(entry))
        lines += [line for line in (truncation_line(entry), prompt_note_line(entry)) if line]
    return lines, counts(entries)


def dry_lines(spec: JobSpec, splits: list[str], tokenizer,
              num_proc: int | None) -> tuple[list, dict] | None:
    """A split's entry when it is built, else the estimate of building it. Without a tokenizer
    (None): from what the plan cache remembers of it and of the estimates made before; None when
    that is not enough (then the caller loads the tokenizer)."""
    facts = tokenizer_facts(spec, tokenizer)
    if facts is None:
        return None
    lines, entries = [], []
    for split in splits:
        entry = locate(spec, split, *facts)
        if entry.data is not None:
            entries.append(entry)
            lines.append(f"tokenised data cached (warm): {summary_line(entry)}")
            lines += [line for line in (prompt_note_line(entry),) if line]
            continue
        processes = num_proc or default_num_proc(spec)
        guess = remembered_estimate(spec, entry, tokenizer, processes)
        if guess is None:
            return None
        records, seconds, size = guess
        lines.append(f"data.{split}: not tokenised yet (cold): about {records:,} records, "
                     f"{size / MiB:,.0f} MiB tokenised, preparation about {seconds:,.0f} s on "
                     f"{processes} process(es) (estimated from the first "
                     f"{min(records, ESTIMATE_RECORDS)} records; `jobspec prepare` builds it "
                     "ahead)")
    return lines, counts(entries)


# ---- what the plan cache remembers (memory/plan_cache: <cache>/plans/) --------------------

def tokenizer_facts(spec: JobSpec, tokenizer) -> tuple[str, str | None] | None:
    """(fingerprint, chat template): what an entry's key needs of the tokenizer. Computed from
    `tokenizer` and remembered by the tokenizer directory's and the template file's state, the
    versions and the code (`_tokenizer_key`); with `tokenizer` None the remembered ones, or None."""
    key = _tokenizer_key(spec)
    path = _memo_path("tokenizers", key) if key is not None else None
    if tokenizer is None:
        kept = read_entry(path)
        if kept is None or kept.get("key") != key:
            return None
        return kept["fingerprint"], kept["template"]
    facts = data_cache.tokenizer_fingerprint(tokenizer), chat_template(spec, tokenizer)
    if path is not None:
        write_entry(path, {"key": key, "fingerprint": facts[0], "template": facts[1]})
    return facts


def remembered_estimate(spec: JobSpec, entry: Entry, tokenizer,
                        processes: int) -> tuple[int, float, int] | None:
    """`estimate`, made once per entry key and process count and remembered (a plan says the same
    numbers each time); None when it was not made before and there is no tokenizer to make it."""
    path = _memo_path("estimates", f"{entry.key}-{processes}")
    kept = read_entry(path)
    if kept is not None and kept.get("key") == entry.key:
        return int(kept["records"]), float(kept["seconds"]), int(kept["bytes"])
    if tokenizer is None:
        return None
    records, seconds, size = estimate(spec, entry, tokenizer, processes)
    write_entry(path, {"key": entry.key, "records": records, "seconds": seconds, "bytes": size})
    return records, seconds, size


def _tokenizer_key(spec: JobSpec) -> str | None:
    """None for a tokenizer named by hub id: its files are the hub's to change."""
    name = tokenizer_name(spec)
    if not name or not Path(name).is_dir():
        return None
    model, template = spec["model"], spec["data"]["chat_template"]
    return digest({"tokenizer": [name, path_state(name)],
                   "trust_remote_code": model["trust_remote_code"],
                   "revision": model["revision"] if name == model["name_or_path"] else None,
                   "chat_template": [template, path_state(template)] if template else None,
                   "data_cache": data_cache.code_version()})


def _memo_path(kind: str, name: str) -> Path:
    return data_cache.cache_root().parent / "plans" / kind / f"{name}.json"


# ---- what is said about it ----------------------------------------------------------------------

def summary_line(entry: Entry) -> str:
    """`data.train: 100,000 chat records -> 99,990 samples, 21.3M tokens (cached, 163 MiB)`."""
    assert entry.data is not None
    meta = entry.data.meta
    no_answer = f", {meta['no_answer']:,} with no answer token within data.max_length (no loss)" \
        if meta["no_answer"] else ""
    what = RECORD_KINDS[entry.kind].described
    return (f"data.{entry.split}: {meta['records']:,} {what} records -> {meta['samples']:,} "
            f"samples, {meta['tokens']:,} tokens{no_answer} (tokenised data "
            f"{entry.data.nbytes / MiB:,.1f} MiB, {entry.data.path})")


def truncation_line(entry: Entry) -> str | None:
    assert entry.data is not None
    meta = entry.data.meta
    if not meta["truncated"]:
        return None
    return (f"data.{entry.split}: {meta['truncated']:,} of {meta['records']:,} records are longer "
            f"than data.max_length ({meta['max_length']:,} tokens) and were truncated; the longest "
            f"has {meta['longest']:,} tokens ({meta['longest_where']})")


def prompt_note_line(entry: Entry) -> str | None:
    """What the check of the served prompts noted (`check_prompts`), or None."""
    assert entry.data is not None
    return entry.data.meta.get("prompt_note")


def counts(entries: list[Entry]) -> dict:
    """The entries' `data_counts` together."""
    out: dict = {}
    for entry in entries:
        assert entry.data is not None
        out.update(data_counts(entry.data))
    return out


def data_counts(cached: data_cache.CachedData) -> dict:
    """data.<split>.records/samples/tokens/truncated/no_answer/cache_mib of an entry (MLflow
    params)."""
    split = cached.meta["split"]
    names = ("records", "samples", "tokens", "truncated", "no_answer")
    out = {f"data.{split}.{name}": cached.meta[name] for name in names}
    out[f"data.{split}.cache_mib"] = round(cached.nbytes / MiB, 1)
    return out


def estimate(spec: JobSpec, entry: Entry, tokenizer, num_proc: int) -> tuple[int, float, int]:
    """(records, seconds, bytes) of a cold pass of the split: the first ESTIMATE_RECORDS records
    tokenised here, their rate scaled by the processes and the records (a jsonl file's: its line
    count), their tokens per record by the records (8 bytes a token: ids and labels, int32)."""
    data = spec["data"]
    source = entry.source
    total = source.total()
    _WORK.update(source=source,
                 record_text=RecordText(spec, tokenizer, entry.kind, chat_template(spec, tokenizer),
                                                        entry.split),
                 tokenizer=tokenizer, max_length=data["max_length"],
                 all_tokens=data["loss_on"] == "all")
    try:
        started = time.perf_counter()
        result = _encode_chunk(source.head(ESTIMATE_RECORDS))
        seconds = time.perf_counter() - started
    finally:
        _WORK.clear()
    sampled = max(result.records, 1)
    processes = max(1, min(num_proc, len(source.chunks())))
    tokens = int(result.lengths.sum()) * total / sampled
    return total, seconds * total / sampled / processes, int(8 * tokens + 8 * total)


class Progress:
    """The pass's progress on the launcher's terminal: a bar with records/s and the ETA (a
    terminal), a line every LINE_EVERY_S seconds (logging.progress: lines), or nothing; a closing
    line either way. `kept`: the records a stopped pass kept, which this one does not tokenise."""

    LINE_EVERY_S = 10.0

    def __init__(self, label: str, total: int, show: str | None, kept: int = 0):
        self.label, self.total, self.show = label, total, show
        self.done, self.kept, self.started, self.last = kept, kept, time.time(), time.time()
        self.bar = None
        going_on = f" ({kept:,} kept from a stopped pass)" if kept else ""
        if show == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=kept, unit=" records",
                            desc=f"jobspec: tokenising {label}", file=sys.stdout,
                            dynamic_ncols=True, smoothing=0.1, unit_scale=False)
        elif show == "lines":
            print(f"jobspec: tokenising {label}: {total:,} records{going_on}", flush=True)

    def update(self, records: int) -> None:
        self.done += records
        if self.bar is not None:
            self.bar.update(records)
        elif self.show == "lines" and time.time() - self.last >= self.LINE_EVERY_S:
            self.last = time.time()
            rate = (self.done - self.kept) / max(self.last - self.started, 1e-6)
            eta = (self.total - self.done) / rate if rate else 0
            print(f"jobspec: tokenising {self.label}: {self.done:,}/{self.total:,} records, "
                  f"{rate:,.0f} records/s, ETA {eta:.0f} s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.show:
            elapsed = time.time() - self.started
            made = self.done - self.kept
            print(f"jobspec: tokenised {self.label}: {made:,} records in {elapsed:.1f} s "
                  f"({made / max(elapsed, 1e-6):,.0f} records/s)", flush=True)

    def stopped(self, kept: int) -> None:
        """Ctrl-C: said whatever `show` is (a stop is never silent), with what the cache kept."""
        if self.bar is not None:
            self.bar.close()
        kept_text = "nothing was tokenised yet" if not kept else (
            f"the {kept:,} records tokenised are kept in the cache and the next launch or "
            "`jobspec prepare` goes on from there")
        print(f"jobspec: tokenising {self.label} stopped (Ctrl-C) at {kept:,} of {self.total:,} "
              f"records: {kept_text}", file=sys.stderr, flush=True)
