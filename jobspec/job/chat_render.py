"""Chat and prompt/completion records → token ids with the loss on the answers.

Chat records (`data.messages_field`, a list of {role, content}) are rendered with the chat template
(`data.chat_template`, a Jinja file, else the tokenizer's own). With `data.loss_on: answers` only the
assistant turns are trained on. The answer spans come from rendering the conversation turn by turn,
so any template works without `{% generation %}` markers: for the assistant message i,

    prefix  = render(messages[:i], add_generation_prompt=True)   # ... up to the assistant header
    through = render(messages[:i + 1])                           # ... through the answer

and the answer is the text `through` adds to `prefix` (its content and the template's end-of-turn
marker, e.g. `<|eot_id|>`, so the model learns to stop). Where a template renders a prefix differently
from the whole conversation (one that rewrites earlier turns), that text, else the message's content,
is found in the whole rendering after the previous answer. The whole rendering is tokenized once
(no special tokens added: the template writes them) with character offsets, and a token is an
answer token when its characters overlap an answer span; every other token's label is -100.

Prompt/completion records (`prompt_field`, `completion_field`) train on the completion only (`loss_on:
all`: on both). With a chat template (data.chat_template or the tokenizer's) they are rendered as the
conversation [user: prompt, assistant: completion], the way a chat model is prompted; without one the
text is the prompt followed directly by the completion and the tokenizer's EOS, with the tokenizer's
own special tokens (BOS) added.

Records longer than `max_length` are truncated (counted, one warning per split).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable, cast

import torch

from jobspec.errors import SpecError, first_line, spec_error
from jobspec.spec.datacheck import messages_problem

IGNORE_INDEX = -100


class RecordError(ValueError):
    """A record the loader cannot take: its 0-based index and the reason (train/data.py names the row)."""

    def __init__(self, index: int, message: str, hint: str):
        super().__init__(message)
        self.index, self.message, self.hint = index, message, hint


def chat_template(spec: dict, tokenizer) -> str | None:
    """The template chat records are rendered with: the `data.chat_template` file's, else the tokenizer's."""
    path = spec["data"].get("chat_template")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise spec_error(f"cannot read the chat template {path}: {first_line(err)}",
                             path=("data", "chat_template"), hint="point it at a Jinja template file") from None
    return getattr(tokenizer, "chat_template", None) or None


def _template_field(spec: dict) -> tuple:
    return ("data", "chat_template") if spec["data"].get("chat_template") else ("data", "tokenizer")


def check_template(spec: dict, tokenizer, template: str) -> None:
    """A template that does not compile is the spec's problem, at data.chat_template (or data.tokenizer)."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise spec_error(f"the chat template does not compile: {err.message} (line {err.lineno})",
                         path=_template_field(spec), hint="fix the Jinja template") from None


class Renderer:
    """Renders conversations with one template and finds the answers' token positions."""

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
            through = self.render(messages[:i + 1])
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

    def encode(self, text: str, spans: list[tuple[int, int]], all_tokens: bool) -> tuple[list, list]:
        """Token ids of `text` and their labels: the id inside a span (everywhere with `all_tokens`), else -100."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = list(encoded["input_ids"])
        if all_tokens:
            return ids, list(ids)
        labels = [token if any(start < end_ and end > start_ for start_, end_ in spans) else IGNORE_INDEX
                  for token, (start, end) in zip(ids, encoded["offset_mapping"])]
        return ids, labels


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


def record_columns(spec: dict, tokenizer, table, kind: str, split: str) -> tuple[list, list, list]:
    """(input ids, attention masks, labels) of a table's chat or prompt/completion records, as unpadded
    1-D LongTensors of at most `max_length` tokens. RecordError names the first record it cannot take."""
    data = spec["data"]
    template = chat_template(spec, tokenizer)
    if kind == "chat" and template is None:
        raise spec_error("chat records need a chat template, and the tokenizer has none",
                         path=("data", "chat_template"),
                         hint="set data.chat_template to a Jinja template file, or use a tokenizer with one")
    if template is not None:
        check_template(spec, tokenizer, template)
    renderer = Renderer(tokenizer, template) if template is not None else None
    all_tokens = data["loss_on"] == "all"
    max_length = data["max_length"]
    rows: Iterable[tuple]
    if kind == "chat":
        rows = ((messages,) for messages in table[data["messages_field"]])
    else:
        rows = zip(table[data["prompt_field"]], table[data["completion_field"]])
    ids_out, masks, labels_out, truncated, answerless = [], [], [], 0, 0
    for index, row in enumerate(rows):
        try:
            # (chat records without a template were refused above)
            ids, labels = (_chat(cast(Renderer, renderer), row[0], all_tokens, data["messages_field"]) if kind == "chat"
                           else _prompt_completion(tokenizer, renderer, row, all_tokens, data))
        except RecordError as err:
            raise RecordError(index, err.message, err.hint) from None
        except Exception as err:   # the template failing on this record (raise_exception, an undefined name)
            if isinstance(err, SpecError):
                raise
            raise RecordError(index, f"the chat template failed on this record: {first_line(err)}",
                              "fix the record, or the template (data.chat_template)") from None
        if len(ids) > max_length:
            truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            answerless += 1
        ids_out.append(torch.tensor(ids, dtype=torch.long))
        labels_out.append(torch.tensor(labels, dtype=torch.long))
        masks.append(torch.ones(len(ids), dtype=torch.long))
    what = "chat" if kind == "chat" else "prompt/completion"
    if truncated:
        warnings.warn(f"data.{split}: {truncated} of {len(ids_out)} {what} records are longer than data.max_length "
                      f"({max_length} tokens) and were truncated", stacklevel=2)
    if answerless and not all_tokens:
        warnings.warn(f"data.{split}: {answerless} of {len(ids_out)} {what} records have no answer token within "
                      f"data.max_length ({max_length}): they add no loss", stacklevel=2)
    return ids_out, masks, labels_out


def _chat(renderer: Renderer, messages, all_tokens: bool, field: str) -> tuple[list, list]:
    problem = messages_problem(messages, field)
    if problem is not None:
        raise RecordError(-1, *problem)
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]   # parquet adds null keys
    full = renderer.render(messages)
    spans = [] if all_tokens else renderer.answer_spans(messages, full)
    return renderer.encode(full, spans, all_tokens)


def _prompt_completion(tokenizer, renderer: Renderer | None, row: tuple, all_tokens: bool,
                       data: dict) -> tuple[list, list]:
    prompt, completion = row
    for name, value in ((data["prompt_field"], prompt), (data["completion_field"], completion)):
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise RecordError(-1, f"{name!r} is {kind}, text expected", "every record needs both texts")
    if renderer is not None:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        full = renderer.render(messages)
        return renderer.encode(full, [] if all_tokens else renderer.answer_spans(messages, full), all_tokens)
    text = prompt + completion
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True, verbose=False)
    ids = list(encoded["input_ids"])
    # special tokens the tokenizer adds at the end (BERT's [SEP]) have empty offsets: not the completion
    labels = [token if all_tokens or (end > len(prompt) and end > start) else IGNORE_INDEX
              for token, (start, end) in zip(ids, encoded["offset_mapping"])]
    if tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return ids, labels
