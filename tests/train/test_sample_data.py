"""The shipped sample data under jobs/data/: what scripts/make_sample_data.py writes, and usable as shipped."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "jobs" / "data"
FILES = ["corpus-sample.txt", "chat-sample.jsonl", "instruct-sample.jsonl", "tokenizer/tokenizer.json",
         "tokenizer/tokenizer_config.json"]


def _generator():
    spec = importlib.util.spec_from_file_location("make_sample_data", ROOT / "scripts" / "make_sample_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_samples_are_what_the_generator_writes(tmp_path):
    _generator().generate(tmp_path)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(FILES)
    stale = [name for name in FILES if (tmp_path / name).read_bytes() != (DATA / name).read_bytes()]
    assert not stale, f"jobs/data is stale ({stale}): run python scripts/make_sample_data.py and commit"


def test_sample_tokenizer_roundtrips_and_renders_chat():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    assert 2000 <= len(tok) <= 4096
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert sum(p.stat().st_size for p in (DATA / "tokenizer").iterdir()) < 400_000
    for line in (DATA / "corpus-sample.txt").read_text(encoding="utf-8").splitlines()[:50]:
        assert tok.decode(tok(line, add_special_tokens=False)["input_ids"]) == line
    record = json.loads((DATA / "chat-sample.jsonl").read_text(encoding="utf-8").splitlines()[0])
    text = tok.apply_chat_template(record["messages"], tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>") and text.endswith("<|eot_id|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|eot_id|>")) == len(record["messages"])


@pytest.mark.parametrize("name, keys", [("chat-sample.jsonl", {"messages"}),
                                        ("instruct-sample.jsonl", {"prompt", "completion"})])
def test_sample_records_have_their_shape(name, keys):
    records = [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 200
    assert all(set(r) == keys for r in records)
    if name.startswith("chat"):
        roles = {m["role"] for r in records for m in r["messages"]}
        assert roles == {"system", "user", "assistant"}
        assert any(len(r["messages"]) > 3 for r in records)   # multi-turn
        assert all(r["messages"][-1]["role"] == "assistant" for r in records)
