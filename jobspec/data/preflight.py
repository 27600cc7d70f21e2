"""The data checks that need transformers, made by `jobspec launch` (and `--dry-run`) before any
rank starts.

`jobspec validate` reads a local tokenizer directory as JSON (spec/rules/data.py) and
data/record_checks.py checks the records' shape without a tokenizer. What is left needs the
tokenizer transformers loads, and would otherwise be found by every rank after DeepSpeed started:

- the tokenizer loads at all (a hub id, a directory of vocab files): model/build.build_tokenizer's
  refusal;
- a tokenizer validate could not read: its size against the model's vocabulary (`tokenizer-vocab`,
  at `model.config`) and, for chat records, that it has a chat template (`chat-template`);
- chat and prompt/completion records rendered with the chat template on the first RENDER_ROWS
  records, with the renders the ranks make (the whole conversation, and each assistant turn's prefix
  with the generation prompt and the conversation through it: data/chat_render.Renderer), so a
  template that fails on a record (`raise_exception`, an undefined name) is reported at the record's
  file:line.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobspec import library_log
from jobspec.data import record_checks
from jobspec.data.formats import source_format, split_format, split_source
from jobspec.data.record_checks import RecordChecker
from jobspec.data.records import RECORD_KINDS, Columns, record_kind
from jobspec.data.records.base import RecordKind
from jobspec.data.tokenizer_files import TokenizerFileError, read_tokenizer, tokenizer_name
from jobspec.errors import SpecError, SpecIssue, first_line
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.model_dims import model_dims
from jobspec.spec.rules.data import vocab_issue
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

# records rendered per file: the template's branches a dataset uses show up early
RENDER_ROWS = 200


def tokenizer_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """The problems above, positioned; [] for synthetic data or records that need no tokenizer
    here."""
    spec = r.spec
    name = tokenizer_name(spec)
    if not name:
        return []
    try:
        facts = read_tokenizer(name)
    except TokenizerFileError:   # validate reported it (tokenizer-files)
        return []
    kinds = {split: _record_kind(spec, split) for split in record_checks.SPLITS
             if spec["data"].get(split)}
    templated = {split: kind for split, kind in kinds.items() if kind is not None and kind.rendered}
    if facts is not None and not templated:
        return []   # validate read everything there is to check
    from jobspec.model.build import build_tokenizer

    # transformers' log lines to the command's log (plan, compile)
    library_log.adopt_transformers()
    try:
        tokenizer = build_tokenizer(spec)
    except SpecError as err:
        return [r.issue(i.path, i.message, i.hint, code="tokenizer-load") for i in err.issues]
    issues: list[SpecIssue] = []
    if facts is None:
        dims = model_dims(spec, local_checkpoint_config(r))
        if dims is not None and dims.vocab_size is not None and len(tokenizer) > dims.vocab_size:
            issues.append(vocab_issue(r, dims.vocab_size, len(tokenizer), name))
    template = _template(spec, tokenizer)
    if template is None:
        if any(kind.needs_template for kind in templated.values()) and facts is None:
            where = ("data", "records") if ("data", "records") in r.positions else ("data", "train")
            issues.append(r.issue(where,
                                  f"chat records need a chat template, and the tokenizer {name} "
                                  "has none",
                                  "set data.chat_template to a Jinja template file, or use a "
                                  "tokenizer with a chat_template", code="chat-template"))
        return issues
    for split, kind in templated.items():
        problem = _render_problem(spec, split, kind, tokenizer, template)
        if problem is not None:
            issues.append(r.issue(("data", split), *problem, code="chat-template-render"))
    return issues


def _record_kind(spec: JobSpec, split: str) -> RecordKind | None:
    """The kind of a local file's records (data/records/), from its first record; None when it
    cannot be read here (a dataset the ranks read, a file the record checks report)."""
    data = spec["data"]
    try:
        fmt = split_format(data, split)
    except SpecError:
        return None
    if not fmt.holds_records:
        return RECORD_KINDS["text"]
    rows = _first_rows(spec, split, 1)
    return record_kind(spec, rows[0][1].keys()) if rows else None


def _first_rows(spec: JobSpec, split: str, limit: int) -> list[tuple[int, dict]] | None:
    """(0-based record index, record) of the file's first `limit` records; None: not a local file of
    records."""
    data = spec["data"]
    source = split_source(data, split)
    try:
        fmt = source_format(source, data["format"])
        if not (fmt.local and fmt.holds_records):
            return None
        return list(enumerate(fmt.first_rows(Path(source), limit)))
    except (OSError, ValueError, SpecError):
        return None   # the record checks report unreadable files with their line


def _template(spec: JobSpec, tokenizer) -> str | None:
    path = spec["data"].get("chat_template")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None   # validate's chat-template rule reports the file
    return getattr(tokenizer, "chat_template", None) or None


def _render_problem(spec: JobSpec, split: str, kind: RecordKind, tokenizer,
                    template: str) -> tuple[str, str] | None:
    """(message, hint) for the first record the template fails on, at its file:line."""
    data = spec["data"]
    columns = replace(Columns.of(spec), records=kind.name)
    checker = RecordChecker(columns, split)
    for index, row in _first_rows(spec, split, RENDER_ROWS) or []:
        if checker.problem(f"record {index + 1}", row) is not None:
            return None   # the record checks reported the record's shape
        try:
            _render_like_the_ranks(tokenizer, template, kind.messages(columns, row))
        # jinja2's errors, TemplateError from raise_exception, TypeError
        except Exception as err:  # noqa: BLE001
            where = record_checks.row_location(spec, split, index)
            source = "data.chat_template" if data.get("chat_template") \
                else "the tokenizer's chat template"
            return (f"{where}: the chat template failed on this record: {first_line(err)}",
                    f"fix the record, or the template ({source})")
    return None


def _render_like_the_ranks(tokenizer, template: str, messages: list[dict[str, Any]]) -> None:
    def render(part: list, generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    render(messages)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            if i:
                render(messages[:i], generation_prompt=True)
            render(messages[:i + 1])
