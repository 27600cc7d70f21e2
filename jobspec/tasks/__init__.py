"""The tasks a spec can name (`model.task`): one module each, registered here.

Each module declares a `Task` (jobspec/tasks/base.py): its transformers head class, its data's label
shape, its loss, the metrics it produces and how they are counted, how its logits line up with the
labels. The model builder, the data loaders, the planner's traced step, the metric counter, the
rules and the report read them from `TASKS`; a test keeps the keys equal to the schema's enum
(tests/test_registries.py). Adding one: the schema's enum, one module here, one line below
(docs/architecture.md, "Adding a task"). Pure data: no torch.
"""
from __future__ import annotations

from jobspec.spec.types import JobSpec
from jobspec.tasks import causal_lm, masked_lm, sequence_classification, token_classification
from jobspec.tasks.base import Task

TASKS: dict[str, Task] = {t.name: t for t in (
    sequence_classification.TASK,
    token_classification.TASK,
    masked_lm.TASK,
    causal_lm.TASK,
)}
DEFAULT = "sequence-classification"   # the schema's default of `model.task`


def get(name: str | None) -> Task:
    """The task `name` (None: the schema's default, for a spec read without its defaults)."""
    return TASKS[name or DEFAULT]


def of(spec: JobSpec) -> Task:
    """The task of a spec (defaults filled or not)."""
    return get(spec["model"]["task"])
