"""`token-classification`: one class per word (named entities, part of speech).

Head AutoModelForTokenClassification (`model.num_labels` classes); data: the first text column holds
lists of words, `data.label_field` one label per word; labels on each word's first sub-word token,
-100 elsewhere; loss the head's cross-entropy over the labelled tokens; metrics token accuracy and,
when the labels are BIO tags, entity F1 over spans (seqeval's default).
"""
from jobspec.tasks.base import TOKEN_CLASS, TOKENS, Task

TASK = Task(
    name="token-classification",
    auto_class="AutoModelForTokenClassification",
    labels=TOKEN_CLASS,
    counts=TOKENS,
    metrics=("loss", "accuracy", "f1"),
    loss="cross-entropy over the labelled tokens",
    classification=True,
    head_modules=("classifier", "score"),
    words=True,
    metric_labels={"accuracy": "token accuracy", "f1": "entity F1"},
    bio_only=("f1",),
)
