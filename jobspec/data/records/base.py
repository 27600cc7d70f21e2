"""What one record kind declares (`data.records`: jobspec/data/records/, one module per kind), and
what every kind's checks share: a bad record (`BadRecord`, `RecordError`) and how a value is
described in a message (`describe`).

A kind owns how its records are recognised (`recognised`: `data.records: auto` on the first record's
fields), which fields they need and which spec field names each (`needed`, `column_field`), how one
record is checked (`check`, validate's and the preparation pass's) and what it is rendered from
(`messages`, `plain_text`: the chat template's conversation, or a prompt and completion joined).
Pure: no torch, no datasets.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobspec.data.record_checks import RecordChecker
    from jobspec.data.records import Columns


class BadRecord(Exception):
    """One problem of a data file or record, at the spec field to change (its message says
    where)."""

    def __init__(self, field: tuple, message: str, hint: str):
        super().__init__(message)
        self.field, self.message, self.hint = field, message, hint


class RecordError(ValueError):
    """A record the preparation pass cannot take: the reason and a hint (the caller knows where it
    is)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


class RecordKind:
    """One `data.records` value: recognised by the first record's fields, checked and rendered."""

    name: str = ""
    described: str = ""         # in messages: "chat", "prompt/completion", "text"
    # rendered (with the chat template, or `plain_text`) and tokenised into the
    rendered: bool = False
                                # data cache (data/prepare.py): trains a causal-lm only
    needs_template: bool = False   # rendered with a chat template only (no `plain_text`)

    def recognised(self, columns: Columns, fields: set) -> bool:
        """Whether a record with these `fields` is of this kind (`data.records: auto`; the kinds are
        asked in RECORD_KINDS' order, the last one recognises anything)."""
        raise NotImplementedError

    def fields(self, columns: Columns) -> tuple[str, ...]:
        """The record's fields this kind reads (the data cache's key holds them)."""
        return tuple(self.needed(columns))

    def needed(self, columns: Columns) -> list[str]:
        raise NotImplementedError

    def column_field(self, columns: Columns, name: str) -> tuple:
        """The spec field that names column `name` (where a missing one is reported)."""
        raise NotImplementedError

    def missing_hint(self, columns: Columns, name: str) -> str:
        return "name one of the file's columns"

    def check(self, checker: RecordChecker, where: str, row: dict) -> None:
        """Raise BadRecord for what is wrong with the record `row` at `where` (its fields are
        there)."""
        raise NotImplementedError

    def messages(self, columns: Columns, record: dict) -> list[dict]:
        """The conversation a checked record is rendered as with the chat template."""
        raise ValueError(f"{self.described} records are not rendered with a chat template")

    def plain_text(self, columns: Columns, record: dict) -> tuple[str, str] | None:
        """(prompt, completion) of a checked record trained without a chat template; None: it needs
        one."""
        return None

    def encode(self, columns: Columns, tokenizer, table, max_length: int, pad: bool):
        """The tokenizer's encoding of a table of records the ranks tokenise (a kind that is not
        `rendered`: those are tokenised into the data cache)."""
        raise NotImplementedError(f"{self.described} records are tokenised into the data cache")


class _Empty:
    """An empty csv field (pandas reads it as missing)."""

    def __repr__(self) -> str:
        return "''"


EMPTY = _Empty()


def describe(value) -> str:
    """A value as a message names it: `a string ('abc')`, `a list of 2`, `null`, `empty`."""
    if value is EMPTY:
        return "empty"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:30]!r})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"an object ({type(value).__name__})" if not isinstance(value, dict) else "an object"
