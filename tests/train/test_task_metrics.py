"""Task metrics (jobspec/train/task_metrics.py): the arithmetic on hand-computed cases, BIO spans as
seqeval reads them, counts summed over ranks (not a mean of the ranks' metrics), the worker's
`evaluate` on a one-rank process group, and the label names an export writes."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from jobspec.errors import SpecError
from jobspec.train.task_metrics import (
    IGNORE_INDEX,
    TaskCounter,
    bio_spans,
    classification_metrics,
    counter_for,
    is_bio,
    perplexity,
    span_counts,
    sum_vectors,
    token_metrics,
)


# Tolerances, derived: the metrics are ratios of integer counts (exact in float64 below 2**53) and sums
# of a few such ratios, so the code's formula and the hand-written one differ only by their float64
# roundings, at most one half-ulp (2**-53 relative) per operation and under 8 operations each: 16 of them.
# Counts that pass through float32 tensors (the counters' vectors, a float32 loss) are integers or
# dyadic values exact in float32: compared exactly; a float32 loss and what is computed from it (the
# mean of float32 losses, the exponential of a ratio of them) carry float32's rounding, 2**-24 per
# operation, under 8 operations.
FLOAT64_FORMULA = 16 * 2**-53
FLOAT32_FORMULA = 8 * 2**-24


def one_hot_logits(predicted: list, classes: int) -> torch.Tensor:
    """Logits whose argmax is `predicted` (any shape of class ids)."""
    ids = torch.tensor(predicted)
    return torch.nn.functional.one_hot(ids, classes).float() * 5.0


# --- sequence classification ------------------------------------------------------------------------

def test_accuracy_and_macro_f1_of_a_hand_computed_confusion_matrix():
    confusion = [[3, 1, 0],   # true 0: 3 right, 1 predicted as 1
                 [0, 2, 2],   # true 1
                 [1, 0, 1]]   # true 2
    metrics = classification_metrics(confusion)
    assert metrics["accuracy"] == pytest.approx(6 / 10, rel=FLOAT64_FORMULA)
    # F1 per class = 2TP / (true + predicted): 6/8, 4/7, 2/5
    assert metrics["f1"] == pytest.approx((6 / 8 + 4 / 7 + 2 / 5) / 3, rel=FLOAT64_FORMULA)


def test_macro_f1_leaves_out_a_class_absent_from_labels_and_predictions():
    metrics = classification_metrics([[2, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert metrics["f1"] == pytest.approx((4 / 5 + 2 / 3) / 2, rel=FLOAT64_FORMULA)
    # present among the predictions only: it counts, with F1 0
    assert classification_metrics([[1, 1], [0, 0]])["f1"] == pytest.approx((2 / 3 + 0) / 2, rel=FLOAT64_FORMULA)


def test_no_samples_give_no_metrics():
    assert classification_metrics([[0, 0], [0, 0]]) == {}
    assert token_metrics(0, 0, [0, 0, 0]) == {} and perplexity(0.0, 0) == {}


def test_the_counter_builds_the_confusion_matrix_from_logits():
    counter = TaskCounter("sequence-classification", 3)
    counter.update(None, one_hot_logits([0, 1, 2, 2], 3), torch.tensor([0, 1, 1, 2]))
    counter.update(None, one_hot_logits([0], 3), torch.tensor([2]))
    summed = counter.vector().tolist()
    assert summed == [1, 0, 0, 0, 1, 1, 1, 0, 1]
    assert counter.finish(summed)["accuracy"] == pytest.approx(3 / 5, rel=FLOAT64_FORMULA)


def test_ranks_counts_are_summed_not_their_metrics_averaged():
    """Rank 0 saw 8 samples, all right; rank 1 saw 2, both wrong: the job's accuracy is 8/10, where a
    mean of the ranks' accuracies would say 1/2; the F1 is the one of all ten samples."""
    labels = [[0, 1, 0, 1, 0, 1, 0, 1], [0, 1]]
    predicted = [[0, 1, 0, 1, 0, 1, 0, 1], [1, 0]]
    ranks = []
    for y, p in zip(labels, predicted):
        counter = TaskCounter("sequence-classification", 2)
        counter.update(None, one_hot_logits(p, 2), torch.tensor(y))
        ranks.append(counter.vector().tolist())
    job = TaskCounter("sequence-classification", 2)
    metrics = job.finish(sum_vectors(ranks))
    assert metrics["accuracy"] == pytest.approx(0.8, rel=FLOAT64_FORMULA)
    per_rank = [job.finish(v)["accuracy"] for v in ranks]
    assert sum(per_rank) / 2 == pytest.approx(0.5, rel=FLOAT64_FORMULA)   # what a mean of means would have logged
    whole = TaskCounter("sequence-classification", 2)
    whole.update(None, one_hot_logits([p for rank in predicted for p in rank], 2),
                 torch.tensor([y for rank in labels for y in rank]))
    assert job.finish(whole.vector().tolist()) == metrics   # the same counts: the same floats


def test_a_rank_without_batches_adds_zeros_of_the_same_shape():
    assert TaskCounter("sequence-classification", 3).vector().tolist() == [0.0] * 9
    assert TaskCounter("causal-lm", 2).vector().tolist() == [0.0, 0.0]


# --- token classification ---------------------------------------------------------------------------

@pytest.mark.parametrize("tags, spans", [
    (["B-PER", "I-PER", "O", "B-LOC"], {("PER", 0, 1), ("LOC", 3, 3)}),
    (["I-PER", "I-PER", "O"], {("PER", 0, 1)}),                    # an I- after O starts a span
    (["B-PER", "I-LOC"], {("PER", 0, 0), ("LOC", 1, 1)}),          # a change of type ends one
    (["B-PER", "B-PER", "I-PER"], {("PER", 0, 0), ("PER", 1, 2)}),  # B- ends the previous one
    (["O", "O"], set()),
    (["B-MISC"], {("MISC", 0, 0)}),                                  # closed at the end
    (["B-ORG", "I-ORG", "I-ORG", "I-ORG"], {("ORG", 0, 3)}),
])
def test_bio_spans_as_seqeval_reads_them(tags, spans):
    assert bio_spans(tags) == spans


def test_entity_f1_needs_type_and_both_boundaries():
    gold = ["B-PER", "I-PER", "O", "B-LOC", "O", "B-ORG"]
    guess = ["B-PER", "I-PER", "O", "B-ORG", "O", "B-ORG", ]
    assert span_counts(gold, guess) == (2, 3, 3)
    assert span_counts(["B-PER", "I-PER"], ["B-PER", "O"]) == (0, 1, 1)   # a short span is a miss
    # 2 hits of 3 predicted and 3 gold: precision = recall = 2/3
    assert token_metrics(5, 6, [2, 3, 3])["f1"] == pytest.approx(2 / 3, rel=FLOAT64_FORMULA)


def test_is_bio():
    assert is_bio(["O", "B-PER", "I-PER", "B-LOC"])
    assert not is_bio(["O", "I-PER"])                  # no B-: not IOB2
    assert not is_bio(["positive", "negative"]) and not is_bio([]) and not is_bio([0, 1])


def test_token_counter_counts_first_sub_words_only_and_spans_per_sequence():
    names = {"B-PER": 0, "I-PER": 1, "O": 2}
    counter = TaskCounter("token-classification", 3, names)
    assert counter.bio and counter.produces("f1")
    x = IGNORE_INDEX
    # row 0: gold B-PER I-PER O (with ignored special tokens), predicted right; row 1: gold O B-PER,
    # predicted B-PER B-PER: one hit, one spurious entity. The ignored positions' predictions never count.
    labels = torch.tensor([[x, 0, 1, 2, x], [x, 2, 0, x, x]])
    predicted = [[0, 0, 1, 2, 0], [0, 0, 0, 0, 0]]
    counter.update(None, one_hot_logits(predicted, 3), labels)
    summed = counter.vector().tolist()
    assert summed == [4, 5, 2, 3, 2]   # correct, labelled, true positive, predicted, gold
    metrics = counter.finish(summed)
    assert metrics == pytest.approx({"accuracy": 4 / 5, "f1": 2 * 2 / 5}, rel=FLOAT64_FORMULA)


def test_token_counter_without_bio_names_reports_token_accuracy_only():
    counter = TaskCounter("token-classification", 2, None)
    assert not counter.bio and not counter.produces("f1") and counter.produces("accuracy")
    counter.update(None, one_hot_logits([[1, 1, 0]], 2), torch.tensor([[1, 0, IGNORE_INDEX]]))
    assert counter.finish(counter.vector().tolist()) == {"accuracy": 0.5}


# --- language models ----------------------------------------------------------------------------------

def test_perplexity_weighs_batches_by_their_predicted_tokens():
    counter = TaskCounter("masked-lm", 2)
    x = IGNORE_INDEX
    counter.update(torch.tensor(2.0), None, torch.tensor([[5, x, 7, 9]]))   # 3 tokens, mean loss 2
    counter.update(torch.tensor(1.0), None, torch.tensor([[x, 4, x, x]]))   # 1 token, mean loss 1
    counter.update(torch.tensor(float("nan")), None, torch.tensor([[x, x]]))   # none: transformers' 0/0
    summed = counter.vector().tolist()
    assert summed == [7.0, 4.0]   # 2*3 + 1*1 and 3 + 1: exact in float32
    assert counter.finish(summed)["perplexity"] == pytest.approx(math.exp(7 / 4), rel=FLOAT64_FORMULA)


def test_causal_lm_counts_the_shifted_targets():
    counter = TaskCounter("causal-lm", 2)
    counter.update(torch.tensor(0.5), None, torch.tensor([[1, 2, 3, IGNORE_INDEX]]))   # predicts 2 and 3
    assert counter.vector().tolist() == [1.0, 2.0]   # 0.5 * 2 and 2: exact
    assert perplexity(1e6, 1)["perplexity"] == math.inf


def test_logits_of_dict_and_tuple_outputs():
    from transformers.modeling_outputs import SequenceClassifierOutput

    from jobspec.train.task_metrics import logits_of
    logits = torch.ones(2, 3)
    assert logits_of(SequenceClassifierOutput(loss=torch.tensor(1.0), logits=logits)) is logits
    assert logits_of((torch.tensor(1.0), logits)) is logits   # a model with return_dict: false


def test_counter_for_takes_the_heads_class_count():
    spec = {"model": {"task": "sequence-classification", "num_labels": 2}}
    assert counter_for(spec, SimpleNamespace(num_labels=5), None).num_labels == 5
    assert counter_for(spec, None, None).num_labels == 2


# --- the worker's evaluate on one rank ---------------------------------------------------------------

@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeEngine:
    """Classifies by the first token id; the loss is a constant."""
    device = torch.device("cpu")

    def __call__(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput
        return SequenceClassifierOutput(loss=torch.tensor(0.25), logits=one_hot_logits(input_ids[:, 0].tolist(), 2))

    def eval(self):
        pass

    def train(self):
        pass


def test_evaluate_returns_the_loss_and_the_reduced_task_metrics(one_rank_group):
    from jobspec.train.evaluation import evaluate
    batches = [{"input_ids": torch.tensor([[0, 9], [1, 9]]), "labels": torch.tensor([0, 0])},
               {"input_ids": torch.tensor([[1, 9], [1, 9]]), "labels": torch.tensor([1, 1])}]
    loss, metrics = evaluate(FakeEngine(), batches, TaskCounter("sequence-classification", 2))
    assert loss == pytest.approx(0.25, rel=FLOAT32_FORMULA)
    assert metrics == pytest.approx({"accuracy": 0.75, "f1": (2 / 3 + 4 / 5) / 2}, rel=FLOAT64_FORMULA)
    assert evaluate(FakeEngine(), batches) == (pytest.approx(0.25, rel=FLOAT32_FORMULA), {})


@pytest.mark.parametrize("task, names, labels", [
    ("sequence-classification", None, torch.tensor([IGNORE_INDEX])),
    ("token-classification", None, torch.full((1, 4), IGNORE_INDEX)),
    ("token-classification", {"B-PER": 0, "I-PER": 1, "O": 2}, torch.full((1, 4), IGNORE_INDEX)),
    ("causal-lm", None, torch.full((1, 4), IGNORE_INDEX)),
    ("masked-lm", None, torch.full((1, 4), IGNORE_INDEX))])
def test_an_all_ignored_padding_batch_counts_nothing(task, names, labels):
    """Evaluation's padding batch (jobspec.data.loaders._WithPadding: a rank with fewer eval batches still
    runs the collective forward) adds zeros to every counter: the confusion matrix, correct/labelled
    tokens and entity spans, the token-loss sum and count -- even where the model's mean is NaN (0/0)."""
    counter = TaskCounter(task, 3, names)
    logits = one_hot_logits([[0, 1, 2, 0]] if labels.dim() == 2 else [0], 3)
    counter.update(torch.tensor(float("nan")), logits, labels)
    assert counter.vector().tolist() == [0.0] * counter.size


def test_evaluate_ignores_a_padding_batch(one_rank_group):
    """The sums of test_evaluate_returns_the_loss_and_the_reduced_task_metrics's batches, with a padding
    batch after them: the same loss and metrics (the model's loss on it is transformers' 0/0)."""
    from jobspec.train.evaluation import evaluate

    class PaddedEngine(FakeEngine):
        def __call__(self, input_ids, attention_mask=None, labels=None):
            outputs = super().__call__(input_ids)
            if labels is not None and (labels == IGNORE_INDEX).all():
                outputs.loss = torch.tensor(float("nan"))
            return outputs
    batches = [{"input_ids": torch.tensor([[0, 9], [1, 9]]), "labels": torch.tensor([0, 0])},
               {"input_ids": torch.tensor([[1, 9], [1, 9]]), "labels": torch.tensor([1, 1])},
               {"input_ids": torch.tensor([[0, 9]]), "labels": torch.tensor([IGNORE_INDEX])}]
    loss, metrics = evaluate(PaddedEngine(), batches, TaskCounter("sequence-classification", 2))
    assert loss == pytest.approx(0.25, rel=FLOAT32_FORMULA)
    assert metrics == pytest.approx({"accuracy": 0.75, "f1": (2 / 3 + 4 / 5) / 2}, rel=FLOAT64_FORMULA)


# --- label names in the exported config, the BIO check of best_metric ---------------------------------

def test_label_maps_cover_every_class_of_the_head():
    from jobspec.export.hf_dir import label_maps, name_labels
    id2label, label2id = label_maps({"negative": 0, "positive": 1}, 3)
    assert id2label == {0: "negative", 1: "positive", 2: "LABEL_2"} and label2id["positive"] == 1
    assert label_maps(None, 2) is None
    from transformers import BertConfig
    config = BertConfig(num_labels=2)
    name_labels(config, {"neg": 0, "pos": 1})
    assert config.id2label == {0: "neg", 1: "pos"} and config.num_labels == 2
    mlp_config = SimpleNamespace(num_labels=2)   # jobspec's mlp: no label maps to set
    name_labels(mlp_config, {"neg": 0, "pos": 1})
    assert not hasattr(mlp_config, "id2label")


def test_entity_f1_as_best_metric_needs_bio_tags_in_the_data():
    from jobspec.export.exporter import check_best_metric
    spec = {"model": {"task": "token-classification"}, "export": {"best_metric": "f1"}}
    check_best_metric(spec, {"O": 0, "B-PER": 1, "I-PER": 2})
    with pytest.raises(SpecError) as caught:
        check_best_metric(spec, {"noun": 0, "verb": 1})
    assert caught.value.issues[0].path == ("export", "best_metric") and "noun, verb" in caught.value.issues[0].message
    check_best_metric({**spec, "export": {"best_metric": "accuracy"}}, None)
