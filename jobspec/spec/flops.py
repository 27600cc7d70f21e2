"""FLOPs per trained token, forward + backward: the one FLOPs model of jobspec (plan, --fit, worker, bench).

Only matrix products are counted, 2 FLOPs per multiply-add, as in Kaplan et al. 2020 ("Scaling Laws
for Neural Language Models", section 2.1) and Narayanan et al. 2021 ("Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", appendix): norms, softmax, activations and the loss
are a few percent at most and not what a GPU's peak FLOP/s measures. Per token, with h the hidden
size, s the sequence length, f the FFN size, kv = kv_heads * h / heads, V the vocabulary, C the labels:

  embeddings   0                  input, position and token-type embeddings are table lookups, not products
  projections  2h(2h + 2kv)       Q, O: h x h; K, V: h x kv (grouped-query attention shrinks only these)
  attention    2*2*s*h            Q.K^T and scores.V over all s positions (eager attention computes the
                                  full s x s matrix also under a causal mask)
  FFN          4hf, gated 6hf     up + down; llama/mistral add the gate projection
  head         LM: 2hV (+2h^2 for the encoders' transform dense)
                   tied or not, the output layer is a matmul over the vocabulary (Narayanan's 2BshV term)
               token classification: 2hC
               sequence classification: encoders run pooler/dense (2h^2) and classifier (2hC) on the
                   first token only, so (2h^2 + 2hC)/s per token; gpt2/llama/mistral score every
                   position (2hC) and pick the last one afterwards
  backward     2 x forward        the gradient w.r.t. the input and w.r.t. the weight, each as large
                                  as the forward product (Kaplan, Narayanan)

  model FLOPs     = 3 (L (projections + attention + FFN) + head)
  hardware FLOPs  = model FLOPs + c (projections + attention + FFN - d)

c is the number of checkpointed layers (L with `activation_checkpointing: true`, ceil(L/k) with
`every_n_layers: k`, since the patch wraps layers i % k == 0): each is run forward once more in
backward. Following Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models": model vs hardware FLOPs utilization) the recompute counts only in hardware FLOPs; MFU divides
model FLOPs by the peak (PaLM's definition, Chowdhery et al. 2022), TFLOP/s reports the hardware
FLOPs the GPUs really did.

d is what the recompute leaves out. torch's non-reentrant checkpoint (jobspec's default,
`use_reentrant: false`) stops recomputing as soon as the last tensor saved for backward is back
("early stop", torch >= 2.1), and an op's inputs are saved before its kernel runs. A llama/mistral
layer ends in the down projection, whose output only meets the residual add (which saves nothing),
so it is never recomputed: d = 2hf. Layers ending in a LayerNorm (the post-LN encoders) or a dropout
(gpt2's resid_pdrop, 0.1 by default) recompute every product: d = 0, as with the reentrant checkpoint.

jobspec's `mlp` (jobspec/model/mlp.py) runs its layers on one mean-pooled vector per sequence: each layer
is 2h^2/s per token, the classifier 2hC/s, and the masked mean a (1 x s).(s x h) product, 2h per
token forward and 2h backward (the mask gets no gradient).

Known gaps: gpt2 with resid_pdrop 0 also skips its last projection (d = 2hf; ModelDims carries no
dropout, so it is counted as recomputed). deberta-v2's disentangled (relative-position) attention
terms are not counted: ModelDims does not carry pos_att_type / position_buckets; with
`relative_attention: false` it is a BERT-shaped encoder and exact. Causal SDPA / flash kernels may
skip the masked half of the attention products; they are counted whole (the model-FLOPs convention).
Frozen parameters (`model.freeze`) are counted as trained.
The numbers match torch.utils.flop_counter.FlopCounterMode (tests/spec/test_flops.py,
bench/flops_check.py). Pure: no torch, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jobspec.spec.model_dims import ModelDims

ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "deberta-v2", "distilbert"})
DECODERS = frozenset({"gpt2", "llama", "mistral"})
GATED_FFN = frozenset({"llama", "mistral"})
TASKS = ("sequence-classification", "token-classification", "masked-lm", "causal-lm")


@dataclass(frozen=True)
class TrainingFlops:
    """FLOPs per trained token, forward + backward; hardware adds the checkpoint recompute."""

    model_flops_per_token: float
    hardware_flops_per_token: float


def training_flops(dims: ModelDims, *, task: str, num_labels: int, seq_len: int,
                   activation_checkpointing: bool | dict | None = False) -> TrainingFlops:
    """The FLOPs model above for `AutoModelFor<task>` of `dims` at `seq_len` tokens per sequence.

    `activation_checkpointing` is the spec's `memory.activation_checkpointing` (false, true or
    {"every_n_layers": k}), or the worker's gradient_checkpointing patch args.
    Raises ValueError for a model family it has no formula for, or missing dimensions.
    """
    family = dims.model_type
    if family not in ENCODERS | DECODERS | {"mlp"}:
        raise ValueError(f"no FLOPs model for model type {family!r}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if not dims.num_layers or not dims.hidden_size or seq_len < 1 or num_labels < 1:
        raise ValueError("the FLOPs model needs num_layers, hidden_size, seq_len and num_labels >= 1")
    if task in ("masked-lm", "causal-lm") and not dims.vocab_size:
        raise ValueError("a language-model head needs vocab_size")
    h, s, layers = dims.hidden_size, seq_len, dims.num_layers

    if family == "mlp":
        layer = 2 * h * h / s
        pool = 2 * h
        model = 3 * (layers * layer + 2 * h * num_labels / s) + 2 * pool
    else:
        layer = layer_forward_flops(dims, s)
        model = 3 * (layers * layer + head_forward_flops(dims, task, num_labels, s))
    recompute = checkpointed_layers(layers, activation_checkpointing) * (
        layer - _skipped_by_early_stop(dims, activation_checkpointing))
    return TrainingFlops(model_flops_per_token=float(model), hardware_flops_per_token=float(model + recompute))


def layer_forward_flops(dims: ModelDims, seq_len: int) -> float:
    """Forward FLOPs per token of one transformer layer: projections, attention scores, FFN."""
    h = dims.hidden_size
    heads = dims.num_heads or 1
    kv = (dims.num_key_value_heads or heads) * (h // heads)
    ffn = dims.intermediate_size or 4 * h
    projections = 2 * h * (2 * h + 2 * kv)
    attention = 2 * 2 * seq_len * h
    mlp = (6 if dims.model_type in GATED_FFN else 4) * h * ffn
    return float(projections + attention + mlp)


def head_forward_flops(dims: ModelDims, task: str, num_labels: int, seq_len: int) -> float:
    """Forward FLOPs per token after the last layer (the task head); embeddings cost nothing."""
    h, encoder = dims.hidden_size, dims.model_type in ENCODERS
    if task in ("masked-lm", "causal-lm"):
        return float(2 * h * dims.vocab_size + (2 * h * h if encoder else 0))
    if task == "token-classification" or not encoder:
        return float(2 * h * num_labels)
    return (2 * h * h + 2 * h * num_labels) / seq_len   # pooler + classifier on the first token only


def _skipped_by_early_stop(dims: ModelDims, setting: bool | dict | None) -> float:
    """Forward FLOPs per token of a checkpointed layer that the recompute never runs (d above)."""
    reentrant = isinstance(setting, dict) and setting.get("use_reentrant", False)
    if reentrant or dims.model_type not in GATED_FFN:
        return 0.0
    return float(2 * dims.hidden_size * (dims.intermediate_size or 4 * dims.hidden_size))


def checkpointed_layers(num_layers: int, setting: bool | dict | None) -> int:
    """Layers whose forward is recomputed in backward: all, one in k (layers i % k == 0), or none."""
    if setting is None or setting is False:
        return 0
    every = setting.get("every_n_layers", 1) if isinstance(setting, dict) else 1
    return math.ceil(num_layers / every)
