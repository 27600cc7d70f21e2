"""The task metrics of an evaluation (jobspec/tasks/metrics.py names them): counts per batch,
summed over ranks, turned into numbers once.

Every rank evaluates its own shard of the eval data, so a rank's accuracy or perplexity is not the
job's: a mean of per-rank means weighs a rank's few samples like another's many, and an F1 does not
average at all. Each rank therefore only counts -- a confusion matrix, correct and labelled tokens,
true-positive/predicted/gold entity spans, summed token losses and tokens -- into one vector of
float64 (exact for counts below 2^53), the vectors are summed with one `all_reduce`, and the
metrics come from the sums (`finish`). The arithmetic on counts and BIO spans is plain Python on
lists: the tests pin it down without torch or ranks.
"""
from __future__ import annotations

import math
from typing import Any

from jobspec import tasks
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import CONFUSION, IGNORE_INDEX, TOKENS
from jobspec.tasks.metrics import BIO_ONLY, is_bio

# --- metrics from summed counts (pure) ------------------------------------------------------------

def classification_metrics(confusion: list[list[float]]) -> dict[str, float]:
    """accuracy and macro-F1 from a confusion matrix (rows: true class, columns: predicted).

    The macro average is over the classes that occur among the labels or the predictions (what
    scikit-learn's f1_score(average="macro") does without `labels=`): a class absent from both says
    nothing about the model. A class's F1 is 2TP / (2TP + FP + FN)."""
    total = sum(sum(row) for row in confusion)
    if not total:
        return {}
    n = len(confusion)
    correct = sum(confusion[c][c] for c in range(n))
    f1s = []
    for c in range(n):
        true_c = sum(confusion[c])
        predicted_c = sum(confusion[r][c] for r in range(n))
        if true_c or predicted_c:
            f1s.append(2 * confusion[c][c] / (true_c + predicted_c))
    return {"accuracy": correct / total, "f1": sum(f1s) / len(f1s)}


def token_metrics(correct: float, labelled: float, spans: list[float] | None = None) -> dict:
    """token accuracy, and entity F1 from [true positive, predicted, gold] span counts (None: not
    BIO)."""
    out = {}
    if labelled:
        out["accuracy"] = correct / labelled
    if spans is not None:
        tp, predicted, gold = spans
        if predicted + gold:   # neither gold nor predicted entities: nothing to judge
            out["f1"] = 2 * tp / (predicted + gold)
    return out


def perplexity(loss_sum: float, tokens: float) -> dict[str, float]:
    """exp of the mean loss per predicted token (inf where that overflows)."""
    if not tokens:
        return {}
    mean = loss_sum / tokens
    return {"perplexity": math.exp(mean) if mean < 709 else math.inf}


def sum_vectors(vectors: list[list[float]]) -> list[float]:
    """What `all_reduce(SUM)` makes of the ranks' count vectors (the tests' stand-in for it)."""
    return [sum(column) for column in zip(*vectors)]


# --- BIO tags -------------------------------------------------------------------------------------

# is_bio (label names that are BIO tags) lives in jobspec/tasks/metrics.py, beside BIO_ONLY.


def bio_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """The entities of a tag sequence as (type, first, last) -- seqeval's default (conlleval)
    reading: a span starts at `B-`, at an `I-` after `O`, or where the type changes; it ends before
    `B-`, `O` or a change of type. So `I-PER I-PER` is one PER span and `B-PER I-LOC` two spans."""
    spans: set[tuple[str, int, int]] = set()
    start, kind = -1, ""   # -1: no span open
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, tag_type = tag.partition("-")
        if start >= 0 and (prefix in ("B", "O") or tag_type != kind):
            spans.add((kind, start, i - 1))
            start, kind = -1, ""
        if prefix == "B" or (prefix == "I" and start < 0):
            start, kind = i, tag_type
    return spans


def span_counts(gold: list[str], predicted: list[str]) -> tuple[int, int, int]:
    """(true positive, predicted, gold) entity spans of one sequence: a hit needs type and
    boundaries."""
    gold_spans, predicted_spans = bio_spans(gold), bio_spans(predicted)
    return len(gold_spans & predicted_spans), len(predicted_spans), len(gold_spans)


# --- counting on the ranks ------------------------------------------------------------------------

class TaskCounter:
    """Counts one task's metrics over the batches of one rank (`update`), as a vector every rank
    shapes alike (`vector`); `finish` turns the summed vector into the metrics.

    `label_names`: the training data's string labels -> ids (jobspec.data.loaders), for BIO tags."""

    def __init__(self, task: str, num_labels: int, label_names: dict | None = None):
        self.task, self.num_labels = task, num_labels
        self.counts, self.shift = tasks.get(task).counts, tasks.get(task).shift   # jobspec/tasks
        self.id2label = {i: name for name, i in (label_names or {}).items()}
        self.bio = self.counts == TOKENS and is_bio(self.id2label.values())
        # on the device: no sync per batch (but BIO spans, counted on the host)
        self._totals: Any = None

    @property
    def size(self) -> int:
        if self.counts == CONFUSION:
            return self.num_labels * self.num_labels
        if self.counts == TOKENS:
            return 5 if self.bio else 2
        return 2   # loss sum, tokens

    def update(self, loss, logits, labels) -> None:
        import torch
        if self._totals is None:
            self._totals = torch.zeros(self.size, dtype=torch.float64, device=labels.device)
        with torch.no_grad():
            if self.counts == CONFUSION:
                self._totals += self._confusion(logits, labels)
            elif self.counts == TOKENS:
                self._tokens(logits, labels)
            else:
                # the model's loss is the mean over the tokens it predicted: times their count,
                # their sum
                # causal-lm: the first token is predicted by none
                targets = labels[..., self.shift:]
                count = (targets != IGNORE_INDEX).sum().to(torch.float64)
                loss_sum = torch.where(count > 0, loss.detach().to(torch.float64) * count,
                                       torch.zeros_like(count))
                self._totals += torch.stack([loss_sum, count])

    def _confusion(self, logits, labels):
        import torch
        n = self.num_labels
        labels = labels.reshape(-1)
        predicted = logits.reshape(labels.shape[0], -1).argmax(-1)
        keep = (labels >= 0) & (labels < n) & (predicted < n)
        cells = torch.bincount(labels[keep] * n + predicted[keep], minlength=n * n)
        return cells.to(torch.float64)

    def _tokens(self, logits, labels) -> None:
        import torch
        predicted = logits.argmax(-1)
        labelled = labels != IGNORE_INDEX
        counts = [((predicted == labels) & labelled).sum(), labelled.sum()]
        if self.bio:   # spans are read per sequence, on the host
            tp = n_predicted = n_gold = 0
            for row_labels, row_predicted in zip(labels.cpu().tolist(), predicted.cpu().tolist()):
                pairs = [(g, p) for g, p in zip(row_labels, row_predicted) if g != IGNORE_INDEX]
                gold = [self.id2label[g] for g, _ in pairs]
                guess = [self.id2label.get(p, "O") for _, p in pairs]
                hits, guessed, actual = span_counts(gold, guess)
                tp, n_predicted, n_gold = tp + hits, n_predicted + guessed, n_gold + actual
            counts += [torch.tensor(v, device=labels.device) for v in (tp, n_predicted, n_gold)]
        self._totals += torch.stack([c.to(torch.float64) for c in counts])

    def vector(self, device=None):
        """This rank's counts (zeros when it saw no batch), for the all_reduce."""
        import torch
        if self._totals is None:
            return torch.zeros(self.size, dtype=torch.float64, device=device)
        return self._totals

    def finish(self, summed: list[float]) -> dict[str, float]:
        """The metrics (names without `eval/`) from every rank's summed counts."""
        if self.counts == CONFUSION:
            n = self.num_labels
            return classification_metrics([summed[r * n:(r + 1) * n] for r in range(n)])
        if self.counts == TOKENS:
            return token_metrics(summed[0], summed[1], summed[2:5] if self.bio else None)
        return perplexity(summed[0], summed[1])

    def produces(self, name: str) -> bool:
        """Whether this job can report metric `name` (entity F1 needs BIO tags)."""
        return (self.task, name) not in BIO_ONLY or self.bio


def logits_of(outputs):
    """The logits of a model's outputs: a ModelOutput (a dict), or a tuple (`return_dict: false`);
    None under `memory.tiled_loss`, which never makes them (perplexity needs only the loss)."""
    if isinstance(outputs, dict):
        return outputs.get("logits")
    logits = getattr(outputs, "logits", None)
    return outputs[1] if logits is None else logits   # (loss, logits, ...) when labels were given


def counter_for(spec: JobSpec, model_config, label_names: dict | None) -> TaskCounter:
    """The counter of the job's task; the class count is the model's (its head), else the spec's."""
    task = spec["model"]["task"]
    num_labels = getattr(model_config, "num_labels", None) or spec["model"]["num_labels"]
    return TaskCounter(task, int(num_labels), label_names)
