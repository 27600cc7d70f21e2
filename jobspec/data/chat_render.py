"""Chat and prompt/completion records → token ids with the loss on the answers (torch-free: the data
preparation pass, jobspec/data/prepare.py, runs it in the launcher's worker processes).

Chat records (`data.messages_field`, a list of {role, content}) are rendered with the chat template
(`data.chat_template`, a Jinja file, else the tokenizer's own). With `data.loss_on: answers` only
the assistant turns are trained on. The answer spans come from rendering the conversation turn by
turn, so any template works without `{% generation %}` markers: for the assistant message i,

    prefix  = render(messages[:i], add_generation_prompt=True)   # ... up to the assistant header
    through = render(messages[:i + 1])                           # ... through the answer

and the answer is the text `through` adds to `prefix` (its content and the template's end-of-turn
marker, e.g. `<|eot_id|>`, so the model learns to stop). Where a template renders a prefix
differently from the whole conversation (one that rewrites earlier turns), that text, else the
message's content, is found in the whole rendering after the previous answer.

One prompt for training and serving: the model is served `generation_prompt_ids`, the prefix
tokenised alone with no special tokens added (the template writes them), as train/generation.py and
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)` give it. The whole rendering
tokenised at once can differ where the prefix ends (GPT-2's pre-tokenizer splits '\n\n' before a
word into 'Ċ' 'Ċ', the prefix alone ends 'ĊĊ'), so the rendering is cut into segments (the text
before the first answer, the first answer, the text up to the next answer, ..., the text after the
last) and tokenised segment by segment, the ids concatenated: the ids before the first answer are
its served prompt's, whatever the tokenizer. A later segment is tokenised after its context (the
previous segment from its last added token, such as `<|eot_id|>`) and keeps the ids it has there
(a SentencePiece tokenizer puts '▁' before a text that starts the input, not after a prompt), or is
tokenised alone where it would change its context's ids.

The ids before a later answer are its served prompt's where the tokenizer tokenises the text on
either side of each cut apart (Llama 3's, Qwen2's, Gemma's and Mistral's do with their templates);
`prompt_check` finds the turns where they are not, and the data preparation pass runs it on its
first records. A template that renders the turns before an answer differently inside the whole
conversation (Mistral's puts the system message in the last user turn only) cannot give that answer
its served prompt: it is trained after the whole rendering, and the check says so. Labels are -100
on the prompt segments and the ids on the answers; with `loss_on: all` the ids everywhere (the same
segments, so the same ids).

Prompt/completion records (`prompt_field`, `completion_field`) train on the completion only
(`loss_on: all`: on both). With a chat template (data.chat_template or the tokenizer's) they are
rendered as the conversation [user: prompt, assistant: completion], the way a chat model is
prompted; without one the text is the prompt followed directly by the completion and the tokenizer's
EOS, with the tokenizer's own special tokens (BOS) added, tokenised at once with character offsets.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from jobspec.data.record_checks import RecordChecker
from jobspec.data.records import RECORD_KINDS, Columns
from jobspec.data.records.base import RecordError
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import IGNORE_INDEX


def chat_template(spec: JobSpec, tokenizer) -> str | None:
    """The template chat records are rendered with: the `data.chat_template` file's, else the
    tokenizer's."""
    path = spec["data"].get("chat_template")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise spec_error(f"cannot read the chat template {path}: {first_line(err)}",
                             path=("data", "chat_template"),
                             hint="point it at a Jinja template file") from None
    return getattr(tokenizer, "chat_template", None) or None


def check_template(spec: JobSpec, template: str) -> None:
    """A template that does not compile is the spec's problem, at data.chat_template (or
    data.tokenizer)."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        where = ("data", "chat_template") if spec["data"].get("chat_template") \
            else ("data", "tokenizer")
        raise spec_error(f"the chat template does not compile: {err.message} (line {err.lineno})",
                         path=where, hint="fix the Jinja template") from None


class Renderer:
    """Renders conversations with one template and finds the answers' character spans."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template,
                                                  tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def answer_spans(self, messages: list, full: str) -> list[tuple[int, int]]:
        """Character spans of `full` (the whole conversation rendered) that the assistant turns
        produce."""
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self.render(messages[:i], add_generation_prompt=True) if i else ""
            # the last turn's conversation through it is the whole one, rendered already
            through = full if i == len(messages) - 1 else self.render(messages[:i + 1])
            if through.startswith(prefix) and full.startswith(through):
                span: tuple[int, int] | None = (len(prefix), len(through))
            # a template that renders a prefix differently: find the answer in the whole text
            else:
                added = _added_text(prefix, through)
                span = _find(full, added, cursor) or _find(full, message["content"].strip(), cursor)
            if span is None:
                raise ValueError(f"assistant turn {i + 1} is not found in the rendered "
                                 "conversation")
            spans.append(span)
            cursor = span[1]
        return spans


def generation_prompt_ids(tokenizer, template: str, messages: list) -> list[int]:
    """The ids the model is served to write the next assistant turn after `messages`: the rendering
    with the generation prompt tokenised with no special tokens added (the template writes them), as
    `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` does."""
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _added_text(prefix: str, through: str) -> str:
    """The answer `through` adds to `prefix`: what follows it, or where the template renders the
    turns before the answer otherwise (Mistral's system message in the last user turn), what follows
    the longest end of `prefix` found in `through` (its last place there)."""
    if through.startswith(prefix):
        return through[len(prefix):]
    low, high = 0, len(prefix)   # a longer end is found only if every shorter one is: a bisection
    while low < high:
        mid = (low + high + 1) // 2
        if prefix[len(prefix) - mid:] in through:
            low = mid
        else:
            high = mid - 1
    if low == 0:
        return through[_common_prefix(prefix, through):]
    return through[through.rfind(prefix[len(prefix) - low:]) + low:]


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
    """One record ready to tokenize: its text, the answers' character spans, how to tokenize it."""

    text: str
    spans: tuple            # ((start, end), ...): a rendered record's answers, in order
    # the tokenizer's own special tokens (prompt/completion without a template)
    special_tokens: bool
    # prompt/completion without a template: label the tokens ending after this
    after: int = -1
    eos: int | None = None  # ... and end with this EOS id

    def segments(self) -> list[str]:
        """A rendered record's text cut where its answers start and end: the text before the
        first answer, the first answer, the text up to the next answer, ..., the text after the last
        (maybe empty)."""
        cuts = [0, *(at for span in self.spans for at in span), len(self.text)]
        return [self.text[a:b] for a, b in zip(cuts, cuts[1:])]


class RecordText:
    """A record of a `rendered` kind (data/records/: chat messages, a prompt and completion) → its
    `Text`; RecordError when it cannot: validate's check of the record
    (data/record_checks.RecordChecker), then the template on it."""

    def __init__(self, spec: JobSpec, tokenizer, kind: str, template: str | None, split: str):
        data = spec["data"]
        self.kind, self.tokenizer = RECORD_KINDS[kind], tokenizer
        self.columns = replace(Columns.of(spec), records=kind)
        self.all_tokens = data["loss_on"] == "all"
        self.renderer = Renderer(tokenizer, template) if template is not None else None
        self.checker = RecordChecker(self.columns, split)

    def messages(self, record: dict) -> list:
        """The conversation a checked record is rendered as."""
        return self.kind.messages(self.columns, record)

    def __call__(self, record, where: str) -> Text:
        if not isinstance(record, dict):
            raise RecordError(f"the record is {type(record).__name__}, an object expected",
                              "write one JSON object per line")
        # validate's own record check (data/record_checks.py)
        bad = self.checker.problem(where, record)
        if bad is not None:
            raise RecordError(bad.message.removeprefix(f"{where}: "), bad.hint)
        plain = self.kind.plain_text(self.columns, record) if self.renderer is None else None
        if plain is not None:
            prompt, completion = plain
            return Text(prompt + completion, (), True, after=len(prompt),
                        eos=self.tokenizer.eos_token_id)
        # records that need a template without one are refused before the pass
        assert self.renderer is not None
        messages = self.messages(record)
        try:
            full = self.renderer.render(messages)
            spans = tuple(self._spans(messages, full))
        # the template failing on this record (raise_exception, an undefined name)
        except Exception as err:
            raise RecordError(f"the chat template failed on this record: {first_line(err)}",
                              "fix the record, or the template (data.chat_template)") from None
        return Text(full, spans, False)

    def _spans(self, messages: list, full: str) -> list[tuple[int, int]]:
        assert self.renderer is not None
        try:
            return self.renderer.answer_spans(messages, full)
        except ValueError:
            if self.all_tokens:   # every token is trained on: the text is one segment
                return []
            raise


def encode(tokenizer, texts: list[Text], all_tokens: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) per text as int32 arrays, untruncated, in batched calls of the fast tokenizer:
    a rendered record segment by segment (`segment_ids`), its labels the answers' ids; a prompt and
    completion without a template at once, its labels from the offsets (the completion's tokens)."""
    out: list = [None] * len(texts)
    rendered = [i for i, t in enumerate(texts) if not t.special_tokens]
    segmented = segment_ids(tokenizer, [texts[i].segments() for i in rendered])
    for i, segments in zip(rendered, segmented):
        out[i] = _joined(segments, all_tokens)
    plain = [i for i, t in enumerate(texts) if t.special_tokens]
    if plain:
        encoded = tokenizer([texts[i].text for i in plain], add_special_tokens=True,
                            return_offsets_mapping=True, verbose=False)
        for i, ids, offsets in zip(plain, encoded["input_ids"], encoded["offset_mapping"]):
            out[i] = _completion(texts[i], np.asarray(ids, dtype=np.int32),
                                 np.asarray(offsets, dtype=np.int64).reshape(-1, 2), all_tokens)
    return out


def _joined(segments: list[list[int]], all_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    """The segments' ids one after the other; the labels keep the answers' (the odd segments)."""
    ids, labels = [], []
    for index, part in enumerate(segments):
        ids += part
        labels += part if all_tokens or index % 2 else [IGNORE_INDEX] * len(part)
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def _completion(text: Text, ids: np.ndarray, offsets: np.ndarray,
                all_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    """A prompt + completion without a template: the tokens ending after the prompt are the
    completion's (special tokens at the end, BERT's [SEP], have empty offsets: not the completion),
    then the EOS."""
    start, end = offsets[:, 0], offsets[:, 1]
    keep = np.ones(len(ids), dtype=bool) if all_tokens else (end > text.after) & (end > start)
    if text.eos is not None and (len(ids) == 0 or ids[-1] != text.eos):
        ids, keep = np.append(ids, np.int32(text.eos)), np.append(keep, True)
    return ids, np.where(keep, ids, np.int32(IGNORE_INDEX)).astype(np.int32)


def segment_ids(tokenizer, records: list[list[str]]) -> list[list[list[int]]]:
    """Each record's segments tokenised (no special tokens added): the first alone, every later one
    after its context (`_context`), keeping the ids it has there where the context keeps its own
    ids, else alone. Two or three batched calls in all."""
    added = _added_tokens(tokenizer)
    jobs = [(r, s, _context(segments[s - 1], added) if s else "")
            for r, segments in enumerate(records) for s in range(len(segments)) if segments[s]]
    contexts = sorted({context for _, _, context in jobs if context})
    encoded = _ids(tokenizer, [context + records[r][s] for r, s, context in jobs] + contexts)
    context_ids = dict(zip(contexts, encoded[len(jobs):]))
    out: list[list] = [[[] for _ in segments] for segments in records]   # an empty one: no ids
    alone = []
    for (r, s, context), ids in zip(jobs, encoded):
        before = context_ids[context] if context else []
        if ids[:len(before)] == before:
            out[r][s] = ids[len(before):]
        else:   # the segment changed its context's ids (a merge across the cut): tokenised alone
            alone.append((r, s))
    for (r, s), ids in zip(alone, _ids(tokenizer, [records[r][s] for r, s in alone])):
        out[r][s] = ids
    return out


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """The texts' ids as `tokenizer(text, add_special_tokens=False)` gives them, in one call."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)
    return encoded["input_ids"]


def _added_tokens(tokenizer) -> re.Pattern | None:
    """A pattern that finds the last of the tokenizer's added tokens in a text (special or not: the
    tokenizer splits the text at them before anything else), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names = sorted({str(token) for token in decoder.values()} | set(tokenizer.all_special_tokens),
                   key=len, reverse=True)
    names = [name for name in names if name]
    return re.compile("(?s:.*)(" + "|".join(map(re.escape, names)) + ")") if names else None


def _context(previous: str, added: re.Pattern | None) -> str:
    """What a segment is tokenised after: the previous segment from its last added token (the
    tokenizer's ids restart there), else the whole previous segment."""
    last = added.match(previous) if added is not None else None
    return previous[last.start(1):] if last is not None else previous


@dataclass(frozen=True)
class PromptDifference:
    """An assistant turn whose training ids before the answer are not the ids it is served."""

    turn: int         # the assistant message's number in the conversation, from 1
    rewritten: bool   # the template renders the turns before it otherwise: no ids can match
    message: str      # which tokens (or characters) differ, and where


def prompt_check(tokenizer, template: str, messages: list, text: Text,
                 segments: list[list[int]]) -> list[PromptDifference]:
    """Every assistant turn of a rendered record (`text`, its `segment_ids`) whose training ids
    before the answer differ from `generation_prompt_ids` of the turns before it."""
    differences, trained = [], []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for n, (i, span) in enumerate(zip(turns, text.spans)):
        trained += segments[2 * n]
        if i == 0:   # an answer that opens the conversation is never served a prompt
            trained += segments[2 * n + 1]
            continue
        served_text = tokenizer.apply_chat_template(messages[:i], chat_template=template,
                                                    tokenize=False, add_generation_prompt=True)
        before = text.text[:span[0]]
        if served_text != before:
            at = _common_prefix(served_text, before)
            differences.append(PromptDifference(i + 1, True, (
                f"character {at + 1} differs: trained {before[at:at + 40]!r}, "
                f"served {served_text[at:at + 40]!r}")))
        else:
            served = generation_prompt_ids(tokenizer, template, messages[:i])
            if served != trained:
                differences.append(PromptDifference(i + 1, False, _token_difference(
                    tokenizer, trained, served)))
        trained += segments[2 * n + 1]
    return differences


def _token_difference(tokenizer, trained: list[int], served: list[int]) -> str:
    """Where two id lists part, as token strings around that place."""
    at = next((k for k, (a, b) in enumerate(zip(trained, served)) if a != b),
              min(len(trained), len(served)))

    def shown(ids: list[int]) -> str:
        window = ids[max(0, at - 3):at + 4]
        names = tokenizer.convert_ids_to_tokens(window)
        return " ".join(repr(str(name)) for name in names) or "(nothing)"

    return (f"token {at + 1} of {len(served)} differs: trained {shown(trained)}, "
            f"served {shown(served)}")
