"""`export.best_metric`: a metric the job's task produces, refused at the field (exit 2) otherwise;
validate checks it without importing torch or transformers."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from jobspec.errors import SpecError
from jobspec.tasks import metrics as eval_metrics
from jobspec.spec.schema import enum_values
from jobspec.spec.validation import load_and_validate

JOB = {"name": "bm", "model": {"architecture": "bert", "task": "sequence-classification"},
       "data": {"synthetic": {"eval_samples": 8}}, "training": {"max_steps": 2},
       "export": {"best_eval": True}}


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB, sort_keys=False))
    return path


def refusal(job, *overrides: str):
    with pytest.raises(SpecError) as caught:
        load_and_validate(job, list(overrides))
    (issue,) = caught.value.issues
    return issue


def test_the_registry_matches_the_schema():
    assert set(eval_metrics.TASK_METRICS) == set(enum_values(("model", "task")))
    assert list(eval_metrics.DIRECTION) == enum_values(("export", "best_metric"))
    assert {m for ms in eval_metrics.TASK_METRICS.values() for m in ms} == set(eval_metrics.DIRECTION)
    assert all("loss" in ms for ms in eval_metrics.TASK_METRICS.values())


@pytest.mark.parametrize("task, metric", [(t, m) for t, ms in eval_metrics.TASK_METRICS.items() for m in ms
                                          if (t, m) not in eval_metrics.BIO_ONLY])
def test_every_metric_of_a_task_is_accepted(job, task, metric):
    spec = load_and_validate(job, [f"model.task={task}", f"export.best_metric={metric}"]).spec
    assert spec["export"]["best_metric"] == metric


def test_the_default_is_the_loss(job):
    assert load_and_validate(job).spec["export"]["best_metric"] == "loss"


@pytest.mark.parametrize("task, metric, allowed", [
    ("sequence-classification", "perplexity", "`loss`, `accuracy`, `f1`"),
    ("causal-lm", "accuracy", "`loss`, `perplexity`"),
    ("masked-lm", "f1", "`loss`, `perplexity`"),
])
def test_a_metric_the_task_does_not_produce_is_refused_with_the_allowed_list(job, task, metric, allowed):
    issue = refusal(job, f"model.task={task}", f"export.best_metric={metric}")
    assert issue.dotted_path == "export.best_metric"
    assert f"`{metric}` is not a metric of {task}" in issue.message and allowed in issue.render()


def test_a_misspelled_metric_gets_did_you_mean(job):
    issue = refusal(job, "export.best_metric=acuracy")
    assert issue.dotted_path == "export.best_metric" and "did you mean `accuracy`?" in issue.render()


def test_entity_f1_needs_bio_tags_which_synthetic_labels_never_are(job):
    issue = refusal(job, "model.task=token-classification", "export.best_metric=f1")
    assert issue.dotted_path == "export.best_metric" and "BIO" in issue.message


def test_entity_f1_on_file_data_is_left_to_the_ranks(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"words": ["a"], "tags": ["B-X"]}\n')
    spec = {**JOB, "model": {"architecture": "bert", "task": "token-classification"},
            "data": {"train": "train.jsonl", "eval": "train.jsonl", "tokenizer": "bert-base-uncased",
                     "text_fields": ["words"], "label_field": "tags", "max_length": 64},
            "export": {"best_eval": True, "best_metric": "f1"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_and_validate(path).spec["export"]["best_metric"] == "f1"


def test_a_best_metric_without_best_eval_is_refused(job):
    issue = refusal(job, "export.best_eval=false", "export.best_metric=accuracy")
    assert issue.dotted_path == "export.best_metric" and "`best_eval` is off" in issue.message


def test_validate_refuses_at_the_line_and_imports_neither_torch_nor_transformers(job):
    code = ("import sys\nfrom jobspec.cli import main\n"
            f"rc = main(['validate', {str(job)!r}, '--set', 'export.best_metric=perplexity'])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "<--set>:1:1: export.best_metric: `perplexity` is not a metric of sequence-classification" in \
        proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, value, best, better", [
    ("loss", 0.5, 0.6, True), ("loss", 0.7, 0.6, False), ("perplexity", 3.0, 4.0, True),
    ("accuracy", 0.9, 0.8, True), ("f1", 0.7, 0.8, False), ("accuracy", 0.1, None, True),
    ("loss", float("nan"), None, False), ("f1", None, 0.3, False), ("accuracy", 0.8, 0.8, False),
])
def test_which_way_each_metric_improves(name, value, best, better):
    assert eval_metrics.improves(name, value, best) is better
