"""The two free-form blocks of a spec, checked at validate time: `model.config` and `deepspeed:`.

Both go to libraries that take almost anything. A transformers 5 config class keeps an unknown
keyword as a stray attribute (`hiddne_size: 1024` trains a 768-wide model); DeepSpeed ignores
unknown top-level keys and refuses unknown nested ones only inside the ranks. So each block is
checked against a table generated from the installed library and shipped under schemas/:

- schemas/transformers-configs/ (scripts/gen_transformers_configs.py): per model type transformers
  registers, the config class's fields with their types, its aliases, and the common keywords
  (read through spec/model_table, one small file per type);
- schemas/deepspeed-config.schema.json (scripts/gen_deepspeed_schema.py): every key DeepSpeed
  reads, as JSON Schema.

Pure: reads two JSON files (and a local checkpoint's config.json); no torch, transformers or
DeepSpeed. Each function returns `SpecIssue`s positioned by the caller's `issue` function
(`ResolvedSpec.issue(path, message, hint=None, key=False)`).
"""
from __future__ import annotations

import json
import operator
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jobspec.errors import SpecIssue, close_choices, did_you_mean
from jobspec.spec import model_table
from jobspec.spec.loader import SET_FILE
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

IssueFn = Callable[..., SpecIssue]
Problem = tuple   # (path inside the block, message, hint, whether to point at the key)

DEEPSPEED_SCHEMA = "deepspeed-config.schema.json"

# DeepSpeed keys a spec field decides, and that field. The planner, --fit, the GPU pre-flight,
# the report and the worker read the spec, so a `deepspeed:` value for one of these would make them
# describe another run than the one that happens. That covers the sizes the memory planner reads
# (ZeRO buckets, stage-3 prefetch and persistence, NVMe parameter buffers:
# jobspec/memory/planner.py). Every other key stays overridable, those of the same sections included
# (overlap_comm, allgather_bucket_size, the fp16 loss-scale window, pin_memory, ...): nothing else
# reads them, and compile notes each one.
OWNED_DEEPSPEED_KEYS: dict[tuple[str, ...], str] = {
    ("train_batch_size",): "training.global_batch_size",
    ("train_micro_batch_size_per_gpu",): "training.micro_batch_size",
    ("gradient_accumulation_steps",): "training.global_batch_size",
    ("optimizer",): "training.optimizer",
    ("scheduler",): "training.scheduler",
    ("gradient_clipping",): "training.gradient_clipping",
    ("zero_optimization", "stage"): "memory.zero_stage",
    ("zero_optimization", "offload_optimizer", "device"): "memory.offload.optimizer",
    ("zero_optimization", "offload_param", "device"): "memory.offload.params",
    ("zero_optimization", "reduce_bucket_size"): "memory.zero.reduce_bucket_size",
    ("zero_optimization", "stage3_prefetch_bucket_size"): "memory.zero.stage3_prefetch_bucket_size",
    ("zero_optimization",
     "stage3_param_persistence_threshold"): "memory.zero.stage3_param_persistence_threshold",
    ("zero_optimization", "offload_param", "buffer_count"): "memory.offload.buffer_count",
    ("zero_optimization", "offload_param", "buffer_size"): "memory.offload.buffer_size",
    ("fp16", "enabled"): "memory.precision",
    ("bf16", "enabled"): "memory.precision",
    # other names DeepSpeed accepts for the keys above: deprecated switches that set an offload
    # device to cpu, pydantic field names of stage3_* aliases, bf16's older name, and autocast,
    # which changes the compute dtype
    ("zero_optimization", "cpu_offload"): "memory.offload.optimizer",
    ("zero_optimization", "cpu_offload_param"): "memory.offload.params",
    ("zero_optimization", "prefetch_bucket_size"): "memory.zero.stage3_prefetch_bucket_size",
    ("zero_optimization",
     "param_persistence_threshold"): "memory.zero.stage3_param_persistence_threshold",
    ("bfloat16", "enabled"): "memory.precision",
    ("torch_autocast", "enabled"): "memory.precision",
}
_OWNED_HINTS: dict[tuple[str, ...], str] = {
    ("gradient_accumulation_steps",): "jobspec derives it as global_batch_size / (micro_batch_size "
                                      "x world size): set `training.global_batch_size`",
    ("optimizer",): "set `training.optimizer` (name, lr, betas, eps, weight_decay, momentum) "
                    "instead",
    ("scheduler",): "set `training.scheduler` (name, warmup_steps or warmup_ratio, min_lr_ratio) "
                    "instead",
}
# `model.config` keys whose job a spec field does (the worker passes that field last).
OWNED_MODEL_CONFIG_KEYS = {"attn_implementation": "model.attention",
                           "_attn_implementation": "model.attention"}

_TYPE_WORDS = {"object": "a mapping", "array": "a list", "string": "a string",
               "integer": "an integer",
               "number": "a number", "float": "a number with a decimal point",
               "boolean": "true or false", "null": "null"}


# ---------------------------------------------------------------- the shipped tables

def _schema_dirs() -> tuple[Path, ...]:
    here = Path(__file__).resolve()
    return (here.parents[2] / "schemas",            # source checkout
            here.parents[1] / "_schemas")           # installed wheel (pyproject force-include)


def schema_file(name: str) -> Path:
    for directory in _schema_dirs():
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{name} not found next to the jobspec package")


@lru_cache(maxsize=None)
def load_table(name: str) -> dict:
    table: dict = json.loads(schema_file(name).read_text(encoding="utf-8"))
    return table


# ---------------------------------------------------------------- model.config

def model_config_issues(spec: JobSpec, issue: IssueFn, checkpoint_config: dict | None = None,
                        entry: dict | None = None) -> list[SpecIssue]:
    """Unknown keys and wrong types in `model.config`, for every model type in the generated table.

    `checkpoint_config`: the parsed config.json of a local `model.name_or_path` directory; its keys
    are accepted too, and its `model_type` names the architecture. `entry`: the type's generated
    entry by default (spec/model_table); job/model_config passes one read from transformers for a
    type the table does not list (a transformers newer than the table).
    """
    model = spec.get("model") if isinstance(spec, dict) else None
    config = model.get("config") if isinstance(model, dict) else None
    if not isinstance(model, dict) or not isinstance(config, dict) or not config:
        return []
    checkpoint_config = checkpoint_config if isinstance(checkpoint_config, dict) else {}
    model_type = model_table.model_type(spec, checkpoint_config)
    entry = entry or model_table.entry(model_type)
    if entry is None:
        # no type known here (a hub id), or one transformers
        # lacks: plan, compile, --dry-run check it
        return []
    fields = {**(model_table.index()["common"] if entry["common"] else {}), **entry["fields"]}
    aliases = entry["aliases"]
    owner = entry["class"].rsplit(".", 1)[-1]
    issues = []
    for key, value in config.items():
        path = ("model", "config", key)
        if key in OWNED_MODEL_CONFIG_KEYS:
            field = OWNED_MODEL_CONFIG_KEYS[key]
            issues.append(issue(path, f"`{key}` is set from `{field}`", f"set `{field}` instead",
                                key=True))
            continue
        expected = fields.get(aliases.get(key, key))
        if expected is None and key in checkpoint_config:
            continue
        if expected is None:
            choices = sorted(set(fields) | set(aliases) | set(checkpoint_config))
            table = f"schemas/{model_table.TABLE_DIR}/{model_type}.json"
            issues.append(issue(path, f"unknown key `{key}` for {owner} ({model_type})",
                                did_you_mean(str(key), choices, f"{owner}'s keys", shown=12,
                                             more=table),
                                key=True))
            continue
        walker = _Walker(auto_is_wrong=False)
        walker.walk(value, expected, path)
        issues += [issue(*problem[:3], key=problem[3]) for problem in walker.problems]
    return issues


# ---------------------------------------------------------------- deepspeed

def deepspeed_issues(spec: JobSpec, issue: IssueFn) -> list[SpecIssue]:
    """Keys a spec field owns, unknown keys and wrong types in the `deepspeed:` section."""
    section = spec.get("deepspeed") if isinstance(spec, dict) else None
    if not isinstance(section, dict) or not section:
        return []
    return [issue(("deepspeed",) + path, message, hint, key=at_key)
            for path, message, hint, at_key in deepspeed_problems(section)]


def deepspeed_problems(config: dict, owned: bool = True) -> list[Problem]:
    """Problems of a DeepSpeed config (the spec's section, or a whole compiled one with
    `owned=False`)."""
    problems, refused = (_owned_problems(config) if owned else ([], set()))
    walker = _Walker(auto_is_wrong=True, skip=refused)
    walker.walk(config, load_table(DEEPSPEED_SCHEMA), ())
    return problems + walker.problems


def _owned_problems(section: dict) -> tuple[list[Problem], set]:
    problems, refused = [], set()
    for owned, field in OWNED_DEEPSPEED_KEYS.items():
        node = section
        for depth, key in enumerate(owned, 1):
            if not isinstance(node, dict) or key not in node:
                break
            path = owned[:depth]
            if depth < len(owned) and isinstance(node[key], dict):
                node = node[key]
                continue
            if path not in refused:
                refused.add(path)
                why = "plan, --fit, the GPU pre-flight and the report read the spec"
                # an HF Trainer config: jobspec does it
                if depth == len(owned) and _is_auto(node[key]):
                    message = f'jobspec sets this from `{field}`, as the HF Trainer does for "auto"'
                    hint = f"remove the key; set `{field}` to change the value"
                elif depth == len(owned):
                    message = f"jobspec sets this from `{field}`"
                    hint = _OWNED_HINTS.get(owned, f"set `{field}` instead: {why}")
                # a null or scalar would replace the whole compiled mapping, the owned key with it
                else:
                    message = ("would replace the compiled mapping, whose "
                               f"`{'.'.join(owned[depth:])}` jobspec sets from `{field}`")
                    hint = (f"set `{field}` instead: {why}; to change other keys here, write a "
                            "mapping of them")
                problems.append((path, message, hint, True))
            break
    return problems, refused


class _Walker:
    """Checks a value against a JSON Schema node (the subset the generated tables use), collecting
    Problems."""

    def __init__(self, auto_is_wrong: bool, skip: frozenset | set = frozenset()) -> None:
        # DeepSpeed takes "auto" as text and falls back to its default
        self.auto_is_wrong = auto_is_wrong
        # paths already reported (owned keys): nothing below them
        self.skip = skip
        self.problems: list[Problem] = []

    def walk(self, value: Any, node: dict, path: tuple, lax: bool = False) -> None:
        """`lax`: inside a section DeepSpeed parses with pydantic, which takes 5e8 (a float) as an
        integer."""
        if any(path[:n] in self.skip for n in range(1, len(path) + 1)):
            return
        lax = lax or "x-pydantic" in node
        if self.auto_is_wrong and path and _is_auto(value):
            self.problems.append((path,
                                  '"auto" is resolved only by the HF Trainer; plain DeepSpeed '
                                  'would '
                                        "silently fall back to its own default",
                                  "write the value itself, or remove the key", False))
            return
        branch = _branch(value, node, lax)
        if branch is None:
            types = _node_types(node)
            self.problems.append((path, f"expected {_types_text(types)}, got {_describe(value)}",
                                  _type_hint(value, types), False))
            return
        problem = _value_problem(value, branch)
        if problem:
            self.problems.append((path, *problem, False))
        if isinstance(value, dict):
            properties = branch.get("properties") or {}
            extra = branch.get("additionalProperties", True)
            for key, child in value.items():
                if key in properties:
                    self.walk(child, properties[key], path + (key,), lax)
                elif isinstance(extra, dict):
                    self.walk(child, extra, path + (key,), lax)
                elif extra is False:
                    self.problems.append(_unknown_key(path + (key,), branch))
        elif isinstance(value, list) and isinstance(branch.get("items"), dict):
            for index, item in enumerate(value):
                self.walk(item, branch["items"], path + (index,), lax)


def _branch(value: Any, node: dict, lax: bool = False) -> dict | None:
    """The part of `node` that describes `value` (the matching anyOf/oneOf branch), None on a type
    mismatch."""
    alternatives = node.get("anyOf") or node.get("oneOf")
    if alternatives:
        for alternative in alternatives:
            branch = _branch(value, alternative, lax)
            if branch is not None:
                return {**{k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}, **branch}
        return None
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    return node if not types or any(_is(value, t, lax) for t in types) else None


def _node_types(node: dict) -> list[str]:
    if node.get("anyOf") or node.get("oneOf"):
        return [t for alt in node.get("anyOf") or node["oneOf"] for t in _node_types(alt)]
    types = node.get("type") or []
    return [types] if isinstance(types, str) else list(types)


def _value_problem(value: Any, node: dict) -> tuple[str, str] | None:
    if "enum" in node and value not in node["enum"]:
        allowed = list(dict.fromkeys(v for v in node["enum"] if v is not None))
        return f"`{value}` is not an allowed value", did_you_mean(str(value),
                                                                  [str(v) for v in allowed],
                                                                  "allowed")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bounds = (("minimum", ">=", operator.ge), ("exclusiveMinimum", ">", operator.gt),
                  ("maximum", "<=", operator.le), ("exclusiveMaximum", "<", operator.lt))
        for keyword, sign, ok in bounds:
            if keyword in node and not ok(value, node[keyword]):
                return f"must be {sign} {node[keyword]}, got {value}", ("the library refuses this "
                                                                        "value")
    return None


def _unknown_key(path: tuple, node: dict) -> Problem:
    key = path[-1]
    removed = node.get("x-removed", {})
    if key in removed:
        why = removed[key].split(". ")[0].rstrip(".")
        return path, f"`{key}` was removed from DeepSpeed", why, True
    here = sorted(node.get("properties", {}))
    close = close_choices(str(key), here, cutoff=0.75)
    elsewhere = [p for p in _key_index().get(key, ()) if p[:-1] != path[:-1]]
    if not close and elsewhere:
        where = " or ".join(f"`deepspeed.{'.'.join(p)}`" for p in elsewhere[:2])
        owner = OWNED_DEEPSPEED_KEYS.get(elsewhere[0])
        tail = f", which jobspec sets from `{owner}`: set that instead" if owner else ""
        return path, f"unknown key `{key}` here", f"it belongs at {where}{tail}", True
    label = "keys here" if path[:-1] else "DeepSpeed's top-level keys"
    hint = did_you_mean(str(key), here, label, shown=12, more=f"schemas/{DEEPSPEED_SCHEMA}")
    owner = OWNED_DEEPSPEED_KEYS.get(path[:-1] + tuple(close)) if hint.startswith("did you mean") \
        else None
    if owner:
        hint += f" jobspec sets it from `{owner}`: set that instead"
    return path, f"unknown key `{key}`", hint, True


@lru_cache(maxsize=1)
def _key_index() -> dict:
    """Every key of the DeepSpeed schema -> the paths it appears at (to say where a stray key
    belongs)."""
    index: dict = {}

    def visit(node: dict, path: tuple) -> None:
        for alternative in node.get("anyOf", ()):
            visit(alternative, path)
        for key, child in node.get("properties", {}).items():
            index.setdefault(key, []).append(path + (key,))
            visit(child, path + (key,))

    visit(load_table(DEEPSPEED_SCHEMA), ())
    return index


# ---------------------------------------------------------------- both, for a loaded spec

def freeform_issues(resolved: ResolvedSpec) -> list[SpecIssue]:
    """`model.config` and `deepspeed:` issues of a loaded spec (anything with `.spec`, `.issue`,
    `.positions` and `.source`, e.g. a ResolvedSpec before defaults are filled)."""
    return (model_config_issues(resolved.spec, resolved.issue, local_checkpoint_config(resolved))
            + deepspeed_issues(resolved.spec, resolved.issue))


def unchecked_model_config(resolved: ResolvedSpec) -> str | None:
    """Why validate did not check `model.config` and `model.lora`'s module names, or None when it
    did: a hub id not in the local Hugging Face cache names its model type only in its config.json,
    which `plan`, `compile` and `launch --dry-run` read (job/model_config); a type the generated
    table lacks (a transformers newer than schemas/transformers-configs/) is checked there against
    transformers."""
    model = resolved.spec.get("model") or {}
    if not model.get("config") and not model.get("lora"):
        return None
    model_type = model_table.model_type(resolved.spec, local_checkpoint_config(resolved))
    if model_table.entry(model_type) is not None:
        return None
    what = " and ".join(n for n, v in (("model.config", model.get("config")),
                                       ("model.lora's module names",
                                                                              model.get("lora")))
                        if v)
    if model_type:
        return (f"{what} of model type `{model_type}` not checked here (not in "
                f"schemas/{model_table.TABLE_DIR}/): plan, compile and launch --dry-run check it "
                "against transformers")
    return (f"{what} of `{model.get('name_or_path')}` not checked here (its model type is in its "
            "config.json, not in the local cache): plan, compile and launch --dry-run read it and "
            "check them")


def local_checkpoint_config(resolved: ResolvedSpec) -> dict | None:
    """The config.json of `model.name_or_path` when it names a local directory (relative to the file
    that wrote it, or to the current directory for --set), else None."""
    model = resolved.spec.get("model") if isinstance(resolved.spec, dict) else None
    name = model.get("name_or_path") if isinstance(model, dict) else None
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    where = resolved.positions.get(("model", "name_or_path"))
    if where is not None and where.file == SET_FILE:
        base = Path.cwd()
    else:
        base = Path(where.file if where is not None else resolved.source).resolve().parent
    text: str | None
    try:
        text = (base / os.path.expanduser(name) / "config.json").read_text(encoding="utf-8")
    # a hub id, or no readable config.json: the Hugging Face cache, else plan/--dry-run
    except OSError:
        text = _cached_hub_file(name, model.get("revision") if isinstance(model, dict) else None,
                                "config.json")
    try:
        config = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _cached_hub_file(name: str, revision: object, filename: str) -> str | None:
    """A hub repository's file from the local Hugging Face cache, read as huggingface_hub lays it
    out (hub/models--org--name/refs/<revision> -> snapshots/<commit>/<file>), without importing it;
    None when it is not there (then plan, compile and --dry-run read it through transformers)."""
    if name.count("/") > 1 or name.startswith((".", "/")) or ".." in name:
        return None
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME")
        or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = Path(cache) / ("models--" + name.replace("/", "--"))
    revision = revision if isinstance(revision, str) and revision else "main"
    try:
        commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else \
            (repo / "refs" / revision).read_text(encoding="utf-8").strip()
        return (repo / "snapshots" / commit / filename).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- words

def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _is(value: Any, type_name: str, lax: bool = False) -> bool:
    if lax and type_name == "integer" and isinstance(value, float) and value.is_integer():
        return True
    return {
        "object": lambda: isinstance(value, dict), "array": lambda: isinstance(value, list),
        "string": lambda: isinstance(value, str), "boolean": lambda: isinstance(value, bool),
        "null": lambda: value is None, "float": lambda: isinstance(value, float),
        "integer": lambda: isinstance(value, int) and not isinstance(value, bool),
        "number": lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
    }.get(type_name, lambda: True)()


def _types_text(types: list[str]) -> str:
    return " or ".join(_TYPE_WORDS.get(t, t) for t in dict.fromkeys(types))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    name = {int: "integer", float: "number", str: "string"}.get(type(value), type(value).__name__)
    return f"{name} {value!r}"[:60]


def _type_hint(value: Any, types: list[str]) -> str:
    if "float" in types and isinstance(value, int) and not isinstance(value, bool):
        return f"transformers refuses an integer here: write {value}.0"
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return f"write {int(value)} without a decimal point"
    if isinstance(value, str) and {"integer", "number", "float"} & set(types):
        return "write the number without quotes"
    if "string" in types and isinstance(value, bool):
        return "YAML reads yes/no/on/off/true/false as booleans: put the text in quotes"
    if isinstance(value, list) and len(value) == 1 and any(_is(value[0], t) for t in types):
        return f"write the value itself, not a list: {json.dumps(value[0])}"
    return f"write {_types_text(types)}"
