"""`model.architecture: mlp`: a deep MLP classifier built into jobspec, for activation-checkpointing
studies.

token embedding -> mean over the (unmasked) sequence -> num_layers x (Linear(h, h) + ReLU) ->
classifier.

It is the network of the "checkpoint_sequential segments" experiment (docs/benchmarks.md): after the
pooling, every activation is a (batch, hidden) matrix, so memory is a clean function of the number
of layers kept, and it runs fast on a CPU. It answers like a transformers model (`forward(input_ids,
attention_mask=None, labels=None)` -> `.loss`, `.logits`) so the worker trains it unchanged, and
keeps its layers in `layers` (an `nn.ModuleList`), where the every-k-th-layer checkpointing patch
finds them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec

ARCHITECTURE = "mlp"
# what `model.config` may set
CONFIG_KEYS = ("hidden_size", "num_layers", "vocab_size", "num_labels")


@dataclass
class MLPConfig:
    """The `model.config` of an mlp; unknown keys are a spec error (there is no AutoConfig to absorb
    them)."""

    hidden_size: int = 1024
    num_layers: int = 16
    vocab_size: int = 30522
    num_labels: int = 2
    model_type: str = ARCHITECTURE
    use_cache: bool = False   # read by the checkpointing patch, as on transformers configs

    @property
    def num_hidden_layers(self) -> int:   # the transformers name, read by metrics and tools
        return self.num_layers

    def to_dict(self) -> dict:
        return asdict(self)


class MLPBlock(nn.Sequential):
    """One layer: Linear(h, h) then ReLU. A Sequential, so its first child is the Linear."""

    def __init__(self, hidden_size: int):
        super().__init__(nn.Linear(hidden_size, hidden_size), nn.ReLU())


class MLPClassifier(nn.Module):
    """Deep MLP over mean-pooled token embeddings; the loss is cross-entropy over `num_labels`
    classes."""

    has_attention = False   # the attention_implementation patch has nothing to switch

    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MLPBlock(config.hidden_size) for _ in range(config.num_layers))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask=None, labels=None, **_ignored):
        from transformers.modeling_outputs import SequenceClassifierOutput

        tokens = self.embeddings(input_ids)                      # (batch, seq, hidden)
        if attention_mask is None:
            hidden = tokens.mean(dim=1)
        else:
            # weights sum to 1 over each sample's real tokens; padding counts for nothing
            weights = attention_mask.to(tokens.dtype)
            weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1)
            hidden = torch.bmm(weights.unsqueeze(1), tokens).squeeze(1)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.classifier(hidden)
        loss = F.cross_entropy(logits.float(), labels.view(-1)) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_mlp(spec: JobSpec) -> MLPClassifier:
    """The spec's mlp with seeded random weights; config errors name `model.config`."""
    model_spec = spec["model"]
    task = model_spec["task"]
    if task != "sequence-classification":
        raise spec_error(f"architecture mlp only has a sequence-classification head, not {task!r}",
                         path=("model", "task"), hint="set model.task: sequence-classification")
    values = dict(model_spec["config"])
    values.setdefault("num_labels", model_spec["num_labels"])
    known = set(CONFIG_KEYS)
    unknown = sorted(set(values) - known)
    if unknown:
        raise spec_error(f"unknown mlp config key(s): {', '.join(unknown)}",
                         path=("model", "config", unknown[0]),
                         hint=f"an mlp takes {', '.join(sorted(known))}")
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise spec_error(f"mlp config {key} must be a positive integer, got {value!r}",
                             path=("model", "config", key),
                             hint=f"e.g. {key}: {getattr(MLPConfig, key)}")
    torch.manual_seed(spec["training"]["seed"])
    return MLPClassifier(MLPConfig(**values))
