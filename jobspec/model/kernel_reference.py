"""PyTorch references of the Liger kernels `model.kernels: liger` applies (model/fused_kernels.py).

Each is an autograd Function called as its Liger counterpart is (liger_kernel.ops:
LigerRMSNormFunction, LigerSiLUMulFunction, LigerGELUMulFunction, LigerRopeFunction,
LigerFusedLinearCrossEntropyFunction with `reduction="sum"`) that computes what transformers'
modules compute, and keeps for the backward what the Triton kernel keeps (Liger 0.8.5's
`ctx.save_for_backward`):

  RMSNorm            the input, the weight and an fp32 rstd per row
  SiLU/GELU x mul    the two inputs
  rotary embedding   cos and sin
  fused linear CE    the gradients of the hidden states and of the head's weight, made in the
                     forward one chunk of tokens' logits at a time (Liger's chunk size)

They are the kernels of CPU ranks under the test hook JOBSPEC_KERNELS_REFERENCE=1
(techniques/fused_kernels.py), where the fused code path must give transformers' loss and gradients.
Their temporaries are PyTorch's; the planner's trace uses model/kernel_stand_ins.py, which allocates
what the kernels allocate.
"""
from __future__ import annotations

import math

from jobspec.tasks.base import IGNORE_INDEX


def _function(forward, backward):
    """An autograd Function of two static methods (torch imported at the first call)."""
    import torch

    return type(forward.__name__, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


# ------------------------------------------------------------------------------ RMSNorm

def _rms_norm_forward(ctx, x, weight, eps, offset, casting, in_place):
    import torch

    x = x.contiguous()
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    ctx.offset, ctx.casting = offset, casting
    ctx.save_for_backward(x, weight, rstd)
    if casting == "gemma":   # everything in fp32, cast back at the end (Gemma's RMSNorm)
        return (x32 * rstd * (offset + weight.float())).to(x.dtype)
    return (offset + weight) * (x32 * rstd).to(x.dtype)   # the weight in the input's dtype


def _rms_norm_backward(ctx, grad):
    x, weight, rstd = ctx.saved_tensors
    normed = x.float() * rstd
    if ctx.casting == "gemma":
        grad_normed = grad.float() * (ctx.offset + weight.float())
        grad_weight = (grad.float() * normed) if ctx.needs_input_grad[1] else None
    else:
        grad_normed = (grad * (ctx.offset + weight)).float()
        grad_weight = (grad * normed.to(x.dtype)) if ctx.needs_input_grad[1] else None
    grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    if grad_weight is not None:
        grad_weight = grad_weight.reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
    return grad_x.to(x.dtype), grad_weight, None, None, None, None


def rms_norm(x, weight, eps: float, offset: float = 0.0, casting: str = "llama",
             in_place: bool = True):
    """LigerRMSNormFunction's reference: `(offset + weight) * x / rms(x)`, cast per `casting`."""
    function = _cached("rms_norm", _rms_norm_forward, _rms_norm_backward)
    return function.apply(x, weight, eps, offset, casting, in_place)


# ---------------------------------------------------------------------- gated activations

def _gated_forward(activation):
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return activation(gate.float()).to(gate.dtype) * up

    forward.__name__ = f"{activation.__name__}_mul"
    return forward


def _gated_backward(activation):
    def backward(ctx, grad):
        import torch

        gate, up = ctx.saved_tensors
        with torch.enable_grad():   # the activation's derivative, recomputed from the kept input
            gate32 = gate.detach().float().requires_grad_(True)
            activated = activation(gate32)
            (grad_gate,) = torch.autograd.grad(activated, gate32, grad.float() * up.float())
        return grad_gate.to(gate.dtype), grad * activated.detach().to(up.dtype)

    return backward


def _silu(x):
    import torch.nn.functional as F

    return F.silu(x)


def _gelu_tanh(x):
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def silu_mul(gate, up):
    """LigerSiLUMulFunction's reference: silu(gate) * up (SwiGLU)."""
    function = _cached("silu_mul", _gated_forward(_silu), _gated_backward(_silu))
    return function.apply(gate, up)


def gelu_mul(gate, up):
    """LigerGELUMulFunction's reference: gelu_tanh(gate) * up (GeGLU)."""
    function = _cached("gelu_mul", _gated_forward(_gelu_tanh), _gated_backward(_gelu_tanh))
    return function.apply(gate, up)


# ------------------------------------------------------------------------------- rotary

def _rotated(x, cos, sin, inverse: bool = False):
    """x rotated by the positions' angles (transformers' `x * cos + rotate_half(x) * sin`) over
    its first cos.shape[-1] features (partial rotary: the rest pass); `inverse`: the transposed map,
    which the backward applies."""
    import torch

    width = min(cos.shape[-1], x.shape[-1])
    rot, rest = x[..., :width], x[..., width:]
    half = width // 2
    if inverse:
        scaled = rot * sin
        out = rot * cos + torch.cat((scaled[..., half:], -scaled[..., :half]), dim=-1)
    else:
        out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _rope_forward(ctx, q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)   # broadcast over the heads
    ctx.save_for_backward(cos, sin)
    return _rotated(q, cos, sin), _rotated(k, cos, sin)


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    return (_rotated(grad_q, cos, sin, inverse=True), _rotated(grad_k, cos, sin, inverse=True),
            None, None)


def rope(q, k, cos, sin):
    """LigerRopeFunction's reference: q and k ([batch, heads, seq, head_dim]) rotated by cos and sin
    ([batch or 1, seq, rotary_dim])."""
    return _cached("rope", _rope_forward, _rope_backward).apply(q, k, cos, sin)


# ----------------------------------------------------------- fused linear cross-entropy

def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Liger's chunk of tokens: about rows x hidden logits at a time (a power of two, <= `rows`)."""
    factor = -(-vocab // hidden)
    return min(rows, 1 << max(0, math.ceil(math.log2(max(1, -(-rows // factor))))))


def _linear_ce_forward(ctx, hidden, weight, targets, bias, softcap):
    import torch

    rows = hidden.shape[0]
    gradients = hidden.requires_grad
    grad_hidden = torch.zeros_like(hidden) if gradients else None
    grad_weight = torch.zeros_like(weight) if gradients and weight.requires_grad else None
    grad_bias = torch.zeros_like(bias) if gradients and bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    step = chunk_rows(rows, weight.shape[0], hidden.shape[1])
    for start in range(0, rows, step):
        part, target = hidden[start:start + step], targets[start:start + step]
        logits = part @ weight.t() if bias is None else part @ weight.t() + bias
        loss, grad_logits = _chunk_loss(logits, target, softcap, gradients)
        total += loss
        if grad_logits is None or grad_hidden is None:
            continue
        grad_hidden[start:start + step] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.t(), part)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    return total


def _chunk_loss(logits, target, softcap, gradients: bool):
    """(the labelled rows' summed cross-entropy in fp32, its gradient w.r.t. the logits in their
    dtype or None without `gradients`)."""
    import torch

    z = logits.float()
    capped = None
    if softcap:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    labelled = target != IGNORE_INDEX
    index = torch.where(labelled, target, torch.zeros_like(target)).unsqueeze(1)
    lse = torch.logsumexp(z, dim=-1)
    loss = ((lse - z.gather(1, index).squeeze(1)) * labelled).sum()
    if not gradients:
        return loss, None
    grad = torch.softmax(z, dim=-1)
    grad.scatter_add_(1, index, torch.full_like(index, -1, dtype=grad.dtype))
    grad *= labelled.unsqueeze(1)
    if capped is not None:
        grad *= 1 - capped * capped
    return loss, grad.to(logits.dtype)


def _linear_ce_backward(ctx, grad_total):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    for grad in (grad_hidden, grad_weight, grad_bias):   # scaled in place, as Liger's kernel does
        if grad is not None:
            grad.mul_(grad_total.to(grad.dtype))
    return grad_hidden, grad_weight, None, grad_bias, None


def linear_cross_entropy(hidden, weight, targets, bias=None, softcap: float | None = None):
    """LigerFusedLinearCrossEntropyFunction's reference (`reduction="sum"`): the fp32 sum of the
    cross-entropy of `hidden` times the transposed `weight` (plus `bias`) ([tokens, vocab],
    `softcap`: tanh capping) against `targets` ([tokens], -100 skipped), the logits made one chunk
    of tokens at a time."""
    function = _cached("linear_cross_entropy", _linear_ce_forward, _linear_ce_backward)
    return function.apply(hidden, weight, targets, bias, softcap)


_FUNCTIONS: dict = {}


def _cached(name: str, forward, backward):
    if name not in _FUNCTIONS:
        _FUNCTIONS[name] = _function(forward, backward)
    return _FUNCTIONS[name]
