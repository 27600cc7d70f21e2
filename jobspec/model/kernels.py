"""The GPU attention kernels' stand-in for the planner's trace (jobspec/model/planner_trace.py).

SDPA cannot reach the GPU kernels in a CPU torch, and the CPU kernels keep other tensors. While
tracing, `torch.nn.functional.scaled_dot_product_attention` is replaced by `_attention`, which calls
the GPU kernels' own meta functions (they work on fake CPU tensors):
`_scaled_dot_product_flash_attention` with no mask and 16-bit inputs (what PyTorch's dispatcher
picks on an Ampere+ GPU), else `_scaled_dot_product_efficient_attention`. Forward keeps what those
kernels keep for backward (q, k, v, the output, the fp32 log-sum-exp); backward calls their backward
meta functions and allocates their fp32 scratch (flash: the dq accumulator and softmax_d; efficient:
delta). Their FLOPs are the kernels' (torch's counter formulas for these ops).

Dropout likewise: on a CUDA tensor `torch.dropout` runs the fused `native_dropout`, which keeps a
one-byte boolean mask for the backward; on a CPU tensor it multiplies by a mask in the input's dtype
(four bytes per element in fp32). `dropout_stand_in` routes `torch.nn.functional.dropout` to
`native_dropout` while tracing, so the trace keeps the GPU's mask.

And the mask decision: without a padding mask, transformers hands SDPA no mask (`is_causal`: the
flash kernel, nothing of seq² size) once it has read the cache position and found no packed
sequences in the position ids, both tensors. A fake tensor counts as tracing there, which would
build the full causal mask; `mask_skip_stand_in` decides with the values a training forward has:
offsets 0 (no cache), and packed sequences only when the step hands the model position ids
(`data.packing`). A padding mask is still kept (its values are unknown to the trace: the worst case,
a padded batch).
"""
from __future__ import annotations

import functools


class _FunctionalStandIn:
    """Replaces one function of torch.nn.functional while tracing, and puts it back after."""

    def __init__(self, name: str, stand_in):
        self.name, self.stand_in = name, stand_in

    def __enter__(self):
        import torch.nn.functional as F

        self._original = getattr(F, self.name)
        setattr(F, self.name, self.stand_in)
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        setattr(F, self.name, self._original)
        return False


def sdpa_stand_in() -> _FunctionalStandIn:
    """torch.nn.functional.scaled_dot_product_attention as the GPU kernels run it (the module
    docstring)."""
    return _FunctionalStandIn("scaled_dot_product_attention", _attention)


def dropout_stand_in() -> _FunctionalStandIn:
    """torch.nn.functional.dropout as CUDA runs it (see the module docstring)."""
    return _FunctionalStandIn("dropout", _dropout)


class mask_skip_stand_in:
    """Wraps transformers' mask decisions while tracing (see the module docstring); `packed`: the
    step hands the model position ids that restart per sample."""

    def __init__(self, packed: bool = False):
        self.packed = packed
        self._originals: dict = {}

    def __enter__(self):
        import sys

        # loaded with any transformers model that builds masks; a model without it (jobspec's MLP)
        # builds none, and importing it would cost seconds
        masking_utils = sys.modules.get("transformers.masking_utils")
        if masking_utils is None:
            return self
        wrappers = {"_ignore_causal_mask_sdpa": _skip_decision}
        if not self.packed:
            wrappers["find_packed_sequence_indices"] = lambda original: _not_packed
        for name, wrap in wrappers.items():
            original = getattr(masking_utils, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(masking_utils, name, wrap(original))
        return self

    def __exit__(self, *exc):
        if self._originals:
            import sys

            masking_utils = sys.modules["transformers.masking_utils"]
            for name, original in self._originals.items():
                setattr(masking_utils, name, original)
        return False


def _not_packed(position_ids):
    """One sequence per row: the position ids the model makes itself (0 .. seq - 1)."""
    return None


def _skip_decision(original):
    import inspect

    import torch

    signature = inspect.signature(original)

    @functools.wraps(original)
    def decide(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name in ("q_offset", "kv_offset"):
            if isinstance(bound.arguments.get(name), torch.Tensor):
                bound.arguments[name] = 0   # a training forward: no cache, positions from 0
        return original(*bound.args, **bound.kwargs)

    return decide


def _dropout(input, p=0.5, training=True, inplace=False):
    """CUDA's dropout: the fused kernel where it applies (0 < p < 1, training), else as torch
    does."""
    import torch

    if not training or p == 0.0:
        return input
    if p == 1.0 or input.numel() == 0:
        return input.mul_(0.0) if inplace else input * 0.0
    output, _ = torch.native_dropout(input, p, True)
    return input.copy_(output) if inplace else output


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    import torch

    use_flash = attn_mask is None and query.dtype in (torch.float16, torch.bfloat16)
    if enable_gqa and not use_flash and key.shape[1] != query.shape[1]:
        # the efficient kernel has no GQA: torch expands k and v
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # torch turns a boolean mask into an additive bias of the query's dtype for the kernel
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype)
        attn_mask = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return _KernelAttention.apply(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                                  scale, use_flash)


def _kernel_class():
    import torch

    aten = torch.ops.aten

    class KernelAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, use_flash):
            if use_flash:
                out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                    q, k, v, dropout_p, is_causal, False, scale=scale)
            else:
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                    q, k, v, bias, True, dropout_p, is_causal, scale=scale)
            ctx.save_for_backward(q, k, v, bias if bias is not None else torch.empty(0), out, lse,
                                  seed, offset)
            ctx.settings = (dropout_p, is_causal, scale, use_flash, bias is not None)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
            dropout_p, is_causal, scale, use_flash, has_bias = ctx.settings
            b, h, s, d = q.shape
            rounded = -(-s // 128) * 128
            scratch: tuple[torch.Tensor, ...]
            if use_flash:   # FlashAttention-2's backward scratch: fp32 dq accumulator and softmax_d
                scratch = (torch.empty(b, rounded, h, d, dtype=torch.float32),
                           torch.empty(b, h, rounded, dtype=torch.float32))
                dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                    grad_out, q, k, v, out, lse, None, None, s, k.shape[2], dropout_p, is_causal,
                    seed, offset, scale=scale)
            else:           # the memory-efficient kernel's backward: fp32 delta
                scratch = (torch.empty(b, h, -(-s // 32) * 32, dtype=torch.float32),)
                dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                    grad_out, q, k, v, bias if has_bias else None, out, lse, seed, offset,
                    dropout_p, [True, True, True, False], is_causal, scale=scale)
            del scratch
            return dq, dk, dv, None, None, None, None, None

    return KernelAttention


class _LazyKernel:
    """`_KernelAttention.apply` without importing torch at module import."""

    @functools.cached_property
    def cls(self):
        return _kernel_class()

    def apply(self, *args):
        return self.cls.apply(*args)


_KernelAttention = _LazyKernel()
