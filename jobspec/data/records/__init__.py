"""The record kinds a spec can name (`data.records`): one module each, registered here.

Each module declares a `RecordKind` (jobspec/data/records/base.py): how its records are recognised
(`data.records: auto` asks the kinds in RECORD_KINDS' order on the first record's fields; `text`,
the last, takes any), checked and rendered. validate's record checks (data/record_checks.py), the
data pre-flight, the preparation pass, the loaders and generation's prompts read the kind from here;
a test keeps the keys equal to the schema's enum (tests/test_registries.py). `Columns`: what the
job's task needs from each record (the field names the spec sets). Pure: no torch, no datasets.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from jobspec import tasks
from jobspec.data.records import chat, instruction, text
from jobspec.data.records.base import RecordKind
from jobspec.spec.types import JobSpec

RECORD_KINDS: dict[str, RecordKind] = {k.name: k for k in (
    chat.KIND,
    instruction.KIND,
    text.KIND,
)}


@dataclass(frozen=True)
class Columns:
    """What the job's task needs from each record of a data file."""

    text_fields: tuple
    label_field: str | None   # None: language-model tasks have no label column
    task: str
    num_labels: int
    # data.records; `resolved` turns auto into the kind the first record shows
    records: str = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"

    @classmethod
    def of(cls, spec: JobSpec) -> Columns:
        data, model = spec["data"], spec["model"]
        task = model["task"]
        label = data["label_field"] if tasks.get(task).classification else None
        return cls(tuple(data["text_fields"] or ["text"]), label, task, model["num_labels"],
                   data["records"], data["messages_field"], data["prompt_field"],
                   data["completion_field"])

    def resolved(self, fields: Iterable) -> Columns:
        """These columns with `records: auto` decided by the first record's `fields`."""
        return self if self.records != "auto" else replace(self, records=kind_of(self, fields).name)

    @property
    def kind(self) -> RecordKind:
        """The kind `records` names (resolved: `auto` names none)."""
        return RECORD_KINDS[self.records]

    def needed(self) -> list[str]:
        return self.kind.needed(self)


def kind_of(columns: Columns, fields: Iterable) -> RecordKind:
    """The kind `columns.records` names, or for `auto` the first kind that recognises a record with
    these `fields` (its keys, or a table's columns)."""
    if columns.records != "auto":
        return RECORD_KINDS[columns.records]
    present = set(fields)
    return next(kind for kind in RECORD_KINDS.values() if kind.recognised(columns, present))


def record_kind(spec: JobSpec, fields: Iterable) -> RecordKind:
    """The kind of the spec's records: `data.records`, or for `auto` what the first record's
    `fields` show."""
    return kind_of(Columns.of(spec), fields)
