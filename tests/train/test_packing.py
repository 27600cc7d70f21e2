"""`data.packing` (jobspec/data/sample_packing.py): the bins, the rows, and what the model makes of them.

The check that matters: a sample's logits packed between others (in a padded batch of packed rows, in
training mode, through the forward pre-hook) equal its logits alone, for sdpa and eager; with the
micro-batch flattened to one row (what flash attention gets) too; and for every family
jobspec.techniques.packing lists, on the installed transformers. Tiny models built from configs, CPU.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from fp_bounds import forward_bound, gamma

from jobspec.errors import SpecError
from jobspec.techniques import packing as packing_rules
from jobspec.data import sample_packing
from jobspec.data.loaders import PadCollator, TensorDictDataset
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.train.metrics import count_tokens

VOCAB = 300


def spec_of(attention="sdpa", packing_on=True, padding="longest", max_length=32) -> dict:
    return {"data": {"packing": packing_on, "max_length": max_length, "padding": padding},
            "model": {"attention": attention}, "training": {"seed": 7}}


def samples(lengths, seed=0, prompt=0) -> list[dict]:
    """Unpadded causal-lm samples; the first `prompt` labels of each are -100 (an answer-only loss)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def dataset(rows: list[dict]) -> TensorDictDataset:
    return TensorDictDataset({name: [row[name] for row in rows] for name in rows[0]}, pad_token_id=0)


LLAMA_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def tiny_llama(attention: str):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def alone_logits(model, sample: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=sample["input_ids"][None], use_cache=False).logits[0]


# ---- the bins --------------------------------------------------------------------------------------

def test_bins_hold_every_sample_once_within_max_length_deterministically():
    rng = random.Random(3)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = sample_packing.pack_order(lengths, 128, seed=11)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert bins == sample_packing.pack_order(lengths, 128, seed=11)
    # first-fit decreasing: within a few rows of the lower bound
    assert len(bins) <= sum(lengths) / 128 * 1.05 + 1


def test_the_seed_orders_equal_lengths_and_a_long_sample_gets_a_row_of_its_own():
    lengths = [4] * 12
    assert sample_packing.pack_order(lengths, 8, seed=1) != sample_packing.pack_order(lengths, 8, seed=2)
    bins = sample_packing.pack_order([200, 3, 5], 64, seed=0)
    assert [0] in bins and sorted(map(sorted, bins)) == [[0], [1, 2]]


# ---- the rows --------------------------------------------------------------------------------------

def test_a_row_restarts_positions_and_masks_each_first_label():
    a, b, c = samples([3, 4, 2])
    row = sample_packing.pack_rows([a, b, c])
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    assert row["input_ids"].tolist() == torch.cat([a["input_ids"], b["input_ids"], c["input_ids"]]).tolist()
    # the model trains position t on label t+1: A's last token must not learn B's first, etc.
    assert row["labels"].tolist() == [IGNORE_INDEX, *a["labels"][1:].tolist(), IGNORE_INDEX,
                                      *b["labels"][1:].tolist(), IGNORE_INDEX, *c["labels"][1:].tolist()]
    assert row["attention_mask"].tolist() == [1] * 9
    assert a["labels"][0] != IGNORE_INDEX   # the sample itself is untouched


def test_padded_samples_lose_their_padding_and_max_length_rows_are_padded_at_the_end():
    rows = samples([5, 9, 3, 7])
    padded = {name: torch.stack([torch.cat([r[name], torch.full((12 - len(r[name]),), fill)]) for r in rows])
              for name, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX))}
    source = TensorDictDataset(padded, pad_token_id=0)
    packed = sample_packing.pack_dataset(source, max_length=12, seed=0, pad_to=12)
    assert packed.columns["input_ids"].shape == (len(packed), 12)
    assert int(packed.columns["attention_mask"].sum()) == 24 == packed.packing.tokens
    assert packed.packing.samples == 4 and packed.packing.rows == 2 and packed.packing.fill == 1.0
    unpadded = sample_packing.pack_dataset(dataset(rows), max_length=12, seed=0)
    assert sorted(len(r) for r in unpadded.columns["input_ids"]) == [12, 12]
    assert "4 samples in 2 rows" in unpadded.packing.note()


def test_only_the_training_set_is_packed():
    train, evaluation = dataset(samples([4, 4, 4])), dataset(samples([4, 4]))
    packed, kept = sample_packing.pack_datasets(spec_of(max_length=8), train, evaluation)
    assert len(packed) == 2 and kept is evaluation
    assert sample_packing.pack_datasets(spec_of(packing_on=False), train, evaluation) == (train, evaluation)


def test_the_token_count_of_a_padded_packed_batch_is_its_real_tokens():
    packed = sample_packing.pack_dataset(dataset(samples([10, 7, 5, 12, 3])), max_length=16, seed=0)
    batch = PadCollator(0)([packed[i] for i in range(len(packed))])
    assert batch["position_ids"].shape == batch["input_ids"].shape
    assert count_tokens(batch) == 37 < batch["input_ids"].numel()


# ---- the model -------------------------------------------------------------------------------------

def packed_batch(rows: list[dict], max_length: int):
    packed = sample_packing.pack_dataset(dataset(rows), max_length=max_length, seed=5)
    return packed, PadCollator(0)([packed[i] for i in range(len(packed))])


def where_each_sample_is(packed, rows) -> list[tuple[int, int]]:
    """(row, start) of each sample in the packed rows, found by its ids."""
    found = []
    for sample in rows:
        ids = sample["input_ids"].tolist()
        for r in range(len(packed)):
            row = packed[r]["input_ids"].tolist()
            starts = [s for s in range(len(row) - len(ids) + 1) if row[s:s + len(ids)] == ids
                      and packed[r]["position_ids"][s] == 0]
            if starts:
                found.append((r, starts[0]))
                break
    assert len(found) == len(rows)
    return found


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_sample_packed_with_others_has_its_logits_alone(attention):
    rows = samples([9, 4, 13, 6, 2, 11, 7], seed=1)
    packed, batch = packed_batch(rows, max_length=24)
    assert len(packed) >= 2 and any(len(packed[i]["input_ids"]) < 24 for i in range(len(packed)))  # padded
    model = tiny_llama(attention)
    assert "packing" in sample_packing.prepare_model(model, spec_of(attention))
    model.train()   # as in training: config.use_cache is on, and the hook turns the cache off
    with torch.no_grad():
        logits = model(**batch).logits
    for sample, (r, start) in zip(rows, where_each_sample_is(packed, rows)):
        alone = alone_logits(model, sample)
        # the same model on the same tokens in another batch shape: only the sums' order/blocking differs
        # (was atol 1e-5, rtol 1e-4); a sample that saw another's tokens is off by ~1e-1 (the control below)
        bound = forward_bound(LLAMA_CONFIG, 24) * float(alone.abs().max())
        assert float((logits[r, start:start + len(sample["input_ids"])] - alone).abs().max()) <= bound


def test_without_the_hook_the_samples_would_see_each_other():
    """The negative control: the same batch with its attention mask (what the collator makes) mixes samples."""
    rows = samples([9, 6], seed=2)
    packed, batch = packed_batch(rows, max_length=16)
    model = tiny_llama("sdpa").eval()
    (r, start), = where_each_sample_is(packed, rows[1:])
    with torch.no_grad():
        logits = model(**batch).logits[r, start:start + 6]
    alone = alone_logits(model, rows[1])
    # the leak is far outside the rounding bound the packed tests hold (100x it)
    assert start > 0 and float((logits - alone).abs().max()) > 100 * forward_bound(LLAMA_CONFIG, 16) * float(
        alone.abs().max())


def test_flattened_to_one_row_as_for_flash_attention_the_samples_stay_apart():
    rows = samples([9, 4, 13, 6, 2, 11, 7], seed=3)
    packed, batch = packed_batch(rows, max_length=24)
    model = tiny_llama("sdpa")
    model.register_forward_pre_hook(sample_packing.packed_forward_hook(flatten=True), with_kwargs=True)
    model.train()
    with torch.no_grad():
        out = model(**batch)
    width = batch["input_ids"].shape[1]
    assert out.logits.shape[:2] == (1, batch["input_ids"].numel())
    for sample, (r, start) in zip(rows, where_each_sample_is(packed, rows)):
        at = r * width + start
        alone = alone_logits(model, sample)   # one row of all the tokens: the sums' order differs only
        bound = forward_bound(LLAMA_CONFIG, width) * float(alone.abs().max())   # was atol 1e-5, rtol 1e-4
        assert float((out.logits[0, at:at + len(sample["input_ids"])] - alone).abs().max()) <= bound


@pytest.mark.parametrize("flatten", [False, True])
def test_the_packed_loss_is_the_token_mean_of_the_samples_alone(flatten):
    rows = samples([9, 4, 13, 6, 2, 11, 7], seed=4, prompt=2)   # answer-only labels
    packed, batch = packed_batch(rows, max_length=24)
    model = tiny_llama("sdpa")
    model.register_forward_pre_hook(sample_packing.packed_forward_hook(flatten=flatten), with_kwargs=True)
    with torch.no_grad():
        packed_loss = model(**batch).loss
        total, count, scale = 0.0, 0, 0.0
        for sample in rows:
            logits = alone_logits(model, sample)
            scale = max(scale, float(logits.abs().max()))
            targets = sample["labels"][1:]
            keep = targets != IGNORE_INDEX
            total += float(torch.nn.functional.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum"))
            count += int(keep.sum())
    # cross entropy = logsumexp - logit moves by at most 2 max|d logit| (the forward bound), plus the token
    # mean's sum of `count` terms (was rel 1e-5); a token counted twice or left out moves it by ~loss/count
    reference = total / count
    bound = 2 * forward_bound(LLAMA_CONFIG, 24) * scale + gamma(count) * reference
    assert abs(float(packed_loss) - reference) <= bound


def test_unpacked_batches_pass_the_hook_untouched():
    hook = sample_packing.packed_forward_hook(flatten=True)
    kwargs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
    assert hook(None, (), kwargs) is None
    _, changed = hook(None, (), {**kwargs, "position_ids": torch.zeros(2, 3, dtype=torch.long)})
    assert "attention_mask" not in changed and changed["use_cache"] is False
    assert changed["input_ids"].shape == (1, 6)


def test_the_ranks_refuse_a_family_validation_could_not_see():
    from transformers import AutoModelForCausalLM, OPTConfig
    model = AutoModelForCausalLM.from_config(OPTConfig(hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                                       num_attention_heads=2, vocab_size=VOCAB,
                                                       word_embed_proj_dim=32))
    with pytest.raises(SpecError) as caught:
        sample_packing.prepare_model(model, spec_of())
    assert caught.value.issues[0].path == ("data", "packing") and "opt" in caught.value.issues[0].message
    assert sample_packing.prepare_model(model, spec_of(packing_on=False)) is None


# ---- every listed family, on the installed transformers ---------------------------------------------

def family_model(model_type: str, attention: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                  max_position_embeddings=128, head_dim=16, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    for name, value in (("num_experts", 4), ("num_local_experts", 4), ("num_experts_per_tok", 2),
                        ("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 32)):
        if hasattr(config, name):   # mixture-of-experts families: a few small experts
            setattr(config, name, value)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


@pytest.mark.parametrize("model_type", sorted(packing_rules.PACKED_FAMILIES))
def test_every_listed_family_keeps_packed_samples_apart(model_type):
    """sdpa and eager: the packed logits equal the alone ones; and the position ids reach the attention
    function, where flash attention reads them (checked with a registered pass-through attention)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen["position_ids"] = kwargs.get("position_ids")
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("jobspec_packing_probe", probe)
    generator = torch.Generator().manual_seed(1)
    first, second = (torch.randint(3, VOCAB, (n,), generator=generator) for n in (7, 5))
    ids = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attention in ("sdpa", "eager"):
            model = family_model(model_type, attention)
            with torch.no_grad():
                alone = model(input_ids=second[None], use_cache=False).logits[0]
                packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 7:]
            # another batch shape and position ids, the same tokens: rounding only (was atol 1e-4, rtol 1e-4)
            bound = forward_bound({**LLAMA_CONFIG, "head_dim": 16}, 12) * float(alone.abs().max())   # its sizes
            assert float((packed - alone).abs().max()) <= bound, (model_type, attention)
        with torch.no_grad():
            family_model(model_type, "jobspec_packing_probe")(input_ids=ids, position_ids=positions, use_cache=False)
    assert seen["position_ids"] is not None and seen["position_ids"].reshape(-1).tolist() == positions[0].tolist()
