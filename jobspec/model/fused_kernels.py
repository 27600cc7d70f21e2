"""`model.kernels: liger` on a Hugging Face model: Liger Kernel's fused modules, for the ranks and
the planner's trace.

What Liger's `apply_liger_kernel_to_<type>` does, done here on the model instance so that one code
path runs with any set of kernels (`KernelSet`): Liger's Triton kernels (liger_kernel.ops) on GPU
ranks; their PyTorch references (model/kernel_reference.py) on CPU ranks under the test hook
JOBSPEC_KERNELS_REFERENCE=1; in the planner's trace, stand-ins that allocate and keep what the
kernels do (model/kernel_stand_ins.py).

- every RMSNorm module of the model type's modeling file: the fused RMSNorm, with the family's
  offset and casting (Gemma's `(1 + weight)`, all in fp32);
- every layer's MLP: the fused SiLU(gate) x up (SwiGLU; Phi-3's fused gate/up projection split) or
  GELU-tanh(gate) x up (GeGLU), its projections called as before (LoRA on them still applies);
- the modeling file's `apply_rotary_pos_emb`: the fused rotary embedding (module-wide;
  `restore_rope` puts transformers' back, as the trace does after each traced step);
- a causal LM's loss (`fused_loss`): model/tiling.replace_head_loss's forward, the base model's
  hidden states into the fused linear cross-entropy (summed, -100 skipped), so `loss_sum` and
  `loss_tokens` reach jobspec's token-weighted loss (train/token_loss.summed_loss) as the tiled
  loss's do, and transformers' loss is never computed. The head is called as a module whose forward
  is the fused loss, so ZeRO-3's hooks gather its weight around the call.

Liger's `apply_liger_kernel_to_<type>` is not called: it patches the modeling classes process-wide
and swaps the causal LM's forward for one that computes transformers' mean loss.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from jobspec.errors import spec_error
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.techniques.fused_kernels import FIELD, GPU_EXTRA, model_problem, reference_kernels
from jobspec.techniques.fused_kernels import fused_loss as computes_fused_loss

if TYPE_CHECKING:
    from jobspec.model.planner_trace import TraceSetting


@dataclass(frozen=True)
class Family:
    """How Liger's kernels apply to one model type's modules."""

    mlp: str                         # "swiglu", "geglu", "gate_up" (SwiGLU, one fused projection)
    activation: str = "hidden_act"   # the config attribute that names the MLP's activation
    norm_offset: float = 0.0         # RMSNorm scales by (offset + weight)
    casting: str = "llama"           # "llama": only rstd in fp32; "gemma": all of it in fp32
    in_place: bool = True            # Liger's RMSNorm backward may overwrite its incoming gradient


# keys: techniques/fused_kernels.LIGER_FAMILIES (tests/model/test_fused_kernels.py holds them equal)
FAMILIES = {
    "llama": Family("swiglu"), "mistral": Family("swiglu"), "qwen2": Family("swiglu"),
    "qwen3": Family("swiglu"), "phi3": Family("gate_up"),
    "gemma": Family("geglu", norm_offset=1.0, casting="gemma"),
    # Gemma 2 adds a residual to its norms' outputs: their incoming gradient is needed after them
    "gemma2": Family("geglu", activation="hidden_activation", norm_offset=1.0, casting="gemma",
                     in_place=False),
}
ACTIVATIONS = {"swiglu": ("silu", "swish"), "gate_up": ("silu", "swish"),
               "geglu": ("gelu_pytorch_tanh",)}


class KernelSet(NamedTuple):
    """The five kernels, each called as model/kernel_reference.py's functions are."""

    name: str
    rms_norm: Callable       # (x, weight, eps, offset, casting, in_place) -> normalised x
    silu_mul: Callable       # (gate, up) -> silu(gate) * up
    gelu_mul: Callable       # (gate, up) -> gelu_tanh(gate) * up
    rope: Callable           # (q, k, cos, sin) -> rotated (q, k)
    linear_cross_entropy: Callable   # (hidden [N, H], weight, targets [N], bias, softcap) -> sum


def reference_set() -> KernelSet:
    from jobspec.model import kernel_reference as ref

    return KernelSet("PyTorch reference", ref.rms_norm, ref.silu_mul, ref.gelu_mul, ref.rope,
                     ref.linear_cross_entropy)


def stand_in_set() -> KernelSet:
    """What Liger's kernels allocate and keep, without their arithmetic: the planner's trace."""
    from jobspec.model import kernel_stand_ins as stand_in

    return KernelSet("Liger's, stood in", stand_in.rms_norm, stand_in.silu_mul, stand_in.gelu_mul,
                     stand_in.rope, stand_in.linear_cross_entropy)


def liger_set() -> KernelSet:
    """Liger's Triton kernels; a SpecError at model.kernels where they cannot load."""
    try:
        from liger_kernel.ops import (
            LigerFusedLinearCrossEntropyFunction,
            LigerGELUMulFunction,
            LigerRMSNormFunction,
            LigerRopeFunction,
            LigerSiLUMulFunction,
        )
    except ImportError as err:
        raise spec_error(f"model.kernels: liger cannot load Liger's kernels: {err}", path=FIELD,
                         hint=f"`{GPU_EXTRA}`, or set `model.kernels: none`") from None

    def rms_norm(x, weight, eps, offset, casting, in_place):
        return LigerRMSNormFunction.apply(x, weight, eps, offset, casting, in_place, None)

    def rope(q, k, cos, sin):
        return LigerRopeFunction.apply(q, k, cos, sin, None, 1)

    def linear_cross_entropy(hidden, weight, targets, bias=None, softcap=None):
        # after bias: ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap
        return LigerFusedLinearCrossEntropyFunction.apply(
            hidden, weight, targets, bias, None, IGNORE_INDEX, 0.0, 0.0, "sum", softcap)[0]

    return KernelSet("Liger", rms_norm, LigerSiLUMulFunction.apply, LigerGELUMulFunction.apply,
                     rope, linear_cross_entropy)


def fused_kernels(model, kernels: str = "liger", fused_loss: bool = False) -> str:
    """The ranks' patch (patches.json `fused_kernels`): Liger's kernels on this rank's CUDA device,
    their PyTorch references under JOBSPEC_KERNELS_REFERENCE=1."""
    if kernels != "liger":
        raise spec_error(f"unknown model.kernels {kernels!r} in patches.json", path=FIELD,
                         hint="recompile the job: patches.json is written by `jobspec compile`")
    if reference_kernels():
        chosen = reference_set()
    else:
        import torch

        if not torch.cuda.is_available():
            raise spec_error("Liger's kernels are Triton programs for CUDA GPUs, and this rank has "
                             "none", path=FIELD,
                             hint="launch on NVIDIA GPUs, or set `model.kernels: none`")
        chosen = liger_set()
    return apply_kernels(model, chosen, fused_loss=fused_loss)


def trace_kernels(model, setting: TraceSetting):
    """The planner's trace's `fused_kernels`: `model.kernels`' fused modules, Liger's kernels stood
    in by what they allocate and keep for the backward (model/kernel_stand_ins.py)."""
    if setting.spec["model"].get("kernels", "none") != "none":
        apply_kernels(model, stand_in_set(), fused_loss=computes_fused_loss(setting.spec))
    return model


def apply_kernels(model, kernels: KernelSet, *, fused_loss: bool) -> str:
    """`kernels` in `model`'s RMSNorms, MLPs and rotary embedding and (`fused_loss`) its loss."""
    config = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    problem = model_problem(model_type)
    if problem is not None:   # a hub id validation could not look into
        raise spec_error(problem[0], path=FIELD, hint=problem[1])
    family = FAMILIES[model_type]
    activation = getattr(config, family.activation, None)
    if activation not in ACTIVATIONS[family.mlp]:
        raise spec_error(f"Liger's {family.mlp} kernel computes {ACTIVATIONS[family.mlp][0]}; this "
                         f"{model_type} model's MLP uses {activation!r}", path=FIELD,
                         hint="set `model.kernels: none`")
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    own = [m for m in model.modules() if type(m).__module__ == modeling.__name__]
    norms = [m for m in own if type(m).__name__.endswith("RMSNorm")]
    mlps = [m for m in own if type(m).__name__.endswith("MLP")]
    if not norms or not mlps:   # a model of the type built from other code (trust_remote_code)
        raise spec_error(f"model.kernels: liger patches transformers' {model_type} modules, and "
                         "this model lacks its RMSNorm or MLP modules", path=FIELD,
                         hint="set `model.kernels: none` for this model")
    for module, forward in [(n, _rms_norm_forward) for n in norms] + \
            [(m, _MLP_FORWARDS[family.mlp]) for m in mlps]:
        # a method bound to its module, the kernels on the module: a deep copy keeps both
        module.fused_kernel = (kernels, family)
        module.forward = types.MethodType(forward, module)
    _patch_rope(modeling, kernels)
    parts = [f"RMSNorm ({len(norms)} modules)", f"{family.mlp} MLP ({len(mlps)} layers)",
             "rotary embedding"]
    if fused_loss:
        from jobspec.model.tiling import replace_head_loss

        softcap = getattr(config, "final_logit_softcapping", None)
        replace_head_loss(model, _fused_head_loss(kernels, softcap), path=FIELD,
                          hint="set `model.kernels: none` for this model")
        parts.append("fused linear cross-entropy (no logits)")
    return f"fused kernels ({kernels.name}): " + ", ".join(parts)


def _rms_norm_forward(self, hidden_states):
    kernels, family = self.fused_kernel
    eps = getattr(self, "variance_epsilon", None) or self.eps
    return kernels.rms_norm(hidden_states, self.weight, eps, family.norm_offset, family.casting,
                            family.in_place)


def _swiglu_forward(self, x):
    kernels, _ = self.fused_kernel
    return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _geglu_forward(self, x):
    kernels, _ = self.fused_kernel
    return self.down_proj(kernels.gelu_mul(self.gate_proj(x), self.up_proj(x)))


def _gate_up_forward(self, x):
    kernels, _ = self.fused_kernel
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(kernels.silu_mul(gate, up))


_MLP_FORWARDS = {"swiglu": _swiglu_forward, "geglu": _geglu_forward, "gate_up": _gate_up_forward}
_ORIGINAL_ROPE: dict[Any, Callable] = {}


def _patch_rope(modeling, kernels: KernelSet) -> None:
    original = _ORIGINAL_ROPE.setdefault(modeling, modeling.apply_rotary_pos_emb)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
        if unsqueeze_dim != 1:   # [batch, seq, heads, dim] tensors: transformers' own
            return original(q, k, cos, sin, unsqueeze_dim)
        return kernels.rope(q, k, cos, sin)

    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


def restore_rope() -> None:
    """transformers' rotary embedding back in every modeling file `apply_kernels` patched."""
    for modeling, original in _ORIGINAL_ROPE.items():
        modeling.apply_rotary_pos_emb = original
    _ORIGINAL_ROPE.clear()


def _fused_head_loss(kernels: KernelSet, softcap: float | None):
    """`replace_head_loss`'s loss: (the fused linear cross-entropy's fp32 sum, labelled count)."""
    def head_loss(head, hidden, targets):
        import torch

        if type(head) is not torch.nn.Linear:
            raise spec_error("Liger's fused linear cross-entropy reads the output projection's "
                             f"weight, and this model's is a {type(head).__name__} (LoRA or "
                             "quantisation on the head)", path=FIELD, hint="keep the output "
                             "projection out of model.lora, or set `model.kernels: none`")
        flat = hidden.reshape(-1, hidden.shape[-1])
        if torch.is_grad_enabled() and head.weight.requires_grad and not flat.requires_grad:
            # a frozen base whose head trains: the kernel makes the weight's gradient only for an
            # input that wants one
            flat = flat.detach().requires_grad_(True)
        labels = targets.reshape(-1)

        def fused(x):
            return kernels.linear_cross_entropy(x, head.weight, labels, head.bias, softcap)

        own = head.__dict__.get("forward")
        head.__dict__["forward"] = fused
        try:
            total = head(flat)
        finally:
            if own is None:
                del head.__dict__["forward"]
            else:
                head.__dict__["forward"] = own
        return total, (labels != IGNORE_INDEX).sum()

    return head_loss
