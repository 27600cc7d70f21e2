"""model/materialize.py: a meta-device skeleton made real module by module, drawn by the model's own
`_init_weights`. Against transformers' `from_config` (the distribution of every tensor, the buffers)
and `initialize_weights` (the same draws in the same order), with ties kept; a Llama and an
XLM-R (BERT-like: position ids, a decoder tied to the embedding and to the head's bias)."""
from __future__ import annotations

import math

import pytest
import torch

from jobspec.model.materialize import materialize, skeleton

LLAMA = ("llama", "AutoModelForCausalLM",
         {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64})
XLMR = ("xlm-roberta", "AutoModelForMaskedLM",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 256, "max_position_embeddings": 66})
SHAPES = [LLAMA, XLMR, (*LLAMA[:2], {**LLAMA[2], "tie_word_embeddings": True})]
IDS = ["llama", "xlmr", "llama-tied"]


def parts(shape):
    import transformers

    kind, auto, config = shape
    return getattr(transformers, auto), transformers.AutoConfig.for_model(kind, **config)


def made(shape, seed: int, dtype=torch.float32, replace=None):
    auto, config = parts(shape)
    torch.manual_seed(seed)
    return materialize(skeleton(auto, config, dtype=dtype), "cpu", replace)


def from_config(shape, seed: int, dtype=torch.float32):
    auto, config = parts(shape)
    torch.manual_seed(seed)
    return auto.from_config(config, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_every_tensor_is_drawn_from_from_configs_distribution(shape):
    """Per tensor, mean and std against `from_config`'s within sampling error (two samples of n
    values from N(0, s): their means differ by s*sqrt(2/n) and their stds by s/sqrt(n), one standard
    error; 6 allowed). Constant tensors (norms, biases) and the buffers are equal."""
    ours, theirs = made(shape, seed=1), from_config(shape, seed=1)
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    assert set(ours_state) == set(their_state)
    for key, want in their_state.items():
        got = ours_state[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if not want.is_floating_point() or float(want.float().std()) == 0.0:
            assert torch.equal(got, want), key
            continue
        n, s = want.numel(), float(want.float().std())
        assert abs(float(got.float().mean()) - float(want.float().mean())) <= 6 * s * math.sqrt(2 / n), key
        assert abs(float(got.float().std()) - s) <= 6 * s / math.sqrt(n), key
    for key, buffer in theirs.named_buffers():   # rotary inv_freq, position_ids, token_type_ids
        assert torch.equal(dict(ours.named_buffers())[key], buffer), key


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_the_draws_are_transformers_initialize_weights_in_its_order(shape):
    """Module by module gives bit for bit what `initialize_weights` gives over the whole skeleton at
    once: the same functions, the same order of draws."""
    auto, config = parts(shape)
    whole = skeleton(auto, config).to_empty(device="cpu")
    whole.tie_weights()   # to_empty made the tied tensors twice
    torch.manual_seed(3)
    whole.initialize_weights()
    ours = made(shape, seed=3)
    for key, tensor in whole.state_dict().items():
        assert torch.equal(ours.state_dict()[key], tensor), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_seed_gives_the_same_weights_and_another_seed_others(dtype):
    first, again, other = (made(XLMR, seed, dtype).state_dict() for seed in (5, 5, 6))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["roberta.embeddings.word_embeddings.weight"],
                           other["roberta.embeddings.word_embeddings.weight"])
    assert {v.dtype for v in first.values() if v.is_floating_point()} == {dtype}


def test_nothing_is_left_on_meta_and_ties_are_kept():
    model = made(XLMR, seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    assert model.lm_head.decoder.bias is model.lm_head.bias
    tied = made(SHAPES[2], seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_the_skeleton_is_tied_so_that_a_tied_weight_is_made_once():
    """accelerate's meta context wraps every assigned parameter anew; the skeleton ties them again
    (else the 16-bit head of a tied 128k vocabulary would be drawn beside the embedding, then dropped)."""
    auto, config = parts(SHAPES[2])
    tied = skeleton(auto, config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    auto, config = parts(XLMR)
    xlmr = skeleton(auto, config)
    assert xlmr.lm_head.decoder.weight is xlmr.roberta.embeddings.word_embeddings.weight
    assert xlmr.lm_head.decoder.bias is xlmr.lm_head.bias


def test_replace_sees_each_module_once_made_and_only_one_at_a_time():
    """What `replace` returns stands in the module's place; when it is called, the modules it
    replaced before are already gone: a QLoRA build holds one 16-bit linear layer at a time."""
    seen: list[str] = []
    model_ref: list = []

    def replace(name, module):
        if type(module) is not torch.nn.Linear or name == "lm_head":
            return None
        assert not module.weight.is_meta and float(module.weight.std()) > 0
        seen.append(name)
        # every linear replaced earlier is an Identity now; this one is the only real one
        model = model_ref[0]
        live = [n for n in seen[:-1] if type(model.get_submodule(n)) is torch.nn.Linear]
        assert live == [], live
        return torch.nn.Identity()

    auto, config = parts(LLAMA)
    shell = skeleton(auto, config)
    model_ref.append(shell)
    torch.manual_seed(0)
    materialize(shell, "cpu", replace)
    assert len(seen) == 2 * 7   # q, k, v, o, gate, up, down per layer
    assert all(type(shell.get_submodule(n)) is torch.nn.Identity for n in seen)


def test_a_parameter_left_on_meta_is_an_error():
    """What the walk leaves on the meta device (here a replacement that was never made real) is
    refused by name, not handed to training."""
    auto, config = parts(LLAMA)

    def unmade(name, module):
        return torch.nn.Linear(64, 64, device="meta") if name == "model.layers.1.mlp.up_proj" else None

    with pytest.raises(RuntimeError, match=r"left on the meta device.*model\.layers\.1\.mlp\.up_proj"):
        materialize(skeleton(auto, config), "cpu", unmade)
