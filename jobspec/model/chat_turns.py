"""Where a chat model's answer ends: the tokenizer's EOS and the token the chat template closes an
assistant turn with (Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>`, Gemma's `<end_of_turn>`).

A model trained on chat records learns to end its answer with the template's end-of-turn marker
(train: the answer spans include it), not with the tokenizer's EOS. Generation that stops only at
EOS runs on to `max_new_tokens`, writing further turns. The ranks' generation at evaluation
(train/generation.py) and every exported model's generation_config.json (export/hf_dir.py) stop at
both. The marker is found by rendering a one-turn conversation with the template and reading what
it writes right after the answer's text, so any template works without a table of model families.
"""
from __future__ import annotations

ANSWER_MARK = "JOBSPECANSWERMARK"   # one plain word: no template trims or escapes it


def end_of_turn_ids(tokenizer, template: str | None) -> list[int]:
    """The ids that end an answer: EOS first, then the template's end-of-turn token when it is
    another special token. [] for a tokenizer without EOS and a template without a marker."""
    ids = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    marker = template_end_token(tokenizer, template)
    if marker is not None and marker not in ids:
        ids.append(marker)
    return ids


def template_end_token(tokenizer, template: str | None) -> int | None:
    """The special token the template writes right after an assistant turn's text, or None."""
    if not template:
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER_MARK}]
    try:
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    # a template that needs a system turn, tools, ...: EOS alone then
    except Exception:  # noqa: BLE001
        return None
    at = rendered.rfind(ANSWER_MARK)
    if at < 0:
        return None
    after = rendered[at + len(ANSWER_MARK):].lstrip(" ")
    if not after:
        return None
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return int(ids[0]) if ids[0] in special or ids[0] in added else None


def token_names(tokenizer, ids: list[int]) -> list[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
