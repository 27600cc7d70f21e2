"""The attention mask a batch hands the model (jobspec/model/padding_mask.py), and the trace's GPU
stand-ins for what transformers and torch decide on a GPU (model/kernels.py): no causal mask without
padding, CUDA's one-byte dropout mask."""
from __future__ import annotations

import torch
import transformers

from jobspec.model.kernels import dropout_stand_in
from jobspec.model.padding_mask import NO_MASK, PACKED, PADDING, model_inputs, trace_mask
from jobspec.model.planner_trace import ModelTracer
from jobspec.model.step import step_inputs
from jobspec.spec.schema import fill_defaults

IDS = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])


def _batch(mask) -> dict:
    return {"input_ids": IDS, "attention_mask": torch.tensor(mask), "labels": IDS}


def test_an_all_ones_mask_is_dropped_for_every_model():
    for causal in (True, False):
        assert "attention_mask" not in model_inputs(_batch([[1, 1, 1, 1], [1, 1, 1, 1]]), causal)


def test_a_right_padded_mask_is_dropped_for_a_causal_lm_only():
    right = _batch([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert "attention_mask" not in model_inputs(right, causal=True)
    assert model_inputs(right, causal=False) is right


def test_a_left_padded_mask_is_kept():
    left = _batch([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert model_inputs(left, causal=True) is left


def test_dropping_a_causal_lms_right_padding_mask_changes_no_loss_and_no_gradient():
    """Pads at a row's end are after every real token (causal attention never sees them) and their
    labels are -100: the loss and every gradient are those of the masked batch."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    for attention in ("eager", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        labels = IDS.masked_fill(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]) == 0, -100)
        batch = {**_batch([[1, 1, 1, 1], [1, 1, 0, 0]]), "labels": labels}
        results = []
        for inputs in (batch, model_inputs(batch, causal=True)):
            model.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert "attention_mask" not in model_inputs(batch, causal=True)
        torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
        for masked, unmasked in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(masked, unmasked, rtol=1e-5, atol=1e-6)


def test_the_trace_hands_the_model_a_mask_exactly_when_the_ranks_do():
    assert trace_mask(causal=True, fixed_length=False, packed=False) == NO_MASK
    assert trace_mask(causal=False, fixed_length=True, packed=False) == NO_MASK
    assert trace_mask(causal=False, fixed_length=False, packed=False) == PADDING
    assert trace_mask(causal=True, fixed_length=False, packed=True) == PACKED
    bert = fill_defaults({"model": {"architecture": "bert", "task": "sequence-classification"},
                          "data": {"train_file": "x.jsonl"}})
    assert "attention_mask" in step_inputs(bert, None, 2, 8)
    synthetic = fill_defaults({"model": {"architecture": "bert", "task": "sequence-classification"},
                               "data": {"synthetic": {"seq_len": 8}}})
    assert "attention_mask" not in step_inputs(synthetic, None, 2, 8)


def _llama_tracer() -> ModelTracer:
    spec = fill_defaults({"model": {"architecture": "llama", "task": "causal-lm", "attention": "sdpa", "config": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 8192}},
        "data": {"synthetic": {"seq_len": 64}}, "training": {"micro_batch_size": 1},
        "memory": {"precision": "bf16", "activation_checkpointing": False}})
    return ModelTracer(spec)


def test_a_causal_lm_without_padding_keeps_nothing_of_the_sequence_squared():
    """On a GPU transformers skips the causal mask (sdpa's is_causal, the flash kernel): the trace's
    activations grow linearly with the sequence; a materialised [s, s] mask would quadruple them."""
    tracer = _llama_tracer()
    short = tracer.profile("bf16", 1, 2048, False).activations.peak
    long = tracer.profile("bf16", 1, 4096, False).activations.peak
    assert 1.9 < long / short < 2.05, long / short


def test_the_traced_dropout_keeps_the_gpus_one_byte_mask():
    """CUDA's fused dropout saves a boolean mask for the backward; torch's CPU dropout multiplies by a
    mask in the input's dtype. Under the stand-in, what autograd saves is the boolean mask."""
    saved: list = []
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with dropout_stand_in():
            y = torch.nn.functional.dropout(x, 0.1, training=True)
    assert [t.dtype for t in saved] == [torch.bool]
    y.sum().backward()
    kept = y.detach() != 0
    torch.testing.assert_close(x.grad, kept.float() / 0.9)
    assert torch.nn.functional.dropout(x, 0.1, training=False) is x
