"""One module per concept: each schema enum equals its registry's keys, so forgetting an entry fails
here, not in a launch (jobspec/optimizers, jobspec/tasks)."""
from __future__ import annotations

import sys
import subprocess

from jobspec import optimizers
from jobspec.optimizers.base import Optimizer
from jobspec.spec.schema import enum_values, subschema_at


def test_optimizer_registry_is_the_schema_enum():
    assert list(optimizers.OPTIMIZERS) == enum_values(("training", "optimizer", "name"))


def test_each_optimizer_module_declares_everything():
    fields = set(subschema_at(("training", "optimizer"))["properties"])
    for name, optimizer in optimizers.OPTIMIZERS.items():
        assert isinstance(optimizer, Optimizer) and optimizer.name == name
        assert set(optimizer.args) <= fields, name
        assert "lr" in optimizer.args, name
        # built one way: by DeepSpeed from its block, or on the ranks from patches.json's args
        assert optimizer.built_by_deepspeed == (optimizer.client_args is None), name
        if not optimizer.built_by_deepspeed:
            assert optimizer.build is not None and optimizer.offload is None, name
        assert all(a in optimizers.OPTIMIZERS for a in optimizer.fit_alternatives), name
        assert optimizer.hf_trainer_optim, name   # bench/trainer_baseline.py runs the Trainer with it


def test_registries_import_no_torch():
    code = ("import sys, jobspec.optimizers, jobspec.tasks; "
            "print([m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_task_registry_is_the_schema_enum():
    from jobspec import tasks
    assert list(tasks.TASKS) == enum_values(("model", "task"))
    assert tasks.DEFAULT == subschema_at(("model", "task"))["default"]


def test_each_task_module_declares_everything():
    import transformers

    from jobspec import tasks
    from jobspec.tasks import metrics as eval_metrics
    for name, task in tasks.TASKS.items():
        assert task.name == name and hasattr(transformers, task.auto_class), name
        assert set(task.metrics) <= set(eval_metrics.DIRECTION), name
        assert set(task.metric_labels) | set(task.bio_only) <= set(task.metrics), name
        assert task.loss, name


def test_tracker_registry_is_the_schema_logging_sections_with_a_switch():
    from jobspec.tracking import trackers
    from jobspec.tracking.base import Tracker
    logging_fields = subschema_at(("logging",))["properties"]
    switched = [name for name, node in logging_fields.items() if "enabled" in node.get("properties", {})]
    assert list(trackers.TRACKERS) == switched
    for name, tracker in trackers.TRACKERS.items():
        assert tracker.name == name and isinstance(tracker, Tracker), name
    # the default is on unless switched off; every other tracker is off unless switched on
    assert [n for n in switched if logging_fields[n]["properties"]["enabled"]["default"]] == [trackers.DEFAULT]


def test_each_technique_declares_everything():
    from jobspec import techniques
    from jobspec.techniques.base import Technique
    names = [t.name for t in techniques.TECHNIQUES]
    assert len(names) == len(set(names)), names
    for technique in techniques.TECHNIQUES:
        assert isinstance(technique, Technique) and technique.summary, technique.name
        if technique.apply is not None:   # a patch: the function is named as module:function
            module, _, function = technique.apply.partition(":")
            assert module.startswith("jobspec.") and function.isidentifier(), technique.apply
        else:   # no model patch: it writes no patches.json entry
            assert technique.trace_args is None and technique.fit is None, technique.name
    assert all(t.trace_args and t.trace_value for t in techniques.TRACED)
    for technique in techniques.TECHNIQUES:   # the trace's own call, named as apply is
        if technique.trace is not None:
            module, _, function = technique.trace.partition(":")
            assert technique.apply and module.startswith("jobspec.") and function.isidentifier()
    keys = [step.key for step in techniques.fit_steps()]
    assert len(keys) == len(set(keys)), keys


def test_technique_registry_imports_no_torch():
    code = ("import sys, jobspec.techniques, jobspec.compile.compiler; "
            "print([m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_each_technique_rule_runs_once_in_the_rule_order():
    """Validation runs every technique's rules, each once: named at its place or among the others."""
    from jobspec import techniques
    from jobspec.spec import validation
    rules = [rule for t in techniques.TECHNIQUES for rule in t.rules]
    assert all(validation.CROSS_FIELD_RULES.count(rule) == 1 for rule in rules)
    assert techniques.placed(("packing", techniques.OTHERS))[0] is techniques.get("packing").rules[0]
    assert len(techniques.placed((techniques.OTHERS,))) == len(rules)
