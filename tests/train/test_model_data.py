"""build_model / build_tokenizer / build_datasets / make_loader on tiny models and files made here."""
from __future__ import annotations

import json
import math

import pytest
import torch

from jobspec.data.loaders import build_datasets, make_loader
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.errors import SpecError
from jobspec.model.build import build_model, build_tokenizer
from jobspec.spec.schema import fill_defaults

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=300,
            max_position_embeddings=64)
GPT2 = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=300, n_positions=64)
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing at dawn", "rain falls on the roof",
             "the sun is warm today", "we read a good book"]


def make_spec(model: dict, data: dict | None = None, seed: int = 42) -> dict:
    return fill_defaults({"model": model, "data": data or {"synthetic": {"vocab_range": [5, 300], "seq_len": 16}},
                          "training": {"seed": seed}})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A WordPiece tokenizer trained on the fixture sentences, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[(s, tok.token_to_id(s)) for s in ("[CLS]", "[SEP]")])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    path = tmp_path_factory.mktemp("tokenizer")
    wrapped.save_pretrained(path)
    return str(path)


# ---- model --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, config, task, head", [
    ("bert", BERT, "sequence-classification", "BertForSequenceClassification"),
    ("xlm-roberta", BERT, "token-classification", "XLMRobertaForTokenClassification"),
    ("bert", BERT, "masked-lm", "BertForMaskedLM"),
    ("gpt2", GPT2, "causal-lm", "GPT2LMHeadModel"),
    ("gpt2", GPT2, "sequence-classification", "GPT2ForSequenceClassification"),
])
def test_build_model_from_architecture(arch, config, task, head):
    spec = make_spec({"architecture": arch, "config": config, "task": task, "num_labels": 3, "attention": "eager"})
    model = build_model(spec)
    assert type(model).__name__ == head
    assert model.config._attn_implementation == "eager"
    if task.endswith("classification"):
        assert model.config.num_labels == 3
    train, _ = build_datasets(spec, None)
    batch = next(iter(make_loader(train, micro_batch_size=4, rank=0, world_size=1, seed=0, epoch=0,
                                  shuffle=False, num_workers=0, pin_memory=False)))
    assert torch.isfinite(model(**batch).loss)


def test_random_init_is_seeded():
    weights = [build_model(make_spec({"architecture": "bert", "config": BERT}, seed=s)).classifier.weight
               for s in (1, 1, 2)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_build_model_loads_a_local_checkpoint(tmp_path):
    original = build_model(make_spec({"architecture": "bert", "config": BERT, "num_labels": 3}, seed=7))
    original.save_pretrained(tmp_path)
    loaded = build_model(make_spec({"name_or_path": str(tmp_path), "num_labels": 3}, seed=0))
    assert torch.equal(loaded.classifier.weight, original.classifier.weight)


@pytest.mark.parametrize("model, path", [
    ({"architecture": "bret", "config": BERT}, ("model", "architecture")),
    ({"architecture": "bert", "config": BERT, "attention": "flash_attention_2"}, ("model", "attention")),
    ({"name_or_path": "/no/such/checkpoint"}, ("model", "name_or_path")),
])
def test_build_model_errors_name_the_field(model, path):
    with pytest.raises(SpecError) as err:
        build_model(make_spec(model))
    assert err.value.issues[0].path == path


def test_synthetic_ids_must_fit_the_vocabulary():
    spec = make_spec({"architecture": "bert", "config": BERT}, {"synthetic": {"vocab_range": [5, 1000]}})
    with pytest.raises(SpecError) as err:
        build_model(spec)
    assert err.value.issues[0].path == ("data", "synthetic", "vocab_range")


def test_trust_remote_code_warns_loudly(capsys):
    build_model(make_spec({"architecture": "bert", "config": BERT, "trust_remote_code": True}))
    assert "trust_remote_code" in capsys.readouterr().err


def test_build_tokenizer(tokenizer_dir, tmp_path):
    assert build_tokenizer(make_spec({"architecture": "bert"})) is None
    tok = build_tokenizer(make_spec({"architecture": "bert"}, {"train": "x.jsonl", "tokenizer": tokenizer_dir}))
    assert tok.mask_token == "[MASK]" and tok.pad_token_id == 0
    with pytest.raises(SpecError) as err:
        build_tokenizer(make_spec({"architecture": "bert"}, {"train": "x.jsonl"}))
    assert err.value.issues[0].path == ("data", "tokenizer")


# ---- synthetic data -----------------------------------------------------------------------------

def synthetic_spec(task: str, labels: str = "random", seed: int = 42, **synthetic) -> dict:
    settings = {"num_samples": 64, "eval_samples": 8, "seq_len": 16, "vocab_range": [10, 110], "labels": labels,
                **synthetic}
    return make_spec({"architecture": "bert", "task": task, "num_labels": 3}, {"synthetic": settings}, seed=seed)


def test_synthetic_data_is_deterministic_per_seed():
    a, a_eval = build_datasets(synthetic_spec("sequence-classification"), None)
    b, _ = build_datasets(synthetic_spec("sequence-classification"), None)
    c, _ = build_datasets(synthetic_spec("sequence-classification", seed=43), None)
    assert len(a) == 64 and len(a_eval) == 8
    assert torch.equal(a[5]["input_ids"], b[5]["input_ids"])
    assert not torch.equal(a[5]["input_ids"], c[5]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], a_eval[0]["input_ids"])
    ids = torch.stack([a[i]["input_ids"] for i in range(len(a))])
    assert ids.min() >= 10 and ids.max() < 110


def test_learnable_class_labels_are_balanced_topics_of_the_tokens():
    spec = synthetic_spec("sequence-classification", labels="learnable", num_samples=600, seq_len=40)
    train, _ = build_datasets(spec, None)
    low, high = spec["data"]["synthetic"]["vocab_range"]
    k = spec["model"]["num_labels"]
    ids = torch.stack([train[i]["input_ids"] for i in range(len(train))])
    labels = torch.stack([train[i]["labels"] for i in range(len(train))])
    assert ids.min() >= low and ids.max() < high
    # balanced (chance = ln k): each class's share within 4 standard deviations of a binomial share of
    # len(labels) draws at 1/k (the data are seeded: a bound on the generator, not a flaky sample)
    spread = 4 * math.sqrt((1 / k) * (1 - 1 / k) / len(labels))
    assert all(abs(float((labels == c).float().mean()) - 1 / k) < spread for c in range(k))
    slices = (ids - low) * k // (high - low)   # which label's slice each token is in
    share = (slices == labels[:, None]).float().mean(dim=1)
    # half the tokens from the label's slice, the other half uniform: (1 + 1/k) / 2 on average
    # each token is in its label's slice with probability (1 + 1/k) / 2: a Bernoulli of variance <= 1/4,
    # averaged over every token: within 4 of its standard deviations
    assert abs(float(share.mean()) - (1 + 1 / k) / 2) < 4 * math.sqrt(0.25 / ids.numel())
    assert float((torch.mode(slices, dim=1).values == labels).float().mean()) > 0.95  # the majority says it


def test_synthetic_lm_labels():
    causal, _ = build_datasets(synthetic_spec("causal-lm"), None)
    assert torch.equal(causal[0]["labels"], causal[0]["input_ids"])
    mlm, _ = build_datasets(synthetic_spec("masked-lm", num_samples=200, seq_len=50), None)
    labels = torch.stack([mlm[i]["labels"] for i in range(len(mlm))])
    share = (labels != IGNORE_INDEX).float().mean().item()
    assert 0.12 < share < 0.18
    again, _ = build_datasets(synthetic_spec("masked-lm", num_samples=200, seq_len=50), None)
    assert torch.equal(again[3]["labels"], mlm[3]["labels"])


# ---- file data ----------------------------------------------------------------------------------

def write_table(tmp_path, fmt: str, rows: list[dict]) -> str:
    import pandas as pd

    path = tmp_path / f"data.{fmt}"
    frame = pd.DataFrame(rows)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_file_data_sequence_classification(tmp_path, tokenizer_dir, fmt):
    rows = [{"text": s, "label": ["neg", "pos"][i % 2]} for i, s in enumerate(SENTENCES)]
    path = write_table(tmp_path, fmt, rows)
    spec = make_spec({"architecture": "bert", "config": BERT},
                     {"train": path, "eval": path, "tokenizer": tokenizer_dir, "max_length": 12})
    train, evaluation = build_datasets(spec, build_tokenizer(spec))
    assert len(train) == len(SENTENCES) == len(evaluation)
    assert train[0]["input_ids"].shape == (12,) and train[0]["input_ids"][0] == 2  # [CLS]
    assert [int(train[i]["labels"]) for i in range(4)] == [0, 1, 0, 1]  # neg/pos in sorted order


def test_longest_padding_pads_in_the_batch(tmp_path, tokenizer_dir):
    path = write_table(tmp_path, "jsonl", [{"text": s} for s in SENTENCES])
    spec = make_spec({"architecture": "gpt2", "config": GPT2, "task": "causal-lm"},
                     {"train": path, "tokenizer": tokenizer_dir, "padding": "longest", "max_length": 64})
    train, _ = build_datasets(spec, build_tokenizer(spec))
    lengths = [len(train[i]["input_ids"]) for i in range(len(train))]
    assert len(set(lengths)) > 1
    batch = next(iter(make_loader(train, micro_batch_size=6, rank=0, world_size=1, seed=0, epoch=0,
                                  shuffle=False, num_workers=0, pin_memory=False)))
    assert batch["input_ids"].shape == (6, max(lengths))
    assert batch["attention_mask"].sum().item() == sum(lengths)
    assert torch.equal(batch["labels"] == IGNORE_INDEX, batch["attention_mask"] == 0)


def test_file_token_classification_labels_first_subword(tmp_path, tokenizer_dir):
    rows = [{"words": s.split(), "tags": [i % 3 for i in range(len(s.split()))]} for s in SENTENCES]
    path = write_table(tmp_path, "jsonl", rows)
    spec = make_spec({"architecture": "bert", "config": BERT, "task": "token-classification", "num_labels": 3},
                     {"train": path, "tokenizer": tokenizer_dir, "text_fields": ["words"], "label_field": "tags",
                      "max_length": 16})
    train, _ = build_datasets(spec, build_tokenizer(spec))
    labels = train[0]["labels"]
    assert labels[0] == IGNORE_INDEX                                   # [CLS]
    assert [int(x) for x in labels[labels != IGNORE_INDEX]] == rows[0]["tags"]


def test_file_masked_lm_never_masks_special_tokens(tmp_path, tokenizer_dir):
    path = write_table(tmp_path, "jsonl", [{"text": s} for s in SENTENCES * 20])
    spec = make_spec({"architecture": "bert", "config": BERT, "task": "masked-lm"},
                     {"train": path, "tokenizer": tokenizer_dir, "max_length": 12})
    train, _ = build_datasets(spec, build_tokenizer(spec))
    labels = torch.stack([train[i]["labels"] for i in range(len(train))])
    masked = labels != IGNORE_INDEX
    assert masked.any()
    assert not masked[:, 0].any()                                      # [CLS] stays
    assert not (masked & (train.columns["attention_mask"] == 0)).any()  # padding stays


def test_missing_column_names_the_columns_present(tmp_path, tokenizer_dir):
    path = write_table(tmp_path, "jsonl", [{"sentence": s, "label": 0} for s in SENTENCES])
    spec = make_spec({"architecture": "bert", "config": BERT}, {"train": path, "tokenizer": tokenizer_dir})
    with pytest.raises(SpecError) as err:
        build_datasets(spec, build_tokenizer(spec))
    issue = err.value.issues[0]
    assert issue.path == ("data", "text_fields") and "'text'" in issue.message and "sentence" in issue.message


# ---- loader -------------------------------------------------------------------------------------

def _order(dataset, **kwargs) -> list[int]:
    loader = make_loader(dataset, micro_batch_size=3, num_workers=0, pin_memory=False, shuffle=True, **kwargs)
    return [int(x) for batch in loader for x in batch["labels"]]


def test_loader_shards_ranks_evenly_and_deterministically():
    from jobspec.data.loaders import TensorDictDataset

    dataset = TensorDictDataset({"input_ids": torch.zeros(20, 2, dtype=torch.long),
                                 "labels": torch.arange(20)})
    rank0 = _order(dataset, rank=0, world_size=3, seed=1, epoch=0, global_batch_size=9)
    rank1 = _order(dataset, rank=1, world_size=3, seed=1, epoch=0, global_batch_size=9)
    rank2 = _order(dataset, rank=2, world_size=3, seed=1, epoch=0, global_batch_size=9)
    assert len(rank0) == len(rank1) == len(rank2) == 6                 # 20 // 9 = 2 global batches of 9
    assert not set(rank0) & set(rank1) and not set(rank1) & set(rank2)
    assert rank0 == _order(dataset, rank=0, world_size=3, seed=1, epoch=0, global_batch_size=9)
    assert rank0 != _order(dataset, rank=0, world_size=3, seed=1, epoch=1, global_batch_size=9)
    assert _order(dataset, rank=0, world_size=3, seed=1, epoch=0, skip_batches=1, global_batch_size=9) == rank0[3:]


@pytest.mark.parametrize("samples", [1, 2, 7, 20, 41, 46])
@pytest.mark.parametrize("micro, world", [(16, 1), (4, 1), (3, 1), (4, 2), (3, 3), (2, 4), (1, 4)])
def test_evaluation_takes_every_sample_once_in_the_same_number_of_batches_per_rank(samples, micro, world):
    """The eval loader (no global batch): every sample on exactly one rank, once; every rank the same
    number of batches (ZeRO-3's forward is collective), a rank short of one ending with a padding batch
    whose labels -- token labels, or a sequence class -- are all ignored."""
    from jobspec.data.loaders import TensorDictDataset

    for label_shape in ((), (5,)):   # a sequence classification's class; a token task's labels
        labels = torch.arange(samples).reshape(-1, *[1] * len(label_shape)).expand(samples, *label_shape)
        dataset = TensorDictDataset({"input_ids": torch.ones(samples, 5, dtype=torch.long), "labels": labels})
        per_rank = [[batch["labels"] for batch in make_loader(
            dataset, micro_batch_size=micro, rank=rank, world_size=world, seed=5, epoch=0, shuffle=shuffle,
            num_workers=0, pin_memory=False)] for rank in range(world) for shuffle in (False, True)]
        assert len({len(batches) for batches in per_rank}) == 1
        assert len(per_rank[0]) == -(-(-(-samples // world)) // micro)   # rank 0's share, in micro-batches
        for shuffle in (0, 1):
            seen = [int(b.reshape(len(b), -1)[i, 0]) for batches in per_rank[shuffle::2] for b in batches
                    for i in range(len(b)) if b.reshape(len(b), -1)[i, 0] != IGNORE_INDEX]
            assert sorted(seen) == list(range(samples))
            for batches in per_rank[shuffle::2]:
                assert all(b.shape[1:] == label_shape and len(b) <= micro for b in batches)
                padding = [b for b in batches if (b == IGNORE_INDEX).all()]
                assert len(padding) <= 1 and all(len(b) == 1 for b in padding)
                assert len(padding) == 0 or batches[-1] is padding[0]


def test_a_training_epoch_is_the_same_whole_global_batches_on_every_split():
    """46 samples, global batch 16: every split (micro-batch x ranks x accumulation, the OOM-halved one
    included) trains the same 2 steps of the same 16 samples per epoch, the first 32 of the epoch's order;
    a rank resumed mid-epoch continues its share. (Dropping each rank's incomplete micro-batch instead
    kept 44 samples at micro-batch 4 and 40 at 8: the samples of an epoch depended on the split.)"""
    from jobspec.data.loaders import TensorDictDataset, epoch_samples

    dataset = TensorDictDataset({"input_ids": torch.zeros(46, 2, dtype=torch.long), "labels": torch.arange(46)})
    assert epoch_samples(46, 16) == 32

    def steps(micro: int, world: int, epoch: int) -> list[set]:
        accumulation = 16 // (micro * world)
        per_rank = [[[int(x) for x in batch["labels"]] for batch in make_loader(
            dataset, micro_batch_size=micro, rank=rank, world_size=world, seed=5, epoch=epoch, shuffle=True,
            num_workers=0, pin_memory=False, global_batch_size=16)] for rank in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1      # every rank takes the same steps
        assert len(per_rank[0]) % accumulation == 0                   # an epoch ends where a step ends
        return [{x for batches in per_rank for batch in batches[k * accumulation:(k + 1) * accumulation]
                 for x in batch} for k in range(len(per_rank[0]) // accumulation)]

    for epoch in (0, 1):
        reference = steps(16, 1, epoch)
        assert [len(s) for s in reference] == [16, 16]
        for micro, world in [(8, 1), (4, 1), (2, 1), (8, 2), (4, 2), (2, 2), (2, 4), (1, 4)]:
            assert steps(micro, world, epoch) == reference, (micro, world, epoch)
    assert steps(4, 1, 0) != steps(4, 1, 1)   # reshuffled: another 32 of the 46 samples
    rank1 = _order(dataset, rank=1, world_size=2, seed=5, epoch=0, global_batch_size=12)
    assert len(rank1) == 18   # 36 = 3 global batches of 12, 18 per rank
    assert _order(dataset, rank=1, world_size=2, seed=5, epoch=0, global_batch_size=12, skip_batches=2) == rank1[6:]
