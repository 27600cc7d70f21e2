"""`model.kernels: liger` on the model (jobspec/model/fused_kernels.py), Liger's kernels replaced
by their PyTorch references (model/kernel_reference.py): for every supported family the patched
model's loss and gradients are transformers' own to fp32 rounding, every kernel runs, the fused loss
is the one loss computed and reaches jobspec's token-weighted loss (train/token_loss) through the
ranks' patch code path, whatever the micro-batch split."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from fp_bounds import forward_bound, gamma

from jobspec.errors import SpecError
from jobspec.model.fused_kernels import (
    FAMILIES,
    KernelSet,
    apply_kernels,
    fused_kernels,
    reference_set,
    restore_rope,
)
from jobspec.techniques.fused_kernels import LIGER_FAMILIES, REFERENCE_ENV

CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 500,
          "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False}
FAMILY_CONFIG = {"gemma2": {"final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8,
                            "sliding_window": 16},
                 "phi3": {"partial_rotary_factor": 0.5}}
# Qwen3's q/k norms; Gemma 2's pre/post feed-forward norms
NORMS_PER_LAYER = {"qwen3": 4, "gemma2": 4}
SCALE = 0.37   # what the engine multiplies the loss by after the forward
SEQ = 40


@pytest.fixture(autouse=True)
def _transformers_rope_after_each_test():
    yield
    restore_rope()


def tiny(model_type: str, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    made = AutoConfig.for_model(model_type,
                                **{**CONFIG, **FAMILY_CONFIG.get(model_type, {}), **config})
    return AutoModelForCausalLM.from_config(made, attn_implementation="eager").float()


def batch_of(batch: int = 2, seq: int = SEQ):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (batch, seq), generator=generator)
    labels = ids.clone()
    labels[0, :11] = -100          # a prompt without loss
    labels[-1, seq - 7:] = -100    # padding
    return ids, labels


def counting(kernels: KernelSet) -> tuple[KernelSet, Counter]:
    """`kernels` with each call counted (and the rotary widths seen, as (cos, head) pairs)."""
    calls: Counter = Counter()

    def wrap(name, kernel):
        def call(*args):
            calls[name] += 1
            if name == "rope":
                calls[("rope width", args[2].shape[-1], args[0].shape[-1])] += 1
            return kernel(*args)
        return call

    wrapped = {f: wrap(f, getattr(kernels, f)) for f in KernelSet._fields[1:]}
    return kernels._replace(**wrapped), calls


def bound(seq: int = SEQ, tokens: int = 2 * SEQ) -> float:
    """Fused and plain runs compute the same products, blocked and summed in other orders."""
    return forward_bound(CONFIG, seq) + gamma(tokens)


def assert_close(a, b, rel: float | None = None):
    a, b = a.detach(), b.detach()
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= (bound() if rel is None else rel) * scale, (a, b)


def loss_and_grads(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    (out.loss * SCALE).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_families_are_validations_list():
    assert set(FAMILIES) == set(LIGER_FAMILIES)


def plain_run(model, ids, labels):
    """transformers' loss, gradients, evaluation loss and logits, before any kernel is applied (the
    rotary embedding is patched module-wide)."""
    out, grads = loss_and_grads(model, ids, labels)
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids, labels=labels).loss, model(input_ids=ids).logits
    return out, grads, evaluated


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_fused_model_trains_as_transformers_model(model_type):
    plain = tiny(model_type)
    fused = copy.deepcopy(plain)
    ids, labels = batch_of()
    expected, expected_grads, (eval_loss, logits) = plain_run(plain, ids, labels)
    kernels, calls = counting(reference_set())
    note = apply_kernels(fused, kernels, fused_loss=True)
    got, grads = loss_and_grads(fused, ids, labels)
    layers = CONFIG["num_hidden_layers"]
    norms = NORMS_PER_LAYER.get(model_type, 2) * layers + 1
    # every kernel ran (the backward recomputes nothing): the norms, a rotary and an MLP per layer,
    # one loss
    gated = "gelu_mul" if FAMILIES[model_type].mlp == "geglu" else "silu_mul"
    assert {k: v for k, v in calls.items() if isinstance(k, str)} == {
        "rms_norm": norms, gated: layers, "rope": layers, "linear_cross_entropy": 1}
    assert f"RMSNorm ({norms} modules)" in note and "fused linear cross-entropy" in note
    if model_type == "phi3":   # partial rotary: half of each head rotated
        assert calls[("rope width", 4, 8)] == layers
    counted = int((labels[:, 1:] != -100).sum())
    assert int(got.loss_tokens) == counted
    assert_close(got.loss, expected.loss)
    assert_close(got.loss_sum, expected.loss * counted)
    assert got.get("logits") is None   # the fused loss is the one computed: no logits, no HF loss
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name])
    fused.eval()
    with torch.no_grad():   # evaluation: the same loss, no gradients made
        assert_close(fused(input_ids=ids, labels=labels).loss, eval_loss)
        assert_close(fused(input_ids=ids).logits, logits)   # generation's: no labels, the logits


def test_a_wrong_kernel_is_seen():
    """The comparison above tells a kernel that is off from one that is right: the rotary embedding
    skipped moves the loss and gradients far past the rounding bound."""
    plain = tiny("llama")
    fused = copy.deepcopy(plain)
    ids, labels = batch_of()
    _, expected_grads = loss_and_grads(plain, ids, labels)
    unrotated = reference_set()._replace(rope=lambda q, k, cos, sin: (q, k))
    apply_kernels(fused, unrotated, fused_loss=True)
    _, grads = loss_and_grads(fused, ids, labels)
    name = "model.layers.0.self_attn.q_proj.weight"
    error = float((grads[name] - expected_grads[name]).abs().max())
    assert error > 100 * bound() * float(expected_grads[name].abs().max())


def test_the_ranks_patch_routes_one_token_weighted_loss(monkeypatch):
    """The ranks' path: the compiled `fused_kernels` patch (train/patches.apply_patches), the
    model's summed loss (train/token_loss.summed_loss) back-propagated over the global batch's
    labelled tokens:
    any split of the global batch into micro-batches gives transformers' token-weighted loss and its
    gradients (the plain model through the same path), to fp32 rounding."""
    from jobspec import tasks
    from jobspec.compile.compiler import compile_patches
    from jobspec.spec.schema import fill_defaults
    from jobspec.train import token_loss
    from jobspec.train.patches import apply_patches

    model = {"architecture": "llama", "task": "causal-lm", "kernels": "liger", "config": CONFIG}
    spec = fill_defaults({"model": model, "training": {}, "data": {}, "memory": {}})
    patches = [p for p in compile_patches(spec) if p["name"] == "fused_kernels"]
    assert patches == [{"name": "fused_kernels", "args": {"kernels": "liger", "fused_loss": True}}]
    task = tasks.get("causal-lm")
    ids, labels = batch_of(batch=4)
    labels[2, :30] = -100   # micro-batches of unequal labelled tokens

    def step(model, split):
        model.zero_grad()
        tokens = token_loss.labelled_count(task, labels)
        total = 0.0
        for part in torch.split(torch.arange(4), split):
            out = model(input_ids=ids[part], labels=labels[part])
            summed = token_loss.summed_loss(task, out, labels[part])
            (summed * token_loss.backward_scale(tokens, 1)).backward()
            total += float(summed.detach()) / tokens
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = tiny("llama")
    fused = copy.deepcopy(plain)
    whole, whole_grads = step(plain, [4])   # before the patch: the rotary one is module-wide
    monkeypatch.setenv(REFERENCE_ENV, "1")
    fused, notes = apply_patches(fused, patches)
    assert notes and "PyTorch reference" in notes[0]
    for split in ([4], [1, 3], [2, 1, 1]):
        loss, grads = step(fused, split)
        assert abs(loss - whole) <= bound(tokens=4 * SEQ) * abs(whole), (split, loss, whole)
        for name, grad in grads.items():
            assert_close(grad, whole_grads[name], rel=bound(tokens=4 * SEQ))


def test_without_cuda_or_the_hook_a_rank_refuses(monkeypatch):
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecError) as caught:
        fused_kernels(tiny("llama"), "liger", True)
    issue = caught.value.issues[0]
    assert issue.path == ("model", "kernels") and "CUDA" in issue.message


def test_a_type_validation_could_not_read_is_refused_where_the_model_is_built():
    with pytest.raises(SpecError) as caught:
        apply_kernels(tiny("gpt2", n_layer=2, n_embd=32, n_head=4), reference_set(),
                      fused_loss=True)
    issue = caught.value.issues[0]
    assert issue.path == ("model", "kernels")
    assert "'gpt2'" in issue.message and "llama" in issue.message


def test_lora_adapters_on_the_fused_model_and_a_frozen_base_whose_head_trains():
    from jobspec.model.lora import apply_lora
    from jobspec.spec.schema import fill_defaults

    def lora(targets):
        adapters = {"r": 4, "dropout": 0.0, "target_modules": targets}
        model = {"architecture": "llama", "task": "causal-lm", "config": CONFIG, "lora": adapters}
        return fill_defaults({"model": model, "training": {}, "data": {}, "memory": {}})

    ids, labels = batch_of()
    base = tiny("llama")
    fused = copy.deepcopy(base)
    plain = apply_lora(base, lora("all-linear"))
    expected, expected_grads = loss_and_grads(plain, ids, labels)
    apply_kernels(fused, reference_set(), fused_loss=True)   # the compiled order: kernels, LoRA
    fused = apply_lora(fused, lora("all-linear"))
    with torch.no_grad():   # the plain model's adapters (PEFT initialises them at random)
        for (name, a), (other, b) in zip(plain.named_parameters(), fused.named_parameters()):
            assert name == other
            b.copy_(a)
    got, grads = loss_and_grads(fused, ids, labels)
    assert_close(got.loss, expected.loss)
    assert grads and all("lora" in name for name in grads)
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name])
    # the head under LoRA: the fused loss would read the base weight and skip the adapter
    wrapped = tiny("llama")
    apply_kernels(wrapped, reference_set(), fused_loss=True)
    wrapped = apply_lora(wrapped, lora(["lm_head"]))
    with pytest.raises(SpecError, match="output projection"):
        wrapped(input_ids=ids, labels=labels)
    # a frozen base whose head trains: the head's gradient still comes (the kernel needs an input
    # that wants a gradient to make the weight's)
    restore_rope()
    plain, fused = tiny("llama"), tiny("llama")
    for model in (plain, fused):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.startswith("lm_head"))
    _, expected_grads = loss_and_grads(plain, ids, labels)
    apply_kernels(fused, reference_set(), fused_loss=True)
    _, grads = loss_and_grads(fused, ids, labels)
    assert set(grads) == {"lm_head.weight"}
    assert_close(grads["lm_head.weight"], expected_grads["lm_head.weight"])


def test_the_rotary_patch_is_module_wide_and_restored():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    apply_kernels(tiny("llama"), reference_set(), fused_loss=False)
    assert modeling_llama.apply_rotary_pos_emb is not original
    restore_rope()
    assert modeling_llama.apply_rotary_pos_emb is original


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels run on CUDA GPUs")
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_ligers_kernels_train_as_transformers_model_on_a_gpu(model_type):
    """The same comparison with Liger's own Triton kernels (a CUDA GPU and the `gpu` extra)."""
    pytest.importorskip("liger_kernel")
    from jobspec.model.fused_kernels import liger_set

    plain = tiny(model_type).cuda()
    fused = copy.deepcopy(plain)
    ids, labels = (t.cuda() for t in batch_of())
    expected, expected_grads = loss_and_grads(plain, ids, labels)
    apply_kernels(fused, liger_set(), fused_loss=True)
    got, grads = loss_and_grads(fused, ids, labels)
    assert_close(got.loss, expected.loss)
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name])
