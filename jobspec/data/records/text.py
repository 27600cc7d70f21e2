"""`data.records: text`: the `text_fields` columns (one text, or two for sentence pairs; a list of
words for a task that labels words) and, for a classification task, a `label_field` label: a class
id or a class name, or one per word. What `auto` picks when a record is neither chat nor
prompt/completion."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.data.records.base import BadRecord, RecordKind, describe
from jobspec.errors import spec_error

if TYPE_CHECKING:
    from jobspec.data.record_checks import RecordChecker
    from jobspec.data.records import Columns


class TextRecords(RecordKind):
    name = "text"
    described = "text"

    def recognised(self, columns: Columns, fields: set) -> bool:
        return True

    def needed(self, columns: Columns) -> list[str]:
        return [*columns.text_fields, *([columns.label_field] if columns.label_field else [])]

    def column_field(self, columns: Columns, name: str) -> tuple:
        return ("data",
                "label_field") if name == columns.label_field and name not in columns.text_fields \
            else ("data", "text_fields")

    def check(self, checker: RecordChecker, where: str, row: dict) -> None:
        c = checker.columns
        words = None
        for i, name in enumerate(c.text_fields):
            value = row[name]
            if tasks.get(c.task).words and i == 0:
                if not (isinstance(value, list) and all(isinstance(w, str) for w in value)):
                    raise BadRecord(("data", "text_fields"),
                                    f"{where}: {name!r} is {describe(value)}; "
                                    "token-classification needs a list of words",
                                    "store words and per-word labels as lists")
                words = value
            elif not isinstance(value, str):
                raise BadRecord(("data", checker.split),
                                f"{where}: {name!r} is {describe(value)}, text expected",
                                "every row needs its text")
        if c.label_field is None:
            return
        label = row[c.label_field]
        if words is None:
            checker.label(where, label)
            return
        if not isinstance(label, list) or len(label) != len(words):
            raise BadRecord(("data", checker.split),
                            f"{where}: {c.label_field!r} is {describe(label)} for "
                            f"{len(words)} words; one label per word expected",
                            "store per-word labels as a list")
        for value in label:
            checker.label(where, value)

    def encode(self, columns: Columns, tokenizer, table, max_length: int, pad: bool):
        """The tokenizer's encoding of a table's texts (a pair per row with two text fields; words
        with a task that labels words), truncated to `max_length`, padded to it with `pad`."""
        # datasets returns lazy columns
        texts = [list(table[field]) for field in columns.text_fields]
        words = tasks.get(columns.task).words
        if words and not all(isinstance(t, list) for t in texts[0][:1]):
            raise spec_error(f"{columns.task} needs column {columns.text_fields[0]!r} to hold "
                             "lists of words",
                             path=("data", "text_fields"),
                             hint="store words and per-word labels as lists")
        return tokenizer(*texts, truncation=True, max_length=max_length,
                         padding="max_length" if pad else False, is_split_into_words=words)


KIND = TextRecords()
