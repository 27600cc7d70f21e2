"""Ctrl-C during the data preparation pass (jobspec/data/prepare.py): it says where it stopped and
what the cache kept, exits 130, and the next pass goes on from the chunks kept, to the very tokens
an uninterrupted pass writes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import REPO_ROOT

from jobspec.data import cache as data_cache, prepare as data_prep
from jobspec.data.formats import jsonl as jsonl_format
from jobspec.spec.validation import load_and_validate

CHAT = REPO_ROOT / "jobs" / "data" / "chat-sample.jsonl"
ENCODE = data_prep._encode_chunk   # the pass's own, before a test wraps it


def write_job(tmp_path, copies: int) -> str:
    data = tmp_path / "chat.jsonl"
    data.write_text(CHAT.read_text() * copies)
    job = {"name": "stop", "model": {"architecture": "qwen2", "task": "causal-lm",
                                     "config": {"hidden_size": 32, "intermediate_size": 64,
                                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                                "num_key_value_heads": 1, "vocab_size": 2048,
                                                "max_position_embeddings": 128}},
           "data": {"train": str(data), "tokenizer": str(REPO_ROOT / "jobs" / "data" / "tokenizer"),
                    "records": "chat", "max_length": 96},
           "training": {"max_steps": 2}, "logging": {"mlflow": {"enabled": False}}}
    path = tmp_path / "stop.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def build(spec, cache, monkeypatch, stop_after: int | None = None):
    """The train split's entry built in this process, in `cache`; with `stop_after`, Ctrl-C (a
    KeyboardInterrupt) comes as chunk `stop_after` is tokenised."""
    from jobspec.model.build import build_tokenizer

    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(cache))
    seen = []

    def interrupted(chunk):
        seen.append(chunk)
        if stop_after is not None and len(seen) > stop_after:
            raise KeyboardInterrupt
        return ENCODE(chunk)
    monkeypatch.setattr(data_prep, "_encode_chunk", interrupted)
    return data_prep.prepare_split(spec, "train", build_tokenizer(spec), num_proc=1, show="lines")


def arrays(entry) -> dict:
    names = ("input_ids", "labels", "offsets")
    return {name: np.asarray(getattr(entry.data, name)) for name in names}


def test_a_stopped_pass_keeps_its_chunks_and_the_next_goes_on_to_the_same_tokens(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jsonl_format, "CHUNK_BYTES", 16 * 1024)   # a dozen chunks of a small file
    spec = load_and_validate(write_job(tmp_path, 2)).spec
    whole = build(spec, tmp_path / "whole", monkeypatch)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        build(spec, tmp_path / "stopped", monkeypatch, stop_after=3)
    err = capsys.readouterr().err
    kept = whole.source.chunks()[:3]
    records = sum(chunk[3] for chunk in kept)
    assert f"jobspec: tokenising data.train stopped (Ctrl-C) at {records:,} of 600 records: the " \
           f"{records:,} records tokenised are kept in the cache" in err
    (partial,) = (tmp_path / "stopped" / "data").glob(f"{data_cache.PARTIAL_PREFIX}*")
    # a chunk written after the last checkpoint (Ctrl-C between the two): cut off when going on
    with open(partial / "input_ids.bin", "ab") as fh:
        fh.write(b"\x07" * 40)
    resumed = build(spec, tmp_path / "stopped", monkeypatch)
    assert f"600 records ({records:,} kept from a stopped pass)" in capsys.readouterr().out
    assert not partial.exists()
    mine, theirs = arrays(resumed), arrays(whole)
    assert all(np.array_equal(mine[name], theirs[name]) for name in mine)
    same = ("records", "tokens", "truncated", "no_answer", "longest", "longest_where", "samples")
    assert {k: resumed.data.meta[k] for k in same} == {k: whole.data.meta[k] for k in same}


def test_a_pass_stopped_before_its_first_chunk_says_nothing_was_kept(tmp_path, monkeypatch, capsys):
    spec = load_and_validate(write_job(tmp_path, 1)).spec
    with pytest.raises(KeyboardInterrupt):
        build(spec, tmp_path / "cache", monkeypatch, stop_after=0)
    err = capsys.readouterr().err
    assert "stopped (Ctrl-C) at 0 of 300 records: nothing was tokenised yet" in err


def test_ctrl_c_while_a_chunk_is_written_stops_after_it_is_written_and_kept(tmp_path, monkeypatch, capsys):
    """A real SIGINT to this process as chunk 3 is appended: the append and its checkpoint finish,
    then the pass stops, keeping 3 chunks (raised inside numpy, a KeyboardInterrupt can come out as
    a TypeError, and a chunk cut halfway is lost)."""
    monkeypatch.setattr(jsonl_format, "CHUNK_BYTES", 16 * 1024)
    spec = load_and_validate(write_job(tmp_path, 2)).spec
    append, appended = data_cache.EntryWriter.append, []

    def ctrl_c_on_the_third(self, *arrays):
        appended.append(1)
        if len(appended) == 3:
            os.kill(os.getpid(), signal.SIGINT)   # its handler runs at the next bytecode: here
        return append(self, *arrays)
    monkeypatch.setattr(data_cache.EntryWriter, "append", ctrl_c_on_the_third)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal's job
    try:
        with pytest.raises(KeyboardInterrupt):
            build(spec, tmp_path / "cache", monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)
    (partial,) = (tmp_path / "cache" / "data").glob(f"{data_cache.PARTIAL_PREFIX}*")
    kept = json.loads((partial / data_cache.PROGRESS).read_text())["state"]
    assert kept["chunks"] == 3 and len(appended) == 3
    assert f"stopped (Ctrl-C) at {kept['totals']['records']:,} of 600 records" in capsys.readouterr().err


def test_ctrl_c_during_prepare_exits_130_with_the_message(tmp_path):
    """A real SIGINT to the command's process group, as a terminal's Ctrl-C: the pool's workers and
    the parent stop, the parent says so, exit 130."""
    job = write_job(tmp_path, 300)   # 90,000 records: tens of seconds of tokenising on 2 cores
    env = {**os.environ, "JOBSPEC_CACHE_DIR": str(tmp_path / "cache"),
           "JOBSPEC_LOG_DIR": str(tmp_path)}

    def default_sigint():   # as a terminal's foreground job (a background one ignores SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen([sys.executable, "-m", "jobspec", "prepare", job, "--data-only"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    try:
        first = proc.stdout.readline()
        assert first.startswith("jobspec: tokenising data.train: 90,000 records"), first
        # once the pool works (a signal while it forks lands in the fork handlers, which drop it)
        assert "records/s" in proc.stdout.readline()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert "jobspec: tokenising data.train stopped (Ctrl-C) at " in err, err
    assert "Traceback" not in err, err
    partial = f"{data_cache.PARTIAL_PREFIX}*/progress.json"
    progress = list((tmp_path / "cache" / "data").glob(partial))
    said_kept = "are kept in the cache" in err
    assert said_kept == bool(progress)   # kept only what it says it kept
    if progress:
        state = json.loads(progress[0].read_text())["state"]
        assert f"at {state['totals']['records']:,} of 90,000 records" in err
