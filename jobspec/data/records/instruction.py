"""`data.records: prompt_completion`: a `prompt_field` and a `completion_field` text; rendered as
the conversation [user: prompt, assistant: completion] with a chat template, else the prompt
followed by the completion (the completion is the answer trained on)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.data.records.base import BadRecord, RecordKind, describe

if TYPE_CHECKING:
    from jobspec.data.record_checks import RecordChecker
    from jobspec.data.records import Columns


class InstructionRecords(RecordKind):
    name = "prompt_completion"
    described = "prompt/completion"
    rendered = True

    def recognised(self, columns: Columns, fields: set) -> bool:
        return {columns.prompt_field, columns.completion_field} <= fields

    def needed(self, columns: Columns) -> list[str]:
        return [columns.prompt_field, columns.completion_field]

    def column_field(self, columns: Columns, name: str) -> tuple:
        return ("data", "prompt_field") if name == columns.prompt_field \
            else ("data", "completion_field")

    def missing_hint(self, columns: Columns, name: str) -> str:
        return ("every prompt/completion record needs both fields (or set data.prompt_field / "
                "completion_field)")

    def check(self, checker: RecordChecker, where: str, row: dict) -> None:
        for name in self.needed(checker.columns):
            if not isinstance(row[name], str):
                raise BadRecord(("data", checker.split),
                                f"{where}: {name!r} is {describe(row[name])}, text expected",
                                "every prompt/completion record needs both texts")

    def messages(self, columns: Columns, record: dict) -> list[dict]:
        return [{"role": "user", "content": record[columns.prompt_field]},
                {"role": "assistant", "content": record[columns.completion_field]}]

    def plain_text(self, columns: Columns, record: dict) -> tuple[str, str] | None:
        return record[columns.prompt_field], record[columns.completion_field]


KIND = InstructionRecords()
