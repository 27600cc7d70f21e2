"""`data.records: chat`: a `messages_field` list of {role, content} messages, rendered with the chat
template (the assistant turns are the answers trained on)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.data.records.base import BadRecord, RecordKind, describe
from jobspec.errors import did_you_mean

if TYPE_CHECKING:
    from jobspec.data.record_checks import RecordChecker
    from jobspec.data.records import Columns

# a chat message's roles (schema: data.messages_field)
ROLES = ("system", "user", "assistant", "tool")


class ChatRecords(RecordKind):
    name = "chat"
    described = "chat"
    rendered = True
    needs_template = True

    def recognised(self, columns: Columns, fields: set) -> bool:
        return columns.messages_field in fields

    def needed(self, columns: Columns) -> list[str]:
        return [columns.messages_field]

    def column_field(self, columns: Columns, name: str) -> tuple:
        return ("data", "messages_field")

    def missing_hint(self, columns: Columns, name: str) -> str:
        return f"every chat record needs its {name!r} list (or set data.messages_field)"

    def check(self, checker: RecordChecker, where: str, row: dict) -> None:
        field = checker.columns.messages_field
        problem = messages_problem(row[field], field)
        if problem is not None:
            raise BadRecord(("data", checker.split), f"{where}: {problem[0]}", problem[1])

    def messages(self, columns: Columns, record: dict) -> list[dict]:
        # only role and content: a table's messages carry null keys of the other records' messages
        return [{"role": m["role"], "content": m["content"]}
                for m in record[columns.messages_field]]


def messages_problem(messages, field: str) -> tuple[str, str] | None:
    """What is wrong with a chat record's messages, with a hint (None: a non-empty list of {role,
    content}, known roles, string content)."""
    if not isinstance(messages, list) or not messages:
        return (f"{field!r} is {describe(messages)}; a non-empty list of {{role, content}} "
                "messages expected",
                "store each conversation as a list of messages")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return (f"message {number} is {describe(message)}; an object with role and content "
                    "expected",
                    'write each message as {"role": ..., "content": ...}')
        role = message.get("role")
        if role not in ROLES:
            return (f"message {number} has role {role!r}; one of {', '.join(ROLES)} expected",
                    did_you_mean(role if isinstance(role, str) else "", ROLES,
                                 "give each message a role", cutoff=0.5, quote="'"))
        if not isinstance(message.get("content"), str):
            return (f"message {number} ({role}) content is {describe(message.get('content'))}, "
                    "text expected",
                    "give each message its text as a string")
    return None


KIND = ChatRecords()
