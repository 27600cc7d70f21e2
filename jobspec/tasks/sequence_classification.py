"""`sequence-classification`: one class per sample (sentiment, topic).

Head AutoModelForSequenceClassification (`model.num_labels` classes); labels one class id per
sample, from `data.label_field` (names numbered in sorted order); loss the head's cross-entropy over
the classes; metrics accuracy and macro-F1 from a confusion matrix of the argmax of the logits.
"""
from jobspec.tasks.base import CLASS, CONFUSION, Task

TASK = Task(
    name="sequence-classification",
    auto_class="AutoModelForSequenceClassification",
    labels=CLASS,
    counts=CONFUSION,
    metrics=("loss", "accuracy", "f1"),
    loss="cross-entropy over the classes",
    classification=True,
    head_modules=("pre_classifier", "classifier", "score"),
    metric_labels={"f1": "macro-F1"},
)
