"""The patch registry: names agree with the compiler, each patch does what it says."""
from __future__ import annotations

import copy

import pytest
import torch

from jobspec.errors import SpecError
from jobspec.optimizers import deepspeed_built
from jobspec.model.structure import checkpoint_every_nth_layer, find_layer_stack
from jobspec.compile.compiler import compile_patches
from jobspec.train.patches import PATCHES, apply_patches, build_client_optimizer, client_optimizer
from jobspec.spec.schema import enum_values, fill_defaults

NUM_LAYERS = 4
TINY = {
    "bert": dict(hidden_size=32, num_hidden_layers=NUM_LAYERS, num_attention_heads=2, intermediate_size=64,
                 vocab_size=200, max_position_embeddings=64, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    "xlm-roberta": dict(hidden_size=32, num_hidden_layers=NUM_LAYERS, num_attention_heads=2, intermediate_size=64,
                        vocab_size=200, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0),
    "gpt2": dict(n_embd=32, n_layer=NUM_LAYERS, n_head=2, vocab_size=200, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
}


def tiny_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(arch, num_labels=3, pad_token_id=0, **{**TINY[arch], **overrides})
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def tiny_batch(seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}


def test_registry_names_are_the_compilers():
    assert set(PATCHES) == {"attention_implementation", "gradient_checkpointing", "tf32", "freeze",
                            "parameter_groups", "lora", "torch_compile", "tiled_loss", "tiled_mlp",
                            "activation_offload", "fused_kernels"}
    # and exactly what the compiler emits with every technique on (the optimizer is no patch)
    spec = fill_defaults({"model": {"architecture": "bert", "freeze": ["embeddings.*"], "compile": True, "lora": {},
                                    "kernels": "liger"},
                          "memory": {"tf32": True, "tiled_mlp": True, "tiled_loss": True,
                                     "activation_checkpointing": {"offload": "cpu"}},
                          "training": {"optimizer": {"name": "adafactor", "weight_decay": 0.1}}})
    spec["model"]["lora"] = fill_defaults({"model": {"lora": {}}})["model"]["lora"]
    assert {p["name"] for p in compile_patches(spec)} == set(PATCHES)


def test_every_schema_optimizer_is_built_somewhere():
    model = tiny_model("bert")
    for name in enum_values(("training", "optimizer", "name")):
        if name == "adamw_8bit":
            pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
        section = fill_defaults({"training": {"optimizer": {"name": name, "lr": 1e-3}}})["training"]["optimizer"]
        optimizer = client_optimizer(model, section, [])   # the ranks' call (train/engine.build_engine)
        if name in deepspeed_built():
            assert optimizer is None
        else:
            assert isinstance(optimizer, torch.optim.Optimizer), name


def _recomputed_layers(model, batch) -> list[int]:
    """Indices of layers whose forward runs again during backward (hooks on each layer's first child,
    which sits inside the checkpointed region whichever way the layer is wrapped)."""
    calls: list[int] = []
    for index, layer in enumerate(find_layer_stack(model)):
        first_child = next(layer.children())
        first_child.register_forward_pre_hook(lambda *_, i=index: calls.append(i))
    loss = model(**batch).loss
    forward_calls = len(calls)
    loss.backward()
    return calls[forward_calls:]


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "gpt2"])
@pytest.mark.parametrize("native", [True, False], ids=["transformers", "own-wrapper"])
def test_checkpointing_every_k_layers_recomputes_only_those(arch, native):
    recomputed = {}
    for k in (1, 2, 3):
        model = tiny_model(arch)
        model.train()
        if native:
            apply_patches(model, [{"name": "gradient_checkpointing", "args": {"every_n_layers": k}}])
        else:
            assert checkpoint_every_nth_layer(model, k) == len(range(0, NUM_LAYERS, k))
        recomputed[k] = sorted(_recomputed_layers(model, tiny_batch()))
    assert recomputed[1] == [0, 1, 2, 3]
    assert recomputed[2] == [0, 2]                  # half of k=1
    assert recomputed[3] == [0, 3]
    # without the patch nothing runs twice
    plain = tiny_model(arch)
    plain.train()
    assert _recomputed_layers(plain, tiny_batch()) == []


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("native", [True, False], ids=["transformers", "own-wrapper"])
def test_checkpointing_keeps_loss_and_gradients(arch, use_reentrant, native):
    reference = tiny_model(arch)
    patched = copy.deepcopy(reference)
    reference.train()
    patched.train()
    if native:
        apply_patches(patched, [{"name": "gradient_checkpointing",
                                 "args": {"every_n_layers": 2, "use_reentrant": use_reentrant}}])
    else:
        checkpoint_every_nth_layer(patched, 2, use_reentrant=use_reentrant)
    batch = tiny_batch()
    ref_loss, loss = reference(**batch).loss, patched(**batch).loss
    ref_loss.backward()
    loss.backward()
    # the same process, code and inputs: the recomputed forward repeats the first one op for op (dropout
    # from the restored RNG state) and each backward op sees the same operands, so the loss and gradients
    # are bit-equal (were allclose, atol 1e-6); a layer recomputed without the RNG state or skipped in
    # the backward differs at the dropout rate's scale
    assert torch.equal(loss, ref_loss)
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), patched.named_parameters()):
        assert p.grad is not None, name
        assert torch.equal(p.grad, p_ref.grad), (name, (p.grad - p_ref.grad).abs().max())


def test_checkpointing_refuses_a_model_without_layers():
    with pytest.raises(SpecError, match="no transformer layer stack"):
        checkpoint_every_nth_layer(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)


def test_freeze_by_pattern_and_error_on_no_match():
    model = tiny_model("bert")
    _, notes = apply_patches(model, [{"name": "freeze", "args": {"patterns": ["embeddings.*", "*.0.attention.*"]}}])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".embeddings." in n or ".layer.0.attention." in n for n in frozen)
    assert "bert.embeddings.word_embeddings.weight" in frozen
    assert "bert.encoder.layer.1.attention.self.query.weight" not in frozen
    assert any(note.startswith("freeze:") for note in notes)
    with pytest.raises(SpecError) as err:
        apply_patches(model, [{"name": "freeze", "args": {"patterns": ["embeddings.*", "decoder.*"]}}])
    assert err.value.issues[0].path == ("model", "freeze", 1)


def test_tf32_sets_the_backend_flags():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        apply_patches(torch.nn.Linear(2, 2), [{"name": "tf32", "args": {"enabled": True}}])
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_attention_patch_verifies_the_implementation():
    model = tiny_model("bert")
    _, notes = apply_patches(model, [{"name": "attention_implementation", "args": {"implementation": "sdpa"}}])
    assert notes == ["attention: sdpa"]
    apply_patches(model, [{"name": "attention_implementation", "args": {"implementation": "eager"}}])
    assert model.config._attn_implementation == "eager"
    with pytest.raises(SpecError) as err:
        apply_patches(model, [{"name": "attention_implementation",
                               "args": {"implementation": "flash_attention_2"}}])
    assert err.value.issues[0].path == ("model", "attention")


def test_apply_patches_skips_the_optimizer_and_rejects_unknown_names():
    model = tiny_model("bert")
    before = {n: p.clone() for n, p in model.named_parameters()}
    same, notes = apply_patches(model, [{"name": "parameter_groups", "args": {
        "weight_decay": 0.1, "no_decay": "biases and normalisation weights"}}])
    assert same is model and notes == []
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(SpecError, match="unknown patch"):
        apply_patches(model, [{"name": "fuse_everything", "args": {}}])
    with pytest.raises(SpecError, match="unknown patch"):   # the optimizer's no-op entry is gone
        apply_patches(model, [{"name": "client_optimizer", "args": {"name": "adafactor", "lr": 1.0}}])
    with pytest.raises(SpecError, match="bad arguments"):
        apply_patches(model, [{"name": "tf32", "args": {"enabeld": True}}])


def test_torch_compile_replaces_the_model():
    model = torch.nn.Linear(2, 2)
    compiled, notes = apply_patches(model, [{"name": "torch_compile", "args": {}}])
    assert compiled is not model and compiled._orig_mod is model
    assert notes and "torch.compile" in notes[0]


def test_weight_decay_skips_biases_and_norms():
    model = tiny_model("bert")
    optimizer = build_client_optimizer(model, {"name": "adafactor", "lr": 1e-3, "weight_decay": 0.1})
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    plain = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert "bert.encoder.layer.0.attention.self.query.weight" in decayed
    assert "bert.encoder.layer.0.attention.self.query.bias" in plain
    assert "bert.embeddings.LayerNorm.weight" in plain
    assert decayed | plain == set(names.values())


def test_adafactor_steps():
    model = tiny_model("bert")
    optimizer = build_client_optimizer(model, {"name": "adafactor", "lr": 1e-2})
    before = model.classifier.weight.clone()
    model(**tiny_batch()).loss.backward()
    optimizer.step()
    assert not torch.equal(before, model.classifier.weight)


def test_adamw_8bit_keeps_embeddings_in_32_bit():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    model = tiny_model("bert", intermediate_size=256)  # 32x256 > 4096 elements: bitsandbytes keeps 8-bit state
    optimizer = build_client_optimizer(model, {"name": "adamw_8bit", "lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                               "weight_decay": 0.0})   # what client_args writes
    model(**tiny_batch()).loss.backward()
    optimizer.step()
    embedding_state = optimizer.state[model.bert.embeddings.word_embeddings.weight]
    linear_state = optimizer.state[model.bert.encoder.layer[0].intermediate.dense.weight]
    assert embedding_state["state1"].dtype == torch.float32
    assert linear_state["state1"].dtype == torch.uint8
