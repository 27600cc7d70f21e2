"""A local tokenizer directory read as JSON (tokenizer.json, tokenizer_config.json,
chat_template.jinja), without transformers: what `jobspec validate`'s data rules
(spec/rules/data.py) and the planner's model build (model/build.tokenizer_token_ids) need to know of
it: its size, its special tokens' ids and its own chat template. Pure: json and pathlib only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.spec.types import JobSpec

SPECIAL_TOKENS = ("bos", "eos", "pad", "unk", "mask")


@dataclass(frozen=True)
class TokenizerFacts:
    """What validate reads of a local tokenizer directory without transformers."""

    directory: Path
    # ids the embedding must hold: the largest id + 1 (vocab and added tokens)
    size: int | None
    # bos/eos/pad/unk/mask -> id (None: the tokenizer has no such token)
    ids: dict[str, int | None]
    # its own template (tokenizer_config.json or chat_template.jinja)
    chat_template: str | None
    template_source: Path | None

    @property
    def pad_id(self) -> int | None:
        """The pad id the ranks use: build_tokenizer pads with EOS when there is no pad token."""
        return self.ids["pad"] if self.ids["pad"] is not None else self.ids["eos"]


class TokenizerFileError(ValueError):
    """A tokenizer file that does not parse: (file, what)."""

    def __init__(self, file: Path, what: str) -> None:
        super().__init__(f"{file}: {what}")
        self.file, self.what = file, what


def read_tokenizer(directory: str | os.PathLike) -> TokenizerFacts | None:
    """The facts of a local tokenizer directory with a tokenizer.json; None when there is none (a
    slow tokenizer, a hub id: transformers tells, at launch). Raises TokenizerFileError for a file
    that does not parse."""
    directory = Path(directory)
    main = directory / "tokenizer.json"
    if not main.is_file():
        return None
    body = _json_file(main)
    config_file = directory / "tokenizer_config.json"
    config = _json_file(config_file) if config_file.is_file() else {}
    special_map = directory / "special_tokens_map.json"
    if special_map.is_file():
        config = {**_json_file(special_map), **config}
    vocab = (body.get("model") or {}).get("vocab")
    by_text: dict[str, int] = {}
    if isinstance(vocab, dict):
        by_text = {k: v for k, v in vocab.items() if isinstance(v, int)}
    elif isinstance(vocab, list):   # Unigram: [[piece, score], ...], ids in order
        by_text = {item[0]: i for i, item in enumerate(vocab) if isinstance(item, list) and item}
    for added in body.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            by_text[str(added.get("content"))] = added["id"]
    for id_text, added in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and str(id_text).isdigit():
            by_text.setdefault(str(added.get("content")), int(id_text))
    ids = {name: _token_id(config.get(f"{name}_token"), by_text) for name in SPECIAL_TOKENS}
    template, source = _own_template(directory, config, config_file)
    size = max(by_text.values()) + 1 if by_text else None
    return TokenizerFacts(directory, size, ids, template, source)


def _json_file(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TokenizerFileError(path, "not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise TokenizerFileError(path,
                                 f"not valid JSON ({err.msg}, line {err.lineno} column "
                                 f"{err.colno})") from None
    except OSError as err:
        raise TokenizerFileError(path, f"cannot be read ({err.strerror or err})") from None
    if not isinstance(value, dict):
        raise TokenizerFileError(path, "a JSON object expected")
    return value


def _token_id(token: Any, by_text: dict[str, int]) -> int | None:
    if isinstance(token, dict):   # an AddedToken as saved by transformers 4
        token = token.get("content")
    return by_text.get(token) if isinstance(token, str) else None


def _own_template(directory: Path, config: dict, config_file: Path) -> tuple[str | None,
                                                                             Path | None]:
    """The tokenizer's chat template: chat_template.jinja (transformers 5 saves it so), else
    tokenizer_config.json's `chat_template` (a text, or a list of named ones: the `default`)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), jinja
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerFileError(jinja, f"cannot be read ({err})") from None
    for source, holder in ((config_file, config), (directory / "chat_template.json", None)):
        if holder is None:
            holder = _json_file(source) if source.is_file() else {}
        template = holder.get("chat_template")
        if isinstance(template, list):   # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str) and template.strip():
            return template, source
    return None, None


def tokenizer_name(spec: JobSpec) -> str | None:
    """The tokenizer the ranks load: `data.tokenizer`, else `model.name_or_path`; None for synthetic
    data."""
    data = spec["data"]
    if data.get("synthetic") is not None:
        return None
    return data.get("tokenizer") or spec["model"].get("name_or_path")
