"""The evaluation metrics each task produces, and which way each one improves.

Pure data, shared by validation (`export.best_metric` must be one the job's task produces), the
ranks (jobspec/train/task_metrics.py computes them; jobspec/export/exporter.py picks the best model
by one), the closing summary and `jobspec report`. Every metric is logged as `eval/<name>`:

- `loss`: the mean eval loss per sample (every task);
- `accuracy`: sequence-classification, share of samples classified right; token-classification,
  share of labelled tokens (each word's first sub-word) tagged right;
- `f1`: sequence-classification, macro-F1 over the classes that occur in the labels or the
  predictions; token-classification, entity F1 over BIO-tagged spans (seqeval's default: exact
  type and boundaries, micro-averaged), only when the labels are BIO tags;
- `perplexity`: masked-lm and causal-lm, exp of the mean loss per predicted token.

Which task produces which metric, and what it calls them, is declared by each task's module
(jobspec/tasks): TASK_METRICS, TASK_LABELS and BIO_ONLY are read from there. Keep DIRECTION's keys
equal to `export.best_metric`'s enum (tests/spec/test_best_metric.py checks it).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable

from jobspec import tasks

PREFIX = "eval/"
# name -> "min" (lower is better) or "max"
DIRECTION: dict[str, str] = {"loss": "min", "accuracy": "max", "f1": "max", "perplexity": "min"}
TASK_METRICS: dict[str,
                   tuple[str, ...]] = {name: task.metrics for name, task in tasks.TASKS.items()}
# how the closing summary and the report name a metric (`f1` means another F1 per task)
LABELS: dict[str, str] = {"accuracy": "accuracy", "f1": "F1", "perplexity": "perplexity"}
TASK_LABELS: dict[tuple[str, str],
                  str] = {(name, metric): label for name, task in tasks.TASKS.items()
                                           for metric, label in task.metric_labels.items()}
# the metrics past the loss, in the order the summary and the report show them
TASK_ONLY = ("accuracy", "f1", "perplexity")
# produced only when the labels are BIO tags
BIO_ONLY = {(name, metric) for name, task in tasks.TASKS.items() for metric in task.bio_only}


def key(name: str) -> str:
    """`accuracy` -> `eval/accuracy`."""
    return PREFIX + name


def label(name: str, task: str | None = None) -> str:
    return TASK_LABELS.get((task or "", name), LABELS.get(name, name))


def metrics_of(task: str) -> tuple[str, ...]:
    return TASK_METRICS.get(task, ("loss",))


def improves(name: str, value: float | None, best: float | None) -> bool:
    """Whether `value` beats the best so far (`best` None: nothing yet). NaN never wins."""
    if value is None or math.isnan(value):
        return False
    if best is None:
        return True
    return value < best if DIRECTION[name] == "min" else value > best


_BIO_TAG = re.compile(r"^(?:O|[BI]-.+)$")


def is_bio(names: Iterable[str]) -> bool:
    """Whether label names are BIO (IOB2) tags: each `O`, `B-<type>` or `I-<type>`, at least one
    `B-`."""
    names = list(names)
    return bool(names) and all(isinstance(n, str) and _BIO_TAG.match(n) for n in names) \
        and any(n.startswith("B-") for n in names)
