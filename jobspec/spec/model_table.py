"""What validate knows of every transformers model type, without transformers:
schemas/transformers-configs/.

scripts/gen_transformers_configs.py writes one JSON file per model type the installed transformers
registers (and jobspec's `mlp`), plus index.json (the common config keywords, the list of types).
This module reads the index and the one file of the job's model type (lru-cached; ~5 KB), so
`jobspec validate` stays torch-free and fast whatever the model:

- `entry(model_type)`: the config keys, aliases, defaults, and per jobspec task the head class, the
  attention implementations it supports and the modules LoRA can adapt (layer numbers written `*`);
- `model_type(spec, checkpoint_config)`: `model.architecture`, else a local checkpoint's config.json
  `model_type` (a hub id's is known only once its config.json is read: job/model_config);
- `best_attention`: what `model.attention` means when the spec leaves it out (sdpa, else eager);
- `lora_target_problems`: `model.lora.target_modules` / `modules_to_save` against the head's
  modules, PEFT's matching (an entry equals a module's dotted name or ends it), with did-you-mean.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from jobspec import tasks
from jobspec.errors import did_you_mean
from jobspec.spec.types import JobSpec, JobSpecModelLora

TABLE_DIR = "transformers-configs"
INDEX = "index.json"
# the default's preference: flash-attn needs a package and half precision
ATTENTION_ORDER: tuple[Literal["sdpa"], Literal["eager"]] = ("sdpa", "eager")
# what PEFT's `all-linear` adapts
LINEAR_KINDS = ("Linear", "Conv1D", "Linear4bit", "Linear8bitLt")


def _table_dir() -> Path:
    here = Path(__file__).resolve()
    for directory in (here.parents[2] / "schemas" / TABLE_DIR,        # source checkout
                      # installed wheel (pyproject force-include)
                      here.parents[1] / "_schemas" / TABLE_DIR):
        if (directory / INDEX).is_file():
            return directory
    raise FileNotFoundError(f"schemas/{TABLE_DIR}/{INDEX} not found next to the jobspec package")


@lru_cache(maxsize=1)
def index() -> dict:
    table: dict = json.loads((_table_dir() / INDEX).read_text(encoding="utf-8"))
    return table


@lru_cache(maxsize=None)
def entry(model_type: object) -> dict | None:
    """The generated file of `model_type`, or None for a type the installed transformers did not
    register when the table was generated (never a path outside the table: only listed names are
    read)."""
    if not isinstance(model_type, str) or model_type not in set(index()["model_types"]):
        return None
    found: dict = json.loads((_table_dir() / f"{model_type}.json").read_text(encoding="utf-8"))
    return found


def model_types() -> list[str]:
    return list(index()["model_types"])


def model_type(spec: JobSpec, checkpoint_config: dict | None) -> str | None:
    """The spec's model type when validate can know it: `architecture`, else a local
    config.json's."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict):
        return None
    if isinstance(model.get("architecture"), str):
        return model["architecture"]
    found = (checkpoint_config or {}).get("model_type")
    return found if isinstance(found, str) else None


def head(model_type_name: str | None, task: str) -> dict | None:
    """The generated head of `task` for the model type ({} when the type has no head for it), None
    unknown."""
    found = entry(model_type_name)
    if found is None or "heads" not in found:
        return None
    heads: dict[str, dict] = found["heads"]
    if task in heads:
        return heads[task]
    # A head is its auto class's: a task added after the tables were generated
    # (scripts/gen_transformers_configs.py) reads the head of a registered task with the same auto
    # class, so adding a task needs no regeneration.
    auto_class = tasks.get(task).auto_class if task in tasks.TASKS else None
    return next((heads[name] for name, other in tasks.TASKS.items()
                 if other.auto_class == auto_class and name in heads), {})


def best_attention(head_entry: dict | None) -> Literal["sdpa", "eager"]:
    """sdpa where the head supports it, else eager; sdpa when the head is not known (the ranks
    decide)."""
    supported = (head_entry or {}).get("attention")
    if not supported:
        return ATTENTION_ORDER[0]
    return next(name for name in ATTENTION_ORDER if supported.get(name, name == "eager"))


def config_default(model_type_name: str | None, key: str) -> Any:
    """The config class's default value of `key` (the generated `defaults`), None when not
    recorded."""
    found = entry(model_type_name)
    return (found or {}).get("defaults", {}).get(key)


def normalized(name: str) -> str:
    """A module name or pattern with layer numbers as `*` (the generated tables' spelling)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def matches(module_pattern: str, entry_text: str) -> bool:
    """PEFT's match of a `target_modules` / `modules_to_save` entry, on the generated patterns."""
    wanted = normalized(entry_text)
    return module_pattern == wanted or module_pattern.endswith(f".{wanted}")


def lora_target_problems(head_entry: dict, lora: JobSpecModelLora, task: str,
                         owner: str) -> list[tuple[tuple, str, str]]:
    """(path, message, hint) per `model.lora` entry that matches no module of the head: the checks
    of model/lora.check_targets on the generated module table (the meta build's names), for
    validate."""
    modules: dict[str, str] = head_entry.get("modules") or {}
    if not modules:
        return []
    problems: list[tuple[tuple, str, str]] = []
    leaves = sorted({p.rsplit(".", 1)[-1] for p in modules})
    saved_entries = lora.get("modules_to_save")
    for i, saved in enumerate(saved_entries or []):
        if isinstance(saved, str) and not any(matches(p, saved) or f".{saved}." in f".{p}."
                                              for p in modules):
            problems.append((("model", "lora", "modules_to_save", i),
                             f"modules_to_save entry {saved!r} matches no adaptable module of "
                             f"{owner} ({task})",
                             did_you_mean(normalized(saved).rsplit(".", 1)[-1], leaves,
                                          "the model's adaptable modules", n=3, quote="'",
                                          shown=12)))
    targets = lora.get("target_modules")
    if targets == "all-linear":
        output = head_entry.get("output")
        if not any(kind in LINEAR_KINDS and pattern != output for pattern, kind in modules.items()):
            problems.append((("model", "lora", "target_modules"),
                             f"`all-linear` finds no linear layer in {owner} outside the head",
                             "list the modules to adapt by name"))
        return problems
    for i, target in enumerate(targets if isinstance(targets, list) else []):
        if isinstance(target, str) and not any(matches(p, target) for p in modules):
            problems.append((("model", "lora", "target_modules", i),
                             f"target module pattern {target!r} matches no module LoRA can adapt "
                             f"in {owner} ({task})",
                             did_you_mean(normalized(target).rsplit(".", 1)[-1], leaves,
                                          "the model's adaptable modules", n=3, quote="'",
                                          shown=12)))
    return problems


def all_linear_modules(head_entry: dict) -> list[str]:
    """The module names `all-linear` adapts (each linear layer's last name component), sorted."""
    output = head_entry.get("output")
    return sorted({p.rsplit(".", 1)[-1] for p, kind in (head_entry.get("modules") or {}).items()
                   if kind in LINEAR_KINDS and p != output})
