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
    from jobspec.spec import eval_metrics
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


def test_format_registry_is_the_schema_enum():
    """Every `data.format` value but `auto` is a module of jobspec/data/formats/ declaring a FORMAT,
    and every such module a schema value or a source told by itself (`hf:` names, saved datasets)."""
    from jobspec.data import formats
    from jobspec.data.formats.base import DataFormat
    schema = sorted(v for v in enum_values(("data", "format")) if v != "auto")
    assert sorted(formats.schema_formats()) == schema
    suffixes = [s for f in formats.FORMATS.values() if f.schema_value for s in f.suffixes]
    # `auto` reads one format from an extension
    assert len(suffixes) == len(set(suffixes)), suffixes
    for name, declared in formats.FORMATS.items():
        assert isinstance(declared, DataFormat) and declared.name == name, name
        # told by its extension, or by itself
        assert declared.schema_value == bool(declared.suffixes), name
        if declared.holds_records and declared.local:   # validate reads its records
            assert type(declared).rows is not DataFormat.rows, name
        if declared.counted:
            assert type(declared).count_rows is not DataFormat.count_rows, name


def test_record_kind_registry_is_the_schema_enum():
    from jobspec.data.records import RECORD_KINDS
    from jobspec.data.records.base import RecordKind
    assert sorted(RECORD_KINDS) == sorted(v for v in enum_values(("data", "records")) if v != "auto")
    for name, kind in RECORD_KINDS.items():
        assert isinstance(kind, RecordKind) and kind.name == name and kind.described, name
    # `auto` falls back to the last kind: it recognises any record
    last = list(RECORD_KINDS.values())[-1]
    assert last.recognised(None, set()), last.name


def test_data_declarations_import_no_torch_and_no_datasets():
    code = ("import sys, jobspec.data.formats, jobspec.data.records, jobspec.data.record_checks; "
            "print([m for m in ('torch', 'transformers', 'deepspeed', 'datasets', 'pyarrow') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
