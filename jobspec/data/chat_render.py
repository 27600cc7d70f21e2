"""Chat and prompt/completion records → token ids with the loss on the answers (torch-free: the data
preparation pass, jobspec/data/data_prep.py, runs it in the launcher's worker processes).

Chat records (`data.messages_field`, a list of {role, content}) are rendered with the chat template
(`data.chat_template`, a Jinja file, else the tokenizer's own). With `data.loss_on: answers` only the
assistant turns are trained on. The answer spans come from rendering the conversation turn by turn,
so any template works without `{% generation %}` markers: for the assistant message i,

    prefix  = render(messages[:i], add_generation_prompt=True)   # ... up to the assistant header
    through = render(messages[:i + 1])                           # ... through the answer

and the answer is the text `through` adds to `prefix` (its content and the template's end-of-turn
marker, e.g. `<|eot_id|>`, so the model learns to stop). Where a template renders a prefix differently
from the whole conversation (one that rewrites earlier turns), that text, else the message's content,
is found in the whole rendering after the previous answer. The whole rendering is tokenized (no special
tokens added: the template writes them) with character offsets, in batches with the fast tokenizer,
and a token is an answer token when its characters overlap an answer span; every other token's
label is -100.

Prompt/completion records (`prompt_field`, `completion_field`) train on the completion only (`loss_on:
all`: on both). With a chat template (data.chat_template or the tokenizer's) they are rendered as the
conversation [user: prompt, assistant: completion], the way a chat model is prompted; without one the
text is the prompt followed directly by the completion and the tokenizer's EOS, with the tokenizer's
own special tokens (BOS) added.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from jobspec.data import datacheck
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec

IGNORE_INDEX = -100


class RecordError(ValueError):
    """A record the pass cannot take: the reason and a hint (the caller knows where the record is)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


def chat_template(spec: JobSpec, tokenizer) -> str | None:
    """The template chat records are rendered with: the `data.chat_template` file's, else the tokenizer's."""
    path = spec["data"].get("chat_template")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise spec_error(f"cannot read the chat template {path}: {first_line(err)}",
                             path=("data", "chat_template"), hint="point it at a Jinja template file") from None
    return getattr(tokenizer, "chat_template", None) or None


def check_template(spec: JobSpec, template: str) -> None:
    """A template that does not compile is the spec's problem, at data.chat_template (or data.tokenizer)."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        where = ("data", "chat_template") if spec["data"].get("chat_template") else ("data", "tokenizer")
        raise spec_error(f"the chat template does not compile: {err.message} (line {err.lineno})",
                         path=where, hint="fix the Jinja template") from None


class Renderer:
    """Renders conversations with one template and finds the answers' character spans."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def answer_spans(self, messages: list, full: str) -> list[tuple[int, int]]:
        """Character spans of `full` (the whole conversation rendered) that the assistant turns produce."""
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self.render(messages[:i], add_generation_prompt=True) if i else ""
            # the last turn's conversation through it is the whole one, rendered already
            through = full if i == len(messages) - 1 else self.render(messages[:i + 1])
            if through.startswith(prefix) and full.startswith(through):
                span: tuple[int, int] | None = (len(prefix), len(through))
            else:   # a template that renders a prefix differently: find the answer in the whole text
                added = through[_common_prefix(prefix, through):]
                span = _find(full, added, cursor) or _find(full, message["content"].strip(), cursor)
            if span is None:
                raise ValueError(f"assistant turn {i + 1} is not found in the rendered conversation")
            spans.append(span)
            cursor = span[1]
        return spans


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _find(text: str, piece: str, start: int) -> tuple[int, int] | None:
    at = text.find(piece, start) if piece else -1
    return (at, at + len(piece)) if at >= 0 else None


@dataclass(frozen=True)
class Text:
    """One record ready to tokenize: its text, the character spans its labels keep, how to tokenize it."""

    text: str
    spans: tuple            # ((start, end), ...); ignored with `all_tokens`
    special_tokens: bool    # the tokenizer's own special tokens (prompt/completion without a template)
    after: int = -1         # prompt/completion without a template: label the tokens ending after this
    eos: int | None = None  # ... and end with this EOS id


class RecordText:
    """A record (chat messages or a (prompt, completion) pair) → its `Text`; RecordError when it cannot:
    validate's check of the record (data/datacheck.RecordChecker), then the template on it."""

    def __init__(self, spec: JobSpec, tokenizer, kind: str, template: str | None, split: str):
        data = spec["data"]
        self.kind, self.tokenizer = kind, tokenizer
        self.all_tokens = data["loss_on"] == "all"
        self.fields: tuple[str, ...] = (data["messages_field"],) if kind == "chat" else \
            (data["prompt_field"], data["completion_field"])
        self.renderer = Renderer(tokenizer, template) if template is not None else None
        self.checker = datacheck.RecordChecker(replace(datacheck.Columns.of(spec), records=kind), split)

    def __call__(self, record, where: str) -> Text:
        if not isinstance(record, dict):
            raise RecordError(f"the record is {type(record).__name__}, an object expected",
                              "write one JSON object per line")
        bad = self.checker.problem(where, record)   # validate's own record check (data/datacheck.py)
        if bad is not None:
            raise RecordError(bad.message.removeprefix(f"{where}: "), bad.hint)
        if self.kind == "chat":
            messages = [{"role": m["role"], "content": m["content"]} for m in record[self.fields[0]]]
        else:
            prompt, completion = record[self.fields[0]], record[self.fields[1]]
            if self.renderer is None:
                return Text(prompt + completion, (), True, after=len(prompt), eos=self.tokenizer.eos_token_id)
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        assert self.renderer is not None   # chat records without a template are refused before the pass
        try:
            full = self.renderer.render(messages)
            spans = () if self.all_tokens else tuple(self.renderer.answer_spans(messages, full))
        except Exception as err:   # the template failing on this record (raise_exception, an undefined name)
            raise RecordError(f"the chat template failed on this record: {first_line(err)}",
                              "fix the record, or the template (data.chat_template)") from None
        return Text(full, spans, False)


def encode(tokenizer, texts: list[Text], all_tokens: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) per text as int32 arrays, untruncated: one batched call of the fast tokenizer per
    kind of text, labels from the offsets (a token overlapping a span keeps its id, else -100)."""
    out: list = [None] * len(texts)
    for special in (False, True):
        chosen = [i for i, t in enumerate(texts) if t.special_tokens == special]
        if not chosen:
            continue
        encoded = tokenizer([texts[i].text for i in chosen], add_special_tokens=special,
                            return_offsets_mapping=True, verbose=False)
        for i, ids, offsets in zip(chosen, encoded["input_ids"], encoded["offset_mapping"]):
            out[i] = _labelled(texts[i], np.asarray(ids, dtype=np.int32),
                               np.asarray(offsets, dtype=np.int64).reshape(-1, 2), all_tokens)
    return out


def _labelled(text: Text, ids: np.ndarray, offsets: np.ndarray, all_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    start, end = offsets[:, 0], offsets[:, 1]
    if text.after >= 0:   # prompt + completion without a template; special tokens at the end (BERT's
        # [SEP]) have empty offsets: not the completion
        keep = np.ones(len(ids), dtype=bool) if all_tokens else (end > text.after) & (end > start)
        if text.eos is not None and (len(ids) == 0 or ids[-1] != text.eos):
            ids, keep = np.append(ids, np.int32(text.eos)), np.append(keep, True)
    elif all_tokens:
        keep = np.ones(len(ids), dtype=bool)
    else:
        keep = np.zeros(len(ids), dtype=bool)
        for span_start, span_end in text.spans:
            keep |= (start < span_end) & (end > span_start)
    return ids, np.where(keep, ids, np.int32(IGNORE_INDEX)).astype(np.int32)
