"""Model and tokenizer agree (issue 24 item 4) and `launch --dry-run` checks the data with file:line (item 5).

In process through jobspec.cli.main, on tiny specs under tmp_path and the shipped sample data
(jobs/data): nothing starts, nothing downloads.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from jobspec.cli import main
from jobspec.model.build import build_config, build_model, build_tokenizer
from jobspec.spec.schema import fill_defaults
from tests.conftest import REPO_ROOT

DATA = REPO_ROOT / "jobs" / "data"
TOKENIZER = DATA / "tokenizer"
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128, "vocab_size": 2048}


def write_spec(tmp_path: Path, data: dict, config: dict | None = None, architecture: str = "gpt2") -> Path:
    spec = {"name": "agree", "output_dir": str(tmp_path / "out"),
            "model": {"architecture": architecture, "task": "causal-lm", "config": config or GPT2},
            "data": {"tokenizer": str(TOKENIZER), "max_length": 64, **data},
            "training": {"max_steps": 2, "micro_batch_size": 2},
            "logging": {"mlflow": {"enabled": False}}, "resources": {"gpus_per_node": 1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err + captured.out


# ---------------------------------------------------------------- item 4: ids and vocabulary

@pytest.fixture
def transformers_log():
    """transformers' own log records (its library logger does not propagate to the root)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.parametrize("architecture,config", [
    ("gpt2", GPT2),
    ("llama", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 64, "vocab_size": 2048, "max_position_embeddings": 128}),
])
def test_a_model_from_a_config_takes_the_tokenizers_special_ids(architecture, config, transformers_log):
    spec = fill_defaults({"model": {"architecture": architecture, "task": "causal-lm", "config": config},
                          "data": {"train": str(DATA / "chat-sample.jsonl"), "tokenizer": str(TOKENIZER)}})
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert ids == (0, 1, 2)   # scripts/make_sample_data.py: <|begin_of_text|> <|end_of_text|> <|pad|>
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == ids
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids
    # the planner's trace and the export build the config without the tokenizer object: the same ids
    _, config_alone = build_config(spec)
    assert (config_alone.bos_token_id, config_alone.eos_token_id, config_alone.pad_token_id) == ids
    assert not [m for m in transformers_log if "token_id" in m], transformers_log


def test_what_model_config_writes_wins_and_synthetic_data_keeps_the_defaults():
    spec = fill_defaults({"model": {"architecture": "gpt2", "task": "causal-lm", "config": {**GPT2, "eos_token_id": 7}},
                          "data": {"train": str(DATA / "chat-sample.jsonl"), "tokenizer": str(TOKENIZER)}})
    _, config = build_config(spec, build_tokenizer(spec))
    assert (config.bos_token_id, config.eos_token_id) == (0, 7)
    synthetic = fill_defaults({"model": {"architecture": "gpt2", "task": "causal-lm", "config": GPT2},
                               "data": {"synthetic": {"vocab_range": [5, 100]}}})
    assert build_config(synthetic)[1].eos_token_id == 50256   # no tokenizer: the architecture's own


def test_validate_refuses_a_vocabulary_smaller_than_the_local_tokenizer(tmp_path, capsys):
    job = write_spec(tmp_path, {"train": str(DATA / "chat-sample.jsonl")}, {**GPT2, "vocab_size": 1000})
    text = refusal(capsys, ["validate", str(job)])
    assert "model.config.vocab_size: the tokenizer" in text and "2048 tokens" in text and "only 1000" in text
    assert "set model.config.vocab_size to at least 2048" in text
    # not written: GPT-2's default 50257 covers it
    job = write_spec(tmp_path, {"train": str(DATA / "chat-sample.jsonl")},
                     {k: v for k, v in GPT2.items() if k != "vocab_size"})
    assert main(["validate", str(job)]) == 0


@pytest.fixture
def vocab_txt_tokenizer(tmp_path) -> Path:
    """A tokenizer only transformers reads (vocab.txt, no tokenizer.json): validate cannot count it."""
    directory = tmp_path / "wordpiece"
    directory.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    (directory / "vocab.txt").write_text("\n".join(words) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    return directory


def test_launch_refuses_before_any_rank_a_vocabulary_only_transformers_can_count(tmp_path, capsys,
                                                                                  vocab_txt_tokenizer):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n" for i in range(8)))
    job = write_spec(tmp_path, {"train": str(rows), "tokenizer": str(vocab_txt_tokenizer)},
                     {**GPT2, "vocab_size": 30})
    assert main(["validate", str(job)]) == 0   # nothing validate can read
    text = refusal(capsys, ["launch", str(job), "--dry-run"])
    assert "job.yaml:" in text and "model.config.vocab_size" in text and "40 tokens" in text and "only 30" in text
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- item 5: the records at --dry-run

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def records(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("data", [
    {"train": str(DATA / "chat-sample.jsonl")},
    {"train": str(DATA / "instruct-sample.jsonl")},
    {"train": str(DATA / "corpus-sample.txt")},
])
def test_dry_run_passes_the_sample_data(tmp_path, data, capsys):
    assert main(["launch", str(write_spec(tmp_path, data)), "--dry-run"]) == 0
    assert "a launch would" in capsys.readouterr().out


@pytest.mark.parametrize("rows,bad_line,expected", [
    ([{"messages": CHAT}, {"messages": CHAT}, {"conversation": CHAT}], 3, "no 'messages' field"),
    ([{"messages": CHAT}, {"messages": [{"role": "assistnt", "content": "x"}]}], 2,
     "role 'assistnt'; one of system, user, assistant, tool expected (did you mean 'assistant'?)"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}], 2, "'completion' is null"),
])
def test_dry_run_refuses_a_bad_record_at_its_line(tmp_path, capsys, rows, bad_line, expected):
    path = records(tmp_path, rows)
    text = refusal(capsys, ["launch", str(write_spec(tmp_path, {"train": str(path)})), "--dry-run"])
    assert f"{path}:{bad_line}" in text and expected in text


def test_dry_run_refuses_a_template_that_fails_on_a_record(tmp_path, capsys):
    template = tmp_path / "no-system.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('this template has no system turn') }}{% endif %}"
                        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    path = records(tmp_path, [{"messages": CHAT}] * 3 + [{"messages": [{"role": "system", "content": "be brief"},
                                                                       *CHAT]}])
    job = write_spec(tmp_path, {"train": str(path), "chat_template": str(template)})
    assert main(["validate", str(job)]) == 0   # it compiles: only the records show it
    text = refusal(capsys, ["launch", str(job), "--dry-run"])
    assert f"data.train: {path}:4: the chat template failed on this record: this template has no system turn" in text
    # an undefined name on a record is Jinja's runtime error, reported the same way
    template.write_text("{% for m in messages %}{{ m['content'] + m.missing.deeper }}{% endfor %}")
    text = refusal(capsys, ["launch", str(job), "--dry-run"])
    assert f"{path}:1: the chat template failed on this record" in text and "no attribute 'missing'" in text
