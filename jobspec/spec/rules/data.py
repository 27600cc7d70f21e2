"""The data section's static rules: what `jobspec validate` can tell about the data without reading
it.

Each rule refuses, at the field to change and with a rule code, what a launch would otherwise refuse
later (the ranks' loaders, the model build) or crash on:

- `seq-len-positions`: `data.max_length` (every sample: a text block, a record's truncation length,
  a packed sequence) or `data.synthetic.seq_len` longer than the model's learned position table
  (spec/model_dims.py; RoBERTa-style models lose `pad_token_id + 1` positions to their offset);
- `data-format`: a data file whose format `data.format: auto` cannot tell from its extension
  (data/formats/); `hf:` datasets have none;
- `tokenizer-path`: a `data.tokenizer` written as a path that does not exist;
- `tokenizer-files`: a local tokenizer whose tokenizer.json or tokenizer_config.json does not parse;
- `tokenizer-vocab`: a tokenizer with more tokens than the model's vocabulary (`model.config`);
- `synthetic-vocab`: a written `data.synthetic.vocab_range` that is empty or outside the model's
  vocabulary;
- `tokenizer-mask-token`, `tokenizer-pad`: masked LM without a mask token; no pad and no EOS to pad
  with;
- `chat-template`: chat records with no chat template (neither `data.chat_template` nor the
  tokenizer's own), or a template file that is missing or is not valid Jinja;
- `epochs-sample-count`: `training.epochs` (no `max_steps`) over data whose samples cannot be
  counted before the ranks tokenize it (a dataset by name, a saved dataset, text).

A local tokenizer directory is read as JSON (tokenizer.json, tokenizer_config.json): no
transformers. What needs transformers (a hub tokenizer, a tokenizer without tokenizer.json) is
checked by plan, compile and `jobspec launch` before any rank starts
(data/preflight.tokenizer_issues), `--dry-run` included. Pure: no torch, no transformers; jinja2
only when a template is checked.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobspec.data.formats import file_format, is_hub_name, named_format, source_format
from jobspec.data.records import RECORD_KINDS, record_kind
from jobspec.data.tokenizer_files import (
    TokenizerFacts,
    TokenizerFileError,
    read_tokenizer,
    tokenizer_name,
)
from jobspec.errors import SpecError, SpecIssue
from jobspec.spec import model_table
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.loader import SET_FILE
from jobspec.spec.model_dims import PADDING_OFFSET_POSITIONS, ModelDims, model_dims

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

def data_rule_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Every data rule's problems, on the defaults-filled spec (one of
    validation.CROSS_FIELD_RULES)."""
    s = r.spec
    config_json = local_checkpoint_config(r)
    tokenizer, issues = _tokenizer(r)
    dims = model_dims(s, config_json)
    return (issues + positions_issues(r, dims, tokenizer, config_json) + format_issues(r)
            + vocab_issues(r, dims, tokenizer) + special_token_issues(r, tokenizer)
            + chat_template_issues(r, tokenizer) + epochs_issues(r))


def epochs_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """`training.epochs` needs the number of training samples before anything starts (the schedule,
    the steps): the rows of a file of a `counted` format are counted (data/formats.count_rows); a
    dataset by name, a saved dataset or text (cut into blocks only by the tokenizer) has no count to
    read here."""
    s = r.spec
    train = s["data"].get("train")
    if s["training"].get("max_steps") is not None or not isinstance(train, str) \
            or s["data"].get("synthetic"):
        return []
    try:
        fmt = source_format(train if is_hub_name(train) else local_path(r, ("data", "train")),
                            s["data"]["format"])
    except SpecError:
        return []   # the data-format rule says so
    if fmt.counted:
        return []
    where = ("training", "epochs") if ("training", "epochs") in r.positions else ("training",)
    return [r.issue(where,
                    f"training.epochs needs the number of training samples, and {train} is "
                    f"{fmt.described}",
                    "set training.max_steps", code="epochs-sample-count")]


def _tokenizer(r: ResolvedSpec) -> tuple[TokenizerFacts | None, list[SpecIssue]]:
    """The local tokenizer's facts (None: none to read here), and the problems of its directory."""
    data = r.spec["data"]
    name = tokenizer_name(r.spec)
    if not isinstance(name, str) or not name or "\0" in name:
        return None, []
    field = ("data", "tokenizer") if data.get("tokenizer") else ("model", "name_or_path")
    directory = local_path(r, field)
    if not _is_dir(directory):
        if field == ("data", "tokenizer") and _looks_like_path(name):
            return None, [r.issue(field, f"tokenizer directory not found: {directory}",
                                  "paths are relative to the spec file that sets them; a hub id "
                                  "looks like `org/name`", code="tokenizer-path")]
        return None, []   # a hub id: launch loads it before any rank starts
    try:
        return read_tokenizer(directory), []
    except TokenizerFileError as err:
        return None, [r.issue(field, f"the tokenizer's {err.file.name} is broken: {err.what}",
                              f"save the tokenizer again ({err.file})", code="tokenizer-files")]


def _looks_like_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else written with slashes or dots is a path."""
    return (name.startswith(("/", "./", "../", "~")) or name.endswith("/") or name.count("/") > 1
            or name in (".", ".."))


# ---------------------------------------------------------------- sequence length against positions

def positions_issues(r: ResolvedSpec, dims: ModelDims | None, tokenizer: TokenizerFacts | None,
                     config_json: dict | None = None) -> list[SpecIssue]:
    """Every sample is at most `data.max_length` tokens (text blocks are exactly that long, records
    are truncated to it, packed sequences filled up to it), or `data.synthetic.seq_len`: at most the
    model's learned positions (refused); beyond a rotary model's max_position_embeddings without
    rope_scaling, a warning (`r.warnings`)."""
    s = r.spec
    if dims is None:
        return []
    model_config = s["model"].get("config") or {}
    if (dims.model_type in PADDING_OFFSET_POSITIONS and "pad_token_id" not in model_config
        and not config_json
            and tokenizer is not None and tokenizer.pad_id is not None):
        # built from the architecture: the model takes the tokenizer's pad id (model/build.py), and
        # RoBERTa's positions start after it
        dims = ModelDims(**{**dims.__dict__, "pad_token_id": tokenizer.pad_id})
    synthetic = s["data"].get("synthetic")
    seq_path, seq_len = ((("data", "synthetic", "seq_len"), synthetic["seq_len"]) if synthetic
                         else (("data", "max_length"), s["data"]["max_length"]))
    trained = dims.max_position_embeddings
    if trained and seq_len > trained and _rotary(dims.model_type) \
            and not _rope_scaled(model_config, config_json):
        # rotary positions are computed, not a table: the model runs past max_position_embeddings,
        # but out of the length it was trained for (quality drops) unless RoPE is scaled: a warning
        r.warnings.append(r.issue(seq_path,
                                  f"{seq_len} tokens per sequence, beyond the {trained} positions "
                                  f"{dims.model_type} is trained for (max_position_embeddings; "
                                  "rotary, no rope_scaling)",
                                  f"set model.config.rope_scaling (e.g. {{rope_type: yarn, "
                                  f"factor: {-(-seq_len // trained)}.0}}), or use at most "
                                  f"{trained}",
                                  code="seq-len-rotary"))
    positions = dims.usable_positions
    if positions is None:
        return []
    if seq_len <= positions:
        return []
    key = next((k for k in ("max_position_embeddings", "n_positions") if k in model_config),
               "max_position_embeddings")
    offset = ""
    if dims.model_type in PADDING_OFFSET_POSITIONS and dims.max_position_embeddings:
        offset = (f" ({dims.max_position_embeddings} positions; {dims.model_type} numbers them "
                  f"from pad_token_id + 1 = {dims.max_position_embeddings - positions})")
        need = seq_len + dims.max_position_embeddings - positions
    else:
        need = seq_len
    if s["model"].get("name_or_path") and key not in model_config:
        hint = f"use at most {positions} (the checkpoint's position table is fixed)"
    else:
        hint = f"use at most {positions}, or set model.config.{key}: {need}"
    return [r.issue(seq_path,
                    f"{seq_len} tokens per sequence, but the model's position table has {positions}"
                    f"{offset}", hint,
                    code="seq-len-positions")]


def _rotary(model_type: str | None) -> bool:
    return (model_table.entry(model_type) or {}).get("positions") == "rotary"


def _rope_scaled(model_config: dict, config_json: dict | None) -> bool:
    for config in (model_config, config_json or {}):
        scaling = config.get("rope_scaling")
        parameters = config.get("rope_parameters")
        if isinstance(scaling, dict) \
                and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            return True
        if isinstance(parameters, dict) and parameters.get("rope_type") not in (None, "default"):
            return True
    return False


# ---------------------------------------------------------------- data files

def format_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """`data.format: auto` on a file whose extension names no format; `hf:` datasets and directories
    (text, one document per file) have none to tell."""
    data = r.spec["data"]
    issues = []
    for split in ("train", "eval"):
        value = data.get(split)
        if not isinstance(value, str) or is_hub_name(value) or "\0" in value:
            continue
        file = local_path(r, ("data", split))
        if not _is_file(file):
            continue   # a missing file, a directory: the data-file rule says so
        try:
            file_format(file, data["format"])
        except SpecError as err:
            for problem in err.issues:
                issues.append(r.issue(("data", split) if data["format"] == "auto" else problem.path,
                                      problem.message, problem.hint, code="data-format"))
    return issues


def first_record(r: ResolvedSpec, split: str = "train") -> dict | None:
    """The first record of a local data file whose format reads it without a library (`light_rows`:
    jsonl, csv), or None (another format, no file, not readable: the record checks report those with
    their line)."""
    value = r.spec["data"].get(split)
    if not isinstance(value, str) or is_hub_name(value) or "\0" in value:
        return None
    file = local_path(r, ("data", split))
    if not _is_file(file):
        return None
    try:
        fmt = file_format(file, r.spec["data"]["format"])
        rows = fmt.first_rows(file, 1) if fmt.light_rows else []
    except (SpecError, OSError, ValueError):
        return None
    return rows[0] if rows else None


def chat_records(r: ResolvedSpec) -> bool | None:
    """Whether the records need a chat template (chat records, data/records/): `data.records` says,
    or with `auto` the kind that recognises the first record; None when it cannot be told here (auto
    on a format whose first record validate does not read, a dataset the ranks read)."""
    data = r.spec["data"]
    named = named_format(data["format"])
    if data["synthetic"] is not None or (named is not None and not named.holds_records):
        return False
    if data["records"] != "auto":
        return RECORD_KINDS[data["records"]].needs_template
    train = data.get("train")
    if not isinstance(train, str):
        return False
    try:
        fmt = source_format(train if is_hub_name(train) else local_path(r, ("data", "train")),
                            data["format"])
    except SpecError:
        return False
    if not (fmt.holds_records and fmt.nested):
        return False   # text, or records that hold no lists of messages
    row = first_record(r)
    if row is not None:
        return record_kind(r.spec, row).needs_template
    return None if not (fmt.local and fmt.light_rows) else False


# ---------------------------------------------------------------- vocabulary and special tokens

def vocab_issues(r: ResolvedSpec, dims: ModelDims | None,
                 tokenizer: TokenizerFacts | None) -> list[SpecIssue]:
    """The model's vocabulary holds every id the data can give: the tokenizer's, or synthetic
    ids."""
    s = r.spec
    vocab = dims.vocab_size if dims is not None else None
    if vocab is None:
        return []
    synthetic = s["data"].get("synthetic")
    if synthetic is not None:
        low, high = synthetic["vocab_range"][:2]
        if high <= low:
            return [r.issue(("data", "synthetic", "vocab_range"),
                            f"vocab_range [{low}, {high}) is empty",
                            "the second id must be larger than the first", code="synthetic-vocab")]
        if high > vocab and ("data", "synthetic", "vocab_range") in r.positions:
            # written: refused here; the default range against a small vocabulary is the ranks'
            # refusal (model/build._check_vocab), which many a compile-only spec relies on not being
            # made here
            return [r.issue(("data", "synthetic", "vocab_range"),
                            f"synthetic token ids go up to {high - 1} but "
                            f"the model's vocabulary has {vocab} entries",
                            f"end vocab_range at most at {vocab}, or raise model.config.vocab_size",
                            code="synthetic-vocab")]
        return []
    if tokenizer is None or tokenizer.size is None or tokenizer.size <= vocab:
        return []
    return [vocab_issue(r, vocab, tokenizer.size, str(tokenizer.directory))]


def vocab_issue(r: ResolvedSpec, vocab: int, size: int, name: str) -> SpecIssue:
    """A tokenizer of `size` tokens against a model vocabulary of `vocab` (validate, and launch for
    the tokenizers only transformers reads)."""
    model = r.spec["model"]
    message = f"the tokenizer {name} has {size} tokens but the model's vocabulary only {vocab}"
    if model.get("name_or_path"):   # a checkpoint's embedding is as large as it was trained
        return r.issue(("data", "tokenizer") if r.spec["data"].get("tokenizer")
                       else ("model", "name_or_path"),
                       message,
                       "use the checkpoint's own tokenizer (or one with at most that many tokens)",
                       code="tokenizer-vocab")
    config = model.get("config") or {}
    path = ("model", "config", "vocab_size") if "vocab_size" in config else ("model", "config")
    return r.issue(path, message, f"set model.config.vocab_size to at least {size}",
                   key=path[-1] == "config", code="tokenizer-vocab")


def special_token_issues(r: ResolvedSpec, tokenizer: TokenizerFacts | None) -> list[SpecIssue]:
    """The tokens the loaders need: a mask token for masked LM, a pad (or an EOS to pad with)."""
    if tokenizer is None:
        return []
    field = ("data", "tokenizer") if r.spec["data"].get("tokenizer") else ("model", "name_or_path")
    issues = []
    if r.spec["model"]["task"] == "masked-lm" and tokenizer.ids["mask"] is None:
        issues.append(r.issue(field,
                              "masked-lm needs a tokenizer with a mask token; "
                              f"{tokenizer.directory} has none",
                              "use a tokenizer that defines mask_token (e.g. [MASK] or <mask>)",
                              code="tokenizer-mask-token"))
    if tokenizer.pad_id is None and (tokenizer.directory / "tokenizer_config.json").is_file():
        issues.append(r.issue(field,
                              f"the tokenizer {tokenizer.directory} has neither a pad nor an eos "
                              "token to pad with",
                              "use a tokenizer with a pad token (or an eos token)",
                              code="tokenizer-pad"))
    return issues


# ---------------------------------------------------------------- chat templates

def chat_template_issues(r: ResolvedSpec, tokenizer: TokenizerFacts | None) -> list[SpecIssue]:
    """`data.chat_template` names a file that parses as Jinja; chat records have a template (that
    file, or the local tokenizer's own, which must parse too). A hub tokenizer's is checked at
    launch."""
    data = r.spec["data"]
    if data.get("chat_template"):
        file = local_path(r, ("data", "chat_template"))
        if not _is_file(file):
            return [r.issue(("data", "chat_template"), f"chat template file not found: {file}",
                            "paths are relative to the spec file that sets them",
                            code="chat-template")]
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            return [r.issue(("data", "chat_template"), f"{file} cannot be read: {err}",
                            "save the template as UTF-8 text", code="chat-template")]
        problem = template_problem(text, str(file))
        return [r.issue(("data", "chat_template"), problem, "fix the template (Jinja syntax)",
                        code="chat-template")] if problem else []
    chat = chat_records(r)
    if not chat or tokenizer is None:
        # not chat, not known here, or a tokenizer only transformers reads: launch checks it
        return []
    field = ("data", "tokenizer") if data.get("tokenizer") else ("model", "name_or_path")
    if tokenizer.chat_template is None:
        where = ("data", "records") if ("data", "records") in r.positions else ("data", "train")
        return [r.issue(where,
                        "chat records need a chat template, and the tokenizer "
                        f"{tokenizer.directory} has none",
                        "set data.chat_template to a Jinja template file, or use a tokenizer with "
                        "a chat_template",
                        code="chat-template")]
    problem = template_problem(tokenizer.chat_template, str(tokenizer.template_source))
    return [r.issue(field, problem,
                    "fix the tokenizer's chat template, or set data.chat_template to a file",
                    code="chat-template")] if problem else []


def template_problem(text: str, source: str) -> str | None:
    """Why `text` is not a chat template Jinja can compile (transformers' environment: the loop
    controls and the `{% generation %}` block), with its file:line; None when it compiles."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):   # transformers marks the assistant's tokens with it
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = jinja2.Environment(extensions=[loopcontrols, Generation])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as err:
        return f"{source}:{err.lineno}: the chat template is not valid Jinja: {err.message}"
    return None


# ---------------------------------------------------------------- paths

def local_path(r: ResolvedSpec, field: tuple) -> Path:
    """The spec's path at `field` as a local path: relative to the file that wrote it (`--set`: to
    the current directory), as validation resolves it."""
    value: Any = r.spec
    for key in field:
        value = value[key]
    where = r.positions.get(tuple(field))
    if where is None:
        base = Path(r.source).resolve().parent
    elif where.file == SET_FILE:
        base = Path.cwd()
    else:
        base = Path(where.file).resolve().parent
    return Path(os.path.abspath(base / os.path.expanduser(str(value))))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False

