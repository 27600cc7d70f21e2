"""The frozen base quantised by bitsandbytes (spec `model.quantization`, QLoRA), and back for
export.

`quantize_linears` turns a model built in its compute dtype into bitsandbytes' `Linear4bit` /
`Linear8bitLt` layers, the way transformers' bitsandbytes integration does when it loads a
checkpoint (the same skip list: the output head and tied weights stay in full precision), so a
model built from `model.architecture` (random weights, no checkpoint to load) is quantised exactly
like one loaded through `from_pretrained(quantization_config=...)`. The weight is quantised when it
is moved to its device (`Params4bit.to` / `Int8Params.to`): blocks of 64 values share an absmax
(4-bit; with double quantisation those constants are themselves 8-bit in blocks of 256).

`dequantized_state_dict` is the export's side: a state dict in which each quantised weight is
dequantised to a float tensor of its logical shape, with the quantisation constants' keys dropped,
so that it loads into the same model built unquantised (the merged export: base + adapters).

bitsandbytes has a CPU backend (this project's CI machine runs 4-bit NF4/FP4 and 8-bit there);
`bitsandbytes_problem` says why it cannot run where it cannot, before a rank meets it.
"""
from __future__ import annotations

from typing import Any

from jobspec.errors import first_line
from jobspec.spec.types import JobSpecModelQuantization

# the state-dict suffixes bitsandbytes adds next to a quantised weight (Params4bit's quant_state,
# Int8Params' SCB)
_QUANT_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB",
                   ".weight_format")
_QUANT_STATE_MARK = ".quant_state."
# the fix for bitsandbytes_problem's refusal, said by the launcher (launch/pipeline) and the ranks
# (model/build) (missing, or installed with a backend that fails: a current release's CPU backend
# runs 4-bit and 8-bit)
BITSANDBYTES_HINT = ("`pip install -U bitsandbytes` (a current release's CPU backend runs 4-bit "
                     "and 8-bit), or drop model.quantization")


def bitsandbytes_problem(quant: JobSpecModelQuantization) -> str | None:
    """Why bitsandbytes cannot quantise on this machine (None: it can): it is missing, or its native
    backend fails on a 64-value block. Imports torch and bitsandbytes: ranks and launch side
    only."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return (f"model.quantization ({quant['bits']}-bit) needs bitsandbytes, which is not "
                "installed")
    try:
        import torch
        from bitsandbytes import functional as bnbf
        block = torch.linspace(-1, 1, 64)
        if quant["bits"] == 4:
            bnbf.quantize_4bit(block, quant_type=quant["quant_type"])
        else:
            bnbf.int8_vectorwise_quant(block.reshape(1, 64).half())
    # any backend failure here is what every rank would meet
    except Exception as err:  # noqa: BLE001
        return (f"bitsandbytes cannot quantise {quant['bits']}-bit on this machine: "
                f"{first_line(err, limit=200)}")
    return None


def quantize_linears(model, bnb_config, names: list[str], device) -> int:
    """Replace the model's `nn.Linear` layers `names` (model/lora.quantized_linear_names:
    transformers' rule, which the planner counts too) by bitsandbytes layers quantised on `device`;
    returns how many."""
    import bitsandbytes as bnb
    import torch.nn as nn

    four_bit = bool(bnb_config.load_in_4bit)
    count = 0
    for name in names:
        module = model.get_submodule(name)
        if type(module) is not nn.Linear:
            continue
        bias = module.bias is not None
        new: nn.Module
        if four_bit:
            new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias,
                                    compute_dtype=bnb_config.bnb_4bit_compute_dtype,
                                    compress_statistics=bnb_config.bnb_4bit_use_double_quant,
                                    quant_type=bnb_config.bnb_4bit_quant_type,
                                    quant_storage=bnb_config.bnb_4bit_quant_storage, device="meta")
            new.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False,
                                           compress_statistics=bnb_config.bnb_4bit_use_double_quant,
                                           quant_type=bnb_config.bnb_4bit_quant_type,
                                           quant_storage=bnb_config.bnb_4bit_quant_storage,
                                           module=new)
        else:
            new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias,
                                      has_fp16_weights=False,
                                      threshold=bnb_config.llm_int8_threshold, device="meta")
            new.weight = bnb.nn.Int8Params(module.weight.data.half(), requires_grad=False,
                                           has_fp16_weights=False)
        if bias:
            new.bias = nn.Parameter(module.bias.data, requires_grad=False)
        new = new.to(device)   # quantises the weight (Params4bit / Int8Params `.to`)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        count += 1
    if hasattr(model, "config"):
        model.config.quantization_config = bnb_config
    return count


def is_quantized(module) -> bool:
    return any(getattr(p, "quant_state", None) is not None or type(p).__name__ == "Int8Params"
               for p in module.parameters())


def dequantized_state_dict(module, dtype) -> dict:
    """`module.state_dict()` with every bitsandbytes weight dequantised to `dtype` in its logical
    shape and the quantisation constants' keys left out (keys otherwise unchanged)."""
    import bitsandbytes as bnb
    from bitsandbytes import functional as bnbf

    state = module.state_dict()
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        weight: Any = getattr(sub, "weight", None)
        if weight is None:
            continue
        if isinstance(sub, bnb.nn.Linear4bit) and getattr(weight, "quant_state", None) is not None:
            state[prefix + "weight"] = bnbf.dequantize_4bit(weight.data,
                                                            weight.quant_state).to(dtype)
        elif isinstance(sub, bnb.nn.Linear8bitLt) and weight.dtype.itemsize == 1:
            scb: Any = getattr(weight, "SCB", None)
            if scb is None:
                scb = sub.state.SCB
            state[prefix
                  + "weight"] = (weight.data.float() * scb.float().unsqueeze(1) / 127.0).to(dtype)
    return {k: v for k, v in state.items()
            if not (k.endswith(_QUANT_SUFFIXES) or _QUANT_STATE_MARK in k)}


def dequantize_saved(state_dict: dict, dtype) -> dict:
    """A saved state dict (a checkpoint's module states) with bitsandbytes' weights dequantised to
    `dtype` and their constants' keys dropped: what `dequantized_state_dict` gives from a live
    module, for `jobspec export`. A 4-bit weight's constants are rebuilt by bitsandbytes' own
    `QuantState.from_dict` from the keys saved beside it; an 8-bit weight is int8 rows times SCB /
    127."""
    import torch
    from bitsandbytes import functional as bnbf

    out = dict(state_dict)
    for key in [k for k in state_dict if _QUANT_STATE_MARK in k]:
        weight_key = key.split(_QUANT_STATE_MARK)[0]
        prefix = weight_key + "."
        parts = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        quant_state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
        packed = state_dict[weight_key].cpu()
        out[weight_key] = bnbf.dequantize_4bit(packed, quant_state).to(dtype)
    for key in [k for k in state_dict if k.endswith(".SCB")]:
        # Linear8bitLt saves `<module>.SCB` beside `<module>.weight` (older versions
        # `<module>.weight.SCB`)
        weight_key = key[:-len(".SCB")] if key[:-len(".SCB")] in state_dict \
            else key[:-len("SCB")] + "weight"
        weight = state_dict[weight_key]
        if weight.dtype == torch.int8:
            scale = state_dict[key].float().unsqueeze(1)
            out[weight_key] = (weight.float() * scale / 127.0).to(dtype)
    return {k: v for k, v in out.items()
            if not (k.endswith(_QUANT_SUFFIXES) or _QUANT_STATE_MARK in k)}
