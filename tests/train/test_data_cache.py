"""The tokenised-data cache (jobspec/data/cache.py, data_prep.py): records tokenised once, the same
tokens as a record-by-record reference, reused by key, rebuilt when damaged, every bad record named,
memory-mapped and packed on the ranks (data/loaders.CachedDataset, data/sample_packing.LazyPackedDataset).

In process, on the shipped sample data and tokenizer (jobs/data), each test with its own cache directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.data import cache as data_cache
from jobspec.data import prepare as data_prep
from jobspec.data.formats import jsonl as jsonl_format
from jobspec.model.build import build_tokenizer
from jobspec.spec.schema import fill_defaults
from jobspec.data import sample_packing
from jobspec.data.loaders import TensorDictDataset, build_datasets
from jobspec.tasks.base import IGNORE_INDEX
from tests.conftest import REPO_ROOT

DATA = REPO_ROOT / "jobs" / "data"
CHAT = DATA / "chat-sample.jsonl"
INSTRUCT = DATA / "instruct-sample.jsonl"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(tmp_path / "cache"))


def make_spec(train: Path, **data) -> dict:
    return fill_defaults({
        "name": "cache", "output_dir": "/tmp/unused",
        "model": {"architecture": "gpt2", "task": "causal-lm",
                  "config": {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 256, "vocab_size": 2048}},
        "data": {"train": str(train), "tokenizer": str(DATA / "tokenizer"), "max_length": 96,
                 "padding": "longest", **data},
        "training": {"max_steps": 2, "micro_batch_size": 2}})


def reference(tokenizer, records: list, max_length: int, loss_on: str) -> list[tuple[list, list]]:
    """Record by record, the way a reader of the docs would do it by hand: the whole conversation
    rendered, each assistant turn's span from its prefix and the conversation through it, one tokenizer
    call per record. The pass tokenises segment by segment (test_served_prompt.py); the shipped
    tokenizer splits as Llama 3's does, so at once gives the same ids."""
    def render(messages, prompt=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    out = []
    for messages in records:
        full = render(messages)
        spans = [(len(render(messages[:i], True)) if i else 0, len(render(messages[:i + 1])))
                 for i, m in enumerate(messages) if m["role"] == "assistant"]
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        labels = [t if loss_on == "all" or any(s < e2 and e > s2 for s2, e2 in spans) else IGNORE_INDEX
                  for t, (s, e) in zip(ids, encoded["offset_mapping"])]
        out.append((ids[:max_length], labels[:max_length]))
    return out


def chat_records(path: Path = CHAT) -> list:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("loss_on", ["answers", "all"])
def test_cached_chat_samples_are_the_record_by_record_tokens(loss_on):
    spec = make_spec(CHAT, records="chat", loss_on=loss_on)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    expected = reference(tokenizer, chat_records(), 96, loss_on)
    assert len(train) == len(expected) == 300
    for i in range(len(train)):
        sample = train[i]
        assert sample["input_ids"].tolist() == expected[i][0]
        assert sample["labels"].tolist() == expected[i][1]
        assert sample["attention_mask"].tolist() == [1] * len(expected[i][0])
    # every record is a sample (the derived job counts rows); those without an answer token are counted
    no_answer = sum(all(label == IGNORE_INDEX for label in labels) for _, labels in expected)
    assert train.cached.meta["no_answer"] == (no_answer if loss_on == "answers" else 0)
    assert loss_on == "all" or no_answer > 0


def test_the_answer_tokens_decode_to_the_assistant_turns():
    """An independent view of the mask: the labelled tokens of a short record are its answers, each with
    the template's end-of-turn marker, and nothing else."""
    spec = make_spec(CHAT, records="chat", max_length=1024)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    records = chat_records()
    for i in (0, 1, 7):
        labels = train[i]["labels"]
        kept = tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
        answers = "".join(m["content"].strip() + "<|eot_id|>" for m in records[i] if m["role"] == "assistant")
        assert kept == answers


def test_prompt_completion_records_train_on_the_completion():
    spec = make_spec(INSTRUCT, max_length=512)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    first = json.loads(INSTRUCT.read_text().splitlines()[0])
    labels = train[0]["labels"]
    assert tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()) == first["completion"].strip() + "<|eot_id|>"


def test_padding_max_length_pads_the_mapped_samples():
    spec = make_spec(CHAT, records="chat", padding="max_length", max_length=128)
    train, _ = build_datasets(spec, build_tokenizer(spec))
    sample = train[3]
    assert sample["input_ids"].shape == (128,)
    real = int(sample["attention_mask"].sum())
    assert (sample["labels"][real:] == IGNORE_INDEX).all() and (sample["attention_mask"][real:] == 0).all()


def test_the_cache_is_reused_and_what_changes_the_tokens_rebuilds_it(tmp_path, monkeypatch):
    data = tmp_path / "chat.jsonl"
    data.write_bytes(CHAT.read_bytes())
    spec = make_spec(data, records="chat")
    tokenizer = build_tokenizer(spec)
    first = data_prep.prepare_split(spec, "train", tokenizer)

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    with monkeypatch.context() as patched:
        patched.setattr(data_prep, "_build", no_build)
        # another world size, output directory, padding or packing: the same tokens
        same = make_spec(data, records="chat", padding="max_length", packing=True)
        same["output_dir"], same["resources"]["gpus_per_node"] = str(tmp_path / "elsewhere"), 4
        assert data_prep.prepare_split(same, "train", tokenizer).key == first.key
    keys = {first.key}
    for changed in (make_spec(data, records="chat", max_length=64), make_spec(data, records="chat", loss_on="all")):
        keys.add(data_prep.prepare_split(changed, "train", tokenizer).key)
    template = tmp_path / "template.jinja"
    template.write_text(tokenizer.chat_template.replace("\\n\\n", "\\n"))
    keys.add(data_prep.prepare_split(make_spec(data, records="chat", chat_template=str(template)), "train", tokenizer).key)
    with open(data, "a") as fh:   # one more record: the content changed
        fh.write(data.read_text().splitlines()[0] + "\n")
    grown = data_prep.prepare_split(spec, "train", tokenizer)
    keys.add(grown.key)
    assert len(keys) == 5
    assert len(grown.data) == len(first.data) + 1


def test_a_damaged_entry_is_rebuilt():
    spec = make_spec(CHAT, records="chat")
    tokenizer = build_tokenizer(spec)
    entry = data_prep.prepare_split(spec, "train", tokenizer)
    assert entry.data is not None
    tokens = entry.data.meta["tokens"]
    with open(entry.data.path / "input_ids.bin", "r+b") as fh:   # a write cut short
        fh.truncate(100)
    assert data_cache.open_entry(entry.key) is None and not entry.data.path.exists()
    rebuilt = data_prep.prepare_split(spec, "train", tokenizer)
    assert rebuilt.data is not None and rebuilt.data.meta["tokens"] == tokens
    (rebuilt.data.path / "meta.json").write_text("{")   # and a torn meta.json
    assert data_prep.prepare_split(spec, "train", tokenizer).data.meta["tokens"] == tokens


def test_parallel_chunks_write_what_one_process_writes(monkeypatch):
    monkeypatch.setattr(jsonl_format, "CHUNK_BYTES", 16 * 1024)   # several chunks of the sample file
    spec = make_spec(CHAT, records="chat")
    tokenizer = build_tokenizer(spec)
    serial = data_prep.prepare_split(spec, "train", tokenizer, num_proc=1)
    assert len(serial.source.chunks()) > 3
    arrays = {name: np.array(getattr(serial.data, name)) for name in ("input_ids", "labels", "offsets")}
    meta = dict(serial.data.meta)
    shutil.rmtree(serial.data.path)
    parallel = data_prep.prepare_split(spec, "train", tokenizer, num_proc=2)
    assert parallel.data.meta["num_proc"] == 2
    for name, values in arrays.items():
        assert np.array_equal(np.array(getattr(parallel.data, name)), values)
    assert {k: v for k, v in parallel.data.meta.items() if k not in ("seconds", "cpu_seconds", "num_proc")} == \
        {k: v for k, v in meta.items() if k not in ("seconds", "cpu_seconds", "num_proc")}


def test_every_bad_record_is_named_at_its_line_and_nothing_is_cached(tmp_path):
    lines = CHAT.read_text().splitlines()
    bad = {5: "{not json", 40: json.dumps({"messages": [{"role": "user", "content": 7}]}),
           120: json.dumps({"text": "no messages"}), 250: json.dumps({"messages": [{"role": "bot", "content": "x"}]})}
    for index, line in bad.items():
        lines[index] = line
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    spec = make_spec(data, records="chat")
    with pytest.raises(SpecError) as caught:
        data_prep.prepare_split(spec, "train", build_tokenizer(spec), num_proc=2)
    messages = [issue.message for issue in caught.value.issues]
    assert [m.split(": ")[0] for m in messages] == [f"{data}:{i + 1}" for i in sorted(bad)]
    assert "not valid JSON" in messages[0] and "content is a number (7)" in messages[1]
    assert "no 'messages' field" in messages[2] and "role 'bot'" in messages[3]
    assert not list((tmp_path / "cache" / "data").glob("[!.]*"))   # no entry, no temporary directory left


def test_past_the_limit_bad_records_are_counted(tmp_path):
    good = CHAT.read_text().splitlines()[0]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join((good if i % 3 else "[]") + "\n" for i in range(90)))
    spec = make_spec(data, records="chat")
    with pytest.raises(SpecError) as caught:
        data_prep.prepare_split(spec, "train", build_tokenizer(spec))
    issues = caught.value.issues
    assert len(issues) == data_prep.MAX_REPORTED + 1
    assert issues[-1].message == f"... and {30 - data_prep.MAX_REPORTED} more bad records (30 of 90)"


def test_truncation_is_one_plain_line_with_the_longest_record(recwarn):
    spec = make_spec(CHAT, records="chat", max_length=48)
    entry = data_prep.prepare_split(spec, "train", build_tokenizer(spec))
    line = data_prep.truncation_line(entry)
    meta = entry.data.meta
    assert meta["truncated"] > 0 and meta["longest"] > 48
    assert line == (f"data.train: {meta['truncated']:,} of {meta['records']:,} records are longer than data.max_length "
                    f"(48 tokens) and were truncated; the longest has {meta['longest']:,} tokens "
                    f"({meta['longest_where']})")
    assert meta["longest_where"].startswith(f"{CHAT}:")
    assert not [w for w in recwarn if "truncated" in str(w.message)]


def test_packing_the_mapped_samples_gives_the_in_memory_rows():
    spec = make_spec(CHAT, records="chat", packing=True)
    tokenizer = build_tokenizer(spec)
    train, _ = build_datasets(spec, tokenizer)
    lazy = sample_packing.pack_dataset(train, 96, seed=3)
    samples = [train[i] for i in range(len(train))]
    columns = {name: [s[name] for s in samples] for name in ("input_ids", "attention_mask", "labels")}
    eager = sample_packing.pack_dataset(TensorDictDataset(columns, pad_token_id=train.pad_token_id), 96, seed=3)
    assert len(lazy) == len(eager) and lazy.packing.fill == eager.packing.fill
    for i in range(len(lazy)):
        for name in ("input_ids", "labels", "position_ids", "attention_mask"):
            assert torch.equal(lazy[i][name], eager[i][name])


def test_dry_run_says_cold_with_an_estimate_then_warm():
    spec = make_spec(CHAT, records="chat")
    cold, _ = data_prep.prepare_data(spec, build=False)
    assert len(cold) == 1 and "not tokenised yet (cold): about 300 records, " in cold[0]
    assert "MiB tokenised, preparation about" in cold[0] and "estimated from the first 200 records" in cold[0]
    tokenised: list[str] = []   # the splits a pass tokenised (the launch's start-up line: prepared)
    built, counts = data_prep.prepare_data(spec, build=True, built=tokenised)
    assert counts["data.train.records"] == 300 and counts["data.train.tokens"] > 0
    assert tokenised == ["train"]
    warm, _ = data_prep.prepare_data(spec, build=False)
    assert warm[0].startswith("tokenised data cached (warm): data.train: 300 chat records")
    data_prep.prepare_data(spec, build=True, built=tokenised)   # cached: read, not tokenised again
    assert tokenised == ["train"]


def test_prepare_builds_the_data_and_refuses_a_bad_record_past_the_launch_preflight(tmp_path, capsys):
    """`jobspec prepare JOB --data-only`: the data cache built; a bad record after the rows the pre-flight
    reads (datacheck.PREFLIGHT_ROWS) is named at its line, exit 2."""
    import yaml

    good = CHAT.read_text().splitlines()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(good[i % len(good)] + "\n" for i in range(1100)) + '{"messages": []}\n')
    spec = make_spec(data, records="chat")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({k: spec[k] for k in ("name", "model", "data", "training")}))
    assert main(["prepare", str(job), "--data-only"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:1101: 'messages' is a list of 0" in err and "Traceback" not in err
    data.write_text("".join(good[i % len(good)] + "\n" for i in range(1100)))
    assert main(["prepare", str(job), "--data-only"]) == 0
    assert "jobspec: data.train: 1,100 chat records -> 1,100 samples" in capsys.readouterr().out


@pytest.mark.parametrize("form", ["parquet", "saved", "hf-dir"])
def test_tables_and_datasets_by_name_go_through_the_same_cache(tmp_path, form):
    """parquet, a save_to_disk directory and `hf:` + that directory: the jsonl file's samples, cached."""
    import datasets

    table = datasets.Dataset.from_list([{"messages": m} for m in chat_records()[:40]])
    if form == "parquet":
        source = str(tmp_path / "chat.parquet")
        table.to_parquet(source)
    else:
        table.save_to_disk(str(tmp_path / "saved"))
        source = ("hf:" if form == "hf-dir" else "") + str(tmp_path / "saved")
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(line + "\n" for line in CHAT.read_text().splitlines()[:40]))
    tokenizer = build_tokenizer(make_spec(CHAT))
    expected, _ = build_datasets(make_spec(jsonl, records="chat"), tokenizer)
    spec = make_spec(CHAT, records="chat")
    spec["data"]["train"] = source
    got, _ = build_datasets(spec, tokenizer)
    assert type(got).__name__ == "CachedDataset" and len(got) == len(expected) > 30
    for i in range(len(got)):
        assert torch.equal(got[i]["input_ids"], expected[i]["input_ids"])
        assert torch.equal(got[i]["labels"], expected[i]["labels"])
    entry = data_prep.find(spec, "train", tokenizer)
    assert entry.data is not None and entry.data.meta["records"] == 40


def test_the_counts_go_to_mlflow_params_and_summary_json():
    from jobspec.rundir import RunSummary
    from jobspec.data.loaders import data_params

    spec = make_spec(CHAT, records="chat", packing=True)
    train, _ = build_datasets(spec, build_tokenizer(spec))
    params = data_params(sample_packing.pack_dataset(train, 96, seed=0), None)   # a packed set: through its samples
    meta = train.cached.meta
    assert params == {"data.train.records": 300, "data.train.samples": 300, "data.train.tokens": meta["tokens"],
                      "data.train.truncated": meta["truncated"], "data.train.no_answer": meta["no_answer"],
                      "data.train.cache_mib": round(train.cached.nbytes / 2**20, 1)}
    summary = RunSummary(status="finished", data=params)
    assert RunSummary.from_dict(summary.to_dict()).data == params and "data" not in RunSummary("x").to_dict()


def test_plan_says_how_big_the_tokenised_data_is(tmp_path, capsys):
    import yaml

    spec = make_spec(CHAT, records="chat")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({k: spec[k] for k in ("name", "model", "data", "training")}))
    assert main(["plan", str(job)]) == 0
    assert "data: data.train: not tokenised yet (cold): about 300 records, " in capsys.readouterr().out
    data_prep.prepare_split(spec, "train", build_tokenizer(spec))
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    assert "data: tokenised data cached (warm): data.train: 300 chat records -> 300 samples" in out


def test_launch_refuses_a_bad_record_before_anything_is_created(tmp_path, capsys):
    """The launch's preparation pass is the full data check: a bad record after the rows the pre-flight
    reads is named at its line, exit 2, and no run directory (nor cache entry) is left."""
    import yaml

    good = CHAT.read_text().splitlines()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(good[i % len(good)] + "\n" for i in range(1200)) +
                    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "x"}]})
                    + "\n")
    spec = make_spec(data, records="chat")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**{k: spec[k] for k in ("name", "model", "data", "training")},
                                   "output_dir": str(tmp_path / "out"), "logging": {"mlflow": {"enabled": False}}}))
    assert main(["launch", str(job)]) == 2
    captured = capsys.readouterr()
    assert f"{data}:1201: message 2 has role 'asistant'" in captured.err and "did you mean 'assistant'?" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not list((tmp_path / "out").glob("run-*")) and not list((tmp_path / "cache" / "data").glob("[!.]*"))


def test_a_cache_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(blocked))
    spec = make_spec(CHAT, records="chat")
    with pytest.raises(SpecError) as caught:
        data_prep.prepare_split(spec, "train", build_tokenizer(spec))
    issue = caught.value.issues[0]
    assert issue.message.startswith(f"cannot write the tokenised data of data.train into {blocked}/data: ")
    assert "JOBSPEC_CACHE_DIR" in issue.hint


def test_prompt_completion_records_are_checked_as_validate_checks_them(tmp_path):
    """The pass takes validate's record check (data/record_checks.RecordChecker): the same words at the same line."""
    from jobspec.data import record_checks as datacheck

    lines = INSTRUCT.read_text().splitlines()[:20]
    lines[7] = json.dumps({"prompt": 3, "completion": "x"})
    data = tmp_path / "instruct.jsonl"
    data.write_text("\n".join(lines) + "\n")
    spec = make_spec(data, records="prompt_completion")
    with pytest.raises(SpecError) as caught:
        data_prep.prepare_split(spec, "train", build_tokenizer(spec))
    checker = datacheck.RecordChecker(datacheck.Columns.of(spec), "train")
    expected = checker.problem(f"{data}:8", json.loads(lines[7]))
    assert [(i.message, i.hint) for i in caught.value.issues] == [(expected.message, expected.hint)]
    assert expected.message == f"{data}:8: 'prompt' is a number (3), text expected"
