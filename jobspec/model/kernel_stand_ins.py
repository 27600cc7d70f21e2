"""Liger's kernels stood in while tracing (`model.kernels: liger`): what each allocates and keeps.

The planner's trace (model/planner_trace.py) runs the model under fake tensors, where a Triton
kernel cannot run. Each stand-in is an autograd Function called as its Liger counterpart is
(liger_kernel 0.8.5, liger_kernel.ops) that makes the tensors the kernel makes, keeps for the
backward what the kernel's `ctx.save_for_backward` keeps, writes where the kernel writes in place,
and runs the matrix products the kernel runs (so the trace counts their FLOPs); no other arithmetic:

  RMSNorm            forward: the output, an fp32 rstd per row; keeps the input, the weight, rstd.
                     backward: the input's gradient in the incoming gradient's storage (`in_place`),
                     else a new one; the weight's gradient
  SiLU/GELU x mul    forward: the output; keeps the two inputs. backward: both gradients written
                     over the kept inputs
  rotary embedding   q and k rotated in place (copied first only when not contiguous); keeps cos
                     and sin. backward: the gradients rotated likewise
  fused linear CE    forward: the hidden states' and the weight's gradients (zeros, then a chunk
                     of tokens at a time: its logits, their gradient in the same storage, two
                     products into the gradients), a per-token fp32 loss. backward: the kept
                     gradients, scaled in place

transformers' modules keep more (a norm's input in fp32 and its normalised rows; the MLP's
activation output; the logits, their fp32 copy and log-softmax): the difference `jobspec plan`
shows. The arithmetic is model/kernel_reference.py's (the kernels CPU ranks run).
"""
from __future__ import annotations

from jobspec.model.kernel_reference import chunk_rows


def _function(name: str, forward, backward):
    import torch

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _in_place(x):
    """`x` where Liger's kernels write it: its own storage when [batch, seq, heads, dim] is
    contiguous (transformers' projections), else a contiguous copy."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _rms_norm_forward(ctx, x, weight, eps, offset, casting, in_place):
    import torch

    x = x.contiguous()
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    ctx.in_place = in_place
    ctx.save_for_backward(x, weight, rstd)
    return torch.empty_like(x)


def _rms_norm_backward(ctx, grad):
    import torch

    _, weight, _ = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grad if ctx.in_place else torch.zeros_like(grad)
    grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight, None, None, None, None


def _gated_forward(ctx, gate, up):
    import torch

    gate, up = gate.contiguous(), up.contiguous()
    ctx.save_for_backward(gate, up)
    return torch.empty_like(gate)


def _gated_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return gate, up   # the kernel stores the two gradients over the inputs it kept


def _rope_forward(ctx, q, k, cos, sin):
    ctx.save_for_backward(cos.contiguous(), sin.contiguous())
    return _in_place(q), _in_place(k)


def _rope_backward(ctx, grad_q, grad_k):
    return _in_place(grad_q), _in_place(grad_k), None, None


def _linear_ce_forward(ctx, hidden, weight, targets, bias, softcap):
    import torch

    rows = hidden.shape[0]
    gradients = hidden.requires_grad
    grad_hidden = torch.zeros_like(hidden)   # made whether it is needed or not, as Liger makes it
    grad_weight = torch.zeros_like(weight) if gradients and weight.requires_grad else None
    grad_bias = torch.zeros_like(bias) if gradients and bias is not None else None
    losses = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    step = chunk_rows(rows, weight.shape[0], hidden.shape[1])
    for start in range(0, rows, step):
        part = hidden[start:start + step]
        logits = part @ weight.t()   # the kernel overwrites them with their gradient
        if gradients:
            torch.mm(logits, weight, out=grad_hidden[start:start + step])
            if grad_weight is not None:
                torch.addmm(grad_weight, logits.t(), part, out=grad_weight)
        del logits
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    return losses.sum()


def _linear_ce_backward(ctx, grad_total):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    return grad_hidden, grad_weight, None, grad_bias, None


_FUNCTIONS: dict = {}


def _apply(name: str, forward, backward, *args):
    if name not in _FUNCTIONS:
        _FUNCTIONS[name] = _function(name, forward, backward)
    return _FUNCTIONS[name].apply(*args)


def rms_norm(x, weight, eps: float, offset: float = 0.0, casting: str = "llama",
             in_place: bool = True):
    return _apply("RMSNormStandIn", _rms_norm_forward, _rms_norm_backward, x, weight, eps, offset,
                  casting, in_place)


def silu_mul(gate, up):
    return _apply("SiLUMulStandIn", _gated_forward, _gated_backward, gate, up)


def gelu_mul(gate, up):
    return _apply("GELUMulStandIn", _gated_forward, _gated_backward, gate, up)


def rope(q, k, cos, sin):
    return _apply("RopeStandIn", _rope_forward, _rope_backward, q, k, cos, sin)


def linear_cross_entropy(hidden, weight, targets, bias=None, softcap: float | None = None):
    return _apply("LinearCrossEntropyStandIn", _linear_ce_forward, _linear_ce_backward, hidden,
                  weight, targets, bias, softcap)
