"""DeepSpeed's long-sequence tiling (ALST) on a Hugging Face model: `memory.tiled_loss`,
`memory.tiled_mlp`.

Shared by the ranks (train/patches.py registers both as patches) and the planner's trace
(model/planner_trace.py), so the plan measures the tiles the ranks run.

Tiled loss. A causal LM's head turns every position's hidden state into vocabulary logits (128,256
per token for Llama 3) and the cross-entropy upcasts them to fp32: at 32K tokens that is tens of
GiB. Here the model's forward runs its base model, then the head and the loss over sequence tiles
through DeepSpeed's `SequenceTiledCompute` (ulysses_sp.py) with a summed reduction: each tile's
logits exist only while that tile runs, in the forward and again in the backward, which recomputes
them. The loss returned is the mean over the labelled tokens (-100 skipped) exactly as transformers'
untiled loss, and the output also carries the labelled tokens' summed loss and their count
(`loss_sum`, `loss_tokens`) so a token-weighted loss over micro-batches and ranks composes with it.
DeepSpeed's `TiledFusedLogitsLoss` is not used: it backpropagates every tile inside the forward with
a gradient of 1 and only scales the hidden states' gradient by the incoming one, so the head's
weight gradient is wrong whenever the loss is scaled after the forward (DeepSpeed divides it by the
accumulation steps; fp16 multiplies it by the loss scale; tests/model/test_tiling.py shows it); the
recompute costs one more head matmul per step.

Tiled MLP. DeepSpeed's `TiledMLP` runs each layer's `mlp` over sequence tiles (one tile per
`hidden_size` tokens, DeepSpeed's own choice) under no_grad and recomputes a tile at a time in the
backward, so the MLP's intermediate activations (intermediate_size wide, ~3.5x the hidden state)
exist for one tile only.

Under several ranks the tile count is agreed (the maximum): under ZeRO-3 every head or MLP call
gathers its parameters, a collective every rank must make the same number of times.
"""
from __future__ import annotations

import math

from jobspec.errors import spec_error
from jobspec.tasks.base import IGNORE_INDEX

TILE_BYTES = 1024 ** 3   # the documented bound: one tile's logits and their fp32 loss copies
# bytes per token and vocabulary entry of one tile while its loss runs: the logits in the working
# dtype (counted as 4: fp32 jobs), their fp32 upcast, the log-softmax and, in the backward, its
# gradient
_TILE_BYTES_PER_LOGIT = 4 + 4 + 4 + 4


def default_tiles(tokens: int, vocab: int, tile_bytes: int = TILE_BYTES) -> int:
    """Tiles over `tokens` positions so one tile's logits and loss copies stay within
    `tile_bytes`."""
    per_token = max(1, vocab) * _TILE_BYTES_PER_LOGIT
    tile_tokens = max(1, tile_bytes // per_token)
    return max(1, math.ceil(tokens / tile_tokens))


def tiled_loss(model, tiles: int | None = None, tile_bytes: int = TILE_BYTES) -> str:
    """Patch a causal LM so training and evaluation compute the head and the loss over sequence
    tiles (`tiles`, else as many as keep one tile within `tile_bytes`); a forward without labels is
    untouched."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    vocab = int(getattr(config, "vocab_size", 0)
                or (head.weight.shape[0] if head is not None else 0))
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    tied = embeddings is not None and weight is getattr(head, "weight", False)

    def head_loss(head, hidden, targets):
        return tiled_cross_entropy(head, hidden, targets, tiles=tiles, vocab=vocab, softcap=softcap,
                                   tile_bytes=tile_bytes, tied=tied)

    replace_head_loss(model, head_loss, path=("memory", "tiled_loss"),
                      hint="turn memory.tiled_loss off for this model")
    how = f"{tiles} tiles" if tiles \
        else f"tiles of at most {tile_bytes / 1024 ** 3:g} GiB of logits"
    return ("tiled loss: the head and the cross-entropy over sequence tiles "
            f"({how}; DeepSpeed SequenceTiledCompute)")


def replace_head_loss(model, head_loss, *, path: tuple, hint: str) -> None:
    """Patch a causal LM's forward with labels: its base model, then `head_loss(head, hidden,
    targets)` -> (the labelled positions' summed loss in fp32, their count), for the tiled loss and
    Liger's fused linear cross-entropy (model/fused_kernels.py) alike. The output carries the mean
    as `loss`, the sum and count as `loss_sum` and `loss_tokens`, which jobspec's token-weighted
    loss takes (train/token_loss.summed_loss); transformers' own loss is never computed. `path`,
    `hint`: where a model without a base model and an output projection is refused."""
    import functools

    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None:
        raise spec_error(f"{type(model).__name__} has no base model and output projection to "
                         "compute the loss from", path=path, hint=hint)
    untiled = model.forward

    @functools.wraps(untiled)
    def forward(input_ids=None, attention_mask=None, labels=None, shift_labels=None, **kwargs):
        # `shift_labels`: labels already aligned with the positions that predict them (transformers'
        # name for them): a sequence-parallel shard's next tokens (train/sequence_parallel), whose
        # last label is the next shard's first token
        if labels is None and shift_labels is None:
            return untiled(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("num_items_in_batch", None)
        kwargs.setdefault("return_dict", True)
        outputs = base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = outputs[0]
        targets = shift_labels if labels is None else next_token_labels(labels)
        # the head as the model has it now: LoRA on the output projection wraps it after this patch
        loss_sum, count = head_loss(model.get_output_embeddings(), hidden, targets)
        return TiledLossOutput(loss=loss_sum / count.to(loss_sum.dtype), loss_sum=loss_sum,
                               loss_tokens=count)

    model.forward = forward


def next_token_labels(labels):
    """Labels aligned with the positions that predict them: position i predicts label i + 1 (the
    last position none), as transformers' causal-LM loss shifts them."""
    import torch.nn.functional as F

    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def tiled_cross_entropy(head, hidden, targets, *, tiles: int | None, vocab: int, softcap=None,
                        tile_bytes: int = TILE_BYTES, tied: bool = False):
    """(summed cross-entropy of the labelled positions in fp32, their count) of `head(hidden)`
    against `targets` ([batch, seq], -100 skipped), computed over sequence tiles."""
    import torch
    import torch.nn.functional as F

    batch, seq = targets.shape[:2]
    count = (targets != IGNORE_INDEX).sum()
    shards = min(seq, tiles or default_tiles(batch * seq, vocab, tile_bytes))
    shards = agreed_tiles(shards, hidden.device)

    def tile_loss(hidden, targets):
        if not torch.is_grad_enabled():
            # the tiled forward runs under no_grad, where a slice of a tensor that wants a gradient
            # says it wants one without a graph (module hooks that watch gradients, torch's
            # ModTracker, fail on it)
            hidden = hidden.detach()
        logits = head(hidden)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    params = [p for p in head.parameters() if p.requires_grad]
    if tied and any(hasattr(p, "ds_id") for p in params):
        # a head tied to the input embeddings: the tiles' backward stores its gradient before the
        # embeddings add theirs, and ZeRO reduces the two apart: stage 3 loses one, stages 1-2
        # refuse the second ("Gradient computed twice"); measured on 2 CPU ranks, refused up front
        # by techniques/tiled_loss.py
        raise spec_error("the tiled loss cannot train a head tied to the input embeddings under "
                         "ZeRO 1-3",
                         path=("memory", "tiled_loss"),
                         hint="memory.zero_stage: 0, or model.config.tie_word_embeddings: false")
    if not torch.is_grad_enabled():   # evaluation: no backward, a plain loop over the tiles
        step = math.ceil(seq / shards)
        total = sum((tile_loss(hidden[:, i:i + step], targets[:, i:i + step])
                     for i in range(0, seq, step)),
                    torch.zeros((), dtype=torch.float32, device=hidden.device))
        return total, count
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    if params and not hidden.requires_grad:
        # a frozen base whose head trains: the tiles' backward runs only for an input that wants a
        # gradient
        hidden = hidden.detach().requires_grad_(True)
    total = sequence_tiled_compute(tile_loss, seq, shards, {"hidden": hidden, "targets": targets},
                                   {}, "hidden", compute_params=params, output_unshard_dimension=0,
                                   output_reduction="sum")
    return total, count


def tiled_mlp(model) -> str:
    """Every layer's `mlp` runs through DeepSpeed's TiledMLP (one tile per hidden_size tokens)."""
    from jobspec.model.structure import find_layer_stack

    layers = find_layer_stack(model)
    mlps = [getattr(layer, "mlp", None) for layer in (layers or [])]
    if not mlps or any(mlp is None for mlp in mlps):
        raise spec_error(f"{type(model).__name__}: no `mlp` module in its layers to tile",
                         path=("memory", "tiled_mlp"),
                         hint="tiled_mlp tiles decoder layers' `mlp` (Llama, Mistral, Qwen, Gemma, "
                              "Phi-3, GPT-2); turn it off for this model")
    for mlp in mlps:
        assert mlp is not None   # refused above
        mlp.forward = _tiled_mlp_forward(mlp)
    return (f"tiled MLP: {len(mlps)} layers' MLP over sequence tiles of hidden_size tokens "
            "(DeepSpeed TiledMLP)")


def _tiled_mlp_forward(mlp):
    import functools

    untiled = mlp.forward

    @functools.wraps(untiled)
    def forward(x):
        import torch
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        if not (mlp.training and torch.is_grad_enabled()):
            return untiled(x)
        shards = agreed_tiles(max(1, math.ceil(x.shape[-2] / x.shape[-1])), x.device)
        params = [p for p in mlp.parameters() if p.requires_grad]
        if params and not x.requires_grad:
            # see tiled_cross_entropy: the tiles' backward needs it
            x = x.detach().requires_grad_(True)
        return TiledMLP.apply(_untiled_tile(untiled), mlp, x, shards, params)

    return forward


def _untiled_tile(untiled):
    def tile(_mlp, x):
        import torch

        # the tiled forward runs under no_grad: see tiled_cross_entropy's tile_loss
        return untiled(x if torch.is_grad_enabled() else x.detach())

    return tile


def agreed_tiles(tiles: int, device) -> int:
    """The largest tile count of any rank (one all-reduce), so every rank gathers alike under
    ZeRO-3."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tiles
    value = torch.tensor([tiles], dtype=torch.long, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _output_class():
    from dataclasses import dataclass

    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class TiledLossOutput(CausalLMOutputWithPast):
        """A causal LM's output without logits (a tiled or fused loss): the mean loss, and its sum
        and labelled-token count."""

        loss_sum: torch.Tensor | None = None
        loss_tokens: torch.Tensor | None = None

    return TiledLossOutput


# constructs the output class (built lazily: no torch at import)
def TiledLossOutput(**fields):  # noqa: N802
    global _OUTPUT
    if _OUTPUT is None:
        _OUTPUT = _output_class()
    return _OUTPUT(**fields)


_OUTPUT = None
