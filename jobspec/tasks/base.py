"""What one task module declares (`Task`); jobspec/tasks/__init__.py registers them. Pure data."""
from __future__ import annotations

from dataclasses import dataclass, field

# `labels`: the data's label shape, which the loaders (jobspec/data/loaders.py), the planner's
# traced step (jobspec/model/step.py) and the metric counter (jobspec/train/task_metrics.py) produce
# and read
CLASS = "class"              # one class id per sample: labels (batch,)
# one class id per token (each word's first sub-word), -100 elsewhere: (batch, seq)
TOKEN_CLASS = "token-class"
# the ids of 15% of the tokens (BERT's 80/10/10 masking), -100 elsewhere
MASKED_TOKENS = "masked"
NEXT_TOKENS = "next"         # the input ids themselves (the model shifts them), -100 on padding
LABEL_SHAPES = (CLASS, TOKEN_CLASS, MASKED_TOKENS, NEXT_TOKENS)
# the label value the losses skip (cross-entropy's `ignore_index`, transformers' too): the "-100
# elsewhere" of the shapes above, padding and a chat record's prompt
IGNORE_INDEX = -100

# `counts`: what an evaluation counts per batch to compute the task's metrics
# a confusion matrix of argmax(logits) against the class: accuracy, macro-F1
CONFUSION = "confusion"
# labelled tokens right (and BIO entity spans): token accuracy, entity F1
TOKENS = "tokens"
TOKEN_LOSS = "token-loss"    # the loss summed over the predicted tokens: perplexity
COUNTS = (CONFUSION, TOKENS, TOKEN_LOSS)


@dataclass(frozen=True)
class Task:
    """One value of the schema's `model.task`."""

    name: str
    # the transformers head: `transformers.<auto_class>.from_config / from_pretrained`
    auto_class: str
    labels: str
    counts: str
    # the evaluation metrics it produces (`eval/<name>`), `loss` first
    metrics: tuple[str, ...]
    # the loss the head computes from `labels` (the model's own; jobspec adds none)
    loss: str
    # whether the head has `model.num_labels` outputs and the data a label column
    # (`data.label_field`)
    classification: bool = False
    # whether the first text column holds lists of words (tokenized with is_split_into_words)
    words: bool = False
    # logits at position i predict the label at i + shift (causal-lm: 1, the model shifts
    # internally)
    shift: int = 0
    # how the summary and the report name a metric of this task, where the generic name says too
    # little
    metric_labels: dict = field(default_factory=dict)
    # metrics produced only when the labels are BIO tags
    bio_only: tuple[str, ...] = ()
    # the head's module names as transformers' heads call them (`classifier`: BERT, RoBERTa,
    # DeBERTa; `score`: the decoder families; `pre_classifier`: DistilBERT): trained in full by
    # default beside LoRA adapters (`model.lora.modules_to_save: null`), as a new head starts from
    # random weights
    head_modules: tuple[str, ...] = ()

    def __post_init__(self):
        if self.labels not in LABEL_SHAPES or self.counts not in COUNTS:
            raise TypeError(f"task {self.name}: labels must be one of {LABEL_SHAPES}, counts one "
                            f"of {COUNTS}")
        if self.metrics[:1] != ("loss",):
            raise TypeError(f"task {self.name}: the metrics start with loss")
