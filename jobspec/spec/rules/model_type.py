"""The rules that read the generated entry of the job's model type (spec/model_table), for every
type transformers registers, without importing it: validate finds here what --dry-run finds by
building the model.

Rule codes:
  model-task-head     the model type has no head for `model.task` (transformers' auto class
                      lacks it)
  lora-targets        a `model.lora.target_modules` entry matches no module LoRA can adapt
  lora-modules-to-save  a `modules_to_save` entry matches no module
  config-token-id     pad_token_id at or beyond `vocab_size` (the embedding's padding index:
                      transformers' build fails with "Padding_idx must be within num_embeddings",
                      at no key)

And `fill_attention`: `model.attention` left out means the best the head supports (sdpa, else
eager). The model type is `model.architecture`, else a local checkpoint's config.json (or a hub id's
in the local Hugging Face cache); a hub id outside the cache is checked by plan, compile and
--dry-run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.data.tokenizer_files import TokenizerFileError, read_tokenizer, tokenizer_name
from jobspec.errors import SpecIssue
from jobspec.spec import model_table
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.rules.base import local_path

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

# the padding id is the embedding's `padding_idx` in most decoders (Phi-3, Llama-style): beyond the
# vocabulary, the build fails; bos/eos out of range only draw transformers' warnings (GPT-2's 50256
# over a small vocabulary trains fine), so they are left alone
TOKEN_IDS = ("pad_token_id",)


def _type_and_head(r: ResolvedSpec) -> tuple[str | None, dict | None]:
    model_type = model_table.model_type(r.spec, local_checkpoint_config(r))
    return model_type, model_table.head(model_type, r.spec["model"]["task"])


def model_type_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """The head, the LoRA module names and the token ids of a defaults-filled spec, positioned."""
    model = r.spec["model"]
    model_type, head = _type_and_head(r)
    if head is None:
        return []
    found = model_table.entry(model_type) or {}
    if not head:
        having = sorted(found.get("heads", {}))
        where = ("model", "task") if ("model", "task") in r.positions else ("model", "architecture")
        return [r.issue(where,
                        f"model type `{model_type}` has no {model['task']} head in transformers",
                        f"set model.task to one it has: {', '.join(having)}" if having else
                        "use a text model: this type has none of jobspec's task heads",
                        code="model-task-head")]
    issues: list[SpecIssue] = []
    if model["lora"] is not None and "modules" in head:
        owner = head.get("class", model_type or "the model")
        for path, message, hint in model_table.lora_target_problems(head, model["lora"],
                                                                    model["task"], owner):
            code = "lora-modules-to-save" if "modules_to_save" in path else "lora-targets"
            issues.append(r.issue(path, message, hint, code=code))
    return issues + token_id_issues(r, model_type)


def token_id_issues(r: ResolvedSpec, model_type: str | None) -> list[SpecIssue]:
    """The padding id of a model built from an architecture, at or beyond its vocabulary: the id the
    build uses (model.config, else the local tokenizer's, else the class's default: Phi-3's pad
    32000 against `vocab_size: 512`), reported at the key to change with a value that works."""
    model = r.spec["model"]
    if not model.get("architecture") or model.get("name_or_path") or model_type is None:
        return []
    entry = model_table.entry(model_type) or {}
    if not entry.get("common", False):
        return []
    config = model.get("config") or {}
    vocab = config.get("vocab_size", model_table.config_default(model_type, "vocab_size"))
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return []
    from_tokenizer = _tokenizer_ids(r)
    issues = []
    for key in TOKEN_IDS:
        if key in config:
            value, source = config[key], "model.config"
        elif key in from_tokenizer:
            value, source = from_tokenizer[key], "the tokenizer"
        else:
            owner = entry["class"].rsplit(".", 1)[-1]
            value, source = model_table.config_default(model_type, key), f"{owner}'s default"
        # None: no such token, nothing to check
        ids = value if isinstance(value, list) else [value]
        bad = [v for v in ids if isinstance(v, int) and not isinstance(v, bool) and v >= vocab]
        if not bad:
            continue
        where = ("model", "config", key) if key in config else \
            ("model", "config", "vocab_size") if "vocab_size" in config \
                else ("model", "architecture")
        issues.append(r.issue(where, f"{key} {bad[0]} ({source}) is not below vocab_size {vocab}",
                              f"set model.config.{key}: {vocab - 1} (any id below {vocab}), or a "
                              f"vocab_size above {max(bad)}", code="config-token-id"))
    return issues


def _tokenizer_ids(r: ResolvedSpec) -> dict:
    """The ids model/build.tokenizer_token_ids takes from a local tokenizer read as JSON ({}:
    none)."""
    name = tokenizer_name(r.spec)
    if not isinstance(name, str) or not name or "\0" in name or not r.spec["data"].get("tokenizer"):
        return {}
    directory = local_path(r, ("data", "tokenizer"))
    try:
        facts = read_tokenizer(directory) if directory.is_dir() else None
    except (TokenizerFileError, ValueError, OSError):
        return {}
    if facts is None:
        return {}
    return {"bos_token_id": facts.ids["bos"], "eos_token_id": facts.ids["eos"],
            "pad_token_id": facts.pad_id}


def fill_attention(r: ResolvedSpec) -> None:
    """`model.attention` the spec leaves out: the best implementation the model's head supports
    (sdpa, else eager), so plan, compile and the ranks build the model it can run; a written one
    stays."""
    if ("model", "attention") in r.positions or not tasks.TASKS.get(r.spec["model"]["task"]):
        return
    _, head = _type_and_head(r)
    if head:
        r.spec["model"]["attention"] = model_table.best_attention(head)
