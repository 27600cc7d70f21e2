"""The planner's stand-ins for Liger's kernels (jobspec/model/kernel_stand_ins.py) keep what the
kernels keep: each keeps the tensors its PyTorch reference (model/kernel_reference.py, written after
Liger's `ctx.save_for_backward`) keeps, and Liger's own Function where a CUDA GPU and liger-kernel
are here.
The trace of a `model.kernels: liger` model then holds, at the turn from forward to backward, what
transformers' modules keep less exactly what they keep more (an RMSNorm's fp32 input copy and
normalised rows, the MLP's activation output), the fused loss's gradients and one chunk of logits in
place of the logits, and counts the same FLOPs."""
from __future__ import annotations

import pytest
import torch

from jobspec.model import kernel_reference as reference
from jobspec.model import kernel_stand_ins as stand_in
from jobspec.model.fused_kernels import restore_rope
from jobspec.model.kernel_reference import chunk_rows

TOKENS, HIDDEN, INTER, VOCAB, HEADS, HEAD_DIM = 24, 16, 40, 300, 4, 8


def _inputs(dtype):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_(grad)

    q = rand(2, TOKENS // 2, HEADS, HEAD_DIM).transpose(1, 2)   # as attention hands them over
    k = rand(2, TOKENS // 2, HEADS // 2, HEAD_DIM).transpose(1, 2)
    angles = torch.randn(1, TOKENS // 2, HEAD_DIM, generator=generator).to(dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    targets[:5] = -100
    return {
        "rms_norm llama": ("rms_norm", (rand(2, TOKENS // 2, HIDDEN), rand(HIDDEN), 1e-6, 0.0,
                                        "llama", True)),
        "rms_norm gemma": ("rms_norm", (rand(TOKENS, HIDDEN), rand(HIDDEN), 1e-6, 1.0, "gemma",
                                        False)),
        "silu_mul": ("silu_mul", (rand(TOKENS, INTER), rand(TOKENS, INTER))),
        "gelu_mul": ("gelu_mul", (rand(TOKENS, INTER), rand(TOKENS, INTER))),
        "rope": ("rope", (q, k, angles.cos(), angles.sin())),
        "linear_cross_entropy": ("linear_cross_entropy", (rand(TOKENS, HIDDEN), rand(VOCAB, HIDDEN),
                                                          targets, None, None)),
        "linear_cross_entropy frozen head": ("linear_cross_entropy", (
            rand(TOKENS, HIDDEN), rand(VOCAB, HIDDEN, grad=False), targets, None, None)),
    }


def kept(module, name, args) -> list:
    """(elements, dtype) of each tensor the call's backward keeps, and of each gradient it gives
    (the shapes may differ: Liger keeps its rows flattened)."""
    outputs = getattr(module, name)(*args)
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    saved = [None if t is None else (t.numel(), t.dtype) for t in first.grad_fn.saved_tensors]
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = torch.autograd.grad(outs, tensors, [torch.ones_like(o) for o in outs])
    return saved + [(g.numel(), g.dtype) for g in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_stand_in_keeps_what_its_reference_keeps(dtype):
    for label, (name, args) in _inputs(dtype).items():
        assert kept(stand_in, name, args) == kept(reference, name, args), label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels run on CUDA GPUs")
def test_each_reference_keeps_what_ligers_kernel_keeps():
    pytest.importorskip("liger_kernel")
    from jobspec.model.fused_kernels import liger_set

    liger = liger_set()
    for label, (name, args) in _inputs(torch.bfloat16).items():
        on_gpu = tuple(_on_gpu(a) for a in args)
        assert kept(liger, name, on_gpu) == kept(reference, name, on_gpu), label


def _on_gpu(value):
    if not isinstance(value, torch.Tensor):
        return value
    moved = value.detach().cuda()
    return moved.requires_grad_(value.requires_grad) if value.is_floating_point() else moved


def _spec(kernels: str):
    from jobspec.spec.schema import fill_defaults

    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 4000,
              "max_position_embeddings": 1024}
    model = {"architecture": "llama", "task": "causal-lm", "attention": "sdpa", "config": config,
             "kernels": kernels}
    return fill_defaults({"model": model, "training": {"micro_batch_size": 1}, "data": {},
                          "memory": {"precision": "bf16"}})


def test_the_trace_holds_what_the_kernels_keep():
    from transformers.models.llama import modeling_llama

    from jobspec.model.planner_trace import ModelTracer

    seq = 512
    rope = modeling_llama.apply_rotary_pos_emb
    plain = ModelTracer(_spec("none")).full("bf16", 1, seq, False)
    fused = ModelTracer(_spec("liger")).full("bf16", 1, seq, False)
    assert modeling_llama.apply_rotary_pos_emb is rope   # the trace put transformers' rotary back
    config = _spec("liger")["model"]["config"]
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    turn, unfused = fused.phases["turn"].regions, plain.phases["turn"].regions
    # transformers keeps per RMSNorm an fp32 copy of its input and the normalised rows where Liger
    # keeps the input (4 bytes a value more in bf16), per MLP the activation's output (2 bytes)
    norm_more, mlp_more = 4 * seq * hidden, 2 * seq * inter
    layers = config["num_hidden_layers"]
    assert unfused["layers"] - turn["layers"] == layers * (2 * norm_more + mlp_more)
    assert unfused["embeddings"] - turn["embeddings"] == norm_more   # the final norm
    # the fused loss holds the head weight's and the hidden states' gradients, the per-token losses
    # and one chunk of logits, beside the shifted int64 labels; transformers' the logits, their fp32
    # copy and more
    chunk = chunk_rows(seq, vocab, hidden)
    assert turn["logits_and_loss"] == (2 * vocab * hidden + 2 * seq * hidden + 4 * seq
                                       + 2 * chunk * vocab + 8 * seq)
    assert unfused["logits_and_loss"] > 3 * seq * vocab * 2
    assert fused.flops == plain.flops   # the head's three products counted, as the plain step's
    restore_rope()
