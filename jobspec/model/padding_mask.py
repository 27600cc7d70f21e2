"""The 2-D attention mask a batch hands the model, only where attention needs it.

transformers turns a 2-D `attention_mask` into a [batch, 1, seq, seq] mask for every attention
implementation but flash-attention's, unless it can prove the mask all ones (sdpa on a GPU: then
`is_causal`, and the flash kernel). With a mask, SDPA cannot run the flash kernel: it converts the
boolean mask into an additive bias in the query's dtype in every layer, and the memory-efficient
kernel keeps that bias for the backward: seq² bytes per layer (2 GiB per layer at 32K tokens).

A causal LM needs no padding mask when each row's padding sits at its end (jobspec's loaders pad on
the right and label the pads -100): a real token attends only to the tokens before it, so no pad
enters its context, and the pads' own outputs carry no loss. An encoder (bidirectional attention)
needs the mask of a row with padding. So the ranks drop the mask of a batch without padding, and of
a causal LM's right-padded batch (`model_inputs`), and the planner's trace hands the model a mask
exactly when the ranks would (`trace_mask`): the plan keeps what the GPU keeps.
"""
from __future__ import annotations

from typing import Any


def model_inputs(batch: dict, causal: bool) -> dict:
    """`batch` without its `attention_mask` where attention does not need it (see the module's
    docstring): no padding, or a causal model with every row padded on the right. On the host batch:
    no device sync."""
    mask: Any = batch.get("attention_mask")
    if mask is None or mask.dim() != 2 or not _droppable(mask, causal):
        return batch
    return {name: value for name, value in batch.items() if name != "attention_mask"}


NO_MASK, PADDING, PACKED = "none", "padding", "packed"


def trace_mask(causal: bool, fixed_length: bool, packed: bool) -> str:
    """What a training batch tells the model's attention on the ranks, for the planner's trace:
    PACKED, position ids that restart per sample (`data.packing`: transformers builds the packed
    samples' mask from them); PADDING, an encoder's mask of rows that may be padded (records of
    varying length); else NO_MASK (synthetic data is never padded; a causal LM's mask is
    dropped)."""
    if packed:
        return PACKED
    return NO_MASK if causal or fixed_length else PADDING


def _droppable(mask: Any, causal: bool) -> bool:
    if bool(mask.all()):
        return True
    if not causal:
        return False
    # right padding: along each row the mask never rises from 0 back to 1
    return not bool((mask[:, 1:] > mask[:, :-1]).any())
