"""jobspec.spec.flops against torch's own FLOP counter on real forward + backward passes.

Each case builds the model the worker trains (jobspec.model.build.build_model, eager attention), runs one
forward + backward under torch.utils.flop_counter.FlopCounterMode, which counts matrix products
only, and compares FLOPs per token with `training_flops`. The shapes are tiny but keep the real
models' proportions where a term depends on them: XLM-R's vocabulary is 250 x its hidden size
(the embedding that the old 6N formula charged for), sequences are half the hidden size or more
(attention scores), llama has 4 query heads per KV head. Where a term is small at real sizes, a case
makes it visible: one BERT case has few tokens and many labels (the first-token pooler and classifier
are ~7% of the total), the small-vocabulary MLM cases make the head's transform dense ~10%.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from jobspec.model.build import build_model
from jobspec.spec.model_dims import model_dims
from jobspec.spec.flops import TrainingFlops, checkpointed_layers, training_flops

# The acceptance bound of issue 10 is 5%. The formula counts exactly the products the counter
# counts, so the tests hold it to 1%, tight enough to catch a missing pooler or classifier.
TOLERANCE = 0.01
BATCH = 2

XLMR = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 8000, "max_position_embeddings": 40}
BERT = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 192,
        "vocab_size": 3000, "max_position_embeddings": 40}
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 2000, "n_positions": 64}
LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 172, "vocab_size": 2000, "max_position_embeddings": 64,
         "tie_word_embeddings": False}

CASES = [
    # (id, architecture, task, num_labels, config, seq_len)
    ("xlmr-mlm", "xlm-roberta", "masked-lm", 2, XLMR, 16),
    ("xlmr-cls", "xlm-roberta", "sequence-classification", 3, XLMR, 16),
    ("bert-cls", "bert", "sequence-classification", 2, BERT, 32),
    ("bert-cls-pooler", "bert", "sequence-classification", 40,
     {**BERT, "num_hidden_layers": 1, "intermediate_size": 48}, 4),
    ("bert-tokens", "bert", "token-classification", 5, BERT, 32),
    # a small vocabulary, so that the MLM head's transform dense (2h^2) is ~10% of the total
    ("bert-mlm", "bert", "masked-lm", 2, {**BERT, "num_hidden_layers": 1, "vocab_size": 100}, 16),
    ("deberta-mlm", "deberta-v2", "masked-lm", 2,
     {**BERT, "num_hidden_layers": 1, "vocab_size": 100, "relative_attention": False}, 16),
    ("deberta-cls", "deberta-v2", "sequence-classification", 2, {**BERT, "relative_attention": False}, 16),
    ("distilbert-cls", "distilbert", "sequence-classification", 2,
     {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 96, "vocab_size": 1000,
      "max_position_embeddings": 40}, 16),
    ("distilbert-mlm", "distilbert", "masked-lm", 2,
     {"dim": 32, "n_layers": 1, "n_heads": 4, "hidden_dim": 96, "vocab_size": 100,
      "max_position_embeddings": 40}, 16),
    ("gpt2-causal", "gpt2", "causal-lm", 2, GPT2, 32),
    ("gpt2-cls", "gpt2", "sequence-classification", 4, {**GPT2, "pad_token_id": 0}, 32),
    ("llama-causal", "llama", "causal-lm", 2, LLAMA, 32),
    ("llama-cls", "llama", "sequence-classification", 3, {**LLAMA, "pad_token_id": 0}, 32),
    ("mistral-causal", "mistral", "causal-lm", 2, {**LLAMA, "sliding_window": None}, 32),
    ("mlp-cls", "mlp", "sequence-classification", 3,
     {"hidden_size": 64, "num_layers": 3, "vocab_size": 500}, 16),
]


def spec_for(architecture: str, task: str, num_labels: int, config: dict, checkpointing=False) -> dict:
    return {"model": {"architecture": architecture, "task": task, "num_labels": num_labels,
                      "config": dict(config), "attention": "eager"},
            "memory": {"activation_checkpointing": checkpointing},
            "training": {"seed": 0}, "data": {}}


def counted_flops_per_token(model, task: str, num_labels: int, vocab: int, seq_len: int) -> float:
    """FlopCounterMode's total for one training forward + backward, divided by the tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (BATCH, seq_len), generator=generator)
    if task == "sequence-classification":
        labels = torch.randint(0, num_labels, (BATCH,), generator=generator)
    elif task == "token-classification":
        labels = torch.randint(0, num_labels, (BATCH, seq_len), generator=generator)
    else:
        labels = ids.clone()
    model.train()
    with FlopCounterMode(display=False) as counter:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
    return counter.get_total_flops() / (BATCH * seq_len)


def predicted(spec: dict, seq_len: int) -> TrainingFlops:
    dims = model_dims(spec)
    return training_flops(dims, task=spec["model"]["task"], num_labels=spec["model"]["num_labels"],
                          seq_len=seq_len, activation_checkpointing=spec["memory"]["activation_checkpointing"])


@pytest.mark.parametrize("architecture, task, num_labels, config, seq_len",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_model_flops_match_torch_flop_counter(architecture, task, num_labels, config, seq_len):
    spec = spec_for(architecture, task, num_labels, config)
    model = build_model(spec)
    counted = counted_flops_per_token(model, task, num_labels, model.config.vocab_size, seq_len)
    flops = predicted(spec, seq_len)
    assert flops.model_flops_per_token == pytest.approx(counted, rel=TOLERANCE)
    assert flops.hardware_flops_per_token == flops.model_flops_per_token   # nothing recomputed


@pytest.mark.parametrize("architecture, task, config, every_n_layers, reentrant", [
    # transformers' gradient_checkpointing_enable; torch's early stop skips the down projection
    ("llama", "causal-lm", {**LLAMA, "num_hidden_layers": 3}, 1, False),
    ("llama", "causal-lm", {**LLAMA, "num_hidden_layers": 3}, 1, True),    # reentrant: the whole layer
    ("llama", "causal-lm", {**LLAMA, "num_hidden_layers": 3}, 2, False),   # jobspec's one-in-k patch
    ("gpt2", "causal-lm", {**GPT2, "n_layer": 3}, 1, False),               # resid dropout: the whole layer
    ("bert", "sequence-classification", {**BERT, "num_hidden_layers": 3}, 2, False),   # layers 0 and 2
    ("mlp", "sequence-classification", {"hidden_size": 64, "num_layers": 4, "vocab_size": 500}, 3, False),
])
def test_recompute_counts_in_hardware_flops_only(architecture, task, config, every_n_layers, reentrant):
    from jobspec.train.patches import gradient_checkpointing

    num_labels, seq_len = 2, 32
    setting = {"every_n_layers": every_n_layers, "use_reentrant": reentrant}
    spec = spec_for(architecture, task, num_labels, config, checkpointing=setting)
    model = build_model(spec)
    gradient_checkpointing(model, every_n_layers=every_n_layers, use_reentrant=reentrant)
    counted = counted_flops_per_token(model, task, num_labels, model.config.vocab_size, seq_len)
    flops = predicted(spec, seq_len)
    assert flops.hardware_flops_per_token == pytest.approx(counted, rel=TOLERANCE)
    assert flops.model_flops_per_token == predicted(spec_for(architecture, task, num_labels, config), seq_len) \
        .model_flops_per_token
    assert flops.hardware_flops_per_token > flops.model_flops_per_token * 1.05


def test_embedding_lookups_cost_nothing_and_the_lm_head_counts_tied_or_not():
    base = {**XLMR, "vocab_size": 1000}
    cls = [predicted(spec_for("xlm-roberta", "sequence-classification", 2, {**base, "vocab_size": v}), 16)
           for v in (1000, 250_000)]
    assert cls[0] == cls[1]     # the vocabulary only feeds a lookup
    tied, untied = (predicted(spec_for("llama", "causal-lm", 2, {**LLAMA, "tie_word_embeddings": t}), 32)
                    for t in (True, False))
    assert tied == untied
    grow = predicted(spec_for("llama", "causal-lm", 2, {**LLAMA, "vocab_size": 3000}), 32).model_flops_per_token
    assert grow - untied.model_flops_per_token == 3 * 2 * LLAMA["hidden_size"] * 1000


def test_checkpointed_layers_follow_the_spec_setting():
    assert [checkpointed_layers(24, s) for s in (False, None, True, {}, {"every_n_layers": 1},
                                                   {"every_n_layers": 5, "use_reentrant": True})] \
        == [0, 0, 24, 24, 24, 5]


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "t5"}, "no FLOPs model"),
    ({"num_layers": None}, "num_layers"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unusable_dimensions_are_a_value_error(change, needle):
    import dataclasses

    dims = dataclasses.replace(model_dims(spec_for("gpt2", "causal-lm", 2, GPT2)), **change)
    with pytest.raises(ValueError, match=needle):
        training_flops(dims, task="causal-lm", num_labels=2, seq_len=8)


def test_plan_json_reports_the_compute_of_the_job_as_torch_counts_it(capsys):
    """`jobspec plan --format json` on jobs/xlmr-large.yaml (seq 512, checkpointing on) against the
    counter on the real-size model, built on the meta device (shapes only, no memory)."""
    import json
    from pathlib import Path

    from jobspec.cli import main
    from jobspec.compile.compiler import compile_patches
    from jobspec.train.patches import gradient_checkpointing
    from jobspec.spec.validation import load_and_validate

    job = Path(__file__).resolve().parents[2] / "jobs" / "xlmr-large.yaml"
    assert main(["plan", str(job), "--format", "json"]) == 0
    compute = json.loads(capsys.readouterr().out)["plan"]["compute"]
    spec = load_and_validate(job).spec
    seq_len, setting = spec["data"]["synthetic"]["seq_len"], spec["memory"]["activation_checkpointing"]
    assert setting and seq_len == 512

    with torch.device("meta"):
        model = build_model({**spec, "model": {**spec["model"], "attention": "eager"}})
    patch = next(p for p in compile_patches(spec) if p["name"] == "gradient_checkpointing")   # as the worker
    gradient_checkpointing(model, **patch["args"])
    model.train()
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        # no attention mask: transformers would look for padding in it with .item(), which meta cannot do
        model(input_ids=ids, labels=torch.zeros(1, dtype=torch.long, device="meta")).loss.backward()
    counted = counter.get_total_flops() / seq_len
    assert compute["hardware_flops_per_token"] == pytest.approx(counted, rel=TOLERANCE)
    assert compute["model_flops_per_token"] < compute["hardware_flops_per_token"]

    assert main(["plan", str(job), "--format", "json", "--set", "memory.activation_checkpointing=false"]) == 0
    unchecked = json.loads(capsys.readouterr().out)["plan"]["compute"]
    assert unchecked["hardware_flops_per_token"] == unchecked["model_flops_per_token"] == \
        compute["model_flops_per_token"]
